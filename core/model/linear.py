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

from ..errors import SpecdecError


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


class CpuKernelLinear:
    """Weights in 16-column panels streamed once per call by the CPU kernels, stored as
    float16 (half the memory traffic) or float32, with norm, residual add and SwiGLU fused
    into the matmul. The same kernel (6 rows at a time per panel) serves every row count,
    because it beat numpy's BLAS from decode batches to prefill chunks (docs/models.md)."""

    name = "cpu"

    def __init__(self, paddle, eps: float, ops, weight_dtype: str = "float16"):
        self.paddle = paddle
        self.eps = eps
        self.ops = ops
        self.weight_dtype = np.float16 if weight_dtype == "float16" else np.float32

    def pack(self, weight_in_out: np.ndarray):
        from specdec.kernels.cpu.packing import pack_panels

        if weight_in_out.shape[1] % 16:
            raise SpecdecError(f"kernels: the cpu kernels need matrices whose output width is a multiple of 16; "
                               f"this model has one {weight_in_out.shape[1]} wide: use --kernels paddle")
        return self.paddle.to_tensor(pack_panels(weight_in_out, self.weight_dtype))

    def pack_gate_up(self, gate_in_out: np.ndarray, up_in_out: np.ndarray):
        from specdec.kernels.cpu.packing import pack_gate_up_panels

        return self.paddle.to_tensor(pack_gate_up_panels(gate_in_out, up_in_out, self.weight_dtype))

    def rms_norm(self, x):
        return self.ops.specdec_rms_norm(x, self.eps)

    def rms_matmul(self, x, weight):
        return self.ops.specdec_rms_matmul(x, weight, self.eps)

    def matmul_add(self, x, weight, residual):
        return self.ops.specdec_matmul_add(x, weight, residual)

    def rms_matmul_swiglu(self, x, weight):
        return self.ops.specdec_rms_matmul_swiglu(x, weight, self.eps)
