"""The ``mtp`` method on the real default model with the head that ships for it: greedy output
equal to naive token for token (num_model_steps 1, 2, 3; alone and batched, with drafts
accepted and rejected), and the head's incremental catch-up over its paged cache layer equal
to running it over the whole sequence at once."""

from __future__ import annotations

import numpy as np
import pytest

from specdec import SamplingParams
from specdec.plugin_manager import load_plugins
from specdec.plugins.mtp import MtpProposer
from specdec.workloads import code_edit_prompts

pytestmark = pytest.mark.slow

PROMPTS = tuple(code_edit_prompts(5))
SAMPLING = SamplingParams(max_tokens=64, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_mtp_is_lossless_at_temperature_zero(model_session, steps, batch):
    spec = {"method": "mtp", "num_model_steps": steps, "adaptive_draft_length": False}
    naive = model_session.run(None, PROMPTS, SAMPLING, max_num_seqs=batch)
    outputs = model_session.run(spec, PROMPTS, SAMPLING, max_num_seqs=batch, cache=False)
    for prompt, got, want in zip(PROMPTS, outputs, naive):
        message = model_session.describe_divergence(prompt, want.token_ids, got.token_ids, label=f"mtp x{steps}")
        assert message is None, message
    # num_model_steps drafts per step at most; some accepted, some rejected.
    assert all(0 < o.metrics.num_draft_tokens <= steps * o.metrics.num_steps for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert 0 < accepted < sum(o.metrics.num_draft_tokens for o in outputs)


@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
def test_quantized_mtp_head_is_lossless_and_still_drafts_well(model_session, quantization):
    """``quantization`` runs the head's matrices on the quantized kernels; acceptance stays near
    the float32 head's (int8 per channel barely moves it; int4 in groups of 32 more)."""
    from specdec.sdk import QuantizedLinear

    base = {"method": "mtp", "num_model_steps": 1, "adaptive_draft_length": False}
    float_head = model_session.run(base, PROMPTS, SAMPLING, max_num_seqs=5)
    naive = model_session.run(None, PROMPTS, SAMPLING, max_num_seqs=5)
    outputs = model_session.run({**base, "quantization": quantization}, PROMPTS, SAMPLING, max_num_seqs=5)
    head = model_session.llm.engine.proposer.head
    assert isinstance(head.qkv, QuantizedLinear) and isinstance(head.down, QuantizedLinear)
    for prompt, got, want in zip(PROMPTS, outputs, naive):
        message = model_session.describe_divergence(prompt, want.token_ids, got.token_ids, label=quantization)
        assert message is None, message

    def acceptance(runs):
        return sum(o.metrics.num_accepted_tokens for o in runs) / sum(o.metrics.num_draft_tokens for o in runs)

    floor = 0.9 if quantization == "wint8" else 0.6
    assert acceptance(outputs) > floor * acceptance(float_head), (acceptance(outputs), acceptance(float_head))


class CheckedMtp(MtpProposer):
    """``mtp`` that, after each catch-up, reruns its head over the whole sequence of a request
    that has computed every position itself, in a fresh cache, and records the difference at
    the last row."""

    NAME = "test_checked_mtp"

    def setup(self, context):
        super().setup(context)
        self.states: dict[str, list] = {}
        self.worst = 0.0
        self.checked = 0

    def _catch_up(self, requests):
        import paddle

        out, last_rows = super()._catch_up(requests)
        for request, last_row in zip(requests, last_rows):
            states = self.states.setdefault(request.request_id, [])
            states.append((np.asarray(request.hidden_positions), np.asarray(request.hidden_states)))
            positions = np.concatenate([p for p, _ in states])
            if positions[0] != 0 or len(positions) != positions[-1] + 1:
                continue  # a cached prefix: not every state is here
            hidden = np.concatenate([np.zeros((1, self.hidden_size), np.float32)] + [h for _, h in states])
            n = len(hidden)
            live, fresh = self.head.cache, type(self.head.cache)(self.head.cache.config, None)
            fresh.setup(num_layers=1, num_heads=live.num_heads, num_kv_heads=live.num_kv_heads, head_dim=live.head_dim,
                        dtype=live.dtype, rope_cos=live.rope_cos, rope_sin=live.rope_sin)
            blocks = -(-n // self.block_size)
            fresh.init_cache(blocks, self.block_size)
            from specdec.sdk import AttentionMetadata

            meta = AttentionMetadata.build([n], [0], [np.arange(blocks)], self.block_size)
            self.head.cache = fresh
            try:
                full = np.asarray(self.head.forward(request.token_ids[:n], paddle.to_tensor(hidden), meta))
            finally:
                self.head.cache = live
            got = np.asarray(out)[last_row]
            self.worst = max(self.worst, float(np.max(np.abs(got - full[-1]) / (1 + np.abs(full[-1])))))
            self.checked += 1
        return out, last_rows


def test_catch_up_over_the_paged_cache_equals_a_full_recomputation(model_session, monkeypatch):
    plugins = load_plugins()
    plugins.proposers.register(CheckedMtp, "tests/e2e/test_mtp.py")
    monkeypatch.setattr(model_session.llm.engine, "plugins", plugins)
    try:
        spec = {"method": "test_checked_mtp", "num_model_steps": 3,
                "adaptive_draft_length": False}
        model_session.run(spec, PROMPTS[:2], SamplingParams(max_tokens=24, ignore_eos=True), max_num_seqs=2,
                          cache=False)
        proposer = model_session.llm.engine.proposer
        assert proposer.checked >= 10
        tolerance = 1e-2 if proposer.head.cache.dtype == "float16" else 1e-4
        assert proposer.worst < tolerance, proposer.worst
    finally:
        model_session.llm.set_speculative_config(None)
