"""How the decoder multiplies by its weights and normalizes: plain paddle, or the CPU kernels.

Both take weights as ``[in, out]`` float32 numpy arrays once, at load time, and keep them in
the layout their matmul streams fastest.
"""

from __future__ import annotations

import numpy as np


class PaddleLinear:
    """Reference path: paddle matmul over pre-transposed float32 weights."""

    name = "paddle"

    def __init__(self, paddle, eps: float):
        self.paddle = paddle
        self.eps = eps

    def pack(self, weight_in_out: np.ndarray):
        return self.paddle.to_tensor(np.ascontiguousarray(weight_in_out, dtype=np.float32))

    def matmul(self, x, weight):
        return self.paddle.matmul(x, weight)

    def rms_norm(self, x):
        p = self.paddle
        return x * p.rsqrt(p.mean(x * x, axis=-1, keepdim=True) + self.eps)


class CpuKernelLinear:
    """Small-batch path: weights in 16-column panels streamed once per matmul by a CPU kernel,
    stored as float16 (half the memory traffic) or float32."""

    name = "cpu"

    def __init__(self, paddle, eps: float, ops, weight_dtype: str = "float16"):
        self.paddle = paddle
        self.eps = eps
        self.ops = ops
        self.weight_dtype = np.float16 if weight_dtype == "float16" else np.float32

    def pack(self, weight_in_out: np.ndarray):
        from specdec.kernels.cpu.reference import pack_panels

        if weight_in_out.shape[1] % 16:
            raise ValueError("the CPU kernels need output widths that are multiples of 16")
        return self.paddle.to_tensor(pack_panels(weight_in_out, self.weight_dtype))

    def matmul(self, x, weight):
        return self.ops.specdec_skinny_matmul(x, weight)

    def rms_norm(self, x):
        return self.ops.specdec_rms_norm(x, self.eps)
