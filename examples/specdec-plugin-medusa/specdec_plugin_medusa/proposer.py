"""The ``medusa`` method: K heads over the target's last hidden state, chain drafting.

Each step, for every request that may draft, the proposer takes the target's hidden state at
the request's second-to-last position (``len(token_ids) - 2``: the row whose next token,
``token_ids[-1]``, the target has just decided). Head ``k`` turns it into a guess at position
``len(token_ids) - 1 + k``; the draft is the top-1 of heads ``1 .. min(K, max_draft_len)`` in
order. All drafting requests go through one matmul with every head at once, then the target's
own LM head. No KV cache, no state across steps.

Drafts are argmaxes and carry no ``probs``: they count as deterministic, which keeps
``rejection`` (and every other lossless strategy) lossless.
"""

from __future__ import annotations

from typing import Optional

import attrs
import numpy as np

import specdec
from specdec.sdk import Drafts, ProposalBatch, SpecdecError, in_range, require_paddle

from .heads import SHIPPED_HEADS, MedusaHeads, load_heads


@attrs.define(frozen=True, kw_only=True)
class MedusaConfig:
    """Options of ``medusa``; they sit flat in ``--speculative-config`` next to the core keys."""

    #: A heads file (safetensors, see :mod:`specdec_plugin_medusa.heads`); ``None``: the heads
    #: that ship for the target.
    medusa_heads_path: Optional[str] = None
    #: How many of the file's heads to use (the first ones); ``None``: all of them.
    medusa_num_heads: Optional[int] = attrs.field(default=None, validator=in_range(1, 16))


class MedusaProposer(specdec.Proposer):
    """Medusa-1 heads (Cai et al., 2024) sharing the target's LM head; top-1 chain drafting."""

    NAME = "medusa"
    Config = MedusaConfig
    NEEDS_HIDDEN_STATES = True

    def __init__(self, config: Optional[MedusaConfig] = None, spec_config=None):
        super().__init__(config or MedusaConfig(), spec_config)
        self.num_heads = 0  # no heads until setup: propose drafts nothing

    def setup(self, context: specdec.ProposerContext) -> None:
        path = self.config.medusa_heads_path
        if path is None:
            path = SHIPPED_HEADS.get(context.model_name)
            if path is None:
                raise SpecdecError(f"no Medusa heads ship for '{context.model_name}' (they ship for "
                                   f"{', '.join(sorted(SHIPPED_HEADS))}): set medusa_heads_path to heads trained "
                                   f"for it with `python -m specdec_plugin_medusa.train`")
        heads = load_heads(path)
        hidden = int(context.model_config.hidden_size)
        if heads.hidden_size != hidden:
            raise SpecdecError(f"medusa_heads_path: {path} holds heads of hidden size {heads.hidden_size}, "
                               f"the target's is {hidden}")
        wanted = self.config.medusa_num_heads or heads.num_heads
        if wanted > heads.num_heads:
            raise SpecdecError(f"medusa_num_heads: {wanted} heads asked for, {path} holds {heads.num_heads}")
        self.load(heads, context, wanted)

    def load(self, heads: MedusaHeads, context: specdec.ProposerContext, num_heads: int) -> None:
        """Use the first ``num_heads`` of ``heads`` with the target of ``context``."""
        paddle = require_paddle()
        self.paddle = paddle
        self.num_heads = num_heads
        self.hidden_size = heads.hidden_size
        self.eps = float(context.target.rms_norm_eps)
        self.final_norm = context.target.final_norm
        self.lm_head = context.target.lm_head
        # [H, K*H]: every head's W_k.T side by side, so that one matmul runs them all
        # (contiguous: paddle's CPU matmul is slower on a transposed view).
        weight = heads.weight[:num_heads].transpose(2, 0, 1).reshape(self.hidden_size, -1)
        self.weight = paddle.to_tensor(np.ascontiguousarray(weight, dtype=np.float32))
        self.bias = paddle.to_tensor(np.ascontiguousarray(heads.bias[:num_heads].reshape(-1), dtype=np.float32))

    def propose(self, batch: ProposalBatch) -> Drafts:
        drafts: list[list[int]] = [[] for _ in batch.requests]
        drafting = [(b, r) for b, r in enumerate(batch.requests)
                    if self.num_heads and r.max_draft_len > 0 and r.hidden_positions is not None
                    and len(r.hidden_positions) and int(r.hidden_positions[-1]) == len(r.token_ids) - 2]
        if drafting:
            depth = min(self.num_heads, max(r.max_draft_len for _, r in drafting))
            tokens = self.draft_tokens([r.hidden_states[-1:] for _, r in drafting], depth)
            for row, (b, request) in enumerate(drafting):
                drafts[b] = tokens[row, : min(depth, request.max_draft_len)].tolist()
        return Drafts.from_lists(drafts)

    def draft_tokens(self, last_states: list, depth: int) -> np.ndarray:
        """``[B, depth]`` int64: the argmax of heads ``1 .. depth`` over each ``[1, H]`` state."""
        p = self.paddle
        with p.no_grad():
            h = p.concat([s if isinstance(s, p.Tensor) else p.to_tensor(np.asarray(s, np.float32))
                          for s in last_states], axis=0).astype("float32")
            n = h * p.rsqrt(p.mean(h * h, axis=-1, keepdim=True) + self.eps) * self.final_norm
            weight, bias = self.weight, self.bias
            if depth < self.num_heads:
                weight, bias = weight[:, : depth * self.hidden_size], bias[: depth * self.hidden_size]
            y = p.nn.functional.silu(p.matmul(n, weight) + bias)
            x = (y.reshape([-1, depth, self.hidden_size]) + n.unsqueeze(1)).reshape([-1, self.hidden_size])
            best = p.argmax(p.matmul(x, self.lm_head, transpose_y=True), axis=-1)
        return best.numpy().astype(np.int64).reshape(-1, depth)
