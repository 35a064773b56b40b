"""The CPU kernels against their numpy reference twins, on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.kernels.cpu import packing, reference
from specdec.kernels.cpu.packing import pack_attention_metadata

paddle = pytest.importorskip("paddle")


@pytest.fixture(scope="module")
def ops():
    from specdec.kernels.cpu import load_cpu_ops

    return load_cpu_ops()  # fails the tests (it does not skip) when the kernels cannot build


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_skinny_matmul_matches_reference(ops, rows, dtype):
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((96, 80)).astype(np.float32)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    panels = packing.pack_panels(weight, dtype)
    got = ops.specdec_skinny_matmul(paddle.to_tensor(x), paddle.to_tensor(panels)).numpy()
    want = reference.skinny_matmul(x, panels)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    if dtype == np.float32:
        np.testing.assert_allclose(got, x @ weight, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 6, 9])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fused_matmuls_match_reference(ops, rows, dtype):
    rng = np.random.default_rng(10 + rows)
    x = (rng.standard_normal((rows, 64)) * 2).astype(np.float32)
    residual = rng.standard_normal((rows, 48)).astype(np.float32)
    panels = packing.pack_panels(rng.standard_normal((64, 48)).astype(np.float32), dtype)
    gate_up = packing.pack_gate_up_panels(rng.standard_normal((64, 40)).astype(np.float32),
                                          rng.standard_normal((64, 40)).astype(np.float32), dtype)
    t = paddle.to_tensor
    np.testing.assert_allclose(ops.specdec_rms_matmul(t(x), t(panels), 1e-5).numpy(),
                               reference.rms_matmul(x, panels, 1e-5), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ops.specdec_matmul_add(t(x), t(panels), t(residual)).numpy(),
                               reference.matmul_add(x, panels, residual), rtol=1e-4, atol=1e-4)
    got = ops.specdec_rms_matmul_swiglu(t(x), t(gate_up), 1e-5).numpy()
    assert got.shape == (rows, 40)
    np.testing.assert_allclose(got, reference.rms_matmul_swiglu(x, gate_up, 1e-5), rtol=1e-4, atol=1e-4)


def test_swiglu_reference_matches_the_definition():
    rng = np.random.default_rng(3)
    gate, up = rng.standard_normal((32, 16)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)
    x = np.eye(32, dtype=np.float32)[:4] * np.sqrt(32)  # rms_norm leaves these rows unchanged
    got = reference.rms_matmul_swiglu(x, packing.pack_gate_up_panels(gate, up, np.float32), 0.0)
    g, u = x @ gate, x @ up
    np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)


def test_swiglu_kernel_handles_large_and_tiny_gates(ops):
    """The vectorized exp must not overflow: silu(g) ~ g for large g and ~ 0 for very negative g."""
    x = np.eye(16, dtype=np.float32)[:2] * 4.0  # rms_norm leaves these rows as they are
    gate = np.zeros((16, 8), np.float32)
    gate[0, :] = [200, -200, 30, -30, 1, -1, 0, 88]
    up = np.ones((16, 8), np.float32)
    got = ops.specdec_rms_matmul_swiglu(paddle.to_tensor(x), paddle.to_tensor(
        packing.pack_gate_up_panels(gate, up, np.float32)), 0.0).numpy()
    g = np.array([800, -800, 120, -120, 4, -4, 0, 352], np.float64)
    want = g / (1 + np.exp(np.clip(-g, -700, 700))) * 4.0  # up = h @ ones = 4
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(got))


def test_pack_panels_round_trips():
    weight = np.arange(12 * 40, dtype=np.float32).reshape(12, 40)
    panels = packing.pack_panels(weight, np.float32)
    assert panels.shape == (3, 12, 16)
    np.testing.assert_array_equal(reference.unpack_panels(panels)[:, :40], weight)
    np.testing.assert_array_equal(reference.unpack_panels(panels)[:, 40:], 0)


def test_rms_norm_matches_reference(ops):
    x = np.random.default_rng(0).standard_normal((5, 576)).astype(np.float32) * 3
    got = ops.specdec_rms_norm(paddle.to_tensor(x), 1e-5).numpy()
    np.testing.assert_allclose(got, reference.rms_norm(x, 1e-5), rtol=1e-5, atol=1e-6)


def _rope_tables(positions: int, dim: int):
    from specdec.model.config import ModelConfig
    from specdec.model.llama import rope_tables

    config = ModelConfig(vocab_size=16, hidden_size=dim * 4, intermediate_size=32, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=dim, rope_theta=10000.0)
    return rope_tables(config, positions)


@pytest.mark.parametrize("dim", [32, 64])  # 64 takes the register-accumulator path
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("ctx,rows", [(0, 1), (0, 7), (9, 1), (9, 6), (20, 3), (37, 40)])
def test_paged_attention_matches_reference(ops, ctx, rows, dim, block_size):
    """One request beside a second one, with scattered blocks; outputs and the whole cache match."""
    heads, kv_heads, num_blocks = 6, 2, 24
    rng = np.random.default_rng(ctx * 100 + rows + block_size)
    cos, sin = _rope_tables(128, dim)
    cache = rng.standard_normal((num_blocks, 2 * kv_heads, block_size, dim)).astype(np.float32)
    order = rng.permutation(num_blocks).astype(np.int32)
    per_request = -(-80 // block_size)
    tables = np.stack([order[:per_request], order[per_request:2 * per_request]])
    context = np.array([ctx, 5], np.int32)
    cu = np.array([0, rows, rows + 2], np.int32)
    qkv = rng.standard_normal((rows + 2, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    want_out, want_cache = reference.paged_attention(qkv, cache, cos, sin, tables, cu, context, heads, kv_heads)

    cache_tensor = paddle.to_tensor(cache)
    got = ops.specdec_paged_attention(paddle.to_tensor(qkv), cache_tensor, paddle.to_tensor(cos),
                                      paddle.to_tensor(sin), paddle.to_tensor(pack_attention_metadata(tables, cu, context)),
                                      heads, kv_heads).numpy()
    np.testing.assert_allclose(got, want_out, rtol=1e-4, atol=1e-5)
    # The new rows' keys (after RoPE) and values land in their slots; nothing else changes.
    np.testing.assert_allclose(cache_tensor.numpy(), want_cache, rtol=1e-5, atol=1e-6)


def test_paged_attention_rejects_bad_block_ids(ops):
    heads, kv_heads, dim = 2, 1, 8
    cos, sin = _rope_tables(32, dim)
    cache = paddle.zeros([2, 2 * kv_heads, 8, dim])
    qkv = paddle.zeros([3, (heads + 2 * kv_heads) * dim])
    tables = np.array([[5]], np.int32)  # the pool has blocks 0 and 1 only
    meta = pack_attention_metadata(tables, np.array([0, 3], np.int32), np.array([0], np.int32))
    with pytest.raises(Exception, match="block id out of range"):
        ops.specdec_paged_attention(qkv, cache, paddle.to_tensor(cos), paddle.to_tensor(sin), paddle.to_tensor(meta),
                                    heads, kv_heads)


def test_heads_longer_than_the_kernel_takes_are_a_clear_error(ops):
    """A head of more than 256 elements: the kernel refuses it, and the backend says so at setup
    (naming the backend to use instead) rather than at the first step."""
    from specdec.errors import SpecdecError
    from specdec.plugins.attention.cpu_backend import CpuAttention

    heads, kv_heads, dim = 2, 1, 264
    cos, sin = _rope_tables(32, dim)
    qkv = paddle.zeros([1, (heads + 2 * kv_heads) * dim])
    meta = pack_attention_metadata(np.array([[0]], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32))
    with pytest.raises(Exception, match="heads of more than 256 elements"):
        ops.specdec_paged_attention(qkv, paddle.zeros([1, 2 * kv_heads, 8, dim]), paddle.to_tensor(cos),
                                    paddle.to_tensor(sin), paddle.to_tensor(meta), heads, kv_heads)
    backend = CpuAttention()
    with pytest.raises(SpecdecError, match="heads of at most 256 elements, this model's have 264; use 'paddle'"):
        backend.setup(num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype="float32",
                      rope_cos=cos, rope_sin=sin)


def test_cpu_attention_backend_equals_paddle_backend(ops):
    """The two registered backends agree over a prefill, then a mixed prefill + verify step."""
    from specdec.attention import AttentionMetadata
    from specdec.plugins.attention.cpu_backend import CpuAttention
    from specdec.plugins.attention.paddle_backend import PaddleAttention

    heads, kv_heads, dim, block_size = 6, 2, 32, 8
    cos, sin = _rope_tables(64, dim)
    rng = np.random.default_rng(7)
    backends = [PaddleAttention(), CpuAttention()]
    for backend in backends:
        backend.setup(num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype="float32",
                      rope_cos=cos, rope_sin=sin)
        backend.init_cache(10, block_size)
    tables = np.array([[4, 0], [7, 2]], np.int32)
    # Two requests: one prefilling 5 rows, one verifying 3 rows after 11 cached positions.
    first = rng.standard_normal((11, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    step = rng.standard_normal((8, (heads + 2 * kv_heads) * dim)).astype(np.float32)
    outputs = []
    for backend in backends:
        warm = AttentionMetadata.build([11], [0], tables[1:], block_size)
        backend.prepare(warm)
        backend.forward(0, paddle.to_tensor(first), warm)
        meta = AttentionMetadata.build([5, 3], [0, 11], tables, block_size)
        backend.prepare(meta)
        outputs.append(backend.forward(0, paddle.to_tensor(step), meta).numpy())
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)


#: One process of the concurrent-build test: load the kernels from the cache the environment
#: names, then check one of them against its twin.
_LOAD_AND_CHECK = """
import numpy as np, paddle
from specdec.kernels.cpu import load_cpu_ops, packing, reference
ops = load_cpu_ops()
rng = np.random.default_rng(0)
# 512 columns: 32 panels, split over the pool's threads
weight, x = rng.standard_normal((64, 512)).astype(np.float32), rng.standard_normal((3, 64)).astype(np.float32)
panels = packing.pack_panels(weight, np.float32)
got = ops.specdec_skinny_matmul(paddle.to_tensor(x), paddle.to_tensor(panels)).numpy()
np.testing.assert_allclose(got, reference.skinny_matmul(x, panels), rtol=1e-5, atol=1e-4)
print("ok")
"""


def test_processes_starting_at_once_on_an_empty_cache_all_load_the_kernels(tmp_path):
    """Four processes (say, serve instances started together on a fresh machine) build into
    one empty cache at once: the build lock makes one build and the others wait, so each
    loads a whole library and computes right."""
    import os
    import subprocess
    import sys

    # two threads each, whatever the suite runs with: the kernels' thread pool is exercised here
    env = {**os.environ, "SPECDEC_KERNEL_CACHE": str(tmp_path / "cache"), "MKL_DEBUG_CPU_TYPE": "5",
           "SPECDEC_NUM_THREADS": "2"}
    processes = [subprocess.Popen([sys.executable, "-c", _LOAD_AND_CHECK], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [process.communicate(timeout=900) for process in processes]
    assert [(process.returncode, out.strip()) for process, (out, _) in zip(processes, results)] == [(0, "ok")] * 4, \
        [err[-2000:] for _, err in results]
    libraries = list((tmp_path / "cache").rglob("specdec_cpu_ops*.so"))
    assert libraries, "no library was built into the given cache"


def test_a_built_library_loads_again_without_a_rebuild(tmp_path):
    """Once built and loaded, the library is found by its folder's marker and loaded directly
    (paddle's ``load`` would run a setuptools build in a subprocess on every process start);
    a folder without the marker, or without the library, is left to paddle's ``load``."""
    import shutil

    from specdec.kernels.cpu import BUILT_MARKER, OPS_NAME, _load_built, kernel_build_dir, load_cpu_ops

    import os
    import subprocess
    import sys

    load_cpu_ops()
    build_dir = kernel_build_dir()
    assert (build_dir / BUILT_MARKER).is_file()
    # in a process of its own: paddle registers a library's operators once per process
    check = ("from specdec.kernels.cpu import _load_built, kernel_build_dir\n"
             "module = _load_built(kernel_build_dir())\n"
             "print(module is not None and hasattr(module, 'specdec_skinny_matmul'))\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MKL_DEBUG_CPU_TYPE": "5"})
    assert result.stdout.strip() == "True", result.stderr[-2000:]
    copy = tmp_path / "copy"
    shutil.copytree(build_dir / OPS_NAME, copy / OPS_NAME)
    assert _load_built(copy) is None  # no marker: not known to be a whole build
    (copy / BUILT_MARKER).write_text(OPS_NAME)
    (copy / OPS_NAME / f"{OPS_NAME}.so").unlink()
    assert _load_built(copy) is None
