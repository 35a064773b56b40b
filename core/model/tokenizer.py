"""Tokenizers for the models specdec serves, built on Hugging Face ``tokenizers``.

:class:`Tokenizer` is built from either

* a GGUF file's metadata (``Tokenizer.from_gguf``): ``tokenizer.ggml.model`` ``gpt2`` (byte-level
  BPE, with the pre-tokenizer that ``tokenizer.ggml.pre`` names) or ``llama`` (SentencePiece BPE
  with byte fallback); a GGUF that embeds a whole ``tokenizer.huggingface.json`` uses that;
* a Hugging Face model directory (``Tokenizer.from_hf_dir``): ``tokenizer.json``,
  ``tokenizer_config.json``, ``generation_config.json``.

BPE itself is never reimplemented here: the vocabulary and merges are handed to
``tokenizers.models.BPE`` and the pipeline around it mirrors the one Hugging Face ships for the
same model (see ``docs/models.md``).

:class:`DetokenizeStream` turns a growing list of generated ids into text deltas for streaming
without splitting a multi-byte character.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import SpecdecError
from .chat import ChatTemplate, end_of_turn_tokens, pick_chat_template

__all__ = ["Tokenizer", "TooManyTokens", "DetokenizeStream", "gguf_field"]

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type / gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer regexes of the Hugging Face tokenizers that llama.cpp's pre types stand for.
_RE_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> pre-tokenizer family. "gpt2": ByteLevel with GPT-2's own regex;
# "digits": Digits(individual_digits) then ByteLevel (StarCoder, SmolLM, ...); "llama3" / "qwen2":
# Split(regex) then ByteLevel without its regex. The groups follow llama.cpp's llama-vocab.cpp.
_PRE_FAMILIES = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "phi-2", "roberta-bpe", "jina-es", "jina-de",
                     "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "gigachat"], "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                     "minerva-7b"], "digits"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], "qwen2"),
}


class TooManyTokens(SpecdecError):
    """``Tokenizer.encode(..., max_tokens=n)``: the text has ``num_tokens`` tokens, more than ``n``."""

    def __init__(self, num_tokens: int, max_tokens: int):
        super().__init__(f"{num_tokens} tokens, more than {max_tokens}")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


# ----------------------------------------------------------------------------------------------
# GGUF metadata access


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The value of one GGUF metadata key (a str, int, float, bool or a list of them).

    Uses ``ReaderField.contents()`` (gguf >= 0.11) and falls back to decoding ``parts``/``data``
    by hand for older gguf releases.
    """
    field = reader.fields.get(key)
    if field is None:
        return default
    contents = getattr(field, "contents", None)
    if contents is not None:
        try:
            return contents()
        except UnicodeDecodeError:
            pass  # fall through: decode strings leniently below
    import gguf

    types = list(field.types)
    if not types:
        return default

    def as_str(part) -> str:
        return bytes(part).decode("utf-8", errors="replace")

    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [as_str(field.parts[i]) for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if types[0] == gguf.GGUFValueType.STRING:
        return as_str(field.parts[-1])
    return field.parts[-1].tolist()[0]


def _open_gguf(reader_or_path):
    if isinstance(reader_or_path, (str, os.PathLike)):
        from .gguf_file import open_gguf_reader

        path = Path(reader_or_path)
        if not path.is_file():
            raise SpecdecError(f"GGUF file not found: {path}")
        return open_gguf_reader(path)
    return reader_or_path


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise SpecdecError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecdecError(f"{path} must hold a JSON object")
    return data


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return value.get("content")
    return str(value)


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


# ----------------------------------------------------------------------------------------------
# Building tokenizers.Tokenizer objects from GGUF vocabularies


def _special_post_processor(tok, bos: str | None, bos_id: int | None, eos: str | None,
                            eos_id: int | None, add_bos: bool, add_eos: bool):
    """A TemplateProcessing post-processor adding BOS/EOS, or None when neither is added."""
    from tokenizers import processors

    add_bos = add_bos and bos is not None and bos_id is not None
    add_eos = add_eos and eos is not None and eos_id is not None
    if not (add_bos or add_eos):
        return None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = []
    if add_bos:
        special.append((bos, bos_id))
    if add_eos and (eos, eos_id) not in special:
        special.append((eos, eos_id))
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=special)


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    duplicates = 0
    for i, t in enumerate(tokens):
        if t in vocab:
            duplicates += 1
            continue
        vocab[t] = i
    if duplicates:
        log.warning("GGUF vocabulary has %d duplicate token strings; the first id of each is used "
                    "for encoding", duplicates)
    return vocab


def _added_tokens(tokens: Sequence[str], types: Sequence[int] | None, extra_special: Iterable[int]):
    """AddedToken objects for control (special) and user-defined (not special) tokens."""
    from tokenizers import AddedToken

    extra_special = set(extra_special)
    specials, user = [], []
    for i, t in enumerate(tokens):
        ttype = types[i] if types is not None and i < len(types) else TOKEN_NORMAL
        if ttype == TOKEN_CONTROL or (i in extra_special and ttype != TOKEN_BYTE):
            if t:
                specials.append(AddedToken(t, special=True, normalized=False))
        elif ttype == TOKEN_USER_DEFINED and t:
            user.append(AddedToken(t, special=False, normalized=False))
    return specials, user


def _build_gpt2(tokens, merges, types, pre: str | None, add_space_prefix: bool, special_ids):
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if pre is None:
        log.warning("GGUF has no tokenizer.ggml.pre; using the GPT-2 pre-tokenizer")
        pre = "default"
    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise SpecdecError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: "
            f"{', '.join(sorted(_PRE_FAMILIES))} (or load the model from a Hugging Face directory)")
    if merges is None:
        raise SpecdecError("GGUF tokenizer 'gpt2' has no tokenizer.ggml.merges")
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise SpecdecError(f"malformed GGUF merge {m!r} (expected 'left right')")
        pairs.append((left, right))
    model = models.BPE(_vocab_dict(tokens), pairs, ignore_merges=(family == "llama3"))
    tok = HFTokenizer(model)
    if family == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_space_prefix, use_regex=True)
    elif family == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_space_prefix, use_regex=True),
        ])
    else:
        pattern = _RE_LLAMA3 if family == "llama3" else _RE_QWEN2
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_space_prefix, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    specials, user = _added_tokens(tokens, types, special_ids)
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    return tok


def _spm_merges(tokens: Sequence[str], scores: Sequence[float] | None, types) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary, ranked by the merged piece's score.

    This is how ``transformers``' LlamaConverter turns a SentencePiece BPE model into a
    ``tokenizers`` BPE (and what llama.cpp's SPM tokenizer does: merge the pair whose merged piece
    scores highest first).
    """
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if scores is None:
        scores = [-float(i) for i in range(len(tokens))]
    merges = []
    for i, piece in enumerate(tokens):
        ttype = types[i] if types is not None and i < len(types) else TOKEN_NORMAL
        if ttype not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or vocab.get(piece) != i or len(piece) < 2:
            continue
        local = []
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        merges.extend((scores[i], j, left, right) for j, (_, _, left, right) in enumerate(local))
    merges.sort(key=lambda m: (-m[0], vocab[m[2] + m[3]], m[1]))
    return [(left, right) for _, _, left, right in merges]


def _build_spm(tokens, scores, types, add_space_prefix: bool, unk_id: int | None, special_ids):
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    if unk is None and types is not None:
        unk = next((t for t, ty in zip(tokens, types) if ty == TOKEN_UNKNOWN), None)
    model = models.BPE(_vocab_dict(tokens), _spm_merges(tokens, scores, types), unk_token=unk,
                       fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(model)
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    specials, user = _added_tokens(tokens, types, special_ids)
    if unk is not None:
        from tokenizers import AddedToken

        specials.append(AddedToken(unk, special=True, normalized=False))
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    return tok


# ----------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens.

    Build it with :meth:`from_gguf` or :meth:`from_hf_dir`; the constructor takes an already built
    ``tokenizers.Tokenizer``.
    """

    def __init__(self, hf_tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 unk_token: str | None = None, pad_token: str | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None,
                 vocab_size: int | None = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, source: str = ""):
        self._tok = hf_tokenizer
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        self._vocab_size = int(vocab_size) if vocab_size is not None else hf_tokenizer.get_vocab_size(True)
        self.bos_token_id = self.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token is not None else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token is not None else None
        self.unk_token_id = self.token_to_id(unk_token) if unk_token is not None else None
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special)
        self.chat_template: str | None = chat_template or None
        self._chat: ChatTemplate | None = None
        eos = set(int(i) for i in eos_token_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        if self.chat_template:
            # The template's end-of-turn token ends generation: a chat model emits it, not EOS.
            for text in end_of_turn_tokens(self.chat_template):
                tid = self.token_to_id(text)
                if tid is not None and tid in self.special_token_ids:
                    eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Build from a GGUF file's metadata; ``reader`` is a ``gguf.GGUFReader`` or a path."""
        where = str(reader) if isinstance(reader, (str, os.PathLike)) else getattr(
            getattr(reader, "data", None), "filename", "")
        reader = _open_gguf(reader)
        get = lambda key, default=None: gguf_field(reader, key, default)  # noqa: E731
        kind = get("tokenizer.ggml.model")
        tokens = get("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise SpecdecError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        types = get("tokenizer.ggml.token_type")
        bos_id = get("tokenizer.ggml.bos_token_id")
        eos_id = get("tokenizer.ggml.eos_token_id")
        unk_id = get("tokenizer.ggml.unknown_token_id")
        pad_id = get("tokenizer.ggml.padding_token_id")
        extra_eos = [i for i in (get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id"))
                     if i is not None]
        add_space_prefix = bool(get("tokenizer.ggml.add_space_prefix", kind == "llama"))
        add_bos = bool(get("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
        special_ids = [i for i in (bos_id, eos_id, pad_id, *extra_eos) if i is not None]

        hf_json = get("tokenizer.huggingface.json")
        if hf_json:
            from tokenizers import Tokenizer as HFTokenizer

            tok = HFTokenizer.from_str(hf_json)
            tok.no_padding()
            tok.no_truncation()
        elif kind == "gpt2":
            tok = _build_gpt2(tokens, get("tokenizer.ggml.merges"), types, get("tokenizer.ggml.pre"),
                              add_space_prefix, special_ids)
        elif kind == "llama":
            tok = _build_spm(tokens, get("tokenizer.ggml.scores"), types, add_space_prefix, unk_id,
                             special_ids)
        else:
            raise SpecdecError(
                f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r}; supported: 'gpt2' "
                "(byte-level BPE) and 'llama' (SentencePiece BPE)")

        def text(i):
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = text(bos_id), text(eos_id)
        if not hf_json:
            post = _special_post_processor(tok, bos, bos_id, eos, eos_id, add_bos, add_eos)
            if post is not None:
                tok.post_processor = post
        return cls(tok, bos_token=bos, eos_token=eos, unk_token=text(unk_id), pad_token=text(pad_id),
                   eos_token_ids=[i for i in (eos_id, *extra_eos) if i is not None],
                   chat_template=_gguf_chat_template(get), vocab_size=len(tokens),
                   add_bos_token=add_bos, add_eos_token=add_eos,
                   source=f"gguf:{where}")

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """Build from a Hugging Face model directory (``tokenizer.json`` and its config files)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise SpecdecError(f"no tokenizer.json in {path} (only fast tokenizers are supported)")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as exc:
            raise SpecdecError(f"cannot load {tj}: {' '.join(str(exc).split())}") from exc
        # transformers sets padding/truncation per call; a tokenizer.json may carry either.
        tok.no_padding()
        tok.no_truncation()
        cfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        model_cfg = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
        smap = _read_json(path / "special_tokens_map.json") if (path / "special_tokens_map.json").is_file() else {}

        def special(name):
            value = _token_content(cfg.get(name))
            return value if value is not None else _token_content(smap.get(name))

        bos, eos, unk, pad = special("bos_token"), special("eos_token"), special("unk_token"), special("pad_token")
        if bos is None:
            bos_ids = _as_id_list(gen.get("bos_token_id", model_cfg.get("bos_token_id")))
            bos = tok.id_to_token(bos_ids[0]) if bos_ids else None
        eos_ids = _as_id_list(gen["eos_token_id"]) if "eos_token_id" in gen else _as_id_list(model_cfg.get("eos_token_id"))
        if eos is None and eos_ids:
            eos = tok.id_to_token(eos_ids[0])

        template = pick_chat_template(cfg.get("chat_template"))
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None and (path / "chat_template.json").is_file():
            template = pick_chat_template(_read_json(path / "chat_template.json").get("chat_template"))

        add_bos = bool(cfg.get("add_bos_token", False))
        add_eos = bool(cfg.get("add_eos_token", False))
        if add_bos or add_eos:
            # transformers rebuilds the post-processor from these flags for Llama-style tokenizers;
            # do the same when tokenizer.json's own post-processor does not already add them.
            probe = tok.encode("a", add_special_tokens=True).ids
            has_bos = bool(probe) and bos is not None and probe[0] == tok.token_to_id(bos)
            has_eos = bool(probe) and eos is not None and probe[-1] == tok.token_to_id(eos)
            if (add_bos and not has_bos) or (add_eos and not has_eos):
                post = _special_post_processor(tok, bos, tok.token_to_id(bos) if bos else None, eos,
                                               tok.token_to_id(eos) if eos else None, add_bos, add_eos)
                if post is not None:
                    tok.post_processor = post
        else:
            probe = tok.encode("a", add_special_tokens=True).ids
            add_bos = bool(probe) and bos is not None and probe[0] == tok.token_to_id(bos)
        return cls(tok, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad, eos_token_ids=eos_ids,
                   chat_template=template, add_bos_token=add_bos, add_eos_token=add_eos,
                   source=f"hf:{path}")

    def to_hf_dir(self, path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

        ``generation_config.json`` (holding ``eos_token_id`` as the full stop list) is written only
        when the directory has none yet; a checkpoint writer that writes its own keeps it.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        added = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                     "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
            for i, t in sorted(self._tok.get_added_tokens_decoder().items())
        }
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                      ("unk_token", self.unk_token), ("pad_token", self.pad_token))
                    if v is not None}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
            **specials,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(path / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)
        with open(path / "special_tokens_map.json", "w", encoding="utf-8") as f:
            json.dump(specials, f, ensure_ascii=False, indent=2)
        gen_path = path / "generation_config.json"
        if not gen_path.exists():
            with open(gen_path, "w", encoding="utf-8") as f:
                json.dump(self.generation_config(), f, indent=2)

    def generation_config(self) -> dict:
        """The token ids a ``generation_config.json`` holds for this tokenizer."""
        gen: dict[str, Any] = {}
        if self.bos_token_id is not None:
            gen["bos_token_id"] = self.bos_token_id
        eos = sorted(self.eos_token_ids, key=lambda i: (i != self.eos_token_id, i))
        if eos:
            gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        if self.pad_token_id is not None:
            gen["pad_token_id"] = self.pad_token_id
        return gen

    # -- encoding / decoding --------------------------------------------------------------------

    @property
    def hf_tokenizer(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, *, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are parsed;
        ``add_special_tokens`` adds BOS/EOS only where the model asks for them.

        Encoding releases the GIL, so other threads (a server's event loop, its engine thread)
        run meanwhile: ``tokenizers``' ``encode`` holds the GIL for the whole call (~0.5 s per
        million characters); ``encode_batch_fast`` (``encode_batch`` before tokenizers 0.21)
        does not, gives the same ids, and skips the character offsets (half the time, and far
        less to free). With ``max_tokens``, a text of more tokens raises :class:`TooManyTokens`
        without building the list of its ids.
        """
        if not isinstance(text, str):
            raise SpecdecError(f"encode() takes a string, got {type(text).__name__}")
        encode_batch = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        [encoding] = encode_batch([text], add_special_tokens=add_special_tokens)
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding), max_tokens)
        return encoding.ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    # -- chat ------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def _compiled_chat(self) -> ChatTemplate:
        if not self.chat_template:
            raise SpecdecError(
                "this model has no chat template: send a plain prompt (completions) instead of chat messages")
        if self._chat is None or self._chat.source != self.chat_template:
            self._chat = ChatTemplate(self.chat_template, {
                "bos_token": self.bos_token, "eos_token": self.eos_token,
                "unk_token": self.unk_token, "pad_token": self.pad_token})
        return self._chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render chat messages to the prompt text with the model's template."""
        return self._compiled_chat().render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *, max_tokens: int | None = None,
                    **extra) -> list[int]:
        """Render and encode a chat. The template writes any BOS itself, so none is added here
        (as ``transformers``' ``apply_chat_template(tokenize=True)`` does). ``max_tokens`` as
        for :meth:`encode`."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                           add_special_tokens=False, max_tokens=max_tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos_ids={sorted(self.eos_token_ids)}, "
                f"chat_template={'yes' if self.chat_template else 'no'}, source={self.source!r})")


def tokenizer_difference(a: Tokenizer, b: Tokenizer) -> str | None:
    """How ``b`` tokenizes differently from ``a`` (a short phrase), or ``None`` when a token
    id means the same to both: the same vocabulary (added tokens included) and the same
    special tokens (BOS, EOS and the tokens that end generation). A draft model must match
    its target this way: its drafts are token ids the target verifies."""
    vocab_a = a.hf_tokenizer.get_vocab(with_added_tokens=True)
    vocab_b = b.hf_tokenizer.get_vocab(with_added_tokens=True)
    if vocab_a != vocab_b:
        ids_a = {i: t for t, i in vocab_a.items()}
        ids_b = {i: t for t, i in vocab_b.items()}
        differing = sorted(i for i in ids_a.keys() | ids_b.keys() if ids_a.get(i) != ids_b.get(i))
        first = differing[0]
        return (f"vocabularies differ ({len(vocab_a)} and {len(vocab_b)} tokens, {len(differing)} ids differ; "
                f"id {first} is {ids_a.get(first)!r} and {ids_b.get(first)!r})")
    for what, value_a, value_b in (("BOS", a.bos_token_id, b.bos_token_id),
                                   ("end-of-generation tokens", sorted(a.eos_token_ids), sorted(b.eos_token_ids))):
        if value_a != value_b:
            return f"{what} differ ({value_a} and {value_b})"
    return None


def _gguf_chat_template(get) -> str | None:
    template = get("tokenizer.chat_template")
    if template:
        return template
    names = get("tokenizer.chat_templates") or []
    if "default" in names:
        return get("tokenizer.chat_template.default")
    for name in names:
        t = get(f"tokenizer.chat_template.{name}")
        if t:
            return t
    return None


# ----------------------------------------------------------------------------------------------


class DetokenizeStream:
    """Incremental detokenization for streaming.

    Call :meth:`step` with the whole list of generated ids so far (it may have grown by several
    tokens, as with speculative decoding); it returns the text that is new since the last call.
    Text is held back while the decoded tail ends in U+FFFD (an incomplete UTF-8 character spread
    over byte tokens). Each step decodes only a small window: the tokens since the last emitted
    boundary plus the chunk before it (``prefix_offset``/``read_offset``), so the cost does not
    grow with the output. :meth:`flush` returns whatever is still held back at the end.

    With ``skip_special_tokens`` the special ids are dropped before decoding, so they never
    become the window's context token (decoders such as SentencePiece's strip a leading space
    relative to the window's first token).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # kept (non-skipped) ids
        self._seen = 0  # how many of the caller's ids have been consumed
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, ids: Sequence[int]) -> str:
        if len(ids) < self._seen:
            raise ValueError("DetokenizeStream.step() got fewer ids than before; the list must only grow")
        special = self._special
        for i in ids[self._seen:]:
            i = int(i)
            if i not in special:
                self._ids.append(i)
        self._seen = len(ids)
        if len(self._ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD here)."""
        if len(self._ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self.text += delta
        return delta
