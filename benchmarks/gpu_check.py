"""Check and time specdec's Triton kernels on a CUDA machine; one table.

For a machine with CUDA, torch and triton, without paddle: specdec is loaded straight from this
checkout (it needs its pure-Python dependencies only: numpy, attrs, cattrs, pluggy, pyyaml) and
the kernels run on torch CUDA tensors. It

1. runs every kernel against its numpy twin (RoPE + cache write, paged attention with and
   without split-KV over float16 and bfloat16 caches, and each built-in verify strategy's
   declared device kernel against its host rule, the kernel's twin);
2. times paged attention for a verify step (1 + 5 rows per request, Llama-8B-like shapes: 32
   query heads, 8 KV heads, head_dim 128, float16 cache, one layer) at batch 1/32/256 and
   contexts 512/4k/32k, as achieved bandwidth (cache bytes read per launch over the time)
   against the device's;
3. times fused verify at batch 256, k 5, vocabulary 152k (Qwen2.5's), greedy and sampled,
   including the launcher's host-to-device copy of the drafts and uniforms and the copy back
   of the results (what the engine pays per step);

and prints one table (markdown). It finishes in well under 5 minutes on an H100/H200.

``--dry-run`` runs the same code on tiny shapes on the CPU, in Triton's interpreter over paddle
CPU tensors (``TRITON_INTERPRET=1`` is set for it): the test suite runs it so that the script
cannot rot. Timings printed by a dry run mean nothing.

    python benchmarks/gpu_check.py            # on the GPU machine (benchmarks/gpu_check.sh)
    python benchmarks/gpu_check.py --dry-run  # anywhere
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: Nominal peak memory bandwidth (bytes/s) by device name, for the "of peak" column.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12,
                  "L40S": 0.864e12, "A10": 0.6e12}
VOCAB_152K = 151936


def load_kernels():
    """The kernel modules and the built-in verify strategies (whose ``DEVICE_KERNEL`` pairs a
    fused verify launcher with its numpy twin), from an installed specdec or, without one (the
    GPU machine), straight from this checkout."""
    try:
        import specdec.kernels.triton  # noqa: F401
    except ImportError:
        _import_checkout()
    from specdec.kernels.triton import load_triton_kernels, reference
    from specdec.plugins.verify.greedy import GreedyVerify
    from specdec.plugins.verify.rejection import RejectionVerify
    from specdec.plugins.verify.target_match import TargetMatchVerify
    from specdec.plugins.verify.topp import ToppVerify

    modules = load_triton_kernels()
    return modules.attention, modules.verify, reference, (GreedyVerify, TargetMatchVerify, RejectionVerify, ToppVerify)


def _import_checkout() -> None:
    """Import specdec from this checkout without installing it, with pyproject.toml's package
    layout: ``core/`` is ``specdec``, ``kernels/`` ``specdec.kernels``, ``plugins/`` ``specdec.plugins``."""
    for name in [n for n in sys.modules if n == "specdec" or n.startswith("specdec.")]:
        del sys.modules[name]
    loaded = []
    for name, folder in (("specdec", "core"), ("specdec.kernels", "kernels"), ("specdec.plugins", "plugins")):
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loaded.append((spec, module))
    package = loaded[0][1]
    package.kernels, package.plugins = loaded[1][1], loaded[2][1]
    for spec, module in loaded:
        spec.loader.exec_module(module)


class Device:
    """Tensors and timing on torch CUDA (the real check) or paddle CPU (the dry run)."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.torch = None
        if not dry_run:
            import torch

            if not torch.cuda.is_available():
                raise SystemExit("gpu_check: no CUDA device (use --dry-run to run the code on the CPU)")
            self.torch = torch
            self.name = torch.cuda.get_device_name()
            self.multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
        else:
            import paddle

            self.paddle = paddle
            self.name = "CPU (Triton interpreter, dry run)"
            self.multiprocessors = 132  # an H100/H200's, so that the dry run plans as a GPU would

    def tensor(self, array: np.ndarray, dtype: str | None = None):
        """A device tensor holding ``array`` (cast to ``dtype``: float32 / float16 / bfloat16 / int32...)."""
        if self.torch is not None:
            t = self.torch.as_tensor(array).cuda()
            return t.to(getattr(self.torch, dtype)) if dtype else t
        t = self.paddle.to_tensor(array)
        return t.astype(dtype) if dtype else t

    def numpy(self, tensor) -> np.ndarray:
        if self.torch is not None:
            t = tensor.float() if tensor.dtype == self.torch.bfloat16 else tensor
            return t.detach().cpu().numpy()
        return (tensor.astype("float32") if str(tensor.dtype).endswith("bfloat16") else tensor).numpy()

    def random_cache(self, shape, dtype: str, rng):
        """A cache filled with normal values (generated on the device for the big ones)."""
        if self.torch is not None:
            return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device="cuda").normal_()
        return self.tensor(rng.standard_normal(shape).astype(np.float32), dtype)

    def seconds(self, fn, repeats: int = 20) -> float:
        """Mean seconds per call of ``fn`` (after a warm-up call)."""
        if self.torch is not None:
            import triton.testing

            return triton.testing.do_bench(fn, warmup=5, rep=max(20, repeats)) / 1e3
        fn()
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def peak_bandwidth(self) -> tuple[float, str]:
        """(bytes/s, where the figure comes from): the nominal figure for a known device, else a
        measured device-to-device copy."""
        for name, peak in PEAK_BANDWIDTH.items():
            if name in self.name:
                return peak, f"nominal {name}"
        if self.torch is None:
            return float("nan"), "n/a"
        buffer = self.torch.empty(1 << 30, dtype=self.torch.uint8, device="cuda")
        target = self.torch.empty_like(buffer)
        return 2 * buffer.numel() / self.seconds(lambda: target.copy_(buffer)), "measured copy"


# -- correctness ---------------------------------------------------------------------------------


def rope_tables(positions: int, dim: int):
    inv_freq = 1.0 / (10000.0 ** (np.arange(dim // 2) * 2 / dim))
    angles = np.outer(np.arange(positions), inv_freq)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=-1).astype(np.float32)
    return cos, sin


def step_layout(query_lens, context_lens, block_size: int, rng):
    """Block tables (shuffled blocks), positions and cache slots of a packed step."""
    query_lens, context_lens = np.asarray(query_lens), np.asarray(context_lens)
    seq_blocks = -(-(query_lens + context_lens) // block_size)
    width = int(seq_blocks.max())
    blocks = rng.permutation(int(seq_blocks.sum())).astype(np.int32)
    tables = np.zeros((len(query_lens), width), dtype=np.int32)
    start = 0
    for b, count in enumerate(seq_blocks):
        tables[b, :count] = blocks[start:start + count]
        start += count
    batch_ids = np.repeat(np.arange(len(query_lens)), query_lens)
    cu = np.concatenate([[0], np.cumsum(query_lens)])
    positions = np.arange(int(cu[-1])) - cu[batch_ids] + context_lens[batch_ids]
    slots = tables[batch_ids, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return tables, positions.astype(np.int64), slots, int(seq_blocks.sum())


def check_attention(device: Device, attention, reference, rng, *, heads, kv_heads, dim, block_size,
                    query_lens, context_lens, cache_dtype, num_splits=None) -> float:
    """Max abs difference of RoPE + cache write + paged attention against the twins."""
    tables, positions, slots, num_blocks = step_layout(query_lens, context_lens, block_size, rng)
    cos, sin = rope_tables(int(positions.max()) + 1, dim)
    rows = len(positions)
    qkv = (rng.standard_normal((rows, (heads + 2 * kv_heads) * dim)) * 0.5).astype(np.float32)
    cache = (rng.standard_normal((num_blocks, 2, kv_heads, block_size, dim)) * 0.5).astype(np.float32)
    device_cache = device.tensor(cache, cache_dtype)
    stored = device.numpy(device_cache)  # the cache as the device holds it (rounded)
    query = attention.rope_and_cache_write(device.tensor(qkv), device_cache, device.tensor(cos), device.tensor(sin),
                                           device.tensor(positions), device.tensor(slots), heads, kv_heads)
    plan = attention.plan_attention(query_lens, context_lens, block_size=block_size, num_heads=heads,
                                    num_kv_heads=kv_heads, head_dim=dim, cache_dtype=cache_dtype,
                                    num_splits=num_splits)
    out = attention.paged_attention(query, device_cache, device.tensor(tables), plan)
    want_query, want_cache = reference.rope_and_cache_write(qkv, stored, cos, sin, positions, slots, heads, kv_heads,
                                                            cache_dtype)
    want = reference.paged_attention(want_query, want_cache, tables, query_lens, context_lens, kv_heads, cache_dtype,
                                     block_n=plan.block_n, split_len=plan.split_len if plan.num_splits > 1 else None)
    return max(float(np.abs(device.numpy(query) - want_query).max()),
               float(np.abs(device.numpy(out) - want).max()))


def verify_inputs(rng, batch: int, width: int, vocab: int, sampled: bool):
    """Random logits and drafts (about half of them the argmax, so that some are accepted)."""
    logits = (rng.standard_normal((batch, width + 1, vocab)) * 3).astype(np.float32)
    lengths = rng.integers(0, width + 1, batch)
    drafts = np.full((batch, width), -1, dtype=np.int64)
    for b in range(batch):
        for j in range(lengths[b]):
            drafts[b, j] = np.argmax(logits[b, j]) if rng.random() < 0.6 else rng.integers(vocab)
    temperature = (rng.uniform(0.5, 1.2, batch) if sampled else np.zeros(batch)).astype(np.float32)
    top_k = np.where(rng.random(batch) < 0.5, 0, 40).astype(np.int64)
    top_p = np.where(rng.random(batch) < 0.5, 1.0, 0.9).astype(np.float32)
    return logits, drafts, lengths.astype(np.int64), temperature, top_k, top_p, rng.random((batch, width + 1, 2))


def check_verify(device: Device, strategies, rng, *, batch, width, vocab) -> int:
    """How many (strategy, greedy/sampled) cases differ from the twin (0 expected): each
    strategy's ``DEVICE_KERNEL.launch`` on device logits against its ``reference`` on the host."""
    from specdec.sdk import BatchSampling, Drafts, VerifyInputs

    mismatches = 0
    for sampled in (False, True):
        logits, drafts, lengths, temperature, top_k, top_p, uniforms = verify_inputs(rng, batch, width, vocab, sampled)
        draft_batch = Drafts(drafts, lengths)
        sampling = BatchSampling(temperature=temperature, top_p=top_p, top_k=top_k, uniforms=uniforms)
        for strategy in strategies:
            kernel = strategy.DEVICE_KERNEL
            got = kernel.launch(VerifyInputs(None, draft_batch, sampling, device_logits=device.tensor(logits)))
            want = kernel.reference(VerifyInputs(logits, draft_batch, sampling))
            mismatches += not all(np.array_equal(getattr(got, f), getattr(want, f))
                                  for f in ("accepted_lengths", "output_tokens", "target_tokens"))
    return mismatches


# -- timing --------------------------------------------------------------------------------------


def time_attention(device: Device, attention, rng, *, batch, context, rows, heads, kv_heads, dim, block_size):
    """(seconds per launch, cache bytes read) of paged attention for one decode/verify step."""
    query_lens = np.full(batch, rows)
    context_lens = np.full(batch, context)
    tables, _, _, num_blocks = step_layout(query_lens, context_lens, block_size, rng)
    cache = device.random_cache((num_blocks, 2, kv_heads, block_size, dim), "float16", rng)
    query = device.tensor((rng.standard_normal((batch * rows, heads, dim)) * 0.1).astype(np.float32))
    plan = attention.plan_attention(query_lens, context_lens, block_size=block_size, num_heads=heads,
                                    num_kv_heads=kv_heads, head_dim=dim, cache_dtype="float16",
                                    target_programs=2 * device.multiprocessors)
    device_tables = device.tensor(tables)
    out = attention.paged_attention(query, cache, device_tables, plan)
    seconds = device.seconds(lambda: attention.paged_attention(query, cache, device_tables, plan, out=out))
    read = batch * (context + rows) * kv_heads * dim * 2 * 2  # keys and values, float16
    del cache
    return seconds, read, plan.num_splits


def time_verify(device: Device, verify, rng, *, batch, width, vocab, sampled):
    logits, drafts, lengths, temperature, top_k, top_p, uniforms = verify_inputs(rng, batch, width, vocab, sampled)
    device_logits = device.tensor(logits)
    return device.seconds(lambda: verify.rejection_verify(device_logits, drafts, lengths, temperature, top_k, top_p,
                                                          uniforms))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU in Triton's interpreter (checks that the script runs)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
        os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    device = Device(args.dry_run)
    attention, verify, reference, strategies = load_kernels()
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    rows_out = []  # (what, shape, result, figure)

    # 1. correctness against the twins
    tiny = args.dry_run
    for cache_dtype in ("float16", "bfloat16"):
        for splits in (None, 3):
            error = check_attention(device, attention, reference, rng, heads=8 if tiny else 32,
                                    kv_heads=2 if tiny else 8, dim=16 if tiny else 128, block_size=16,
                                    query_lens=[5, 1, 6] if tiny else [37, 1, 6, 6, 200],
                                    context_lens=[0, 40, 21] if tiny else [0, 900, 4000, 17, 300],
                                    cache_dtype=cache_dtype, num_splits=splits)
            ok = error < (2e-2 if cache_dtype == "bfloat16" else 5e-3)
            rows_out.append(("attention vs twin", f"{cache_dtype}, splits {splits or 'auto'}",
                             "ok" if ok else "FAIL", f"max abs err {error:.1e}"))
    vocab = 300 if tiny else 32000
    mismatches = check_verify(device, strategies, rng, batch=4 if tiny else 64, width=3 if tiny else 5, vocab=vocab)
    rows_out.append(("fused verify vs twin", f"4 strategies x greedy/sampled, V {vocab}",
                     "ok" if mismatches == 0 else "FAIL", f"{mismatches} cases differ"))

    # 2. attention bandwidth
    peak, peak_source = device.peak_bandwidth()
    shapes = dict(heads=8, kv_heads=2, dim=16, block_size=16) if tiny else dict(heads=32, kv_heads=8, dim=128,
                                                                               block_size=16)
    for batch in ((1, 2) if tiny else (1, 32, 256)):
        for context in ((40,) if tiny else (512, 4096, 32768)):
            seconds, read, splits = time_attention(device, attention, rng, batch=batch, context=context, rows=6,
                                                   **shapes)
            bandwidth = read / seconds
            rows_out.append(("attention, 6 rows/request", f"batch {batch}, context {context}, splits {splits}",
                             f"{seconds * 1e6:.1f} us", f"{bandwidth / 1e9:.0f} GB/s = {bandwidth / peak:.0%} of peak"))

    # 3. fused verify
    for sampled in (False, True):
        batch, width, vocab = (4, 3, 300) if tiny else (256, 5, VOCAB_152K)
        seconds = time_verify(device, verify, rng, batch=batch, width=width, vocab=vocab, sampled=sampled)
        rows_out.append(("fused verify (rejection)", f"batch {batch}, k {width}, V {vocab}, "
                         f"{'temperature 0.5-1.2, top-k/top-p' if sampled else 'greedy'}",
                         f"{seconds * 1e6:.1f} us", ""))

    print(f"# specdec Triton kernels on {device.name} (peak bandwidth {peak / 1e9:.0f} GB/s, {peak_source})\n")
    print("| check | shape | result | figure |")
    print("|---|---|---|---|")
    for row in rows_out:
        print("| " + " | ".join(row) + " |")
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 1 if any(r[2] == "FAIL" for r in rows_out) else 0


if __name__ == "__main__":
    sys.exit(main())
