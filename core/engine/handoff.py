"""Handing a running request from one engine to another (prefill/decode disaggregation).

A *prefill* engine runs a request's prompt and its first output token
(``Engine.add_request(..., handoff=True)``), then ends it with finish reason ``handoff`` and
a :class:`HandoffState` (:attr:`Request.handoff_state`): the tokens so far, the sampling
parameters and generator state, the KV cache of the computed positions and, when asked for
(``capture_hidden``), the target's hidden states there. A *decode* engine, in another
process, loaded with the same model and cache settings (equal :class:`KVLayout`), continues
it with :meth:`Engine.import_request`: the tokens are those one engine alone would have
produced. The transport between them is not the engine's business: :meth:`HandoffState.to_wire`
gives a JSON header and raw buffers, :meth:`HandoffState.from_wire` takes them back.

This module holds the state and both halves of the engine's side: :func:`export_request`
(the prefill engine's, called by the step when a hand-off request has its first token) and
:func:`import_request` (the decode engine's, behind :meth:`Engine.import_request`).
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional, Sequence, Union

import attrs
import numpy as np

from ..errors import SpecdecError
from ..sampling import SamplingParams
from .request import DECODE

#: The version of the :meth:`HandoffState.to_wire` header; :meth:`HandoffState.from_wire`
#: refuses another.
WIRE_VERSION = 1

Buffer = Union[bytes, bytearray, memoryview]


@attrs.define(frozen=True)
class KVLayout:
    """What must be equal on both sides of a hand-off for the KV blocks to mean the same thing.

    :ivar backend: the attention backend's ``NAME`` (its cache layout).
    :ivar dtype: the cache dtype (``kv_cache_dtype`` resolved).
    :ivar block_size: positions per KV block.
    :ivar num_layers: the target's decoder layers.
    :ivar num_kv_heads: its KV heads.
    :ivar head_dim: its head dimension.
    :ivar model: the engine config's ``model``, as given (a name or a path).
    :ivar vocab_size: the target's vocabulary size.
    """

    backend: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model: str
    vocab_size: int

    def to_dict(self) -> dict:
        """The fields as a JSON-serialisable dict (:meth:`from_dict` takes it back)."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        """The layout :meth:`to_dict` gave; a missing or unknown field is a one-line SpecdecError."""
        try:
            return cls(**data)
        except TypeError as exc:
            raise SpecdecError(f"not a KV layout: {exc}") from None

    def mismatch(self, other: "KVLayout") -> Optional[str]:
        """One line naming the first field that differs (``block_size: 16 vs 32``, this
        layout's value first), or None when the layouts are equal."""
        for field in attrs.fields(type(self)):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return f"{field.name}: {mine!r} vs {theirs!r}"
        return None


@attrs.define(eq=False)
class HandoffState:
    """A request in flight, as one engine hands it to another.

    :ivar request_id: the id it had on the engine that exported it (informational: the
        importing engine gives it an id of its own).
    :ivar prompt_token_ids: ``[P]`` int64, the prompt.
    :ivar output_token_ids: ``[m]`` int64 (``m >= 1``), the tokens generated so far.
    :ivar sampling: the request's :class:`SamplingParams`, as the user gave them.
    :ivar rng_state: its random generator's ``bit_generator.state``, so that a seeded sampled
        request draws on where it left off.
    :ivar num_positions: the positions whose keys and values are in :attr:`kv`
        (``0 .. num_positions - 1``): the request's ``context_len`` when it was exported.
    :ivar kv: one array per attention layer, the cache contents of the blocks that cover
        those positions (first axis: the blocks, in position order), in the exporting
        backend's own layout (:meth:`specdec.AttentionBackend.export_blocks`); opaque
        elsewhere. Rows past ``num_positions`` in the last block mean nothing.
    :ivar hidden_states: ``[num_positions, width]`` float32, the target's hidden states at
        those positions as the proposer reads them (the last layer's, or the layers its
        ``hidden_state_layers`` names, side by side), for a decode engine whose proposer reads
        them, or None.
    :ivar layout: the exporting engine's :class:`KVLayout`.
    :ivar first_token_s: seconds from the request's arrival to its first token there.
    :ivar share_prefix: whether the importing engine may offer the imported prompt blocks to
        its prefix cache, for later requests to share. True for a state from a trusted source;
        :meth:`from_wire` makes it False unless the transport authenticated the sender (a
        forged hand-off must not *poison* the prefix cache: the first entry of a key wins).
    """

    request_id: str
    prompt_token_ids: np.ndarray
    output_token_ids: np.ndarray
    sampling: SamplingParams
    rng_state: dict
    num_positions: int
    kv: list[np.ndarray]
    hidden_states: Optional[np.ndarray]
    layout: KVLayout
    first_token_s: float
    share_prefix: bool = True

    @property
    def buffers(self) -> list[np.ndarray]:
        """The big arrays, in wire order: every layer's KV, then the hidden states if any."""
        return [*self.kv, *([] if self.hidden_states is None else [self.hidden_states])]

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`buffers` (what :meth:`to_wire` sends besides its header)."""
        return sum(int(np.asarray(buffer).nbytes) for buffer in self.buffers)

    def to_wire(self) -> tuple[dict, list[np.ndarray]]:
        """``(header, buffers)``: a JSON-serialisable header holding everything but the big
        arrays (with each buffer's dtype and shape), and the C-contiguous arrays to send as raw
        bytes, in order (:attr:`buffers`). :meth:`from_wire` takes both back.

        The generator state travels as JSON text: its 128-bit integers do not fit every JSON
        parser's numbers."""
        buffers = [np.ascontiguousarray(buffer) for buffer in self.buffers]
        names = ["kv"] * len(self.kv) + ([] if self.hidden_states is None else ["hidden_states"])
        header = {
            "version": WIRE_VERSION,
            "request_id": self.request_id,
            "prompt_token_ids": np.asarray(self.prompt_token_ids, dtype=np.int64).tolist(),
            "output_token_ids": np.asarray(self.output_token_ids, dtype=np.int64).tolist(),
            "sampling": attrs.asdict(self.sampling),
            "rng_state": json.dumps(self.rng_state),
            "num_positions": int(self.num_positions),
            "layout": self.layout.to_dict(),
            "first_token_s": float(self.first_token_s),
            "buffers": [{"name": name, "dtype": buffer.dtype.str, "shape": list(buffer.shape)}
                        for name, buffer in zip(names, buffers)],
        }
        return header, buffers

    @classmethod
    def from_wire(cls, header: dict, buffers: Sequence[Buffer], share_prefix: bool = False) -> "HandoffState":
        """The state :meth:`to_wire` sent: ``header`` and the raw bytes of each buffer, in
        order. The arrays are read-only views of ``buffers`` (no copy). A header or buffer
        that does not fit is a one-line :class:`SpecdecError`.

        :param share_prefix: the transport authenticated the sender (see :attr:`share_prefix`)."""
        try:
            state = cls._from_wire(header, buffers)
        except SpecdecError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecdecError(f"not a hand-off: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
        state.share_prefix = share_prefix
        return state

    @classmethod
    def _from_wire(cls, header: dict, buffers: Sequence[Buffer]) -> "HandoffState":
        if header.get("version") != WIRE_VERSION:
            raise SpecdecError(f"hand-off version {header.get('version')!r}; this engine reads {WIRE_VERSION}")
        specs = header["buffers"]
        if len(specs) != len(buffers):
            raise SpecdecError(f"the hand-off header describes {len(specs)} buffers, {len(buffers)} came")
        arrays = [_array(spec, buffer) for spec, buffer in zip(specs, buffers)]
        kv = [array for spec, array in zip(specs, arrays) if spec["name"] == "kv"]
        hidden = [array for spec, array in zip(specs, arrays) if spec["name"] == "hidden_states"]
        if len(kv) + len(hidden) != len(arrays) or len(hidden) > 1:
            raise SpecdecError("the hand-off's buffers are not KV blocks and at most one hidden-state array")
        return cls(
            request_id=str(header["request_id"]),
            prompt_token_ids=np.asarray(header["prompt_token_ids"], dtype=np.int64),
            output_token_ids=np.asarray(header["output_token_ids"], dtype=np.int64),
            sampling=SamplingParams(**header["sampling"]),
            rng_state=json.loads(header["rng_state"]),
            num_positions=int(header["num_positions"]),
            kv=kv,
            hidden_states=hidden[0] if hidden else None,
            layout=KVLayout.from_dict(header["layout"]),
            first_token_s=float(header["first_token_s"]),
        )


def _array(spec: dict[str, Any], buffer: Buffer) -> np.ndarray:
    """The array ``spec`` (dtype, shape) describes, viewing ``buffer`` without a copy."""
    dtype, shape = np.dtype(spec["dtype"]), tuple(int(n) for n in spec["shape"])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    size = memoryview(buffer).nbytes
    if size != expected:
        raise SpecdecError(f"hand-off buffer '{spec['name']}' has {size} bytes; {dtype} {list(shape)} needs {expected}")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


# --- the engine's side: exporting on the prefill engine, importing on the decode engine ----------


def check_handoff_supported(engine, what: str) -> None:
    """A one-line error: hand-offs do not work with tensor parallelism."""
    if engine.config.tensor_parallel_size > 1:
        raise SpecdecError(f"{what}: handing requests between engines does not work with tensor_parallel_size > 1")


def import_request(engine, state: HandoffState, request_id: Optional[str] = None, *,
                   tenant: Optional[str] = None, row_processors: Sequence = ()):
    """Continue a request another engine handed off (``add_request(..., handoff=True)``
    there): it produces the tokens that engine alone would have produced (the same greedy
    tokens; a sampled request draws on from the same generator state).

    When the batch has a free seat (fewer than ``max_num_seqs`` running, none waiting) and
    the pool has the blocks, its KV blocks are written into this cache and it joins the
    running batch at once (``request.kv_imported`` True). Otherwise, or when this engine's
    proposer reads hidden states and the state has none, it queues and recomputes its tokens
    here (``kv_imported`` False): the same tokens, later. Imported full prompt blocks join
    the prefix cache only when ``state.share_prefix`` (a state from an authenticated sender).

    :param request_id: the request's id here (default: a fresh one of this engine's).
    :param tenant: who sent it, as ``add_request``'s (a state does not carry it).
    :param row_processors: as ``add_request``'s; a grammar's must already have consumed the
        handed-off output tokens (the next row it masks follows them).
    :returns: the request; its ``text`` already holds the handed-off tokens' text, and its
        first-token time is the exporting engine's.
    :raises SpecdecError: one line, when the state's KV layout differs from this engine's
        (:attr:`kv_layout`), its tokens or arrays do not fit, or with tensor parallelism;
        a :class:`RequestError` for a prompt or sampling values this engine cannot take.
    """
    check_handoff_supported(engine, "import_request")
    mismatch = state.layout.mismatch(engine.kv_layout)
    if mismatch is not None:
        raise SpecdecError(f"import_request: the hand-off's KV layout differs from this engine's ({mismatch})")
    prompt_ids = engine.checked_prompt(state.prompt_token_ids)
    engine.check_sampling(state.sampling, len(prompt_ids))
    output_ids = _checked_handoff(engine, state, len(prompt_ids))
    request = engine.new_request(prompt_ids, state.sampling, None, request_id)
    request.tenant = tenant
    request.row_processors[:0] = list(row_processors)
    _restore(request, state, output_ids)
    if not _seat_imported(engine, request, state):
        request.context_len = 0  # recomputed, as a preempted request is
        engine.scheduler.waiting.append(request)
    return request


def _checked_handoff(engine, state: HandoffState, num_prompt_tokens: int) -> np.ndarray:
    """The state's output ids, after checking that its tokens, positions and arrays fit."""
    vocab = engine.model_config.vocab_size
    output_ids = np.asarray(state.output_token_ids, dtype=np.int64)
    if output_ids.ndim != 1 or not 0 < len(output_ids) < state.sampling.max_tokens:
        raise SpecdecError(f"import_request: {output_ids.size} output tokens; a hand-off has from 1 to "
                           f"max_tokens - 1 ({state.sampling.max_tokens - 1})")
    if output_ids.min() < 0 or output_ids.max() >= vocab:
        raise SpecdecError(f"import_request: output token ids must lie in [0, {vocab})")
    num_tokens = num_prompt_tokens + len(output_ids)
    if not 0 < state.num_positions < num_tokens:
        raise SpecdecError(f"import_request: num_positions {state.num_positions} outside [1, {num_tokens - 1}] "
                           f"(the last token is never in the cache)")
    blocks = -(-state.num_positions // engine.block_size)
    if len(state.kv) != engine.model_config.num_layers or any(len(layer) != blocks for layer in state.kv):
        raise SpecdecError(f"import_request: the KV must be {engine.model_config.num_layers} layers of {blocks} "
                           f"blocks for {state.num_positions} positions")
    hidden = state.hidden_states
    if hidden is not None and tuple(hidden.shape) != (state.num_positions, engine.hidden_width):
        raise SpecdecError(f"import_request: hidden states {list(hidden.shape)}; expected "
                           f"[{state.num_positions}, {engine.hidden_width}]")
    return output_ids


def _restore(request, state: HandoffState, output_ids: np.ndarray) -> None:
    """Give a new request the handed-off tokens, text, generator state and times."""
    start = request.num_prompt_tokens
    request.tokens[start: start + len(output_ids)] = output_ids
    request.num_tokens = start + len(output_ids)
    request.token_sources[:] = bytes([DECODE]) * len(output_ids)  # how they came is the exporter's
    try:
        request.rng.bit_generator.state = state.rng_state
    except (TypeError, ValueError, KeyError) as exc:
        raise SpecdecError(f"import_request: the generator state does not fit numpy's "
                           f"{type(request.rng.bit_generator).__name__}: {exc}") from None
    request.text = request.detokenizer.step(request.generated_ids)
    now = time.perf_counter()
    request.arrival_time = now - state.first_token_s  # first_token_s stays the exporter's
    request.first_token_time = now


def _seat_imported(engine, request, state: HandoffState) -> bool:
    """Put an imported request straight into the running batch with its KV blocks (and
    hidden states) when there is a seat and the blocks for it; False otherwise."""
    scheduler, n = engine.scheduler, state.num_positions
    if scheduler.waiting or len(scheduler.running) >= scheduler.max_num_seqs:
        return False
    if engine.needs_hidden_states and state.hidden_states is None:
        return False  # the proposer's own cache rows would be missing: recompute them
    # Room for the token the next step feeds too, so that the import does not preempt itself.
    if engine.kv.blocks_needed(request, request.num_tokens) > engine.kv.pool.num_free:
        return False
    engine.kv.grow(request, n)
    try:
        engine.attention.import_blocks(request.block_table, state.kv)
    except BaseException:
        engine.kv.free(request)
        raise
    if not state.share_prefix:
        request.prefix_keys = []  # unauthenticated blocks stay this request's own
    engine.kv.adopt(request, n, engine.shareable_through(request))
    request.kv_imported = True
    scheduler.running.append(request)
    if engine.needs_hidden_states:
        hidden = engine.model.paddle.to_tensor(np.asarray(state.hidden_states, dtype=np.float32))
        engine.hidden_states.keep(request, hidden, 0, 0, n)
    engine.start_request(request)
    return True


def export_request(engine, request) -> None:
    """End ``request`` (it has its first token) with finish reason ``handoff`` and its
    exported state; its blocks are still held (the caller retires it)."""
    n = request.context_len
    hidden = _captured_rows(engine, request, n) if request.capture_hidden else None
    request.handoff_state = HandoffState(
        request_id=request.request_id,
        prompt_token_ids=request.tokens[: request.num_prompt_tokens].copy(),
        output_token_ids=request.generated_ids.copy(),
        sampling=request.sampling,
        rng_state=request.rng.bit_generator.state,
        num_positions=n,
        kv=engine.attention.export_blocks(request.block_table[: -(-n // engine.block_size)]),
        hidden_states=hidden,
        layout=engine.kv_layout,
        first_token_s=request.first_token_time - request.arrival_time,
    )
    request.finish_reason = "handoff"


def _captured_rows(engine, request, num_positions: int) -> np.ndarray:
    """``[num_positions, H]`` float32: the hidden states captured for ``request``."""
    states, positions = engine.captured_hidden.take(request)
    if not np.array_equal(positions, np.arange(num_positions)):
        raise SpecdecError(f"captured hidden states of {len(positions)} positions, expected 0..{num_positions - 1}")
    return np.asarray(states.numpy(), dtype=np.float32)
