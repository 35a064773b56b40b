"""Dispatch of a verify strategy to its fused device kernel: :func:`verify_on_device` (part of
:mod:`specdec.sdk`).

A strategy declares its kernel as :attr:`specdec.VerifyStrategy.DEVICE_KERNEL` (a
:class:`specdec.sdk.DeviceVerifyKernel`); this module only looks at what was declared, so a
third-party strategy gets a fused device path the same way as a built-in one.
"""

from __future__ import annotations

import warnings
from typing import Union

from .verify import VerifyInputs, VerifyResult, VerifyStrategy


def verify_on_device(strategy: Union[VerifyStrategy, type, str], inputs: VerifyInputs, **options) -> VerifyResult:
    """Verify ``inputs`` with the device kernel ``strategy`` declared as its ``DEVICE_KERNEL``.

    :param strategy: the strategy (``self`` inside ``verify``) or its class. Passing a
        registered strategy's name (``"greedy"``) is the form of earlier releases: it still
        works, looked up among the installed plugins, with a ``DeprecationWarning``.
    :param inputs: the verify inputs; with ``inputs.device_logits`` (the engine runs
        ``kernels: triton``) the kernel verifies on the device and only the result comes back.
    :param options: the strategy's keyword options, handed to the kernel as they are (``topp``:
        ``max_candidate_len``, ``verify_window``).

    Which path runs:

    - a declared kernel and device logits: ``DEVICE_KERNEL.launch(inputs, **options)``;
    - a declared kernel and host logits only: its numpy twin ``DEVICE_KERNEL.reference``;
    - no declared kernel: the strategy's own ``verify`` on host logits (device logits are
      copied to the host once), so calling this is always safe.

    :raises TypeError: when ``strategy`` is not a verify strategy (instance, class or name).
    :raises specdec.PluginError: for a name that no installed plugin registered.
    """
    if isinstance(strategy, str):
        warnings.warn("verify_on_device(name, ...) is deprecated: pass the strategy itself (self, or its class), "
                      "whose DEVICE_KERNEL is dispatched", DeprecationWarning, stacklevel=2)
        strategy = _registered_strategy(strategy)
    if not (isinstance(strategy, VerifyStrategy)
            or (isinstance(strategy, type) and issubclass(strategy, VerifyStrategy))):
        raise TypeError(f"verify_on_device: {strategy!r} is not a specdec.VerifyStrategy (instance or class)")
    kernel = strategy.DEVICE_KERNEL
    if kernel is None:
        instance = strategy if isinstance(strategy, VerifyStrategy) else strategy()
        return instance.verify(VerifyInputs(inputs.logits, inputs.drafts, inputs.sampling))
    if inputs.device_logits is not None:
        return kernel.launch(inputs, **options)
    return kernel.reference(inputs, **options)


def _registered_strategy(name: str) -> type:
    """The verify strategy class the installed plugins registered as ``name``."""
    import importlib

    # Looked up by name for this deprecated form only: the contract does not depend on the
    # plugin manager.
    plugin_manager = importlib.import_module("specdec.plugin_manager")
    return plugin_manager.get_plugins().verify_strategies.get(name, "verify_on_device")
