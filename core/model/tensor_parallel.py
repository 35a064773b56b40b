"""Tensor parallelism of the Llama decoder (Megatron-style), over paddle.distributed.

Each of ``N`` ranks holds a slice of every layer:

- attention: its KV heads and the query heads that share them (QKV column-parallel, O
  row-parallel), so its attention backend and KV cache hold only those heads;
- MLP: a slice of the intermediate width (gate/up column-parallel, down row-parallel);
- embedding and LM head: a slice of the vocabulary (vocab-parallel).

A layer's O and down products are partial sums: one all-reduce after each gives every rank the
full hidden state again, so norms and residuals run replicated. The embedding is a lookup in
the rank's rows (zeros elsewhere) and one all-reduce; the logits are each rank's vocabulary
slice, all-gathered. The matmuls are paddle's own (the float32 ``paddle`` path).

Heads and widths need not divide evenly: ranks take ``ceil`` or ``floor`` shares (the default
model has 3 KV heads, so 2 ranks hold 2 and 1), but every rank needs at least one KV head.
"""

from __future__ import annotations

import attrs
import numpy as np

from ..errors import SpecdecError
from .config import ModelConfig
from .float_weights import FloatWeights


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``total`` items are split in ``parts`` parts
    as evenly as possible (the first ``total % parts`` parts take one more)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@attrs.frozen
class Shard:
    """What rank ``rank`` of ``world_size`` holds.

    :ivar kv_heads: ``[start, end)`` of its KV heads (its query heads are the ``group`` per KV head).
    :ivar intermediate: ``[start, end)`` of its MLP columns.
    :ivar vocab: ``[start, end)`` of its vocabulary rows; every rank's slice is padded to
        ``vocab_per_rank`` rows when the logits are gathered.
    """

    rank: int
    world_size: int
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int

    @classmethod
    def plan(cls, config: ModelConfig, rank: int, world_size: int) -> "Shard":
        if world_size > config.num_kv_heads:
            raise SpecdecError(f"tensor_parallel_size: {world_size} ranks for a model with {config.num_kv_heads} KV "
                               f"heads; each rank needs at least one (use at most {config.num_kv_heads})")
        per_rank = -(-config.vocab_size // world_size)
        vocab = (min(rank * per_rank, config.vocab_size), min((rank + 1) * per_rank, config.vocab_size))
        return cls(rank=rank, world_size=world_size, kv_heads=split_range(config.num_kv_heads, world_size, rank),
                   intermediate=split_range(config.intermediate_size, world_size, rank), vocab=vocab,
                   vocab_per_rank=per_rank)


def shard_weights(config: ModelConfig, weights: dict, shard: Shard) -> tuple[ModelConfig, dict]:
    """``(local config, local weights)``: rank ``shard.rank``'s slices of HF-named float
    weights, and the config of the slice (its head counts, MLP width and vocabulary rows)."""
    group, dim = config.num_heads // config.num_kv_heads, config.head_dim
    k0, k1 = shard.kv_heads
    q_rows = slice(k0 * group * dim, k1 * group * dim)
    kv_rows = slice(k0 * dim, k1 * dim)
    i0, i1 = shard.intermediate
    v0, v1 = shard.vocab
    local = {}
    for name, value in weights.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            value = value[q_rows]
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                            "self_attn.k_proj.bias", "self_attn.v_proj.bias")):
            value = value[kv_rows]
        elif name.endswith("self_attn.o_proj.weight"):
            value = value[:, q_rows]
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            value = value[i0:i1]
        elif name.endswith("mlp.down_proj.weight"):
            value = value[:, i0:i1]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            value = value[v0:v1]
        local[name] = np.ascontiguousarray(value)
    local_config = attrs.evolve(config, num_heads=(k1 - k0) * group, num_kv_heads=k1 - k0,
                                intermediate_size=i1 - i0, vocab_size=v1 - v0)
    return local_config, local


class TensorParallelWeights(FloatWeights):
    """:class:`FloatWeights` of one rank's slice, with the collectives that make the slices
    one model: the embedding all-reduced, O and down all-reduced before the residual, the
    logits all-gathered over the vocabulary. Every rank must make the same calls in the same
    order (the engine's workers replay rank 0's steps)."""

    def __init__(self, paddle, local_config: ModelConfig, local_weights: dict, linear, group, shard: Shard,
                 vocab_size: int):
        super().__init__(paddle, local_config, local_weights, linear)
        self.group = group
        self.shard = shard
        self.vocab_size = vocab_size

    def embed(self, ids):
        p = self.paddle
        start, end = self.shard.vocab
        local = ids - start
        inside = (local >= 0) & (local < end - start)
        rows = p.gather(self.embedding, p.where(inside, local, p.zeros_like(local)))
        return self.group.all_reduce(rows * inside.astype(rows.dtype).unsqueeze(-1))

    def layer_output(self, index: int, attn, x):
        p, layer, linear = self.paddle, self.layers[index], self.linear
        x = x + self.group.all_reduce(p.matmul(attn, layer["o"]))
        return x + self.group.all_reduce(p.matmul(linear.rms_matmul_swiglu(x, layer["gate_up"]), layer["down"]))

    def logits(self, x):
        p = self.paddle
        local = self.linear.rms_matmul(x, self.lm_head)
        missing = self.shard.vocab_per_rank - local.shape[-1]
        if missing:  # all_gather wants equal shapes: pad the last slice
            local = p.concat([local, p.zeros([local.shape[0], missing], dtype=local.dtype)], axis=-1)
        return self.group.all_gather(local)[:, : self.vocab_size]


class CollectiveGroup:
    """The collectives tensor parallelism uses, over ``paddle.distributed`` (gloo on CPU,
    NCCL on GPU); the process group must be joined (``init_parallel_env``) before the first
    collective."""

    def __init__(self, paddle, rank: int | None = None, world_size: int | None = None):
        """``rank`` and ``world_size`` may be given before the group is joined (a rank builds
        its model first); else they are read from the joined group."""
        import paddle.distributed as dist

        self.paddle, self.dist = paddle, dist
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size

    def all_reduce(self, tensor):
        """The elementwise sum over ranks (in place, and returned)."""
        self.dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor):
        """Every rank's ``[M, n]`` tensor side by side: ``[M, world_size * n]``."""
        parts = []
        self.dist.all_gather(parts, tensor)
        return self.paddle.concat(parts, axis=-1)

    def broadcast_int64(self, values=None, length: int = 0):
        """Rank 0's int64 ``values`` (1-D numpy) on every rank, as numpy; the other ranks pass
        the ``length`` they expect. Plain tensors, never pickled objects: nothing received
        is more than integers (specdec.engine.tensor_parallel_messages gives them meaning)."""
        p = self.paddle
        if values is None:
            tensor = p.zeros([length], dtype="int64")
        else:
            tensor = p.to_tensor(np.ascontiguousarray(values, dtype=np.int64))
        self.dist.broadcast(tensor, src=0)
        return tensor.numpy()
