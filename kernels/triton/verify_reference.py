"""The numpy twin of the fused verify kernel (:func:`specdec.kernels.triton.verify.fused_verify`).

Written the plain way, one request and one row at a time with sorts, so that it is easy to
check by reading; the tests hold it equal to the engine's own verify strategies
(``plugins/verify``) and to the kernel. It imports numpy only, so ``benchmarks/gpu_check.py``
can use it on a machine that has torch and triton but not specdec's dependencies.
"""

from __future__ import annotations

import numpy as np

DRAFT_PAD = -1  # specdec.DRAFT_PAD
STRATEGIES = ("greedy", "target_match", "rejection", "topp")


def processed_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row's sampling distribution ``[V]`` float32: temperature, then top-k, then top-p
    (keep best-first tokens while the mass before them is below ``top_p``), renormalised;
    one-hot on the argmax at temperature 0. Float32 with float64 sums, as the engine's
    ``processed_probs`` computes it (so that the same tokens underflow to 0)."""
    vocab = len(logits)
    probs = np.zeros(vocab, dtype=np.float32)
    if temperature <= 0:
        probs[int(np.argmax(logits))] = 1.0
        return probs
    scaled = logits.astype(np.float32) / np.float32(temperature)
    order = np.argsort(-scaled, kind="stable")
    if 0 < top_k < vocab:
        order = order[:top_k]
    kept = np.exp(scaled[order] - scaled[order[0]])
    kept /= kept.sum(dtype=np.float64).astype(np.float32)
    if top_p < 1.0:
        mass_before = np.concatenate([[0.0], np.cumsum(kept, dtype=np.float64)[:-1]])
        count = int(np.count_nonzero(mass_before < top_p))
        order, kept = order[:count], kept[:count]
        kept = kept / kept.sum(dtype=np.float64).astype(np.float32)
    probs[order] = kept
    return probs


def sample(weights: np.ndarray, u: float) -> int:
    """The first token whose cumulative weight exceeds ``u * total`` (inverse CDF in vocabulary order)."""
    cdf = np.cumsum(weights, dtype=np.float64)
    target = min(u * cdf[-1], np.nextafter(cdf[-1], 0.0))
    return int(np.count_nonzero(cdf <= target))


def verify(strategy: str, logits, draft_ids, draft_lengths, temperature, top_k, top_p, uniforms,
           draft_probs=None, *, max_candidate_len: int = 5, verify_window: int = 2):
    """``(accepted_lengths [B], output_tokens [B, k+1], target_tokens [B, k+1])`` int64, as
    the fused kernel returns them; arguments as :func:`~specdec.kernels.triton.verify.fused_verify`
    takes them, all numpy."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown verify strategy {strategy!r}; expected one of {STRATEGIES}")
    logits = np.asarray(logits, dtype=np.float32)
    batch, rows, _ = logits.shape
    accepted = np.zeros(batch, dtype=np.int64)
    output = np.full((batch, rows), DRAFT_PAD, dtype=np.int64)
    targets = np.full((batch, rows), DRAFT_PAD, dtype=np.int64)
    for b in range(batch):
        length = int(draft_lengths[b])
        greedy = strategy == "greedy" or temperature[b] <= 0
        probs = [processed_row(logits[b, j], 0.0 if greedy else float(temperature[b]), int(top_k[b]), float(top_p[b]))
                 for j in range(length + 1)]
        targets[b, : length + 1] = [int(np.argmax(p)) if greedy else sample(p, uniforms[b, j, 1])
                                    for j, p in enumerate(probs)]
        drafts = [int(d) for d in draft_ids[b, :length]]
        if strategy == "topp":
            count = _topp_walk(logits[b], probs, drafts, greedy, max_candidate_len, verify_window)
            next_token = targets[b, count]
        elif strategy == "rejection" and not greedy:
            count, next_token = _rejection(probs, drafts, draft_probs, b, uniforms[b], targets[b])
        else:
            count = 0
            while count < length and drafts[count] == targets[b, count]:
                count += 1
            next_token = targets[b, count]
        accepted[b] = count
        output[b, :count] = drafts[:count]
        output[b, count] = next_token
    return accepted, output, targets


def _rejection(probs, drafts, draft_probs, b, uniforms, targets):
    """Speculative sampling for one sampled request: ``(accepted, emitted token)``."""
    for j, draft in enumerate(drafts):
        q = np.zeros_like(probs[j]) if draft_probs is None else np.asarray(draft_probs[b, j], dtype=np.float32)
        if draft_probs is None:
            q[draft] = 1.0
        if uniforms[j, 0] * q[draft] < probs[j][draft]:
            continue
        residual = np.maximum(probs[j] - q, 0.0)
        if residual.sum(dtype=np.float64) <= 0.0:
            residual = probs[j]
        return j, sample(residual, uniforms[j, 1])
    return len(drafts), int(targets[len(drafts)])


def _topp_walk(logits, probs, drafts, greedy, max_candidate_len, verify_window):
    """How many drafts ``topp`` accepts (see plugins/verify/topp.py for the rules)."""
    ranks = []  # each draft's rank by raw logit (ties: lower id first)
    for j, draft in enumerate(drafts):
        row = logits[j]
        ranks.append(int(np.count_nonzero(row > row[draft]) + np.count_nonzero(row[:draft] == row[draft])))
    counts = [1 if greedy else min(int(np.count_nonzero(probs[j])), max_candidate_len) for j in range(len(drafts))]
    position = 0
    while position < len(drafts):
        if ranks[position] < counts[position]:
            position += 1
            continue
        window = range(position + 1, position + 1 + verify_window)
        if (max_candidate_len >= 2 and ranks[position] == 1 and window.stop <= len(drafts)
                and all(ranks[i] == 0 for i in window)):
            position = window.stop
            continue
        break
    return position
