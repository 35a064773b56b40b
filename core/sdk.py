"""The plugin SDK: everything a plugin of any kind may import from specdec.

A plugin (built-in or third-party) imports ``specdec`` and ``specdec.sdk`` only, never another
plugin or an engine module; a test holds the built-ins to it. Here are the four plugin bases
and their data, the ``hookimpl`` marker, the contract of model-based proposers
(:class:`ProposerContext`, :class:`TargetModel`, :class:`DraftModel`), the sampling math and verify result builders
that strategies share (with a strategy's fused device kernel, :class:`DeviceVerifyKernel`,
which :func:`verify_on_device` dispatches), the validators of a plugin's ``Config``, the
errors, and the native code a plugin may use (the CPU and Triton kernel loaders,
:class:`QuantizedLinear`, :class:`QuantizedDecoderLayer`, :class:`QuantizedDraftInput`,
:class:`QuantizedDraftHead`).
docs/plugins.md ("The SDK") lists every name with what it is for.

The SDK stands on the ground floor: importing it (or any plugin written against it) loads no
engine, server, cluster, CLI, model loader, plugin manager or recorder. Tools that run an
engine for a plugin's own commands live in :mod:`specdec.tools`; their old SDK names still
resolve, with a ``DeprecationWarning``, for one release. Conformance checks for each kind are
in :mod:`specdec.testing`.
"""

from .attention import AttentionBackend, AttentionMetadata
from .device_verify import verify_on_device
from .errors import ConfigError, PluginError, SpecdecError, require_paddle
from .hookspecs import hookimpl
from .kernels.cpu import KernelUnavailable, kernel_build_dir, load_cpu_ops
from .kernels.cpu.packing import pack_attention_metadata
from .kernels.cpu.shared_library import load_shared_library
from .kernels.triton import load_triton_kernels
from .model.quant import QuantizedLinear
from .model.quant_layer import PendingDraftHead, QuantizedDecoderLayer, QuantizedDraftHead, QuantizedDraftInput
from .model_paths import resolve_model_path
from .plugin import Plugin
from .probs import (greedy_tokens, one_hot, processed_probs, recovered_tokens, residual_distribution, sample_tokens,
                    target_choice, target_distribution, top_tokens)
from .proposer import DRAFT_PAD, Drafts, ProposalBatch, ProposalRequest, Proposer
from .proposer_context import DraftModel, ProposerContext, TargetModel
from .validators import above, in_range, multiple_of, one_of
from .verify import AcceptPolicy, BatchSampling, DeviceVerifyKernel, VerifyInputs, VerifyResult, VerifyStrategy
from .verify_builders import (accepted_prefix, assemble_output, at_positions, check_inputs, draft_mask,
                              pad_beyond_drafts, prefix_match_result)

__all__ = [
    "Plugin", "Proposer", "ProposalBatch", "ProposalRequest", "Drafts", "DRAFT_PAD", "ProposerContext", "TargetModel",
    "DraftModel",
    "VerifyStrategy", "VerifyInputs", "VerifyResult", "BatchSampling", "AcceptPolicy",
    "AttentionBackend", "AttentionMetadata", "hookimpl",
    "processed_probs", "greedy_tokens", "one_hot", "sample_tokens", "target_choice", "target_distribution",
    "top_tokens", "residual_distribution", "recovered_tokens",
    "check_inputs", "draft_mask", "accepted_prefix", "assemble_output", "at_positions", "pad_beyond_drafts",
    "prefix_match_result", "verify_on_device",
    "in_range", "above", "one_of", "multiple_of",
    "SpecdecError", "ConfigError", "PluginError", "require_paddle",
    "load_cpu_ops", "kernel_build_dir", "load_shared_library", "KernelUnavailable", "pack_attention_metadata", "load_triton_kernels", "QuantizedLinear",
    "QuantizedDecoderLayer", "QuantizedDraftHead", "QuantizedDraftInput", "PendingDraftHead", "resolve_model_path",
    "DeviceVerifyKernel",
]

#: Names the SDK used to hold that moved to :mod:`specdec.tools` (they need the engine).
_MOVED_TO_TOOLS = ("load_plugins", "HiddenStateRecorder", "RecordedSequence", "save_recorded", "load_recorded")


def __getattr__(name: str):
    if name in _MOVED_TO_TOOLS:
        import importlib
        import warnings

        # Looked up by name when an old plugin asks: the SDK itself does not depend on the tools.
        tools = importlib.import_module("specdec.tools")
        warnings.warn(f"specdec.sdk.{name} moved to specdec.tools.{name}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(tools, name)
    raise AttributeError(f"module 'specdec.sdk' has no attribute {name!r}")
