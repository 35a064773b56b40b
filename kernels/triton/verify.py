"""Fused verification on the device: one Triton launch turns a step's target logits and drafts
into what the numpy verify strategies (``plugins/verify``) return. A shared kernel library:
one launcher per rule, :func:`greedy_verify`, :func:`target_match_verify`,
:func:`rejection_verify` and :func:`topp_verify`, each the device half of the strategy that
declares it as its ``DEVICE_KERNEL`` (``plugins/verify/<rule>.py``, whose host rule is the
numpy twin). This module does not know the strategies: it imports Triton and numpy only.

One program per request walks its rows in order, each in a few passes over the vocabulary in
chunks (no ``[V]``-sized buffer); every float operation is the one ``core/probs.py`` does, so in
Triton's interpreter the kernel gives the numpy rules' tokens exactly. docs/gpu.md ("How the
verify kernel works") describes the passes, the top-k/top-p search and where a GPU may differ.
"""

from __future__ import annotations

import warnings

import numpy as np
import triton
import triton.language as tl

from . import runtime


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


# Reductions and scans go through tl.reduce / tl.associative_scan with triton.language's own
# combine functions, which is what tl.sum, tl.max, tl.min and tl.cumsum do. Called directly, the
# interpreter runs them as single numpy calls; the tl.sum & co. wrappers are jit functions, and
# the interpreter's per-call set-up made them most of the tests' run time. The local combine
# functions are the fallback should a Triton version rename its private ones (same results;
# only the interpreter gets slower).
_SUM = getattr(tl.standard, "_sum_combine", _add)
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)
_MIN = getattr(tl.standard, "_elementwise_min", _minimum)

#: The kernel's ``STRATEGY`` codes: which rule a compiled specialisation runs.
_GREEDY, _TARGET_MATCH, _REJECTION, _TOPP = 0, 1, 2, 3
DRAFT_PAD = -1  # specdec.DRAFT_PAD (core/proposer.py); not imported so this module needs triton only
#: Largest vocabulary chunk a program loads at once (on a GPU; the interpreter takes bigger ones).
_BLOCK_V_GPU = 1024
_BLOCK_V_INTERPRETER = 4096
#: Warps per program on a GPU (the top-k / top-p search holds a [_PIVOTS, _BLOCK_V_GPU] tile).
_NUM_WARPS = 8
#: Keys a pass of the top-k / top-p search tries at once (a power of two).
_PIVOTS = 8
#: A key below every float32 key, and one above (keys span the signed 32-bit range).
_NO_KEY_LOW = tl.constexpr(-(2**40))
_NO_KEY_HIGH = tl.constexpr(2**40)
_PAD = tl.constexpr(DRAFT_PAD)


# The per-chunk math below is written out in every pass instead of calling small helpers:
# Triton's interpreter re-patches triton.language on every call of a jit function, which would
# dominate the tests' run time. Every pass computes the same values the same way:
#   s = x / temp (float32, round to nearest)
#   skey = the order-preserving int image of s's float32 bits (bits, or bits ^ 0x7FFFFFFF when
#          negative: a < b iff key(a) < key(b), except that -0.0 sorts just below +0.0)
#   p1 = exp(s - s_max) / s1 where skey > k_lo, else 0    (softmax after top-k)
#   p2 = p1 / s2 where bits(p1) > p_lo, else 0             (top-p, renormalised; p1 >= +0,
#                                                           so its bits are its key)


@triton.jit
def _max_pass(row_ptr, V, temp, x_draft, draft, SCALED: tl.constexpr, RANK: tl.constexpr,
              BLOCK_V: tl.constexpr, N_CHUNKS: tl.constexpr):
    """Pass 1 over a row: ``(argmax, max scaled logit, min scaled key, rank of the draft)``.

    The argmax breaks ties to the lowest id (``np.argmax``). The draft's rank counts the tokens
    with a larger raw logit, and tied ones with a lower id (the order of ``top_tokens``)."""
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    s_max = tl.full((), float("-inf"), tl.float32)
    key_min = tl.full((), _NO_KEY_HIGH, tl.int64)
    rank = tl.full((), 0, tl.int64)
    for chunk in range(0, N_CHUNKS):
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf"))
        chunk_max = tl.reduce(x, 0, _MAX)
        chunk_arg = tl.reduce(tl.where(mask & (x == chunk_max), offs, V), 0, _MIN)  # lowest id of the max
        better = chunk_max > best  # strictly: an earlier chunk keeps a tie
        best_id = tl.where(better, chunk_arg.to(tl.int64), best_id)
        best = tl.where(better, chunk_max, best)
        if SCALED:
            s = tl.math.div_rn(x, temp)
            bits = s.to(tl.int32, bitcast=True)
            skey = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
            s_max = tl.maximum(s_max, tl.reduce(s, 0, _MAX))
            key_min = tl.minimum(key_min, tl.reduce(tl.where(mask, skey, _NO_KEY_HIGH), 0, _MIN))
        if RANK:
            above = (x > x_draft) | ((x == x_draft) & (offs < draft))
            rank += tl.reduce(tl.where(mask & above, 1, 0), 0, _SUM).to(tl.int64)
    return best_id, s_max, key_min, rank


@triton.jit
def _scaled(row_ptr, offs, mask, temp):
    """One chunk of a row: the logits divided by the temperature (``-inf`` past the row), and
    their keys (the order-preserving integer image of their float32 bits)."""
    x = tl.load(row_ptr + offs, mask=mask, other=float("-inf"))
    s = tl.math.div_rn(x, temp)
    bits = s.to(tl.int32, bitcast=True)
    return s, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _cut(row_ptr, V, temp, s_max, k_lo, s1, limit, lo, hi, TOP_P: tl.constexpr, PIVOTS: tl.constexpr,
         BLOCK_V: tl.constexpr, N_CHUNKS: tl.constexpr):
    """Where top-k (``TOP_P`` false: keys of ``s``, weight 1, ``limit = top_k``) or top-p
    (``TOP_P``: keys of ``p1``, weight ``p1`` in float64, ``limit = top_p``) cuts a row.

    A token is kept when the weight of the tokens with a larger key is below ``limit``. Returns
    ``cut``: the kept tokens are those whose key is ``> cut``. ``lo`` must be below every key
    and ``hi`` at least the largest one.

    A search over keys, not a sort: each pass over the row evaluates ``PIVOTS`` evenly spaced
    keys of ``(lo, hi]`` at once (the weight above each) and keeps the sub-interval where the
    condition turns true; it ends when that interval holds at most one token's key (then the
    kept set is decided) or is a single key wide (tokens tied at the cut are all kept).
    About ``log_{PIVOTS+1}`` of the key range over the gap at the cut: 3-6 passes in practice."""
    piv = tl.arange(0, PIVOTS)
    above_lo = tl.full((), 0, tl.int64) + V  # every key is above lo
    above_hi = tl.full((), 0, tl.int64)  # and none above hi
    while (above_lo - above_hi > 1) & (hi - lo > 1):
        mids = lo + ((hi - lo) * (piv + 1).to(tl.int64)) // (PIVOTS + 1)
        count = tl.full([PIVOTS], 0, tl.int64)
        mass = tl.full([PIVOTS], 0.0, tl.float64)
        for chunk in range(0, N_CHUNKS):
            offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
            mask = offs < V
            s, skey = _scaled(row_ptr, offs, mask, temp)
            if TOP_P:
                p1 = tl.math.div_rn(tl.exp(s - s_max), s1)
                p1 = tl.where(mask & (skey > k_lo), p1, 0.0)
                key = p1.to(tl.int32, bitcast=True).to(tl.int64)
                above = (key[None, :] > mids[:, None]) & mask[None, :]
                mass += tl.reduce(tl.where(above, p1.to(tl.float64)[None, :], 0.0), 1, _SUM)
            else:
                above = (skey[None, :] > mids[:, None]) & mask[None, :]
            count += tl.reduce(above.to(tl.int64), 1, _SUM)
        if TOP_P:
            ok = mass < limit
        else:
            ok = count < limit
        # The new interval runs from the last pivot before the first one where the condition
        # holds to that one (mids rise and counts fall with the pivot index).
        first = tl.reduce(tl.where(ok, piv, PIVOTS), 0, _MIN)
        before = piv < first
        lo = tl.reduce(tl.where(before, mids, lo), 0, _MAX)
        above_lo = tl.reduce(tl.where(before, count, above_lo), 0, _MIN)
        hi = tl.reduce(tl.where(before, hi, mids), 0, _MIN)
        above_hi = tl.reduce(tl.where(before, above_hi, count), 0, _MAX)
    return lo


@triton.jit
def _softmax_sum(row_ptr, V, temp, s_max, k_lo, BLOCK_V: tl.constexpr, N_CHUNKS: tl.constexpr):
    """Float64 sum of ``exp(s - s_max)`` over the tokens top-k keeps."""
    total = tl.full((), 0.0, tl.float64)
    for chunk in range(0, N_CHUNKS):
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = offs < V
        s, skey = _scaled(row_ptr, offs, mask, temp)
        e = tl.exp(s - s_max)
        total += tl.reduce(tl.where(mask & (skey > k_lo), e.to(tl.float64), 0.0), 0, _SUM)
    return total


@triton.jit
def _chunk_weights(row_ptr, q_ptr, offs, mask, temp, s_max, k_lo, s1, p_lo, s2, draft, residual,
                   HAS_Q: tl.constexpr, RESIDUAL: tl.constexpr):
    """The weights one chunk ``offs`` of a row samples from: ``p2`` (the logits scaled by
    ``temp``, cut by top-k at key ``k_lo`` and by top-p at key ``p_lo``, normalised by ``s1``
    then ``s2``), or where ``residual`` is set (only when ``RESIDUAL``), the rejection
    residual ``max(0, p2 - q)`` (``p2`` without ``draft`` unless ``HAS_Q``)."""
    s, skey = _scaled(row_ptr, offs, mask, temp)
    p1 = tl.math.div_rn(tl.exp(s - s_max), s1)
    p1 = tl.where(mask & (skey > k_lo), p1, 0.0)
    w = tl.where(p1.to(tl.int32, bitcast=True).to(tl.int64) > p_lo, tl.math.div_rn(p1, s2), 0.0)
    if RESIDUAL:
        if HAS_Q:
            r = tl.maximum(w - tl.load(q_ptr + offs, mask=mask, other=0.0), 0.0)
        else:
            r = tl.where(offs == draft, 0.0, w)
        w = tl.where(residual != 0, r, w)
    return w


@triton.jit
def _mass_pass(row_ptr, q_ptr, V, temp, s_max, k_lo, s1, p_lo, s2, draft, residual,
               HAS_Q: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_V: tl.constexpr, N_CHUNKS: tl.constexpr):
    """``(total weight (float64), count of nonzero weights, weight of draft)`` of the weights a
    row samples from: ``p2``, or where ``residual`` is set (only when ``RESIDUAL``), the
    rejection residual ``max(0, p2 - q)`` (``p2`` without ``draft`` unless ``HAS_Q``)."""
    total = tl.full((), 0.0, tl.float64)
    nonzero = tl.full((), 0, tl.int64)
    at_draft = tl.full((), 0.0, tl.float32)
    for chunk in range(0, N_CHUNKS):
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = offs < V
        w = _chunk_weights(row_ptr, q_ptr, offs, mask, temp, s_max, k_lo, s1, p_lo, s2, draft, residual,
                           HAS_Q, RESIDUAL)
        total += tl.reduce(w.to(tl.float64), 0, _SUM)
        nonzero += tl.reduce(tl.where(w > 0.0, 1, 0), 0, _SUM).to(tl.int64)
        at_draft += tl.reduce(tl.where(offs == draft, w, 0.0), 0, _SUM)
    return total, nonzero, at_draft


@triton.jit
def _sample_pass(row_ptr, q_ptr, V, temp, s_max, k_lo, s1, p_lo, s2, draft, residual, target,
                 HAS_Q: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_V: tl.constexpr, N_CHUNKS: tl.constexpr):
    """Inverse CDF in vocabulary order over the weights of :func:`_mass_pass`: the first token
    with positive weight whose cumulative weight (float64) exceeds ``target``; the last
    positive-weight token when rounding leaves ``target`` at or above the total."""
    cdf = tl.full((), 0.0, tl.float64)
    token = tl.full((), -1, tl.int64)
    last = tl.full((), -1, tl.int64)
    for chunk in range(0, N_CHUNKS):
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = offs < V
        w = _chunk_weights(row_ptr, q_ptr, offs, mask, temp, s_max, k_lo, s1, p_lo, s2, draft, residual,
                           HAS_Q, RESIDUAL)
        cum = cdf + tl.associative_scan(w.to(tl.float64), 0, _SUM)
        hit = mask & (w > 0.0) & (cum > target)
        first = tl.reduce(tl.where(hit, offs, V), 0, _MIN)
        token = tl.where((token < 0) & (first < V), first.to(tl.int64), token)
        last = tl.maximum(last, tl.reduce(tl.where(mask & (w > 0.0), offs, -1), 0, _MAX).to(tl.int64))
        cdf = tl.reduce(cum, 0, _MAX)  # the cumulative weight is non-decreasing: its last value
    return tl.where(token < 0, last, token)


@triton.jit
def _fused_verify_kernel(
    logits_ptr, draft_ptr, length_ptr, temp_ptr, top_k_ptr, top_p_ptr, uniform_ptr, q_ptr,
    accepted_ptr, output_ptr, target_ptr,
    V, max_candidates, window,
    K: tl.constexpr, STRATEGY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, N_CHUNKS: tl.constexpr,
    K_PAD: tl.constexpr, PIVOTS: tl.constexpr,
):
    """Verify one request (``program_id(0)``) of a batch.

    :param logits_ptr: ``[B, K+1, V]`` float32 target logits.
    :param draft_ptr: ``[B, K]`` int64 drafts (``DRAFT_PAD`` past each request's length).
    :param length_ptr: ``[B]`` int64 draft counts.
    :param temp_ptr, top_k_ptr, top_p_ptr: ``[B]`` float32 / int64 / float32 sampling settings.
    :param uniform_ptr: ``[B, K+1, 2]`` float64 uniforms: ``[..., 0]`` accept tests,
        ``[..., 1]`` token samples.
    :param q_ptr: ``[B, K, V]`` float32 draft distributions when ``HAS_Q`` (else unused).
    :param accepted_ptr, output_ptr, target_ptr: ``[B]``, ``[B, K+1]``, ``[B, K+1]`` int64
        results, the fields of ``VerifyResult``.
    :param V: the vocabulary size (any; the last chunk is masked).
    :param max_candidates, window: ``topp``'s ``max_candidate_len`` and ``verify_window``.
    :param K: the draft width ``k`` (a constexpr: one compilation per width in use).
    :param STRATEGY: 0 greedy, 1 target_match, 2 rejection, 3 topp.
    :param HAS_Q: whether ``q_ptr`` holds draft distributions (else drafts are one-hot).
    :param BLOCK_V, N_CHUNKS: the vocabulary chunk (a power of two) and ``ceil(V / BLOCK_V)``.
    :param K_PAD: a power of two ``> K``: the per-row registers (targets, ranks, counts).
    :param PIVOTS: keys tried per pass of the top-k / top-p search (a power of two).

    Rows ``0 .. lengths[b]`` are processed in order; the accept decision of ``greedy``,
    ``target_match`` and ``rejection`` is made row by row (``stopped`` ends it), ``topp``'s
    after the last row from the ranks and candidate counts it kept.
    """
    b = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, K_PAD)
    length = tl.minimum(tl.maximum(tl.load(length_ptr + b), 0), K)
    drafts = tl.load(draft_ptr + b * K + idx, mask=idx < K, other=-1)

    temp = tl.load(temp_ptr + b)
    top_k = tl.load(top_k_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    sampled = (temp > 0.0) & (STRATEGY != 0)
    temp = tl.where(sampled, temp, 1.0)  # greedy requests never divide by their temperature
    top_k_on = sampled & (top_k > 0) & (top_k < V)
    top_p_on = sampled & (top_p < 1.0)
    renormalise = top_k_on | top_p_on

    accepted = tl.full((), 0, tl.int64)
    stopped = tl.full((), 0, tl.int32)
    next_token = tl.full((), _PAD, tl.int64)
    targets = tl.full([K_PAD], _PAD, tl.int64)
    ranks = tl.full([K_PAD], 0, tl.int64)
    counts = tl.full([K_PAD], 1, tl.int64)

    # Loop bounds are constexprs: with numpy >= 2 the interpreter cannot take a tensor (a loaded
    # length, or an int argument) as a range bound. Rows past the drafts are skipped.
    for j in range(0, K + 1):
        if j <= length:
            row = b * (K + 1) + j
            row_ptr = logits_ptr + row * V
            q_row_ptr = q_ptr + (b * K + j) * V
            is_draft = j < length
            draft = tl.load(draft_ptr + b * K + j, mask=is_draft, other=0)
            draft = tl.minimum(tl.maximum(draft, 0), V - 1)  # padding -> any valid id (unused)
            x_draft = tl.load(row_ptr + draft)

            argmax, s_max, key_min, rank = _max_pass(row_ptr, V, temp, x_draft, draft, STRATEGY != 0,
                                                     STRATEGY == 3, BLOCK_V, N_CHUNKS)
            token = argmax
            accept = draft == token  # prefix match; rejection overrides it for sampled requests
            emitted = token  # the token emitted if the drafts stop at this row
            nonzero = tl.full((), 1, tl.int64)
            if STRATEGY != 0:
                if sampled:
                    k_lo = tl.full((), _NO_KEY_LOW, tl.int64)  # keep tokens with key(s) > k_lo
                    if top_k_on:
                        bits = s_max.to(tl.int32, bitcast=True)
                        key_max = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
                        k_lo = _cut(row_ptr, V, temp, s_max, k_lo, 1.0, top_k, key_min - 1, key_max,
                                    False, PIVOTS, BLOCK_V, N_CHUNKS)
                    s1 = _softmax_sum(row_ptr, V, temp, s_max, k_lo, BLOCK_V, N_CHUNKS).to(tl.float32)
                    p_lo = tl.full((), -1, tl.int64)  # keep tokens with bits(p1) > p_lo
                    s2 = tl.full((), 1.0, tl.float32)
                    if top_p_on:
                        # The top token's p1 is exp(0) / s1: the largest key.
                        top_key = tl.math.div_rn(tl.full((), 1.0, tl.float32), s1).to(tl.int32, bitcast=True)
                        p_lo = _cut(row_ptr, V, temp, s_max, k_lo, s1, top_p.to(tl.float64), p_lo,
                                    top_key.to(tl.int64), True, PIVOTS, BLOCK_V, N_CHUNKS)
                    if renormalise:
                        s2 = _mass_pass(row_ptr, q_row_ptr, V, temp, s_max, k_lo, s1, p_lo, s2, draft, 0,
                                        HAS_Q, False, BLOCK_V, N_CHUNKS)[0].to(tl.float32)
                    total, nonzero, p_draft = _mass_pass(row_ptr, q_row_ptr, V, temp, s_max, k_lo, s1, p_lo, s2,
                                                         draft, 0, HAS_Q, False, BLOCK_V, N_CHUNKS)
                    u = tl.load(uniform_ptr + row * 2 + 1)
                    token = _sample_pass(row_ptr, q_row_ptr, V, temp, s_max, k_lo, s1, p_lo, s2, draft, 0,
                                         u * total, HAS_Q, False, BLOCK_V, N_CHUNKS)
                    accept = draft == token
                    emitted = token
                    if STRATEGY == 2:
                        if is_draft & (stopped == 0):
                            if HAS_Q:
                                q_draft = tl.load(q_row_ptr + draft).to(tl.float64)
                            else:
                                q_draft = tl.full((), 1.0, tl.float64)
                            accept = tl.load(uniform_ptr + row * 2) * q_draft < p_draft.to(tl.float64)
                            if accept == 0:
                                # Sample from the residual max(0, p - q), or from p when it is empty.
                                r_total = _mass_pass(row_ptr, q_row_ptr, V, temp, s_max, k_lo, s1, p_lo, s2,
                                                     draft, 1, HAS_Q, True, BLOCK_V, N_CHUNKS)[0]
                                use_residual = r_total > 0.0
                                emitted = _sample_pass(row_ptr, q_row_ptr, V, temp, s_max, k_lo, s1, p_lo, s2,
                                                       draft, tl.where(use_residual, 1, 0),
                                                       u * tl.where(use_residual, r_total, total),
                                                       HAS_Q, True, BLOCK_V, N_CHUNKS)
            targets = tl.where(idx == j, token, targets)
            if STRATEGY == 3:
                ranks = tl.where(idx == j, rank, ranks)
                count = tl.where(sampled, tl.minimum(nonzero, max_candidates), 1)
                counts = tl.where(idx == j, count, counts)
            else:
                live = stopped == 0
                accepted += tl.where(live & is_draft & accept, 1, 0)
                stop_here = live & ((j >= length) | (accept == 0))
                next_token = tl.where(stop_here, emitted, next_token)
                stopped = tl.where(stop_here, 1, stopped)

    if STRATEGY == 3:
        # The device half of topp; its host twin is topp_rule in plugins/verify/topp.py (steps,
        # then walk): steps[j] = 1 for a candidate, window + 1 for the second-best token
        # followed by `window` top-1 drafts, else 0; walk them from position 0.
        valid = idx < length
        in_set = valid & (ranks < counts)
        top1 = valid & (ranks == 0)
        second = valid & (ranks == 1)
        use_window = (max_candidates >= 2) & (V >= 2)
        position = tl.full((), 0, tl.int64)
        for _ in range(0, K):
            here = idx == position
            candidate = tl.reduce(tl.where(here & in_set, 1, 0), 0, _SUM) > 0
            runner_up = tl.reduce(tl.where(here & second, 1, 0), 0, _SUM) > 0
            ahead = (idx > position) & (idx <= position + window) & top1
            run = tl.reduce(tl.where(ahead, 1, 0), 0, _SUM) == window
            step = tl.where(candidate, 1, tl.where(use_window & runner_up & run, window + 1, 0))
            position += tl.where(position < length, step, 0).to(tl.int64)
        accepted = position
        next_token = tl.reduce(tl.where(idx == position, targets, 0), 0, _SUM)

    output = tl.where(idx < accepted, drafts, tl.where(idx == accepted, next_token, _PAD))
    tl.store(output_ptr + b * (K + 1) + idx, output, mask=idx < K + 1)
    tl.store(target_ptr + b * (K + 1) + idx, targets, mask=idx < K + 1)
    tl.store(accepted_ptr + b, accepted)


def _host(array, dtype, shape, name):
    array = np.ascontiguousarray(np.asarray(array, dtype=dtype))
    if array.shape != tuple(shape):
        raise ValueError(f"fused_verify: {name} has shape {array.shape}, expected {tuple(shape)}")
    return array


def _float32_tensor(tensor):
    """A contiguous float32 tensor of ``tensor``'s framework and device."""
    if runtime.is_torch(tensor):
        import torch

        return tensor.to(torch.float32).contiguous()
    if not str(tensor.dtype).endswith("float32"):
        tensor = tensor.astype("float32")
    return tensor


def _launch(code: int, logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs=None, *,
            max_candidate_len: int = 5, verify_window: int = 2):
    """Verify a batch of drafts in one launch of the kernel specialised for rule ``code``.

    :param code: the rule, one of ``_GREEDY``, ``_TARGET_MATCH``, ``_REJECTION``, ``_TOPP``.
    :param logits: ``[B, k+1, V]`` float32 target logits, a paddle (or torch) tensor on the
        device (a paddle CPU tensor in Triton's interpreter).
    :param draft_ids: ``[B, k]`` int64 drafts (numpy), ``DRAFT_PAD`` past each length.
    :param draft_lengths: ``[B]`` int64 draft counts (numpy).
    :param temperature: ``[B]`` float32 (numpy); <= 0 means greedy.
    :param top_k: ``[B]`` int64 (numpy); 0 (or >= V) keeps every token.
    :param top_p: ``[B]`` float32 (numpy); 1 keeps every token.
    :param uniforms: ``[B, k+1, 2]`` float64 pre-drawn uniforms (numpy), as in ``BatchSampling``.
    :param draft_probs: ``None`` (deterministic drafts), or ``[B, k, V]`` float32 draft
        distributions for ``rejection``, numpy or a tensor like ``logits``.
    :param max_candidate_len: ``topp``'s candidate limit (``ToppVerify.Config``).
    :param verify_window: ``topp``'s top-1 window (``ToppVerify.Config``).
    :returns: ``(accepted_lengths [B], output_tokens [B, k+1], target_tokens [B, k+1])``, int64
        numpy arrays: the fields of the numpy strategy's ``VerifyResult``.
    :raises ValueError: for a non-positive ``topp`` option or arrays whose shapes do not match
        the logits.
    """
    if max_candidate_len < 1 or verify_window < 1:
        raise ValueError("fused_verify: max_candidate_len and verify_window must be >= 1")
    if len(logits.shape) != 3:
        raise ValueError(f"fused_verify: logits of shape {tuple(logits.shape)}; expected [B, k+1, V]")
    batch, rows, vocab = (int(n) for n in logits.shape)
    width = rows - 1
    if batch == 0:
        empty = np.zeros((0, rows), dtype=np.int64)
        return np.zeros(0, dtype=np.int64), empty, empty.copy()
    logits = _float32_tensor(logits)

    host = {
        "draft_ids": _host(draft_ids, np.int64, (batch, width), "draft_ids"),
        "draft_lengths": _host(draft_lengths, np.int64, (batch,), "draft_lengths"),
        "temperature": _host(temperature, np.float32, (batch,), "temperature"),
        "top_k": _host(top_k, np.int64, (batch,), "top_k"),
        "top_p": _host(top_p, np.float32, (batch,), "top_p"),
        "uniforms": _host(uniforms, np.float64, (batch, rows, 2), "uniforms"),
    }
    if width == 0:  # no zero-size tensors reach the kernel: it reads no draft then
        host["draft_ids"] = np.full(1, DRAFT_PAD, dtype=np.int64)
    device = {name: runtime.from_numpy(array, like=logits) for name, array in host.items()}

    has_q = draft_probs is not None and width > 0
    if has_q:
        if isinstance(draft_probs, np.ndarray):
            q = runtime.from_numpy(_host(draft_probs, np.float32, (batch, width, vocab), "draft_probs"), like=logits)
        else:
            q = _float32_tensor(draft_probs)
            if tuple(q.shape) != (batch, width, vocab):
                raise ValueError(f"fused_verify: draft_probs has shape {tuple(q.shape)}, "
                                 f"expected {(batch, width, vocab)}")
    else:
        q = logits  # never read

    accepted = runtime.empty(logits, [batch], "int64")
    output = runtime.empty(logits, [batch, rows], "int64")
    targets = runtime.empty(logits, [batch, rows], "int64")
    block = min(_BLOCK_V_INTERPRETER if runtime.interpreting() else _BLOCK_V_GPU, triton.next_power_of_2(vocab))
    arg = runtime.kernel_arg
    _fused_verify_kernel[(batch,)](
        arg(logits), arg(device["draft_ids"]), arg(device["draft_lengths"]), arg(device["temperature"]),
        arg(device["top_k"]), arg(device["top_p"]), arg(device["uniforms"]), arg(q),
        arg(accepted), arg(output), arg(targets),
        vocab, int(max_candidate_len), int(verify_window),
        K=width, STRATEGY=code, HAS_Q=has_q, BLOCK_V=block, N_CHUNKS=triton.cdiv(vocab, block),
        K_PAD=max(2, triton.next_power_of_2(rows)), PIVOTS=_PIVOTS, num_warps=_NUM_WARPS,
    )
    return runtime.to_numpy(accepted), runtime.to_numpy(output), runtime.to_numpy(targets)


def greedy_verify(logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs=None):
    """``greedy`` on the device: accept drafts while they equal the argmax, emit the argmax
    (host twin: ``greedy_rule`` in ``plugins/verify/greedy.py``). Arguments and result as
    :func:`_launch` takes and returns them; sampling settings and ``draft_probs`` are unused."""
    return _launch(_GREEDY, logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs)


def target_match_verify(logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs=None):
    """``target_match`` on the device: accept drafts while they equal the target's own sample
    (host twin: ``target_match_rule`` in ``plugins/verify/target_match.py``). Arguments and
    result as :func:`_launch` takes and returns them; ``draft_probs`` is unused."""
    return _launch(_TARGET_MATCH, logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs)


def rejection_verify(logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs=None):
    """``rejection`` on the device: speculative sampling against ``draft_probs`` (one-hot
    drafts when ``None``) (host twin: ``rejection_rule`` in ``plugins/verify/rejection.py``).
    Arguments and result as :func:`_launch` takes and returns them."""
    return _launch(_REJECTION, logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs)


def topp_verify(logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs=None, *,
                max_candidate_len: int = 5, verify_window: int = 2):
    """``topp`` on the device: accept drafts among the nucleus's best ``max_candidate_len``
    tokens, or a second-best draft followed by ``verify_window`` top-1 drafts (host twin:
    ``topp_rule`` in ``plugins/verify/topp.py``). Arguments and result as :func:`_launch` takes
    and returns them; ``draft_probs`` is unused."""
    return _launch(_TOPP, logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs,
                   max_candidate_len=max_candidate_len, verify_window=verify_window)


_CODES = {"greedy": _GREEDY, "target_match": _TARGET_MATCH, "rejection": _REJECTION, "topp": _TOPP}


def fused_verify(strategy: str, logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms,
                 draft_probs=None, *, max_candidate_len: int = 5, verify_window: int = 2):
    """Deprecated (kept for one release): the launcher of the built-in rule named ``strategy``.
    Call that rule's launcher (:func:`greedy_verify`, ...) or, from a strategy,
    ``specdec.sdk.verify_on_device(self, inputs)``."""
    warnings.warn("fused_verify(name, ...) is deprecated: call greedy_verify, target_match_verify, rejection_verify "
                  "or topp_verify, or specdec.sdk.verify_on_device(strategy, inputs)", DeprecationWarning, stacklevel=2)
    if strategy not in _CODES:
        raise ValueError(f"unknown verify strategy {strategy!r}; expected one of {sorted(_CODES)}")
    return _launch(_CODES[strategy], logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms, draft_probs,
                   max_candidate_len=max_candidate_len, verify_window=verify_window)


__all__ = ["greedy_verify", "target_match_verify", "rejection_verify", "topp_verify", "fused_verify"]
