"""Triton kernels for GPUs, each with a numpy twin in :mod:`specdec.kernels.triton.reference`.

- :mod:`.attention`: RoPE + paged KV-cache write of a step's new rows, and paged
  variable-length attention over the cache (one launch per layer for a packed step of
  prefill chunks and decode rows; split-KV for long contexts at small batch);
- :mod:`.verify`: fused verification (greedy, target_match, rejection, topp) with
  temperature, top-k and top-p processing, one program per request.

They run on a CUDA device, and on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``),
which is how the test suite checks them (see :mod:`.runtime`).
"""

from .runtime import interpreting, load_triton



def load_triton_kernels():
    """Import Triton (:func:`load_triton`, which raises ``KernelUnavailable`` with the reason
    when the kernels cannot run here) and return the kernel modules as a namespace with
    ``attention`` and ``verify``."""
    import types

    load_triton()
    from . import attention, verify

    return types.SimpleNamespace(attention=attention, verify=verify)


__all__ = ["interpreting", "load_triton", "load_triton_kernels"]
