"""Conformance kit of attention backends (re-exported by :mod:`specdec.testing`).

    from specdec.testing import check_attention_backend

    def test_contract():
        check_attention_backend(MyBackend)

It runs the backend and the reference backend (``paddle``, looked up through the plugin
registry) side by side on the same random steps and raises ``AssertionError`` with a one-line
message naming the backend, the step and the layer where their outputs part.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .sdk import AttentionBackend, AttentionMetadata, require_paddle
from .testing_verify import build_plugin

#: ``(num_heads, num_kv_heads, head_dim)`` of the models a backend is compared on (GQA with
#: groups of 2 and 3, and plain multi-head attention).
ATTENTION_SHAPES = ((4, 2, 16), (4, 4, 32), (6, 2, 16))
#: Layers of each comparison: each has its own cache.
NUM_LAYERS = 2
#: The requests each step runs: ``prefill`` starts a request (context 0), ``chunk`` continues a
#: prefill over its partial context, ``decode`` verifies 1..5 rows (the last token plus drafts)
#: over its context. After a decode only some rows count as accepted: the next step's context
#: is shorter than what was written, and its rows overwrite the rejected ones.
STEPS = (
    (("prefill", 0), ("prefill", 1), ("prefill", 2)),
    (("decode", 0), ("decode", 1), ("chunk", 2), ("prefill", 3)),
    (("decode", 0), ("decode", 1), ("decode", 2), ("decode", 3), ("prefill", 4)),
)
#: Default tolerance per cache dtype: ``|out - ref| <= tolerance * (1 + |ref|)``.
TOLERANCES = {"float32": 1e-4, "float16": 1e-2}


def rope_tables(max_positions: int, head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and signed ``sin`` ``[max_positions, head_dim]`` float32 tables of rotate-half
    RoPE, as :meth:`specdec.AttentionBackend.setup` takes them (``-sin`` on the first half)."""
    half = head_dim // 2
    angles = np.outer(np.arange(max_positions), 1.0 / theta ** (np.arange(half) * 2 / head_dim))
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=-1).astype(np.float32)
    return cos, sin


def plan_steps(rng: np.random.Generator, block_size: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The :data:`STEPS` with random lengths: per step ``(requests, query_lens, context_lens)``,
    requests in a shuffled batch order. Prefills span several blocks."""
    known = np.zeros(1 + max(r for step in STEPS for _, r in step), dtype=np.int64)
    plan = []
    for step in STEPS:
        order = rng.permutation(len(step))
        requests = np.array([step[i][1] for i in order])
        kinds = [step[i][0] for i in order]
        prefill = rng.integers(block_size // 2, 3 * block_size, len(step))
        decode = rng.integers(1, 6, len(step))
        query = np.where(np.array(kinds) == "decode", decode, prefill)
        context = known[requests].copy()
        # A decode keeps 1..query of its rows (the accepted drafts plus one token).
        kept = np.where(np.array(kinds) == "decode", rng.integers(1, query + 1), query)
        known[requests] = context + kept
        plan.append((requests, query, context))
    return plan


def check_attention_backend(cls: type, config: object = None, *, reference: Optional[type] = None,
                            block_sizes: Sequence[int] = (8, 16), seed: int = 0,
                            tolerance: Optional[float] = None, dtype: str = "float32") -> None:
    """Compare attention backend class ``cls`` with ``reference`` (default: the ``paddle``
    backend from the plugin registry) and assert that they agree.

    For each block size and each of :data:`ATTENTION_SHAPES`, both backends are set up for a
    two-layer model with the same RoPE tables (``cls`` with cache ``dtype``, the reference with
    float32) and run :data:`STEPS`: random packed batches of prefills, chunked prefills and
    decodes over the context earlier steps cached, with shuffled, non-contiguous block tables.
    Asserts that ``bytes_per_block(block_size)`` is a positive int, that ``forward`` returns
    ``[T, H*D]``, and that every layer's output equals the reference's within ``tolerance``
    (``|out - ref| <= tolerance * (1 + |ref|)``; default :data:`TOLERANCES` of ``dtype``).

    ``config`` defaults to ``cls.Config()`` when the class declares a ``Config``. Needs paddle.
    """
    paddle = require_paddle()
    build_plugin(cls, AttentionBackend, config)  # checks the class before anything runs
    if reference is None:
        from .plugin_manager import get_plugins  # the reference is a plugin: never import it

        reference = get_plugins().attention_backends.get("paddle")
    tolerance = TOLERANCES.get(dtype, TOLERANCES["float16"]) if tolerance is None else tolerance
    rng = np.random.default_rng(seed)
    for block_size in block_sizes:
        for heads, kv_heads, head_dim in ATTENTION_SHAPES:
            prefix = f"{cls.NAME}: block_size {block_size}, heads {heads}/{kv_heads}, head_dim {head_dim}, {dtype}"
            _compare(paddle, build_plugin(cls, AttentionBackend, config), build_plugin(reference, AttentionBackend),
                     block_size, (heads, kv_heads, head_dim), dtype, tolerance, rng, prefix)


def _compare(paddle, backend: AttentionBackend, ref: AttentionBackend, block_size: int, shape: tuple,
             dtype: str, tolerance: float, rng: np.random.Generator, prefix: str) -> None:
    heads, kv_heads, head_dim = shape
    plan = plan_steps(rng, block_size)
    lengths = np.zeros(1 + max(int(requests.max()) for requests, _, _ in plan), dtype=np.int64)
    for requests, query, context in plan:
        np.maximum.at(lengths, requests, context + query)
    blocks_each = -(-int(lengths.max()) // block_size)
    num_blocks = len(lengths) * blocks_each + 3
    tables = rng.permutation(num_blocks)[: len(lengths) * blocks_each].reshape(len(lengths), blocks_each)
    cos, sin = rope_tables(int(lengths.max()), head_dim)
    for backend_, dtype_ in ((backend, dtype), (ref, "float32")):
        backend_.setup(num_layers=NUM_LAYERS, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       dtype=dtype_, rope_cos=cos, rope_sin=sin)
    size = backend.bytes_per_block(block_size)
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size <= 0:
        raise AssertionError(f"{prefix}: bytes_per_block({block_size}) must be a positive int, got {size!r}")
    backend.init_cache(num_blocks, block_size)
    ref.init_cache(num_blocks, block_size)

    width = (heads + 2 * kv_heads) * head_dim
    scale = np.repeat([head_dim ** -0.5, 1.0], [heads * head_dim, 2 * kv_heads * head_dim]).astype(np.float32)
    for step, (requests, query, context) in enumerate(plan):
        # Each backend gets its own metadata and tensors: neither can disturb the other's.
        metas = [AttentionMetadata.build(query, context, tables[requests], block_size) for _ in range(2)]
        backend.prepare(metas[0])
        ref.prepare(metas[1])
        for layer in range(NUM_LAYERS):
            qkv = rng.standard_normal((int(query.sum()), width)).astype(np.float32) * scale
            got = backend.forward(layer, paddle.to_tensor(qkv), metas[0])
            want = ref.forward(layer, paddle.to_tensor(qkv.copy()), metas[1]).numpy()
            where = f"{prefix}, step {step} layer {layer}"
            got = np.asarray(got.numpy() if hasattr(got, "numpy") else got)
            if got.shape != want.shape:
                raise AssertionError(f"{where}: forward returned shape {list(got.shape)}, expected "
                                     f"{list(want.shape)} ([T, H*D])")
            error = np.abs(got.astype(np.float64) - want) / (1.0 + np.abs(want))
            if not np.all(error <= tolerance):  # also catches NaN
                error = np.where(np.isnan(error), np.inf, error)
                row = int(np.argmax(error.max(axis=1)))
                b = int(metas[1].batch_ids[row])
                raise AssertionError(
                    f"{where}: output differs from the reference '{type(ref).NAME}' by {error.max():.2e} "
                    f"(tolerance {tolerance:.0e}) at row {row}: request {requests[b]} position "
                    f"{metas[1].positions[row]}, context {context[b]}, query {query[b]}")
