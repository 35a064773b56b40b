"""Sampling math shared by the verify strategies (part of :mod:`specdec.sdk`): processed target
distributions, sampling from them with pre-drawn uniforms, and the residual distribution
speculative sampling draws from after a rejection.

Every function works on whole batches shaped ``[B, R, V]`` (``R`` rows per request, usually
``k+1``) with per-request settings shaped ``[B]``; none loops over requests in Python.

The processing order is the usual one: temperature, then top-k, then top-p (the nucleus of the
distribution left by top-k), renormalised. Temperature 0 means greedy: the row becomes one-hot
on its argmax. Top-k keeps exactly ``k`` tokens and top-p the shortest best-first run of
tokens whose mass reaches ``top_p``; ties at either boundary are broken arbitrarily (but
deterministically).

Probabilities are float32 (a ``[256, 6, 49152]`` batch is already 300 MB); the sums that decide
which token is sampled or kept are float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from .verify import BatchSampling

#: Tokens per block in the two-level inverse CDF of :func:`sample_tokens`.
_SAMPLE_BLOCK = 256
#: Candidate counts tried, in order, when looking for the nucleus before sorting a whole row.
_NUCLEUS_WINDOWS = (64, 1024, 8192)
#: Up to this many top tokens, :func:`top_tokens` uses repeated argmax instead of a partition.
_ARGMAX_TOP_TOKENS = 8


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """``[..., V]`` logits -> ``[...]`` int64 argmax tokens (ties to the lowest id).

    A large array (a batch of 64 rows of a 49152-token vocabulary is 12.6 MB) is read by two
    threads, half the rows each (numpy's argmax releases the GIL): one core alone does not
    reach the machine's memory bandwidth."""
    if logits.size < _PARALLEL_ARGMAX_ELEMENTS or logits.ndim < 2 or not logits.flags.c_contiguous:
        return np.argmax(logits, axis=-1).astype(np.int64, copy=False)
    rows = logits.reshape(-1, logits.shape[-1])
    half = len(rows) // 2
    other = _argmax_pool().submit(np.argmax, rows[half:], axis=-1)
    first = np.argmax(rows[:half], axis=-1)
    return np.concatenate([first, other.result()]).astype(np.int64, copy=False).reshape(logits.shape[:-1])


#: Logits from which :func:`greedy_tokens` splits the rows between two threads (a 4 MB array).
_PARALLEL_ARGMAX_ELEMENTS = 1 << 20
_POOL = None


def _argmax_pool():
    """The one extra thread of :func:`greedy_tokens` (started on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-argmax")
    return _POOL


def processed_probs(
    logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray
) -> np.ndarray:
    """Turn logits into each request's sampling distribution.

    :param logits: ``[B, R, V]`` float logits.
    :param temperature: ``[B]``; 0 makes every row of that request one-hot on its argmax.
    :param top_k: ``[B]``; 0 (or >= V) keeps every token.
    :param top_p: ``[B]`` in (0, 1]; 1 keeps every token.
    :returns: ``[B, R, V]`` float32 probabilities, each row summing to 1.
    """
    logits = np.asarray(logits)
    batch, rows, vocab = logits.shape
    temperature = np.asarray(temperature, dtype=np.float64).reshape(batch)
    greedy = temperature <= 0.0
    if greedy.all():
        return one_hot(greedy_tokens(logits), vocab)
    sampled = ~greedy
    if sampled.all():
        return _sampled_probs(logits, temperature, np.asarray(top_k), np.asarray(top_p))
    probs = np.empty((batch, rows, vocab), dtype=np.float32)
    probs[greedy] = one_hot(greedy_tokens(logits[greedy]), vocab)
    probs[sampled] = _sampled_probs(
        logits[sampled], temperature[sampled], np.asarray(top_k)[sampled], np.asarray(top_p)[sampled]
    )
    return probs


def one_hot(tokens: np.ndarray, vocab: int) -> np.ndarray:
    """``[...]`` int tokens -> ``[..., vocab]`` float32 one-hot rows."""
    out = np.zeros(tokens.shape + (vocab,), dtype=np.float32)
    np.put_along_axis(out, tokens[..., None], 1.0, axis=-1)
    return out


def sample_tokens(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Sample one token per row by inverse CDF.

    :param probs: ``[B, R, V]`` non-negative weights (need not be normalised).
    :param u: ``[B, R]`` uniforms in [0, 1).
    :returns: ``[B, R]`` int64: the first token whose cumulative weight exceeds ``u * total``,
        which never is a zero-weight token.
    """
    *lead, vocab = probs.shape
    flat = probs.reshape(-1, vocab)
    rows = np.arange(len(flat))
    # A cumsum over the whole vocabulary is slow in numpy; find the block holding the token
    # from per-block sums, then take the cumulative sum inside that block only.
    block = min(_SAMPLE_BLOCK, vocab)
    starts = np.arange(0, vocab, block)
    block_cdf = np.cumsum(_block_sums(flat, block), axis=-1)
    total = block_cdf[:, -1]
    # u < 1, but u * total can round up to total; stay strictly below it.
    target = np.minimum(np.asarray(u, dtype=np.float64).reshape(-1) * total, np.nextafter(total, 0.0))
    chosen = np.minimum(np.count_nonzero(block_cdf <= target[:, None], axis=-1), len(starts) - 1)
    before = np.where(chosen > 0, block_cdf[rows, chosen - 1], 0.0)

    columns = starts[chosen][:, None] + np.arange(block)[None, :]
    inside = columns < vocab
    weights = np.where(inside, np.take_along_axis(flat, np.minimum(columns, vocab - 1), axis=-1), 0.0)
    cdf = np.cumsum(weights, axis=-1, dtype=np.float64)
    offset = np.minimum(target - before, np.nextafter(cdf[:, -1], 0.0))
    within = np.minimum(np.count_nonzero(cdf <= offset[:, None], axis=-1), block - 1)
    return (starts[chosen] + within).astype(np.int64).reshape(lead)


def _block_sums(flat: np.ndarray, block: int) -> np.ndarray:
    """``[N, V]`` -> ``[N, ceil(V / block)]`` float64 sums of consecutive blocks of each row."""
    rows, vocab = flat.shape
    whole = vocab // block * block
    sums = flat[:, :whole].reshape(rows, -1, block).sum(axis=-1, dtype=np.float64)
    if whole < vocab:
        sums = np.concatenate([sums, flat[:, whole:].sum(axis=-1, dtype=np.float64, keepdims=True)], axis=1)
    return sums


def target_choice(logits: np.ndarray, sampling: "BatchSampling", uniforms: np.ndarray) -> np.ndarray:
    """The target's own token at every row: argmax for greedy requests, else a sample.

    :param logits: ``[B, R, V]``.
    :param sampling: the batch's sampling settings.
    :param uniforms: ``[B, R]`` uniforms used to sample (``sampling.uniforms[..., 1]``).
    :returns: ``[B, R]`` int64. An all-greedy batch never computes a softmax.
    """
    return target_distribution(logits, sampling, uniforms)[0]


def target_distribution(
    logits: np.ndarray, sampling: "BatchSampling", uniforms: np.ndarray
) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """:func:`target_choice` plus the distributions it sampled from, for strategies that need both.

    :returns: ``(tokens [B, R], sampled [B] bool, probs [S, R, V] or None)`` where ``sampled``
        marks the requests with temperature > 0 and ``probs`` holds their processed
        distributions, in batch order (``None`` when every request is greedy).
    """
    tokens = greedy_tokens(logits)
    sampled = np.asarray(sampling.temperature) > 0.0
    if not sampled.any():
        return tokens, sampled, None
    if sampled.all():
        probs = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return sample_tokens(probs, uniforms), sampled, probs
    probs = processed_probs(
        logits[sampled], sampling.temperature[sampled], sampling.top_k[sampled], sampling.top_p[sampled]
    )
    tokens[sampled] = sample_tokens(probs, np.asarray(uniforms)[sampled])
    return tokens, sampled, probs


def top_tokens(logits: np.ndarray, count: int) -> np.ndarray:
    """``[B, R, V]`` logits -> ``[B, R, count]`` int64 ids of the largest logits, best first.

    The first id is always the argmax (ties go to the lowest id, as in :func:`greedy_tokens`).
    """
    vocab = logits.shape[-1]
    count = min(count, vocab)
    if count <= _ARGMAX_TOP_TOKENS:
        # A few argmax passes over one copy beat a partition of the whole vocabulary.
        remaining = np.array(logits, dtype=np.float32)
        ids = np.empty(logits.shape[:-1] + (count,), dtype=np.int64)
        for rank in range(count):
            ids[..., rank] = np.argmax(remaining, axis=-1)
            np.put_along_axis(remaining, ids[..., rank : rank + 1], -np.inf, axis=-1)
        return ids
    candidates = np.argpartition(logits, vocab - count, axis=-1)[..., vocab - count :]
    candidates.sort(axis=-1)  # so that the stable sort below puts tied logits in id order
    order = np.argsort(-np.take_along_axis(logits, candidates, axis=-1), axis=-1, kind="stable")
    return np.take_along_axis(candidates, order, axis=-1).astype(np.int64, copy=False)


def _sampled_probs(
    logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray
) -> np.ndarray:
    """:func:`processed_probs` for requests that all have temperature > 0."""
    batch, rows, vocab = logits.shape
    scaled = (logits / temperature.astype(np.float32)[:, None, None]).reshape(-1, vocab)
    row_top_k = np.repeat(np.asarray(top_k, dtype=np.int64), rows)
    row_top_p = np.repeat(np.asarray(top_p, dtype=np.float64), rows)

    filtered = (row_top_k > 0) & (row_top_k < vocab)
    if filtered.all():
        probs = _top_k_probs(scaled, row_top_k, row_top_p)
    elif not filtered.any():
        probs = _full_probs(scaled, row_top_p)
    else:
        probs = np.empty_like(scaled)
        probs[filtered] = _top_k_probs(scaled[filtered], row_top_k[filtered], row_top_p[filtered])
        probs[~filtered] = _full_probs(scaled[~filtered], row_top_p[~filtered])
    return probs.reshape(batch, rows, vocab)


def _top_k_probs(scaled: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Rows ``[N, V]`` of scaled logits with top-k on -> dense probabilities after top-k and top-p.

    Only the ``max(top_k)`` largest logits can survive, so everything happens on those
    (partition instead of sorting the vocabulary; no softmax over the whole row).
    """
    vocab = scaled.shape[-1]
    k_max = int(top_k.max())
    ids = np.argpartition(scaled, vocab - k_max, axis=-1)[:, vocab - k_max :]
    values = np.take_along_axis(scaled, ids, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    values = np.take_along_axis(values, order, axis=-1)
    values[np.arange(k_max)[None, :] >= top_k[:, None]] = -np.inf
    candidate_probs = _softmax_inplace(values)
    kept = _nucleus_size(np.cumsum(candidate_probs, axis=-1, dtype=np.float64), top_p)
    return _scatter_kept(ids, candidate_probs, kept, vocab)


def _full_probs(scaled: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Rows ``[N, V]`` of scaled logits with top-k off -> probabilities after top-p (in place)."""
    probs = _softmax_inplace(scaled)
    nucleus = top_p < 1.0
    if nucleus.any():
        probs[nucleus] = _nucleus_probs(probs[nucleus], top_p[nucleus])
    return probs


def _softmax_inplace(values: np.ndarray) -> np.ndarray:
    values -= values.max(axis=-1, keepdims=True)
    np.exp(values, out=values)
    values /= values.sum(axis=-1, keepdims=True, dtype=np.float64).astype(values.dtype)
    return values


def _nucleus_size(cumulative: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """How many of the best-first tokens top-p keeps, from their cumulative mass ``[N, m]``.

    A token is kept while the mass before it is still below ``top_p``, so the token that
    reaches ``top_p`` is kept and the first one always is. ``top_p`` 1 keeps every token, even
    where rounding lifts the cumulative mass to 1 early.
    """
    cut = np.where(top_p >= 1.0, np.inf, top_p)
    return 1 + np.count_nonzero(cumulative[:, :-1] < cut[:, None], axis=-1)


def _scatter_kept(ids: np.ndarray, probs: np.ndarray, kept: np.ndarray, vocab: int) -> np.ndarray:
    """Dense ``[N, V]`` rows holding the first ``kept`` of the best-first ``ids``/``probs``, renormalised."""
    probs = np.where(np.arange(ids.shape[-1])[None, :] < kept[:, None], probs, 0.0)
    probs /= probs.sum(axis=-1, keepdims=True, dtype=np.float64).astype(probs.dtype)
    dense = np.zeros((len(ids), vocab), dtype=np.float32)
    np.put_along_axis(dense, ids, probs, axis=-1)
    return dense


def _nucleus_probs(probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Rows ``[N, V]`` of probabilities -> the same rows cut to their top-p nucleus.

    Most nuclei are small: the largest few probabilities are tried first (a partition, not a
    sort) and a row is sorted whole only when they do not reach ``top_p``.
    """
    vocab = probs.shape[-1]
    out = np.empty_like(probs)
    pending = np.arange(len(probs))
    for window in (*(w for w in _NUCLEUS_WINDOWS if w < vocab), vocab):
        rows = probs[pending]
        if window < vocab:
            ids = np.argpartition(rows, vocab - window, axis=-1)[:, vocab - window :]
        else:
            ids = np.broadcast_to(np.arange(vocab), rows.shape)
        values = np.take_along_axis(rows, ids, axis=-1)
        order = np.argsort(-values, axis=-1, kind="stable")
        ids = np.take_along_axis(ids, order, axis=-1)
        values = np.take_along_axis(values, order, axis=-1)
        cumulative = np.cumsum(values, axis=-1, dtype=np.float64)
        cut = top_p[pending]
        found = (cumulative[:, -1] >= cut) | (window == vocab)
        kept = _nucleus_size(cumulative[found], cut[found])
        out[pending[found]] = _scatter_kept(ids[found], values[found], kept, vocab)
        pending = pending[~found]
        if len(pending) == 0:
            break
    return out


def residual_distribution(p: np.ndarray, q: Optional[np.ndarray], draft_ids: np.ndarray) -> np.ndarray:
    """``[N, V]`` unnormalised ``max(0, p - q)``: what speculative sampling draws the
    recovered token from where draft ``draft_ids[n]`` was rejected.

    :param p: ``[N, V]`` the target's processed distributions at the rejected positions.
    :param q: ``[N, V]`` the distributions the drafts were sampled from, or ``None`` for
        deterministic drafts (one-hot ``q``: then ``p - q`` is ``p`` without the draft).
    :param draft_ids: ``[N]`` the rejected drafts.

    Falls back to ``p`` where the residual has no mass (``p == q`` up to rounding, where a
    rejection is practically impossible).
    """
    if q is None:
        residual = p.copy()
        residual[np.arange(len(draft_ids)), draft_ids] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    empty = residual.sum(axis=-1) <= 0.0
    residual[empty] = p[empty]
    return residual


def recovered_tokens(p: np.ndarray, q: Optional[np.ndarray], draft_ids: np.ndarray, u: np.ndarray) -> np.ndarray:
    """``[N]`` int64 tokens sampled from :func:`residual_distribution` with uniforms ``u [N]``:
    the token speculative sampling emits in place of a rejected draft."""
    residual = residual_distribution(p, q, draft_ids)
    return sample_tokens(residual[:, None], np.asarray(u)[:, None])[:, 0]
