"""The built-in accept policies: normal, accept_all, reject_all."""

from __future__ import annotations

import importlib

import numpy as np
import pluggy
import pytest

from specdec import BatchSampling, Drafts, VerifyInputs, VerifyResult, hookspecs
from specdec.plugins.accept.accept_all import AcceptAll
from specdec.plugins.accept.normal import NormalAccept
from specdec.plugins.accept.reject_all import RejectAll
from specdec.plugins.verify.greedy import GreedyVerify

PAD = -1


def hand_case():
    """Drafts of lengths 3, 1, 0 and what a verify strategy made of them."""
    drafts = Drafts.from_lists([[5, 6, 7], [1], []])
    result = VerifyResult(
        accepted_lengths=np.array([1, 0, 0]),
        output_tokens=np.array([[5, 9, PAD, PAD], [2, PAD, PAD, PAD], [3, PAD, PAD, PAD]]),
        target_tokens=np.array([[5, 9, 8, 4], [2, 2, PAD, PAD], [3, PAD, PAD, PAD]]),
    )
    return result, drafts


def test_normal_keeps_the_result():
    result, drafts = hand_case()
    assert NormalAccept().apply(result, drafts) is result


def test_accept_all_keeps_every_draft_then_the_target_token():
    result, drafts = hand_case()
    got = AcceptAll().apply(result, drafts)
    np.testing.assert_array_equal(got.accepted_lengths, [3, 1, 0])
    np.testing.assert_array_equal(got.output_tokens, [[5, 6, 7, 4], [1, 2, PAD, PAD], [3, PAD, PAD, PAD]])
    np.testing.assert_array_equal(got.target_tokens, result.target_tokens)
    assert [got.emitted(b).tolist() for b in range(3)] == [[5, 6, 7, 4], [1, 2], [3]]


def test_reject_all_keeps_no_draft():
    result, drafts = hand_case()
    got = RejectAll().apply(result, drafts)
    np.testing.assert_array_equal(got.accepted_lengths, [0, 0, 0])
    np.testing.assert_array_equal(got.output_tokens, [[5, PAD, PAD, PAD], [2, PAD, PAD, PAD], [3, PAD, PAD, PAD]])
    assert [got.emitted(b).tolist() for b in range(3)] == [[5], [2], [3]]


@pytest.mark.parametrize("policy, accepted", [(AcceptAll, [2, 0]), (RejectAll, [0, 0])])
def test_policies_on_a_real_verify_result(policy, accepted):
    # Argmax 1, 2, 3 in every request; drafts [9, 9] and [] disagree with it.
    logits = np.zeros((2, 3, 10), dtype=np.float32)
    logits[:, [0, 1, 2], [1, 2, 3]] = 1.0
    drafts = Drafts.from_lists([[9, 9], []])
    sampling = BatchSampling(
        temperature=np.zeros(2, np.float32), top_p=np.ones(2, np.float32), top_k=np.zeros(2, np.int64), uniforms=np.zeros((2, 3, 2))
    )
    result = GreedyVerify().verify(VerifyInputs(logits=logits, drafts=drafts, sampling=sampling))
    got = policy().apply(result, drafts)
    np.testing.assert_array_equal(got.accepted_lengths, accepted)
    expected_first = [[9, 9, 3], [1]] if policy is AcceptAll else [[1], [1]]
    assert [got.emitted(b).tolist() for b in range(2)] == expected_first


@pytest.mark.parametrize(
    "module, cls",
    [
        ("specdec.plugins.accept.normal", NormalAccept),
        ("specdec.plugins.accept.accept_all", AcceptAll),
        ("specdec.plugins.accept.reject_all", RejectAll),
    ],
)
def test_each_module_registers_its_policy(module, cls):
    manager = pluggy.PluginManager("specdec")
    manager.add_hookspecs(hookspecs)
    manager.register(importlib.import_module(module))
    registered = []
    manager.hook.specdec_register_accept_policies(register=registered.append)
    assert registered == [cls]
    assert {NormalAccept.NAME, AcceptAll.NAME, RejectAll.NAME} == {"normal", "accept_all", "reject_all"}
