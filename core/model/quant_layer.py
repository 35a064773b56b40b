"""One decoder layer on the quantized CPU kernels, in two native calls: the code the target's
quantized path (:class:`specdec.model.quant_weights.QuantizedWeights`) runs per layer, and
:class:`QuantizedDecoderLayer`, the same for a plugin's own layer (an MTP head, an EAGLE or
draft layer), exported as ``specdec.sdk.QuantizedDecoderLayer``, with
:class:`QuantizedDraftInput`, a one-layer draft head's input in one call, and
:class:`QuantizedDraftHead`, such a head's whole forward in one call.

A layer is a dict of kernel operands (:func:`build_layer`):

- ``qkv`` (q, k and v stacked: one matmul), ``qkv_epilogue`` (``[2, N]``: a scale per output
  column, ``1/sqrt(head_dim)`` on the query columns and 1 elsewhere, then the q/k/v biases
  already scaled), ``attn_gain`` (the input RMSNorm's gain);
- ``o``, ``mlp_gain`` (the post-attention RMSNorm's gain), ``gate_up`` (gate and up stacked),
  ``down``;

each matrix a ``(data, layout)`` pair of paddle tensors (see :func:`specdec.model.quant.layout_array`).
:func:`attention_input` and :func:`layer_output` are its two calls.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import weakref
from typing import Any, Callable

import numpy as np

from .quant import QuantizedMatrix, load_quantized_ops, quantize, to_paddle

#: The float weights of one decoder layer, by their Hugging Face names below ``model.layers.{i}.``.
LAYER_MATRICES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LAYER_GAINS = ("input_layernorm.weight", "post_attention_layernorm.weight")
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def qkv_epilogue(num_heads: int, num_kv_heads: int, head_dim: int, biases=None) -> np.ndarray:
    """``[2, N]`` float32 for ``specdec_q_matmul``'s epilogue over the fused q/k/v output: row 0
    scales each column (``1/sqrt(head_dim)`` on the queries: the attention backends take queries
    pre-scaled, and blocks cannot absorb the scale as float weights do), row 1 is added after
    (the q, k, v biases times that scale; zeros without ``biases``)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    scale = np.concatenate([np.full(q_size, head_dim ** -0.5), np.ones(2 * kv_size)])
    bias = np.zeros(q_size + 2 * kv_size) if biases is None else np.concatenate(biases) * scale
    return np.stack([scale, bias]).astype(np.float32)


def build_layer(paddle, get: Callable[[str], Any], matrix: Callable[..., Any], num_heads: int, num_kv_heads: int,
                head_dim: int, attention_bias: bool) -> dict:
    """One layer's kernel operands (the module docstring lists them). ``get(name)`` returns a
    float weight by its name within the layer (``input_layernorm.weight``, ...); ``matrix(*names)``
    returns the ``(data, layout)`` pair of those matrices stacked, in blocks."""
    def vector(name: str):
        return paddle.to_tensor(np.ascontiguousarray(get(name), dtype=np.float32))

    biases = [get(name) for name in QKV_BIASES] if attention_bias else None
    return {
        "qkv": matrix(*LAYER_MATRICES[:3]),
        "qkv_epilogue": paddle.to_tensor(qkv_epilogue(num_heads, num_kv_heads, head_dim, biases)),
        "attn_gain": vector("input_layernorm.weight"),
        "o": matrix("self_attn.o_proj.weight"),
        "mlp_gain": vector("post_attention_layernorm.weight"),
        "gate_up": matrix("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "down": matrix("mlp.down_proj.weight"),
    }


def release_with(owner, ops, handle) -> None:
    """Release ``handle`` (weights the kernels read once and kept pointers to:
    ``specdec_q_release``) when ``owner``, which keeps their tensors alive, is collected. Not
    at exit: the process frees it then, and paddle may be gone."""
    finalizer = weakref.finalize(owner, ops.specdec_q_release, handle)
    finalizer.atexit = False


def layer_operands(layer: dict) -> list:
    """A layer's operands in the order of the kernels' registered stacks (``o``, ``mlp_gain``,
    ``gate_up``, ``down``, then its input side: ``attn_gain``, ``qkv``, ``qkv_epilogue``)."""
    return [*layer["o"], layer["mlp_gain"], *layer["gate_up"], *layer["down"], layer["attn_gain"], *layer["qkv"],
            layer["qkv_epilogue"]]


def attention_input(ops, layer: dict, x, eps: float):
    """``[T, N]`` q/k/v for the attention backend: RMSNorm of ``x`` ``[T, H]``, the gain, the
    fused matmul, the query scale and the biases, in one call."""
    data, layout = layer["qkv"]
    return ops.specdec_q_matmul(x, layer["attn_gain"], data, layout, layer["qkv_epilogue"], eps, True)


def layer_output(ops, layer: dict, attn, x, eps: float):
    """``[T, H]``: the layer's output from the attention output ``attn`` and its input ``x``
    (output projection, residual, RMSNorm, gate/up, SwiGLU, down, residual), in one call."""
    return ops.specdec_q_layer_tail(attn, x, *layer["o"], layer["mlp_gain"], *layer["gate_up"], *layer["down"], eps)


class QuantizedDecoderLayer:
    """A Llama/Qwen2-style decoder layer (pre-norm attention and SwiGLU MLP) quantized at
    construction and run by the CPU kernels in two native calls, the calls the target's own
    quantized layers make: :meth:`attention_input` before the attention backend's ``forward``,
    :meth:`output` after it. For a model-based proposer's own layer: one call replaces the
    dozen eager paddle ops (each 20-60 us of dispatch on a CPU) a layer costs written out.

    :param weights: the layer's float weights by their Hugging Face names within the layer:
        ``self_attn.{q,k,v,o}_proj.weight`` (``[out, in]``), ``self_attn.{q,k,v}_proj.bias``
        (optional: all three or none), ``input_layernorm.weight``,
        ``post_attention_layernorm.weight``, ``mlp.{gate,up,down}_proj.weight``. Numpy arrays
        (any float dtype); input sizes must be multiples of 32.
    :param num_heads: query heads; with ``num_kv_heads`` and ``head_dim`` the attention's
        shape (the target's ``model_config`` values when the layer attends over
        ``create_cache_layers`` defaults).
    :param num_kv_heads: key/value heads.
    :param head_dim: the size of one head.
    :param eps: the RMSNorms' epsilon (``context.target.rms_norm_eps``).
    :param method: ``wint8`` (int8 per output channel) or ``wint4`` (int4 in groups of 32), as
        :func:`specdec.model.quant.quantize`.

    Raises :class:`specdec.SpecdecError` (one line) for an unknown ``method``, kernels that are
    not built, or a weight the kernels cannot take.
    """

    def __init__(self, weights: dict, *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 method: str = "wint8"):
        from specdec.errors import SpecdecError, require_paddle

        self._ops = load_quantized_ops(method)
        paddle = require_paddle()
        self.method, self.eps = method, float(eps)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        missing = [name for name in LAYER_MATRICES + LAYER_GAINS if name not in weights]
        if missing:
            raise SpecdecError(f"QuantizedDecoderLayer: missing weights {', '.join(missing)}")

        def matrix(*names: str):
            try:
                parts = [quantize(np.asarray(weights[name], np.float32), method) for name in names]
            except ValueError as exc:
                raise SpecdecError(f"QuantizedDecoderLayer: {names[0]}: {exc}") from None
            return to_paddle(paddle, parts[0] if len(parts) == 1 else QuantizedMatrix.stacked(parts))

        self._layer = build_layer(paddle, weights.__getitem__, matrix, num_heads, num_kv_heads, head_dim,
                                  attention_bias=QKV_BIASES[0] in weights)
        self.hidden_size = int(self._layer["attn_gain"].shape[0])

    def attention_input(self, x):
        """``[T, (num_heads + 2 * num_kv_heads) * head_dim]`` float32: q, k, v of the layer's
        input ``x`` ``[T, H]`` (float32 paddle tensor), as an attention backend's ``forward``
        takes them: before RoPE, queries pre-scaled by ``1/sqrt(head_dim)``, biases added."""
        return attention_input(self._ops, self._layer, x, self.eps)

    def output(self, attn, x, *, head=None, rows=None):
        """``[T, H]``: the layer's output from the attention backend's output ``attn``
        ``[T, num_heads * head_dim]`` and the layer's input ``x`` ``[T, H]``.

        With ``head`` (a :class:`~specdec.model.quant.QuantizedLinear` built with a
        ``norm_gain``: a draft head's final norm and LM head) returns ``(output, logits)``,
        ``logits`` being ``head`` over the output's rows ``rows`` (a sequence of row indices;
        every row when None), in the same native call: a one-layer head's forward and its
        logits then cost two calls around the attention, not four. Pass only the rows that
        draft (a catch-up over a prompt needs none of its other rows' logits)."""
        if head is None:
            return layer_output(self._ops, self._layer, attn, x, self.eps)
        if not head.normalizes:
            from specdec.errors import SpecdecError

            raise SpecdecError("QuantizedDecoderLayer.output: head must be a QuantizedLinear with a norm_gain")
        picked = list(range(int(x.shape[0]))) if rows is None else [int(r) for r in rows]
        o, mlp, gate_up, down = self._layer["o"], self._layer["mlp_gain"], self._layer["gate_up"], self._layer["down"]
        return self._ops.specdec_q_layer_tail_head(attn, x, *o, mlp, *gate_up, *down, *head.operands, picked, self.eps)


class QuantizedDraftInput:
    """The input of a one-layer draft head and its first layer's q/k/v, in one native call:
    ``x = embed_proj(n_e(embed(t))) + hidden_proj(n_h(h))``, then
    ``layer.attention_input(x)``, where ``embed(t)`` are the target's embeddings of the tokens
    (read from its quantized table inside the call when the target is quantized) and ``n_e``,
    ``n_h`` RMSNorms with their gains. It is DeepSeek-V3's MTP input (``eh_proj`` over
    ``[enorm(embedding); hnorm(hidden)]``, split into its two halves) and EAGLE-1/2's (``fc``
    over ``[embedding; feature]``, no norms: gains None). Exported as
    ``specdec.sdk.QuantizedDraftInput``.

    Written out, the same forward costs an embedding lookup, two projections, an add and the
    attention input: five paddle dispatches of 20-60 us each on a CPU, more than the head's
    arithmetic at batch 1. The result is the same, bit for bit.

    :param target: ``context.target`` (:class:`specdec.TargetModel`).
    :param embed_proj: ``[H, E]`` float weight over the embedding (``E`` the target's hidden size).
    :param hidden_proj: ``[H, Hh]`` float weight over the hidden state.
    :param method: ``wint8`` or ``wint4``, as :class:`QuantizedDecoderLayer`.
    :param embed_gain: ``[E]`` RMSNorm gain of the embedding, or None for no norm.
    :param hidden_gain: ``[Hh]`` RMSNorm gain of the hidden state, or None for no norm.
    :param eps: the norms' epsilon.
    """

    def __init__(self, target, embed_proj: np.ndarray, hidden_proj: np.ndarray, method: str = "wint8", *,
                 embed_gain=None, hidden_gain=None, eps: float = 1e-6):
        from specdec.errors import require_paddle

        from .quant import QuantizedLinear

        paddle = require_paddle()
        self._ops = load_quantized_ops(method)
        self._target = target
        self._embed = QuantizedLinear(np.asarray(embed_proj, np.float32), method, norm_gain=embed_gain, eps=eps)
        self._hidden = QuantizedLinear(np.asarray(hidden_proj, np.float32), method, norm_gain=hidden_gain, eps=eps)
        self.eps = float(eps)
        #: The target's quantized embedding table ``(data, layout)``, None for a float target
        #: (whose embeddings then come from ``target.embed``, one call more).
        self._table = target._quantized_embedding()
        self._empty = paddle.empty([0], dtype="float32")
        self._no_table = paddle.empty([0], dtype="uint8"), paddle.empty([0, 4], dtype="int64")

    def __call__(self, token_ids: np.ndarray, hidden, layer: QuantizedDecoderLayer):
        """``(x, qkv)`` for ``token_ids`` ``[T]`` and the hidden states ``hidden`` ``[T, Hh]``
        (float32 paddle tensor): ``x`` ``[T, H]`` is the layer's input (its residual), ``qkv``
        what ``layer.attention_input(x)`` returns."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if self._table is None:
            embeds, (data, layout), listed = self._target.embed(ids), self._no_table, []
        else:
            embeds, (data, layout), listed = self._empty, self._table, ids.tolist()
        operands = layer._layer
        return self._ops.specdec_q_draft_input(
            embeds, data, layout, hidden, *self._embed.operands, *self._hidden.operands, operands["attn_gain"],
            *operands["qkv"], operands["qkv_epilogue"], listed, self._embed.in_features, self.eps,
            self._embed.normalizes, self._hidden.normalizes)


class QuantizedDraftHead:
    """A one-layer draft head's forward in one native call: :class:`QuantizedDraftInput`, the
    attention over the head's cache layer, then :class:`QuantizedDecoderLayer`'s ``output``
    with an LM head over the rows that draft. The kernels read the three parts' weights once,
    here, and each call passes a handle: the paddle dispatch of three calls and the Python
    between them go (the default model's MTP head step, 0.38 ms at batch 1, took 0.34 ms this
    way; 2026-12-05, AMD Zen 5). The result is the same, bit for bit. Exported as
    ``specdec.sdk.QuantizedDraftHead``.

    :param draft_input: the head's input (over a quantized target's embedding table).
    :param layer: its decoder layer.
    :param lm_head: its LM head, a :class:`~specdec.model.quant.QuantizedLinear` built with a
        ``norm_gain`` (the final norm).

    Over cache layers of another attention backend than ``cpu`` (whose ``kernel_operands()``
    is None) :meth:`forward` makes the three calls. Raises :class:`specdec.SpecdecError` (one
    line) for a float target or an LM head without a norm.
    """

    def __init__(self, draft_input: QuantizedDraftInput, layer: QuantizedDecoderLayer, lm_head):
        from specdec.errors import SpecdecError

        if draft_input._table is None:
            raise SpecdecError("QuantizedDraftHead: needs a quantized target (its embedding table)")
        if not lm_head.normalizes:
            raise SpecdecError("QuantizedDraftHead: lm_head must be a QuantizedLinear with a norm_gain")
        self._ops = layer._ops
        self.eps = layer.eps
        self._parts = draft_input, layer, lm_head
        embed, hidden = draft_input._embed, draft_input._hidden
        #: The tensors the kernels read: kept alive as long as the handle.
        self._operands = [*draft_input._table, *embed.operands, *hidden.operands, *layer_operands(layer._layer),
                          *lm_head.operands]
        self._handle = self._ops.specdec_q_register_draft_head(
            self._operands, embed.in_features, hidden.in_features, layer.num_heads * layer.head_dim)
        release_with(self, self._ops, self._handle)
        self._bound = None  # (key, binding handle, cache tensor, its releaser): start's binding
        self._io = None  # start's buffers (_StartBuffers)
        self._metadata_tensors: dict[int, tuple] = {}

    def forward(self, token_ids: np.ndarray, hidden, cache_layers, layer_index: int, meta, logit_rows=()):
        """``(output [T, H], logits [len(logit_rows), V])`` for ``token_ids`` ``[T]`` and the
        previous positions' hidden states ``hidden`` ``[T, Hh]``, attending over layer
        ``layer_index`` of ``cache_layers`` at the positions ``meta`` gives (their keys and
        values are written there): what ``draft_input``, ``cache_layers.forward`` and
        ``layer.output(attn, x, head=lm_head, rows=logit_rows)`` return."""
        cache_layers.prepare(meta)
        operands = getattr(cache_layers, "kernel_operands", lambda: None)()
        if operands is None:
            draft_input, layer, lm_head = self._parts
            x, qkv = draft_input(token_ids, hidden, layer)
            attn = cache_layers.forward(layer_index, qkv, meta)
            return layer.output(attn, x, head=lm_head, rows=logit_rows)
        caches, cos, sin, packed, heads, kv_heads = operands
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist()
        return self._ops.specdec_q_draft_head(hidden, caches[layer_index], cos, sin, packed, self._handle, ids,
                                              [int(r) for r in logit_rows], heads, kv_heads, self.eps)

    def start(self, token_ids: np.ndarray, hidden, cache_layers, layer_index: int, meta, logit_rows=()):
        """:meth:`forward`, started on the kernels' worker thread while the caller goes on:
        a :class:`PendingDraftHead` whose ``result()`` is ``(output [T, H], logits)`` as
        :meth:`forward` computes them (the same floats), as numpy arrays (views of this head's
        buffers, valid until its next ``start``). The work writes its
        keys and values into ``cache_layers`` as it goes: the caller must not run this head
        again, nor hand the cache layer's blocks to another request, before ``result()``.
        Over another attention backend than ``cpu``, or with ``hidden`` not contiguous, the
        forward runs here, at once, and ``result()`` only returns it.

        Meant for work that can overlap the caller's own Python: a draft head's catch-up
        started at the end of a step, its drafts collected at the next one (the ``mtp``
        proposer's ``CATCHES_UP_AFTER_STEP``). It is started through ctypes, not a paddle
        operator: paddle's dispatch costs 100 us or more on the caches a forward pass has just
        flushed, as much as the head's own work at batch 1."""
        cache_layers.prepare(meta)
        operands = getattr(cache_layers, "kernel_operands", lambda: None)()
        if operands is None or not hidden.is_contiguous():
            out, logits = self.forward(token_ids, hidden, cache_layers, layer_index, meta, logit_rows)
            return PendingDraftHead((np.asarray(out), np.asarray(logits)))
        caches, cos, sin, packed, heads, kv_heads = operands
        binding = self._binding(caches[layer_index], cos, sin, heads, kv_heads)
        T, width = hidden.shape
        R = len(logit_rows)
        io = self._buffers(T, R)
        io.ids[:T] = token_ids
        io.rows[:R] = logit_rows
        B, columns, meta_pointer = self._metadata(packed)
        ticket = next(_tickets)
        if _c_library().specdec_draft_head_start(binding, hidden.data_ptr(), T, width, io.ids_pointer, io.rows_pointer,
                                                 R, meta_pointer, B, columns, io.out_pointer, io.logits_pointer,
                                                 ticket, io.message, len(io.message)):
            from specdec.errors import SpecdecError

            raise SpecdecError("QuantizedDraftHead.start: " + io.message.value.decode(errors="replace").splitlines()[0])
        return PendingDraftHead((io.out, io.logits, T, R), ticket=ticket, keep=(hidden, io))

    def prepare_start(self, cache_layers, layer_index: int, block_size: int) -> None:
        """Bind this head to ``cache_layers`` and load what :meth:`start` calls, ahead of the
        first ``start`` (from a proposer's ``setup``): that one then costs what the others do,
        and a drafting controller does not take one-time work for the proposer's time. A no-op
        over another attention backend than ``cpu``."""
        from specdec.attention import AttentionMetadata

        kernel_operands = getattr(cache_layers, "kernel_operands", None)
        if kernel_operands is None:
            return
        cache_layers.prepare(AttentionMetadata.build([0], [0], np.zeros((1, 1), np.int32), block_size))
        operands = kernel_operands()
        if operands is None:
            return
        caches, cos, sin, _, heads, kv_heads = operands
        self._binding(caches[layer_index], cos, sin, heads, kv_heads)
        self._buffers(8, 8)
        _c_library()
        _finish_message()

    def _buffers(self, rows: int, logit_rows: int) -> "_StartBuffers":
        """The buffers :meth:`start` hands the kernels, with room for ``rows`` and
        ``logit_rows`` (made anew, twice as large, when they are too small)."""
        io = self._io
        if io is None or io.capacity < rows or io.logit_capacity < logit_rows:
            io = self._io = _StartBuffers(max(rows, 2 * (io.capacity if io else 8)),
                                          max(logit_rows, 2 * (io.logit_capacity if io else 8)),
                                          self._parts[1].hidden_size, self._parts[2].out_features)
        return io

    def _metadata(self, packed) -> tuple[int, int, int]:
        """``(rows, columns, address)`` of the attention backend's metadata tensor (the backend
        keeps one per shape, so they are looked up once)."""
        found = self._metadata_tensors.get(id(packed))
        if found is None or found[3] is not packed:
            if len(self._metadata_tensors) >= 8:
                self._metadata_tensors.clear()
            rows, columns = packed.shape
            found = self._metadata_tensors[id(packed)] = (rows, columns, packed.data_ptr(), packed)
        return found[0], found[1], found[2]

    def _binding(self, cache, cos, sin, heads: int, kv_heads: int) -> int:
        """The kernels' handle of this head bound to ``cache`` (``specdec_q_bind_draft_head``;
        bound again when the cache layer's tensor changes)."""
        key = (id(cache), heads, kv_heads)
        if self._bound is None or self._bound[0] != key:
            if self._bound is not None:
                self._bound[3].detach()  # release the old binding now
            tensor = self._ops.specdec_q_bind_draft_head(self._handle, cache, cos, sin, heads, kv_heads, self.eps)
            finalizer = weakref.finalize(self, self._ops.specdec_q_release, tensor)
            finalizer.atexit = False
            self._bound = (key, int(tensor.numpy()[0]), cache, _Releaser(self._ops, tensor, finalizer))
        return self._bound[1]


class _StartBuffers:
    """What :meth:`QuantizedDraftHead.start` hands the kernels: the rows' token ids and the
    rows that need logits (copied by the call), the output and the logits (written by the work),
    and room for an error message, with their addresses taken once. Taking an array's address
    or making a new one costs 10-25 us on the caches a forward pass has just flushed."""

    def __init__(self, capacity: int, logit_capacity: int, hidden_size: int, vocab: int):
        self.capacity, self.logit_capacity = capacity, logit_capacity
        self.ids = np.zeros(capacity, np.int64)
        self.rows = np.zeros(logit_capacity, np.int64)
        self.out = np.zeros((capacity, hidden_size), np.float32)
        self.logits = np.zeros((logit_capacity, vocab), np.float32)
        self.ids_pointer, self.rows_pointer = self.ids.ctypes.data, self.rows.ctypes.data
        self.out_pointer, self.logits_pointer = self.out.ctypes.data, self.logits.ctypes.data
        self.message = ctypes.create_string_buffer(256)


class _Releaser:
    """Releases a binding when asked (``detach``) rather than when its head is collected."""

    def __init__(self, ops, tensor, finalizer):
        self._ops, self._tensor, self._finalizer = ops, tensor, finalizer

    def detach(self) -> None:
        if self._finalizer.detach() is not None:
            self._ops.specdec_q_release(self._tensor)


#: Numbers for the work :meth:`QuantizedDraftHead.start` hands the kernels (unique per process).
_tickets = itertools.count(1)


class PendingDraftHead:
    """A draft head's forward running in the background (:meth:`QuantizedDraftHead.start`).
    Exported as ``specdec.sdk.PendingDraftHead``."""

    def __init__(self, outputs, ticket: int | None = None, keep=None):
        self._outputs = outputs
        self._ticket = ticket
        self._keep = keep  # what the work reads: alive until it has finished
        self._error = ""

    def __del__(self):
        # Forgotten before its result (a proposer dropped with work in flight): wait for the
        # work, which writes into buffers this object keeps alive.
        if getattr(self, "_ticket", None) is not None:
            try:
                _c_library().specdec_draft_head_finish(self._ticket, None, 0)
            except Exception:  # noqa: BLE001 - at interpreter exit, say: nothing left to wait for
                pass

    def result(self):
        """Wait for the forward and return ``(output [T, H], logits [rows, V])``, numpy arrays.
        They are views of the head's buffers, valid until its next ``start``: copy what must
        live longer. Raises :class:`specdec.SpecdecError` with the kernel's message if the work
        failed. Calling it again returns the same."""
        if self._ticket is not None:
            message = _finish_message()
            ticket, self._ticket = self._ticket, None
            status = _c_library().specdec_draft_head_finish(ticket, message, len(message))
            self._keep = None
            if status != 0:
                self._outputs = None
                self._error = (message.value.decode(errors="replace").splitlines() or ["no such work"])[0]
        if self._outputs is None:
            from specdec.errors import SpecdecError

            raise SpecdecError(f"draft head: {self._error}")
        if len(self._outputs) == 4:  # start's buffers: the rows this work wrote
            out, logits, rows, logit_rows = self._outputs
            self._outputs = out[:rows], logits[:logit_rows]
        return self._outputs


@functools.lru_cache(maxsize=1)
def _finish_message():
    """Room for a background forward's error message (results are collected one at a time)."""
    return ctypes.create_string_buffer(256)


_library = None


def _c_library():
    """The kernels' library through ctypes (looked up once: an import statement and a cached
    call cost several us each on the caches a forward pass has just flushed)."""
    global _library
    if _library is None:
        from specdec.kernels.cpu import cpu_ops_c_library

        _library = cpu_ops_c_library()
    return _library
