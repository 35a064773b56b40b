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
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence, Union

import attrs
import numpy as np

from ..errors import SpecdecError
from ..sampling import SamplingParams

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
    :ivar hidden_states: ``[num_positions, hidden]`` float32, the target's last-layer hidden
        states at those positions (for a decode engine whose proposer reads them), or None.
    :ivar layout: the exporting engine's :class:`KVLayout`.
    :ivar first_token_s: seconds from the request's arrival to its first token there.
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
    def from_wire(cls, header: dict, buffers: Sequence[Buffer]) -> "HandoffState":
        """The state :meth:`to_wire` sent: ``header`` and the raw bytes of each buffer, in
        order. The arrays are read-only views of ``buffers`` (no copy). A header or buffer
        that does not fit is a one-line :class:`SpecdecError`."""
        try:
            return cls._from_wire(header, buffers)
        except SpecdecError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecdecError(f"not a hand-off: {type(exc).__name__}: {' '.join(str(exc).split())}") from None

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
