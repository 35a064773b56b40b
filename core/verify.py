"""Verify strategies and accept policies: the contract between the target forward pass and the
tokens a step emits.

Every strategy works on the whole batch at once with numpy arrays shaped ``[B, k+1, ...]``;
there is no per-request Python loop inside a strategy.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

import attrs
import numpy as np

from .plugin import Plugin
from .probs import greedy_tokens
from .proposer import Drafts


@attrs.define(slots=True)
class BatchSampling:
    """Per-request sampling settings of a batch, as arrays.

    :ivar temperature: ``[B]`` float32; 0 means greedy (argmax).
    :ivar top_p: ``[B]`` float32 in (0, 1]; 1 keeps everything.
    :ivar top_k: ``[B]`` int64; 0 keeps everything.
    :ivar uniforms: ``[B, k+1, 2]`` float64 uniforms in [0, 1) drawn from each request's own
        seeded generator: ``[..., 0]`` for accept tests, ``[..., 1]`` for sampling a token.
        Drawing them outside the strategy keeps every strategy reproducible under a seed.
    """

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    uniforms: np.ndarray

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature <= 0.0))

    def select(self, rows) -> "BatchSampling":
        """The settings of the requests at ``rows`` (in that order)."""
        return BatchSampling(self.temperature[rows], self.top_p[rows], self.top_k[rows], self.uniforms[rows])


class VerifyInputs:
    """What a verify strategy sees.

    :ivar logits: ``[B, k+1, V]`` float32 numpy target logits. Row ``j`` of request ``b`` is
        the target's prediction after the context plus the first ``j`` drafts; rows beyond
        ``drafts.lengths[b]`` are padding and must be ignored. When the engine built the
        inputs from ``device_logits``, this is copied to the host on first access only.
    :ivar drafts: the drafts being verified (``k = drafts.width``).
    :ivar sampling: per-request sampling settings and pre-drawn uniforms.
    :ivar device_logits: the same logits as a tensor on the device the model ran on, when the
        engine runs the Triton kernels (``kernels: triton``), else ``None``. A strategy with a
        fused kernel (:attr:`VerifyStrategy.DEVICE_KERNEL`) verifies from it through
        :func:`specdec.sdk.verify_on_device` and the logits never leave the device; any other
        strategy reads ``logits`` as usual.

    The engine may also give the logits as ``rows`` (the step's ``[R, V]`` logits, one row per
    request and draft, no padding) and ``row_index`` (``[B, k+1]`` into them, padding
    repeating a request's last row): ``logits`` is then ``rows[row_index]``, built on first
    access, and :meth:`argmax` never builds it (a greedy batch of 64 would otherwise copy
    64 x (k+1) rows of the vocabulary each step).
    """

    __slots__ = ("drafts", "sampling", "device_logits", "_logits", "_rows", "_row_index", "_argmax")

    def __init__(self, logits: Optional[np.ndarray], drafts: Drafts, sampling: BatchSampling, device_logits=None, *,
                 rows: Optional[np.ndarray] = None, row_index: Optional[np.ndarray] = None):
        if logits is None and device_logits is None and (rows is None or row_index is None):
            raise ValueError("VerifyInputs needs logits, device_logits, or rows with row_index")
        self._logits = logits
        self.drafts = drafts
        self.sampling = sampling
        self.device_logits = device_logits
        self._rows, self._row_index = rows, row_index
        self._argmax: Optional[np.ndarray] = None

    @property
    def logits(self) -> np.ndarray:
        if self._logits is None:
            self._logits = self.device_logits.numpy() if self._rows is None else self._rows[self._row_index]
        return self._logits

    @logits.setter
    def logits(self, value: np.ndarray) -> None:
        self._logits = value
        self.device_logits = None  # they no longer hold the same logits
        self._rows = self._row_index = self._argmax = None

    @property
    def logits_shape(self) -> tuple[int, ...]:
        """The logits' shape, without copying device logits to the host or building them from rows."""
        if self._logits is None and self._rows is not None:
            return (*self._row_index.shape, self._rows.shape[-1])
        source = self._logits if self._logits is not None else self.device_logits
        return tuple(source.shape)

    def argmax(self) -> np.ndarray:
        """``[B, k+1]`` int64: the argmax of every row of ``logits`` (ties to the lowest id, as
        :func:`specdec.sdk.greedy_tokens`), computed once and shared (copy it before changing
        it); from ``rows`` without building ``logits`` when the engine gave rows."""
        if self._argmax is None:
            if self._logits is None and self._rows is not None:
                self._argmax = greedy_tokens(self._rows)[self._row_index]
            else:
                self._argmax = greedy_tokens(self.logits)
        return self._argmax


@attrs.define(slots=True)
class VerifyResult:
    """What a step emits for each request.

    :ivar accepted_lengths: ``[B]`` int64, how many drafts each request keeps.
    :ivar output_tokens: ``[B, k+1]`` int64; the first ``accepted_lengths[b] + 1`` entries of row
        ``b`` are emitted: the accepted drafts, then one token chosen by the target.
    :ivar target_tokens: ``[B, k+1]`` int64, the target's own choice at every position (argmax,
        or a sample from its processed distribution), independent of the drafts. Accept
        policies use it to build the token that follows the drafts they keep.
    """

    accepted_lengths: np.ndarray
    output_tokens: np.ndarray
    target_tokens: np.ndarray

    def select(self, rows) -> "VerifyResult":
        """The results of the requests at ``rows`` (in that order)."""
        return VerifyResult(self.accepted_lengths[rows], self.output_tokens[rows], self.target_tokens[rows])

    def emitted(self, b: int) -> np.ndarray:
        """The tokens request ``b`` appends this step."""
        return self.output_tokens[b, : self.accepted_lengths[b] + 1]


@attrs.frozen
class DeviceVerifyKernel:
    """A verify strategy's fused device kernel and its numpy twin, declared by the strategy as
    :attr:`VerifyStrategy.DEVICE_KERNEL` and dispatched by :func:`specdec.sdk.verify_on_device`.

    Both callables take ``(inputs: VerifyInputs, **options)`` and return a
    :class:`VerifyResult`, and must return the same one for the same inputs and options (the
    strategy's tests hold them to it):

    :ivar launch: verifies from ``inputs.device_logits`` (a tensor on the device the model ran
        on) without copying the logits to the host; only the result comes back.
    :ivar reference: the same rule on the host, from ``inputs.logits`` (numpy). For a
        strategy's own rule, this is the function its ``verify`` runs without device logits,
        so the rule has one host implementation and one device implementation.

    ``options`` are the strategy's own keyword options (``topp`` passes its
    ``max_candidate_len`` and ``verify_window``). ``launch`` imports its kernel's framework
    (Triton) when called, not when the strategy's module is imported.
    """

    launch: Callable[..., "VerifyResult"] = attrs.field(validator=attrs.validators.is_callable())
    reference: Callable[..., "VerifyResult"] = attrs.field(validator=attrs.validators.is_callable())


class VerifyStrategy(Plugin):
    """Base class of verify strategies: turn target logits + drafts into emitted tokens."""

    #: True when the strategy's output equals plain sampling from the target (for
    #: deterministic drafts at least). Documentation and tests rely on it.
    LOSSLESS: ClassVar[bool] = False

    #: The strategy's fused device kernel and its numpy twin, or ``None`` when it has none
    #: (then :func:`specdec.sdk.verify_on_device` runs :meth:`verify` on host logits).
    DEVICE_KERNEL: ClassVar[Optional[DeviceVerifyKernel]] = None

    def verify(self, inputs: VerifyInputs) -> VerifyResult:
        """Decide, for the whole batch at once, how many drafts each request keeps and which
        target token follows them."""
        raise NotImplementedError


class AcceptPolicy(Plugin):
    """Base class of accept policies: may override how many drafts a verify result keeps."""

    def apply(self, result: VerifyResult, drafts: Drafts) -> VerifyResult:
        """The result to emit: ``result`` itself, or one keeping other draft counts (with the
        target's token after the drafts kept, from ``result.target_tokens``)."""
        raise NotImplementedError
