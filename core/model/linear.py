"""How the decoder multiplies by its weights: plain paddle, or the fused CPU kernels.

Both expose the four fused steps a layer is made of, take weights as ``[in, out]`` float32
numpy arrays once at load time, and keep them in the layout their matmul streams fastest:

- ``rms_matmul(x, w)``: ``rms_norm(x) @ w`` (the norm's gain is folded into ``w``)
- ``matmul_add(x, w, residual)``: ``residual + x @ w``
- ``rms_matmul_swiglu(x, w)``: ``silu(h @ gate) * (h @ up)`` with ``h = rms_norm(x)``
- ``rms_norm(x)`` (for callers that want the normalized hidden states)
"""

from __future__ import annotations

import numpy as np


class PaddleLinear:
    """Reference path: paddle ops over pre-transposed float32 weights."""

    name = "paddle"

    def __init__(self, paddle, eps: float):
        self.paddle = paddle
        self.eps = eps

    def pack(self, weight_in_out: np.ndarray):
        return self.paddle.to_tensor(np.ascontiguousarray(weight_in_out, dtype=np.float32))

    def pack_gate_up(self, gate_in_out: np.ndarray, up_in_out: np.ndarray):
        return self.pack(np.concatenate([gate_in_out, up_in_out], axis=1))

    def rms_norm(self, x):
        p = self.paddle
        return x * p.rsqrt(p.mean(x * x, axis=-1, keepdim=True) + self.eps)

    def rms_matmul(self, x, weight):
        return self.paddle.matmul(self.rms_norm(x), weight)

    def matmul_add(self, x, weight, residual):
        return residual + self.paddle.matmul(x, weight)

    def rms_matmul_swiglu(self, x, weight):
        return self.paddle.nn.functional.swiglu(self.rms_matmul(x, weight))


#: From this many rows on, the CPU path multiplies with numpy's BLAS (float32 weights): a
#: tuned GEMM is 1.5x (16-32 rows) to 2.5x (prefill chunks) faster than the panel kernel there,
#: while the panel kernel, which streams half-size weights once, wins for the few rows of
#: small-batch decoding. Measured on the 2-core AVX2 machines: docs/benchmarks.md.
GEMM_MIN_ROWS = 16


class PackedWeight:
    """A weight in both layouts of the CPU path: 16-column panels for the kernels, and a plain
    float32 ``[in, out]`` matrix for the BLAS path (``gate_up``: gate columns, then up)."""

    __slots__ = ("panels", "dense")

    def __init__(self, panels, dense: np.ndarray):
        self.panels, self.dense = panels, dense


class CpuKernelLinear:
    """Weights in 16-column panels streamed once per call by the CPU kernels, stored as
    float16 (half the memory traffic) or float32, with norm, residual add and SwiGLU fused
    into the matmul; calls of ``GEMM_MIN_ROWS`` rows or more go through numpy's BLAS."""

    name = "cpu"

    def __init__(self, paddle, eps: float, ops, weight_dtype: str = "float16"):
        self.paddle = paddle
        self.eps = eps
        self.ops = ops
        self.weight_dtype = np.float16 if weight_dtype == "float16" else np.float32

    def pack(self, weight_in_out: np.ndarray) -> PackedWeight:
        from specdec.kernels.cpu.reference import pack_panels

        if weight_in_out.shape[1] % 16:
            raise ValueError("the CPU kernels need output widths that are multiples of 16")
        panels = self.paddle.to_tensor(pack_panels(weight_in_out, self.weight_dtype))
        return PackedWeight(panels, self._dense(weight_in_out))

    def pack_gate_up(self, gate_in_out: np.ndarray, up_in_out: np.ndarray) -> PackedWeight:
        from specdec.kernels.cpu.reference import pack_gate_up_panels

        panels = self.paddle.to_tensor(pack_gate_up_panels(gate_in_out, up_in_out, self.weight_dtype))
        return PackedWeight(panels, self._dense(np.concatenate([gate_in_out, up_in_out], axis=1)))

    def _dense(self, weight_in_out: np.ndarray) -> np.ndarray:
        # The same values the panels hold (rounded to float16 when they are float16).
        return np.ascontiguousarray(weight_in_out.astype(self.weight_dtype), dtype=np.float32)

    def rms_norm(self, x):
        return self.ops.specdec_rms_norm(x, self.eps)

    def rms_matmul(self, x, weight: PackedWeight):
        if x.shape[0] < GEMM_MIN_ROWS:
            return self.ops.specdec_rms_matmul(x, weight.panels, self.eps)
        return self.paddle.to_tensor(self.rms_norm(x).numpy() @ weight.dense)

    def matmul_add(self, x, weight: PackedWeight, residual):
        if x.shape[0] < GEMM_MIN_ROWS:
            return self.ops.specdec_matmul_add(x, weight.panels, residual)
        out = x.numpy() @ weight.dense
        out += residual.numpy()
        return self.paddle.to_tensor(out)

    def rms_matmul_swiglu(self, x, weight: PackedWeight):
        if x.shape[0] < GEMM_MIN_ROWS:
            return self.ops.specdec_rms_matmul_swiglu(x, weight.panels, self.eps)
        both = self.rms_norm(x).numpy() @ weight.dense
        inner = both.shape[1] // 2
        gate, up = both[:, :inner], both[:, inner:]
        with np.errstate(over="ignore"):  # exp(-gate) may overflow to inf: silu is then -0
            return self.paddle.to_tensor(gate / (1.0 + np.exp(-gate)) * up)
