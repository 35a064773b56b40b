"""Conformance checks for plugin authors: run your class on synthetic batches and fail with a
one-line message naming the broken rule.

    from specdec.testing import check_proposer
    from specdec_plugin_mine import MyProposer

    def test_contract():
        check_proposer(MyProposer)

One kit per plugin kind: :func:`check_proposer` (here), :func:`check_verify_strategy` and
:func:`check_accept_policy` (:mod:`specdec.testing_verify`), :func:`check_attention_backend`
(:mod:`specdec.testing_attention`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .proposer import DRAFT_PAD, Drafts, ProposalBatch, ProposalRequest, Proposer, valid_draft_classes
from .testing_attention import check_attention_backend
from .testing_verify import check_accept_policy, check_verify_strategy

__all__ = ["check_proposer", "check_drafts", "synthetic_batches", "check_verify_strategy", "check_accept_policy",
           "check_attention_backend"]

#: Vocabulary size of the synthetic batches (token ids lie in ``[0, DEFAULT_VOCAB_SIZE)``).
DEFAULT_VOCAB_SIZE = 512


def _request(request_id: str, token_ids, num_prompt_tokens: int, max_draft_len: int, **fields) -> ProposalRequest:
    tokens = np.asarray(token_ids, dtype=np.int64)
    tokens.flags.writeable = False  # the engine hands a read-only view: catch proposers writing to it
    return ProposalRequest(request_id=request_id, token_ids=tokens,
                           num_prompt_tokens=num_prompt_tokens, max_draft_len=max_draft_len, **fields)


def synthetic_batches(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> list[ProposalBatch]:
    """Batches that exercise the corners of the contract: an empty batch, a one-token prompt,
    ``max_draft_len`` 0, drafts longer than the context, repetitive and random text, and a
    batch whose requests want different draft lengths."""
    rng = np.random.default_rng(seed)
    random_text = rng.integers(0, vocab_size, size=200)
    loop = np.tile(rng.integers(0, vocab_size, size=7), 12)
    counting = np.arange(60) % vocab_size
    return [
        ProposalBatch(requests=[]),
        ProposalBatch(requests=[_request("one-token", [vocab_size - 1], 1, 4)]),
        ProposalBatch(requests=[_request("no-drafts", loop, 40, 0)]),
        ProposalBatch(requests=[_request("long-draft", [3, 4, 3], 3, 16)]),
        ProposalBatch(requests=[
            _request("loop", loop, 50, 5),
            _request("random", random_text, 150, 3),
            _request("counting", np.concatenate([counting, counting[:10]]), 60, 8),
            _request("zero", [0, 0, 0, 0], 2, 2),
            _request("capped", loop, 20, 1),
        ]),
    ]


def check_drafts(drafts: object, batch: ProposalBatch, vocab_size: int, who: str = "proposer") -> None:
    """Assert that ``drafts`` is a valid answer to ``batch`` (see :class:`specdec.Drafts`)."""
    def fail(message: str):
        raise AssertionError(f"{who}.propose: {message}")

    if not isinstance(drafts, Drafts):
        fail(f"returned {type(drafts).__name__}, expected specdec.Drafts")
    token_ids, lengths = np.asarray(drafts.token_ids), np.asarray(drafts.lengths)
    if token_ids.ndim != 2 or not np.issubdtype(token_ids.dtype, np.integer):
        fail(f"token_ids must be a 2-D integer array, got {token_ids.dtype} shape {token_ids.shape}")
    if lengths.shape != (len(batch),) or not np.issubdtype(lengths.dtype, np.integer):
        fail(f"lengths must be an integer array of shape ({len(batch)},), got {lengths.dtype} shape {lengths.shape}")
    if token_ids.shape[0] != len(batch):
        fail(f"returned {token_ids.shape[0]} rows for a batch of {len(batch)} requests")
    for b, request in enumerate(batch.requests):
        _check_row(token_ids[b], int(lengths[b]), request, vocab_size, fail)
    if drafts.probs is not None:
        probs = np.asarray(drafts.probs)
        if probs.ndim != 3 or probs.shape[:2] != token_ids.shape:
            fail(f"probs must be [B, k, V] with [B, k] = {token_ids.shape}, got shape {probs.shape}")
        if not np.all(np.isfinite(probs)) or np.any(probs < 0):
            fail("probs must be finite and non-negative")
    if drafts.classes is not None and valid_draft_classes(drafts.classes, len(batch)) is None:
        classes = np.asarray(drafts.classes)
        fail(f"classes must be {len(batch)} non-negative integer labels, got {classes.dtype} {classes.tolist()}")


def _check_row(row: np.ndarray, length: int, request: ProposalRequest, vocab_size: int, fail) -> None:
    name = f"request '{request.request_id}'"
    if length < 0 or length > request.max_draft_len:
        fail(f"{name} drafted {length} tokens, max_draft_len is {request.max_draft_len}")
    if length > len(row):
        fail(f"{name} has length {length} but token_ids is only {len(row)} wide")
    drafted, padding = row[:length], row[length:]
    if np.any((drafted < 0) | (drafted >= vocab_size)):
        fail(f"{name} drafted token ids outside [0, {vocab_size}): {drafted.tolist()}")
    if np.any(padding != DRAFT_PAD):
        fail(f"{name} has padding {padding.tolist()}, expected every entry to be {DRAFT_PAD}")


def check_proposer(cls: type, config: object = None, spec_config: object = None,
                   vocab_size: int = DEFAULT_VOCAB_SIZE, batches: Optional[list[ProposalBatch]] = None) -> None:
    """Run proposer class ``cls`` through its lifecycle on synthetic batches and assert the
    contract: a subclass of :class:`specdec.Proposer` with a ``NAME``; ``propose`` returns
    :class:`specdec.Drafts` with one row per request, lengths within ``max_draft_len``, pads of
    ``-1``, token ids in ``[0, vocab_size)`` and, if given, one non-negative integer class per
    request; the lifecycle methods accept their arguments; a seeded sampled request's drafts
    depend on its own tokens alone (not on the requests beside or before it).

    ``config`` defaults to ``cls.Config()`` when the class declares a ``Config``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise AssertionError(f"{cls!r} is not a subclass of specdec.Proposer")
    if not isinstance(cls.NAME, str) or not cls.NAME:
        raise AssertionError(f"{cls.__qualname__} must set NAME to a non-empty string")
    if config is None and getattr(cls, "Config", None) is not None:
        config = cls.Config()
    proposer = cls(config, spec_config)
    for batch in batches if batches is not None else synthetic_batches(vocab_size):
        _run_step(proposer, batch, vocab_size)
    _check_reproducible(proposer, cls(config, spec_config), vocab_size)


def _check_reproducible(used: Proposer, fresh: Proposer, vocab_size: int) -> None:
    """A seeded sampled request (``ProposalRequest.reproducible``) gets the same drafts from a
    fresh proposer, alone, as from ``used`` beside other requests, after an earlier request
    whose response holds its context's end and a continuation: its drafts may depend on its
    own tokens and generator only."""
    from .sampling import SamplingParams

    rng = np.random.default_rng(1)
    text = rng.integers(0, vocab_size, size=60)
    earlier = np.concatenate([rng.integers(0, vocab_size, size=10), text[-8:], rng.integers(0, vocab_size, size=8)])

    def seeded() -> ProposalRequest:
        return _request("seeded", text, 30, 5, sampling=SamplingParams(temperature=0.8, seed=1),
                        rng=np.random.default_rng(1))

    _run_step(used, ProposalBatch(requests=[_request("earlier", earlier, 10, 5)]), vocab_size)
    mates = [_request("mate-earlier", earlier, 18, 5), _request("mate-random", rng.integers(0, vocab_size, 80), 40, 5)]
    drafts = []
    for proposer, batch in ((fresh, [seeded()]), (used, [mates[0], seeded(), mates[1]])):
        for request in batch:
            proposer.on_request_start(_prompt_only(request))
        proposer.on_step(ProposalBatch(requests=[_prompt_only(r) for r in batch]),
                         [np.array(r.token_ids[r.num_prompt_tokens:]) for r in batch])
        result = proposer.propose(ProposalBatch(requests=batch))
        check_drafts(result, ProposalBatch(requests=batch), vocab_size, who=type(proposer).NAME)
        row = next(b for b, r in enumerate(batch) if r.request_id == "seeded")
        drafts.append(result.token_ids[row, : int(result.lengths[row])].tolist())
        for request in batch:
            proposer.on_request_finish(request.request_id)
    if drafts[0] != drafts[1]:
        raise AssertionError(f"{type(used).NAME}.propose: a seeded sampled request (ProposalRequest.reproducible) "
                             f"drafted {drafts[0]} alone in a fresh proposer but {drafts[1]} beside other requests, "
                             f"after earlier ones: its drafts must depend on its own tokens alone")


def _prompt_only(request: ProposalRequest) -> ProposalRequest:
    return _request(request.request_id, request.token_ids[: request.num_prompt_tokens],
                    request.num_prompt_tokens, request.max_draft_len)


def _run_step(proposer: Proposer, batch: ProposalBatch, vocab_size: int) -> None:
    """Drive ``proposer`` as the engine does: admit each request with its prompt, catch up on
    the tokens generated so far with ``on_step``, propose, check, report one accepted step,
    finish."""
    for request in batch.requests:
        proposer.on_request_start(_prompt_only(request))
    generating = [r for r in batch.requests if r.num_generated_tokens > 0]
    if generating:
        proposer.on_step(ProposalBatch(requests=[_prompt_only(r) for r in generating]),
                         [np.array(r.token_ids[r.num_prompt_tokens:]) for r in generating])
    drafts = proposer.propose(batch)
    check_drafts(drafts, batch, vocab_size, who=type(proposer).NAME)
    accepted = []
    for b, request in enumerate(batch.requests):
        kept = drafts.token_ids[b, : min(int(drafts.lengths[b]), 1)]
        accepted.append(np.concatenate([kept, [int(request.token_ids[-1])]]).astype(np.int64))
    proposer.on_step(batch, accepted)
    for request in batch.requests:
        proposer.on_request_finish(request.request_id)
