"""specdec: speculative decoding for Llama-family models on PaddlePaddle.

The public API: :class:`LLM` and :class:`SamplingParams` to generate; :class:`Proposer`,
:class:`ProposalBatch`, :class:`Drafts`, :class:`VerifyStrategy`, :class:`AcceptPolicy`,
:class:`AttentionBackend` and the ``hookimpl`` marker to write plugins (model-based proposers
also :class:`ProposerContext` and :class:`TargetModel`). :mod:`specdec.sdk` holds
everything else a plugin may use (the sampling math, the verify result builders, the config
validators); :mod:`specdec.testing` the conformance checks of each plugin kind.
"""

from .attention import AttentionBackend, AttentionMetadata
from .errors import ConfigError, PluginError, SpecdecError
from .hookspecs import hookimpl
from .plugin import Plugin
from .proposer import Drafts, ProposalBatch, ProposalRequest, Proposer
from .proposer_context import DraftModel, ProposerContext, TargetModel
from .sampling import SamplingParams
from .verify import AcceptPolicy, BatchSampling, VerifyInputs, VerifyResult, VerifyStrategy

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "SpeculativeConfig", "Plugin", "Proposer", "ProposalBatch", "ProposalRequest",
    "Drafts", "VerifyStrategy", "AcceptPolicy", "VerifyInputs", "VerifyResult", "BatchSampling",
    "AttentionBackend", "AttentionMetadata", "hookimpl", "SpecdecError", "ConfigError", "PluginError",
    "ProposerContext", "TargetModel", "DraftModel",
]


def __getattr__(name):
    # LLM pulls in paddle; load it only when asked so that `specdec plugins` and config
    # validation work (and fail with a clear message) without paddle.
    if name == "LLM":
        from .api import LLM
        return LLM
    if name == "SpeculativeConfig":
        from .config import SpeculativeConfig
        return SpeculativeConfig
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
