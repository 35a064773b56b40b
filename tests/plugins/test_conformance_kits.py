"""The conformance kits of verify strategies, accept policies and attention backends: every
built-in passes its kit, and a class that breaks one rule fails with a message naming it."""

from __future__ import annotations

import re

import numpy as np
import pytest

import specdec
from specdec.plugin_manager import get_plugins
from specdec.sdk import (DRAFT_PAD, AttentionMetadata, SpecdecError, VerifyResult, assemble_output, at_positions,
                         prefix_match_result, target_choice)
from specdec.testing import check_accept_policy, check_attention_backend, check_verify_strategy

PLUGINS = get_plugins()


def strategy(name):
    return PLUGINS.verify_strategies.get(name)


def policy(name):
    return PLUGINS.accept_policies.get(name)


def backend(name):
    return PLUGINS.attention_backends.get(name)


# --- the built-ins pass -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["target_match", "topp", "rejection"])
def test_builtin_verify_strategies_pass(name):
    check_verify_strategy(strategy(name))


def test_greedy_passes_as_greedy_equivalent():
    """greedy emits the argmax at every temperature: not LOSSLESS (not sampling from the
    target), but exactly greedy decoding, which the kit checks."""
    check_verify_strategy(strategy("greedy"), greedy_equivalent=True)


def test_greedy_fails_the_sampling_check():
    """The statistical check has teeth: greedy, checked as if it claimed to sample, fails."""
    with pytest.raises(AssertionError):
        check_verify_strategy(strategy("greedy"), lossless=True)


def test_greedy_passes_every_other_rule():
    check_verify_strategy(strategy("greedy"), lossless=False)


def test_topp_with_its_options_passes():
    topp = strategy("topp")
    check_verify_strategy(topp, topp.Config(max_candidate_len=1, verify_window=1), seed=1, vocab_size=64)


@pytest.mark.parametrize("name", ["normal", "accept_all", "reject_all"])
def test_builtin_accept_policies_pass(name):
    check_accept_policy(policy(name))


@pytest.mark.parametrize("name, dtype", [("paddle", "float32"), ("cpu", "float32"), ("cpu", "float16")])
def test_builtin_attention_backends_pass(name, dtype):
    check_attention_backend(backend(name), dtype=dtype)


def test_a_backend_without_the_cache_dtype_says_so():
    with pytest.raises(SpecdecError, match="kv_cache_dtype"):
        check_attention_backend(backend("paddle"), dtype="float16")


# --- broken verify strategies fail ------------------------------------------------------------

class TargetMatch(specdec.VerifyStrategy):
    """A correct strategy (``target_match``) that its subclasses break with ``sabotage``."""

    NAME = "sabotaged"
    LOSSLESS = True

    def verify(self, inputs):
        sampling = inputs.sampling
        result = prefix_match_result(inputs.drafts, target_choice(inputs.logits, sampling, sampling.uniforms[..., 1]))
        return self.sabotage(inputs, result)

    @staticmethod
    def sabotage(inputs, result):
        return result


def sabotaged(name, sabotage):
    return type(name, (TargetMatch,), {"NAME": name, "sabotage": staticmethod(sabotage)})


def always_accept(inputs, result):
    drafts = inputs.drafts
    accepted = drafts.lengths.copy()
    next_tokens = at_positions(result.target_tokens, accepted)
    return VerifyResult(accepted, assemble_output(drafts.token_ids, accepted, next_tokens), result.target_tokens)


def test_the_sabotage_base_passes():
    check_verify_strategy(TargetMatch)


IDS = r"\[-?\d+(, -?\d+)*\]"  # a list of token ids in a message


@pytest.mark.parametrize("cls, message", [
    (sabotaged("tuple", lambda inputs, r: (r.accepted_lengths, r.output_tokens)),
     r"tuple\.verify on the mixed batch: returned tuple, expected specdec\.VerifyResult"),
    (sabotaged("narrow", lambda inputs, r: VerifyResult(r.accepted_lengths, r.output_tokens[:, :-1], r.target_tokens)),
     r"narrow\.verify on the mixed batch: output_tokens must be an integer array of shape \(8, 5\), "
     r"got int64 shape \(8, 4\)"),
    (sabotaged("floats", lambda inputs, r: VerifyResult(r.accepted_lengths.astype(float), r.output_tokens,
                                                        r.target_tokens)),
     r"floats\.verify on the mixed batch: accepted_lengths must be an integer array of shape \(8,\), "
     r"got float64 shape \(8,\)"),
    (sabotaged("toomany", lambda inputs, r: VerifyResult(r.accepted_lengths + 1, r.output_tokens, r.target_tokens)),
     r"toomany\.verify on the mixed batch: request 0 accepted 1 drafts, it has 0"),
    (sabotaged("zeropad", lambda inputs, r: VerifyResult(
        r.accepted_lengths, np.where(r.output_tokens == DRAFT_PAD, 0, r.output_tokens), r.target_tokens)),
     r"zeropad\.verify on the mixed batch: request 0 \(drafts \[-1, -1, -1, -1\], accepted 0\) has output_tokens "
     r"\[\d+, 0, 0, 0, 0\]: entries after the emitted tokens must be -1"),
    (sabotaged("unpadded", lambda inputs, r: VerifyResult(r.accepted_lengths, r.output_tokens, target_choice(
        inputs.logits, inputs.sampling, inputs.sampling.uniforms[..., 1]))),
     rf"unpadded\.verify on the mixed batch: request 0 has target_tokens {IDS}: rows past its 0 drafts must be -1"),
    (sabotaged("scaler", lambda inputs, r: (inputs.logits.__imul__(2), r)[1]),
     r"scaler\.verify on the mixed batch: modified its input logits"),
    (sabotaged("flipped", lambda inputs, r: VerifyResult(
        r.accepted_lengths, np.where(r.output_tokens >= 0, r.output_tokens ^ 1, DRAFT_PAD), r.target_tokens)),
     rf"flipped\.verify on the mixed batch: request \d \(drafts {IDS}, accepted [1-4]\) has output_tokens {IDS}: "
     r"the accepted drafts must equal the drafts"),
    (sabotaged("alwaysaccept", always_accept),
     rf"alwaysaccept\.verify on the mixed batch: temperature-0 request \d \(drafts {IDS}\) emitted {IDS}, but "
     rf"prefix matching against the argmax gives {IDS} \(greedy_equivalent\)"),
])
def test_broken_verify_strategies_fail_with_the_rule_they_break(cls, message):
    with pytest.raises(AssertionError) as excinfo:
        check_verify_strategy(cls)
    assert re.fullmatch(message, str(excinfo.value)), str(excinfo.value)


def test_a_lossless_claim_that_always_accepts_fails_the_sampling_check():
    cls = sabotaged("alwaysaccept", always_accept)
    message = (r"^alwaysaccept\.verify \(LOSSLESS, temperature 1\.0, top_k 0, top_p 1\.0, deterministic drafts\): "
               r"the first emitted token does not follow the target: chi-square \d+\.\d > 41\.8 over 4000 rows")
    with pytest.raises(AssertionError, match=message):
        check_verify_strategy(cls, greedy_equivalent=False)
    check_verify_strategy(cls, greedy_equivalent=False, lossless=False)  # the shapes are all right


def test_not_a_strategy_or_nameless_is_refused():
    with pytest.raises(AssertionError, match="not a subclass of specdec.VerifyStrategy"):
        check_verify_strategy(policy("normal"))
    with pytest.raises(AssertionError, match="must set NAME"):
        check_verify_strategy(sabotaged("", TargetMatch.sabotage))


# --- broken accept policies fail --------------------------------------------------------------

def accept_policy(name, apply):
    return type(name, (specdec.AcceptPolicy,), {"NAME": name, "apply": apply})


def keep_all_with_stale_token(self, result, drafts):
    """Keeps every draft but emits the verify's token after them, chosen for another position."""
    accepted = drafts.lengths.copy()
    stale = at_positions(result.output_tokens, result.accepted_lengths)
    return VerifyResult(accepted, assemble_output(drafts.token_ids, accepted, stale), result.target_tokens)


def overwrite_input(self, result, drafts):
    result.accepted_lengths[:] = 0
    return result


@pytest.mark.parametrize("cls, message", [
    (accept_policy("stale", keep_all_with_stale_token),
     r"stale\.apply on the prefix-match batch: request \d keeps \d drafts and emits \d+ after them, expected the "
     r"target's token there, result\.target_tokens\[\d, \d\] = \d+"),
    (accept_policy("overdraw", lambda self, r, d: VerifyResult(r.accepted_lengths + 1, r.output_tokens,
                                                               r.target_tokens)),
     r"overdraw\.apply on the prefix-match batch: request 0 accepted 1 drafts, it has 0"),
    (accept_policy("retarget", lambda self, r, d: VerifyResult(
        r.accepted_lengths, r.output_tokens, np.where(r.target_tokens >= 0, 0, DRAFT_PAD))),
     r"retarget\.apply on the prefix-match batch: target_tokens must be the verify result's, unchanged"),
    (accept_policy("inplace", overwrite_input),
     r"inplace\.apply on the prefix-match batch: modified its input accepted_lengths"),
    (accept_policy("short", lambda self, r, d: VerifyResult(r.accepted_lengths[:1], r.output_tokens, r.target_tokens)),
     r"short\.apply on the prefix-match batch: accepted_lengths must be an integer array of shape \(6,\), "
     r"got int64 shape \(1,\)"),
])
def test_broken_accept_policies_fail_with_the_rule_they_break(cls, message):
    with pytest.raises(AssertionError) as excinfo:
        check_accept_policy(cls)
    assert re.fullmatch(message, str(excinfo.value)), str(excinfo.value)


# --- broken attention backends fail -----------------------------------------------------------

Paddle = backend("paddle")


def forget_context(meta):
    return AttentionMetadata.build(meta.query_lens, np.zeros_like(meta.context_lens), meta.block_tables,
                                   meta.block_size)


class Forgetful(Paddle):
    """Attends to this step's rows only: ignores what earlier steps cached."""

    NAME = "forgetful"

    def prepare(self, meta):
        super().prepare(forget_context(meta))

    def forward(self, layer, qkv, meta):
        return super().forward(layer, qkv, forget_context(meta))


class DropsLastRow(Paddle):
    NAME = "droplast"

    def forward(self, layer, qkv, meta):
        return super().forward(layer, qkv, meta)[:-1]


class NoRope(Paddle):
    NAME = "norope"

    def setup(self, *, rope_cos, rope_sin, **shape):
        super().setup(rope_cos=np.ones_like(rope_cos), rope_sin=np.zeros_like(rope_sin), **shape)


class FractionalBlocks(Paddle):
    NAME = "fractional"

    def bytes_per_block(self, block_size):
        return super().bytes_per_block(block_size) / 3


@pytest.mark.parametrize("cls, message", [
    (Forgetful, r"forgetful: block_size 8, heads 4/2, head_dim 16, float32, step 1 layer 0: output differs from the "
                r"reference 'paddle' by .* \(tolerance 1e-04\) at row \d+: request \d position \d+, "
                r"context [1-9]\d*, query \d+"),
    (DropsLastRow, r"droplast: block_size 8, heads 4/2, head_dim 16, float32, step 0 layer 0: forward returned shape "
                   r"\[\d+, 64\], expected \[\d+, 64\] \(\[T, H\*D\]\)"),
    (NoRope, r"norope: block_size 8, heads 4/2, head_dim 16, float32, step 0 layer 0: output differs .*"),
    (FractionalBlocks, r"fractional: block_size 8, heads 4/2, head_dim 16, float32: bytes_per_block\(8\) must be a "
                       r"positive int, got \d+\.\d+"),
])
def test_broken_attention_backends_fail_with_the_rule_they_break(cls, message):
    with pytest.raises(AssertionError) as excinfo:
        check_attention_backend(cls)
    assert re.fullmatch(message, str(excinfo.value)), str(excinfo.value)


def test_not_a_backend_is_refused():
    with pytest.raises(AssertionError, match="not a subclass of specdec.AttentionBackend"):
        check_attention_backend(strategy("greedy"))
