"""The plugin SDK: everything a plugin of any kind may import from specdec.

A plugin (built-in or third-party) imports ``specdec`` and ``specdec.sdk`` only, never another
plugin or an engine module; a test holds the built-ins to it. What is here:

- the four plugin bases and their data: :class:`Proposer` (:class:`ProposalBatch`,
  :class:`ProposalRequest`, :class:`Drafts`, :data:`DRAFT_PAD`), :class:`VerifyStrategy`
  (:class:`VerifyInputs`, :class:`VerifyResult`, :class:`BatchSampling`),
  :class:`AcceptPolicy`, :class:`AttentionBackend` (:class:`AttentionMetadata`), their common
  base :class:`Plugin`, and the :data:`hookimpl` marker; for model-based proposers
  :class:`ProposerContext` and :class:`TargetModel`;
- the sampling math of verify strategies (``[B, R, V]`` batches, no Python loop per request):
  :func:`processed_probs`, :func:`greedy_tokens`, :func:`one_hot`, :func:`sample_tokens`
  (inverse CDF with pre-drawn uniforms), :func:`target_choice`, :func:`target_distribution`,
  :func:`top_tokens`, and speculative sampling's :func:`residual_distribution` and
  :func:`recovered_tokens`;
- the verify result builders: :func:`check_inputs`, :func:`draft_mask`,
  :func:`accepted_prefix`, :func:`assemble_output`, :func:`at_positions`,
  :func:`pad_beyond_drafts`, :func:`prefix_match_result`, and :func:`verify_on_device` (the
  fused Triton verify kernels, for inputs that carry ``device_logits``);
- :class:`DeviceVerifyKernel`: a verify strategy's fused device kernel and its numpy twin,
  which the strategy declares as ``DEVICE_KERNEL`` and :func:`verify_on_device` dispatches;
- the validators for a plugin's attrs ``Config`` (they make config errors one line naming the
  key): :func:`in_range`, :func:`above`, :func:`one_of`, :func:`multiple_of`;
- errors (:class:`SpecdecError`, :class:`ConfigError`, :class:`PluginError`) and
  :func:`require_paddle`;
- native code: :func:`load_cpu_ops` (the engine's compiled CPU operators), and for a plugin
  that compiles its own, :func:`kernel_build_dir` (where a source version is built, shared
  with the engine's kernels) and :class:`KernelUnavailable` (raise it when it cannot build);
  :func:`load_triton_kernels` (the Triton kernel modules, ``attention`` and ``verify``, for
  a CUDA device or Triton's interpreter);
- :class:`QuantizedLinear` (a matrix quantized to ``wint8`` / ``wint4`` and multiplied by the
  engine's quantized kernels: what a draft or MTP model's ``quantization`` runs on);
- :func:`load_plugins`, for a plugin's tools that run an engine with plugins of their own;
- for training model-based proposers: :class:`HiddenStateRecorder` (runs the target and keeps
  its hidden state and argmax at every position, as :class:`RecordedSequence`),
  :func:`save_recorded` and :func:`load_recorded`.

Conformance checks for each kind are in :mod:`specdec.testing`.
"""

from .attention import AttentionBackend, AttentionMetadata
from .config import above, in_range, multiple_of, one_of
from .errors import ConfigError, PluginError, SpecdecError, require_paddle
from .hookspecs import hookimpl
from .kernels.cpu import KernelUnavailable, kernel_build_dir, load_cpu_ops
from .kernels.triton import load_triton_kernels
from .model.quant import QuantizedLinear
from .plugin import Plugin
from .plugin_manager import load_plugins
from .probs import (greedy_tokens, one_hot, processed_probs, recovered_tokens, residual_distribution, sample_tokens,
                    target_choice, target_distribution, top_tokens)
from .proposer import DRAFT_PAD, Drafts, ProposalBatch, ProposalRequest, Proposer
from .proposer_context import ProposerContext, TargetModel
from .recording import HiddenStateRecorder, RecordedSequence, load_recorded, save_recorded
from .verify import AcceptPolicy, BatchSampling, VerifyInputs, VerifyResult, VerifyStrategy
from .verify import DeviceVerifyKernel
from .verify_builders import (accepted_prefix, assemble_output, at_positions, check_inputs, draft_mask,
                              pad_beyond_drafts, prefix_match_result, verify_on_device)

__all__ = [
    "Plugin", "Proposer", "ProposalBatch", "ProposalRequest", "Drafts", "DRAFT_PAD", "ProposerContext", "TargetModel",
    "VerifyStrategy", "VerifyInputs", "VerifyResult", "BatchSampling", "AcceptPolicy",
    "AttentionBackend", "AttentionMetadata", "hookimpl",
    "processed_probs", "greedy_tokens", "one_hot", "sample_tokens", "target_choice", "target_distribution",
    "top_tokens", "residual_distribution", "recovered_tokens",
    "check_inputs", "draft_mask", "accepted_prefix", "assemble_output", "at_positions", "pad_beyond_drafts",
    "prefix_match_result", "verify_on_device",
    "in_range", "above", "one_of", "multiple_of",
    "SpecdecError", "ConfigError", "PluginError", "require_paddle",
    "load_cpu_ops", "kernel_build_dir", "KernelUnavailable", "load_triton_kernels", "QuantizedLinear", "load_plugins",
    "HiddenStateRecorder", "RecordedSequence", "save_recorded", "load_recorded",
    "DeviceVerifyKernel",
]
