"""The package without the real model: registration, the import surface, config and setup
errors, the heads file, and the drafting arithmetic against a tiny fake target."""

from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

import attrs
import numpy as np
import pytest

import specdec
import specdec_plugin_medusa
from specdec.sdk import SpecdecError
from specdec.tools import load_plugins
from specdec.testing import check_proposer
from specdec_plugin_medusa import MedusaConfig, MedusaHeads, MedusaProposer, load_heads, save_heads
from specdec_plugin_medusa.heads import SHIPPED_HEADS

PACKAGE = Path(specdec_plugin_medusa.__file__).resolve().parent
#: What a plugin may import from specdec: the public SDK only.
PUBLIC_MODULES = {"specdec", "specdec.sdk", "specdec.tools"}
MAX_HEADS_BYTES = 5 * 1024 * 1024


# --- (c) the public contract only ------------------------------------------------------------


def outside_surface(path: Path) -> list[str]:
    """Every import of a specdec module other than ``specdec`` / ``specdec.sdk`` / ``specdec.tools``, and every
    ``specdec.x`` attribute that is not in ``specdec.__all__``, in ``path``."""
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "specdec"
              and node.attr not in specdec.__all__ and node.attr != "sdk"):
            problems.append(f"{path.name}:{node.lineno}: specdec.{node.attr} is not public")
            continue
        else:
            continue
        problems += [f"{path.name}:{node.lineno}: imports {name}" for name in names
                     if name.split(".")[0] == "specdec" and name not in PUBLIC_MODULES]
    return problems


def test_the_package_imports_only_the_public_sdk():
    files = sorted(PACKAGE.rglob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "proposer.py", "heads.py", "train.py"}
    assert [problem for path in files for problem in outside_surface(path)] == []


def test_the_check_catches_a_private_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import specdec\nfrom specdec.engine import Engine\nimport specdec.plugins.mtp\n"
                   "x = specdec.config\n")
    assert [p.split(": ")[1] for p in outside_surface(bad)] == [
        "imports specdec.engine", "imports specdec.plugins.mtp", "specdec.config is not public"]


# --- registration ----------------------------------------------------------------------------


def test_medusa_is_registered_through_its_entry_point(monkeypatch):
    monkeypatch.delenv("SPECDEC_LOAD_PLUGINS", raising=False)
    version = metadata.version("specdec-plugin-medusa")
    plugins = load_plugins()
    assert "medusa" in plugins.proposers, plugins.errors
    info = next(info for info in plugins.infos if info.name == "medusa")
    assert (info.distribution, info.version, info.builtin, info.error) == (
        "specdec-plugin-medusa", version, False, None)
    assert info.registered["proposers"] == ["medusa"]
    assert plugins.proposers.get("medusa") is MedusaProposer


def test_medusa_passes_the_conformance_kit():
    # Without setup (and without hidden states) it drafts nothing, within the contract.
    check_proposer(MedusaProposer)
    check_proposer(MedusaProposer, config=MedusaConfig(medusa_num_heads=2))


# --- the heads file --------------------------------------------------------------------------


def test_the_shipped_heads_fit_the_default_model_and_the_size_limit():
    path = SHIPPED_HEADS["smollm2-135m-instruct"]
    assert path.stat().st_size <= MAX_HEADS_BYTES
    heads = load_heads(path)
    assert heads.hidden_size == 576 and heads.num_heads >= 1
    assert np.abs(heads.weight).max() > 0  # trained, not the zero init


def test_heads_round_trip_in_float16(tmp_path):
    rng = np.random.default_rng(0)
    heads = MedusaHeads(rng.standard_normal((2, 8, 8)).astype(np.float32),
                        rng.standard_normal((2, 8)).astype(np.float32), "tiny")
    save_heads(heads, tmp_path / "h.safetensors")
    loaded = load_heads(tmp_path / "h.safetensors")
    np.testing.assert_allclose(loaded.weight, heads.weight, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(loaded.bias, heads.bias, rtol=1e-3, atol=1e-3)
    assert (loaded.num_heads, loaded.hidden_size, loaded.model) == (2, 8, "tiny")


# --- (d) setup errors: one line each (the config keys' errors: test_medusa_model.py) -------


def one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message, repr(message)
    return message


@attrs.define
class FakeTarget:
    """A tiny target: ``final_norm``, ``lm_head`` and ``logits`` as :class:`specdec.TargetModel` has them."""

    final_norm: object
    lm_head: object
    rms_norm_eps: float = 1e-5

    def logits(self, hidden):
        import paddle

        h = paddle.to_tensor(np.asarray(hidden, np.float32))
        n = h * paddle.rsqrt(paddle.mean(h * h, axis=-1, keepdim=True) + self.rms_norm_eps) * self.final_norm
        return paddle.matmul(n, self.lm_head, transpose_y=True)


def fake_context(model_name="smollm2-135m-instruct", hidden_size=8, vocab_size=16, seed=0):
    import paddle

    rng = np.random.default_rng(seed)
    target = FakeTarget(paddle.to_tensor(rng.uniform(0.5, 1.5, hidden_size).astype(np.float32)),
                        paddle.to_tensor(rng.standard_normal((vocab_size, hidden_size)).astype(np.float32)))
    model_config = type("ModelConfig", (), {"hidden_size": hidden_size, "vocab_size": vocab_size})()

    def no_cache_layers(*args, **kwargs):
        raise AssertionError("medusa needs no cache layers")

    return specdec.ProposerContext(model_name=model_name, model_config=model_config, tokenizer=None, target=target,
                                   block_size=16, num_blocks=4, create_cache_layers=no_cache_layers)


def test_setup_refuses_heads_of_another_hidden_size(tmp_path):
    save_heads(MedusaHeads.zeros(3, 64), tmp_path / "h64.safetensors")
    proposer = MedusaProposer(MedusaConfig(medusa_heads_path=str(tmp_path / "h64.safetensors")))
    with pytest.raises(SpecdecError) as info:
        proposer.setup(fake_context(hidden_size=8))
    assert "hidden size 64, the target's is 8" in one_line(info.value)


def test_setup_refuses_a_target_without_shipped_heads():
    with pytest.raises(SpecdecError) as info:
        MedusaProposer().setup(fake_context(model_name="some-other-model"))
    assert "no Medusa heads ship for 'some-other-model'" in one_line(info.value)


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "missing.safetensors", "no such file"),
    (lambda d: (d / "junk.safetensors").write_bytes(b"not a safetensors file") and d / "junk.safetensors",
     "cannot read"),
], ids=["missing", "not-safetensors"])
def test_setup_refuses_a_missing_or_broken_heads_file(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(SpecdecError) as info:
        MedusaProposer(MedusaConfig(medusa_heads_path=str(path))).setup(fake_context())
    assert expected in one_line(info.value)


def test_setup_refuses_more_heads_than_the_file_holds(tmp_path):
    save_heads(MedusaHeads.zeros(2, 8), tmp_path / "h.safetensors")
    proposer = MedusaProposer(MedusaConfig(medusa_heads_path=str(tmp_path / "h.safetensors"), medusa_num_heads=3))
    with pytest.raises(SpecdecError) as info:
        proposer.setup(fake_context())
    assert "medusa_num_heads: 3 heads asked for" in one_line(info.value)


# --- drafting ---------------------------------------------------------------------------------


def request(request_id, tokens, max_draft_len, hidden, positions):
    return specdec.ProposalRequest(request_id=request_id, token_ids=np.asarray(tokens, np.int64),
                                   num_prompt_tokens=1, max_draft_len=max_draft_len,
                                   hidden_states=np.asarray(hidden, np.float32),
                                   hidden_positions=np.asarray(positions, np.int64))


def test_drafts_are_each_heads_argmax_over_the_last_row(tmp_path):
    rng = np.random.default_rng(1)
    H, K = 8, 3
    heads = MedusaHeads(rng.standard_normal((K, H, H)).astype(np.float32),
                        rng.standard_normal((K, H)).astype(np.float32))
    save_heads(heads, tmp_path / "h.safetensors", dtype=np.float32)
    context = fake_context(hidden_size=H)
    proposer = MedusaProposer(MedusaConfig(medusa_heads_path=str(tmp_path / "h.safetensors")))
    proposer.setup(context)
    states = rng.standard_normal((4, H)).astype(np.float32) * 3
    batch = specdec.ProposalBatch(requests=[
        request("a", [1, 2, 3, 4, 5], 5, states[:3], [1, 2, 3]),   # last row at len - 2: drafts K
        request("b", [1, 2, 3], 2, states[3:], [1]),               # drafts max_draft_len
        request("c", [1, 2, 3], 0, states[3:], [1]),               # may not draft
        request("d", [1, 2, 3, 4], 3, states[3:], [1]),            # last row is not at len - 2
        request("e", [1, 2, 3, 4], 3, np.zeros((0, H)), []),       # no rows this step
    ])
    got = proposer.propose(batch).to_lists()

    def expected(h, depth):
        final_norm, lm_head = np.asarray(context.target.final_norm), np.asarray(context.target.lm_head)
        n = h / np.sqrt(np.mean(h * h) + 1e-5) * final_norm
        silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
        return [int(np.argmax((n + silu(heads.weight[k] @ n + heads.bias[k])) @ lm_head.T)) for k in range(depth)]

    assert got == [expected(states[2], 3), expected(states[3], 2), [], [], []]


def test_zero_heads_reproduce_the_target_head(tmp_path):
    """An untrained head (W = 0) guesses the target's own next token: the one already decided."""
    save_heads(MedusaHeads.zeros(3, 8), tmp_path / "h.safetensors")
    context = fake_context(hidden_size=8)
    proposer = MedusaProposer(MedusaConfig(medusa_heads_path=str(tmp_path / "h.safetensors"), medusa_num_heads=2))
    proposer.setup(context)
    states = np.random.default_rng(2).standard_normal((5, 8)).astype(np.float32)
    batch = specdec.ProposalBatch(requests=[request(f"r{i}", [0, 1, 2], 4, states[i:i + 1], [1]) for i in range(5)])
    want = np.asarray(context.target.logits(states)).argmax(axis=-1)
    assert proposer.propose(batch).to_lists() == [[int(t)] * 2 for t in want]
