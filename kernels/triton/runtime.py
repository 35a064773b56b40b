"""How specdec's Triton kernels get launched: on a CUDA device, or in Triton's interpreter on CPU.

The launchers in this package take paddle tensors (what the engine holds) or torch tensors
(what ``benchmarks/gpu_check.py`` holds on a machine without paddle) and never import either
framework at module level; the helpers here hide the difference.

- On a CUDA device Triton takes the tensors as they are. With paddle, Paddle >= 3.3 has to be
  told first (``paddle.enable_compat(scope={"triton"})`` before the first ``import triton``):
  :func:`load_triton` does that.
- With ``TRITON_INTERPRET=1`` Triton runs every program in numpy on the CPU. It reads and
  writes tensors through ``data_ptr()`` and a few storage methods, which paddle CPU tensors
  lack: :func:`kernel_arg` wraps them in :class:`InterpreterTensor`, which provides those
  methods over the tensor's own memory (no copy). This is how the test suite runs every kernel.
"""

from __future__ import annotations

import functools
import os

from ..cpu import KernelUnavailable

#: Values of ``TRITON_INTERPRET`` that turn the interpreter on (Triton's own reading of it).
_TRUE = ("1", "true", "yes", "on", "y")


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def _paddle_has_cuda() -> bool:
    try:
        import paddle
    except ImportError:
        return False
    return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


@functools.lru_cache(maxsize=1)
def load_triton():
    """Import Triton for specdec's kernels and return the module.

    :raises KernelUnavailable: with the reason, when Triton is not installed, or when there
        is neither a CUDA device nor ``TRITON_INTERPRET=1`` (Triton compiles for GPUs only).
    """
    if not interpreting():
        try:
            import paddle
        except ImportError:
            paddle = None
        if paddle is not None and _paddle_has_cuda():
            if not hasattr(paddle, "enable_compat"):
                raise KernelUnavailable(f"the Triton kernels need paddlepaddle-gpu >= 3.3 (found {paddle.__version__})")
            # Lets Triton read paddle tensors; must happen before triton is first imported.
            paddle.enable_compat(scope={"triton"})
        elif not _torch_has_cuda():
            raise KernelUnavailable("the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 to run them "
                                    "in Triton's interpreter on the CPU, slowly: for tests)")
    try:
        import triton
    except ImportError as exc:
        raise KernelUnavailable(f"triton cannot be imported ({exc}); see docs/gpu.md#install") from None
    return triton


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def is_torch(tensor) -> bool:
    """True for a torch tensor (else the tensor is paddle's)."""
    return type(tensor).__module__.startswith("torch")


class _InterpreterStorage:
    """The storage view the interpreter asks a tensor for: here, the tensor itself."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def cpu(self) -> "_InterpreterStorage":
        return self  # already in host memory: the interpreter reads it in place

    def copy_(self, other) -> "_InterpreterStorage":
        return self  # the kernel wrote the tensor's own memory; nothing to copy back


class InterpreterTensor:
    """A paddle CPU tensor as Triton's interpreter wants its arguments: ``data_ptr()``,
    ``dtype`` and the storage calls it makes around a launch (``untyped_storage()``,
    ``new_empty()``, ``set_()``, ``storage_offset()``, ``size()``, ``stride()``). The
    interpreter "copies" a device tensor to the host before a launch and back after it; for a
    tensor already in host memory both copies are no-ops, so the kernel reads and writes the
    paddle tensor's memory directly."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def dtype(self):
        return self.tensor.dtype  # str() gives "paddle.float32": Triton keeps the last part

    def untyped_storage(self) -> _InterpreterStorage:
        return _InterpreterStorage(self.tensor)

    def new_empty(self, *args, **kwargs) -> "InterpreterTensor":
        return InterpreterTensor(None)

    def set_(self, storage, offset, size, stride) -> "InterpreterTensor":
        self.tensor = storage.tensor
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return tuple(self.tensor.shape)

    def stride(self):
        return None


def kernel_arg(tensor):
    """``tensor`` as a Triton kernel argument: paddle CPU tensors are wrapped for the
    interpreter (and must be contiguous: the kernels index them as dense arrays)."""
    if tensor is None or is_torch(tensor) or not interpreting():
        return tensor
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        raise ValueError("Triton kernels take contiguous tensors")
    return InterpreterTensor(tensor)


def empty(like, shape, dtype: str):
    """An uninitialised tensor of ``shape`` and ``dtype`` (a name: ``float32``, ``int64``...)
    from the same framework and on the same device as ``like``."""
    if is_torch(like):
        import torch

        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=like.device)
    import paddle

    return paddle.empty(list(shape), dtype=dtype).to(like.place)


def zeros(like, shape, dtype: str):
    """Like :func:`empty`, filled with zeros."""
    if is_torch(like):
        import torch

        return torch.zeros(tuple(shape), dtype=getattr(torch, dtype), device=like.device)
    import paddle

    return paddle.zeros(list(shape), dtype=dtype).to(like.place)


def from_numpy(array, like):
    """A numpy array as a tensor of ``like``'s framework, on ``like``'s device."""
    if is_torch(like):
        import torch

        return torch.as_tensor(array, device=like.device)
    import paddle

    return paddle.to_tensor(array, place=like.place)


def to_numpy(tensor):
    """A tensor's values as a numpy array (a device-to-host copy on a GPU)."""
    if is_torch(tensor):
        return tensor.detach().cpu().numpy()
    return tensor.numpy()
