"""Triton kernels for GPUs, each with a numpy twin: attention's in
:mod:`specdec.kernels.triton.reference`, verify's the host rules of the strategies that declare them.

- :mod:`.attention`: RoPE + paged KV-cache write of a step's new rows, and paged
  variable-length attention over the cache (one launch per layer for a packed step of
  prefill chunks and decode rows; split-KV for long contexts at small batch);
- :mod:`.verify`: fused verification with temperature, top-k and top-p processing, one
  program per request: one launcher per rule (``greedy_verify``, ``target_match_verify``,
  ``rejection_verify``, ``topp_verify``), each declared by its strategy in ``plugins/verify``
  as that strategy's device kernel, whose numpy twin is the strategy's own host rule.

They run on a CUDA device, and on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``),
which is how the test suite checks them (see :mod:`.runtime`).
"""

from .runtime import interpreting, load_triton


def load_triton_kernels():
    """Import Triton (:func:`load_triton`, which raises ``KernelUnavailable`` with the reason
    when the kernels cannot run here) and return the kernel modules as a namespace with
    ``attention``, ``verify`` and ``runtime`` (the launch helpers a plugin's own kernel uses:
    ``kernel_arg``, ``from_numpy``, ``empty``, ``to_numpy``)."""
    import types

    load_triton()
    from . import attention, runtime, verify

    return types.SimpleNamespace(attention=attention, verify=verify, runtime=runtime)


__all__ = ["interpreting", "load_triton", "load_triton_kernels"]
