"""``specdec train-mtp``: train an MTP head for a target model on local text, on CPU, by
self-distillation.

1. **Collect.** The target reads the corpus through the public engine: text files are read as
   prompts (split into windows), a JSONL of prompts is answered by the target itself (greedy,
   its chat template), which is the best data, since it is what the head will be asked to
   predict. A recording proposer (``NEEDS_HIDDEN_STATES``) keeps every position's hidden
   state, and the label of each position: the target's own argmax there, the token a draft
   must equal to be accepted.
2. **Train.** The head (:class:`TrainableMtp`, the same math as :class:`MtpHead`, with plain
   causal attention over whole sequences) learns to predict, from the state at ``p - 1`` and
   the token at ``p``, what the target predicts at ``p``: the loss is the cross-entropy against
   the target's whole distribution there (:func:`distillation_loss`), over a draft vocabulary
   of the most frequent labels (EAGLE-3 style; the head's LM head is those rows of the
   target's).
3. **Report.** Accuracy on held-out sequences is the first-position acceptance of greedy
   verification; the end of the run also measures acceptance per position with the engine.

Checkpoints (the head's and the optimizer's tensors as safetensors, then ``checkpoint.json``
with their hashes, written crash-safe by :mod:`.checkpoint`) are written every
``--checkpoint-every`` steps and at the end, with ``head.safetensors``, the trained head;
``--resume`` verifies the checkpoint and continues from it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

import attrs
import numpy as np

import specdec
from specdec.sdk import SpecdecError, require_paddle

from .checkpoint import Checkpoint, read_checkpoint, write_checkpoint
from .weights import MtpLayerWeights, load_mtp_layers, save_mtp_layers

if TYPE_CHECKING:
    from specdec.tools import RecordedSequence


# --- 2. the trainable head --------------------------------------------------------------------


def rope_tables(head_dim: int, theta: float, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """Rotate-half RoPE tables as the target's attention applies them: ``x * cos + roll(x,
    D/2) * sin`` with the sign folded into ``sin``."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / head_dim)
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=-1).astype(np.float32)
    return cos, sin


class TrainableMtp:
    """The MTP layer's parameters and a differentiable forward over padded sequences."""

    def __init__(self, config, target, draft_vocab: np.ndarray, init: Optional[MtpLayerWeights] = None,
                 seed: int = 0):
        paddle = require_paddle()
        self.paddle, self.config, self.target = paddle, config, target
        c = config
        H, I = c.hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        rng = np.random.default_rng(seed)

        def normal(rows, cols, scale=1.0):
            return (rng.standard_normal((rows, cols)) * scale / math.sqrt(cols)).astype(np.float32)

        weights = init or MtpLayerWeights(
            enorm=np.ones(H, np.float32), hnorm=np.ones(H, np.float32),
            embed_proj=normal(H, H, 0.5), hidden_proj=np.eye(H, dtype=np.float32),
            decoder={"input_layernorm.weight": np.ones(H, np.float32),
                     "post_attention_layernorm.weight": np.ones(H, np.float32),
                     "self_attn.q_proj.weight": normal(q, H), "self_attn.k_proj.weight": normal(kv, H),
                     "self_attn.v_proj.weight": normal(kv, H), "self_attn.o_proj.weight": normal(H, q, 0.1),
                     "mlp.gate_proj.weight": normal(I, H), "mlp.up_proj.weight": normal(I, H),
                     "mlp.down_proj.weight": normal(H, I, 0.1)})
        self.names = ["enorm", "hnorm", "embed_proj", "hidden_proj", *weights.decoder]
        arrays = {"enorm": weights.enorm, "hnorm": weights.hnorm, "embed_proj": weights.embed_proj,
                  "hidden_proj": weights.hidden_proj, **weights.decoder}
        self.params = {}
        for name in self.names:
            param = paddle.create_parameter(list(arrays[name].shape), "float32",
                                            default_initializer=paddle.nn.initializer.Assign(arrays[name]))
            param.stop_gradient = False
            self.params[name] = param
        self.draft_vocab = np.asarray(draft_vocab, dtype=np.int64)
        with paddle.no_grad():
            rows = paddle.gather(target.lm_head, paddle.to_tensor(self.draft_vocab))
            # [K, H] with the final norm's gain folded in; used as matmul(x, head, transpose_y=True)
            # (paddle's CPU matmul is several times slower on a transposed view).
            self.head = rows * target.final_norm.unsqueeze(0)
        self.eps = float(target.rms_norm_eps)

    def _rms(self, x, gain=None):
        p = self.paddle
        x = x * p.rsqrt(p.mean(x * x, axis=-1, keepdim=True) + self.eps)
        return x if gain is None else x * gain

    def _linear(self, x, name):
        return self.paddle.matmul(x, self.params[name], transpose_y=True)

    def forward(self, tokens, states, cos, sin):
        """``[B, S, K]`` draft-vocabulary logits for rows ``tokens [B, S]`` with the previous
        positions' states ``[B, S, H]`` (row 0 of each sequence gets a zero state)."""
        return self.forward_depths(tokens, states, cos, sin, 1)[0]

    def forward_depths(self, tokens, states, cos, sin, depths: int) -> list:
        """The logits of substeps ``1 .. depths`` as the proposer chains them, teacher-forced.

        Depth 1 is :meth:`forward`. Depth ``d`` runs the row at position ``q`` from depth
        ``d - 1``'s output at ``q - 1`` and the token at ``q`` (the draft, when the drafts
        before it were right), and attends to what the proposer's cache holds then: depth 1's
        rows up to ``q - d + 1``, then one row of each depth ``r`` (2 .. d) at ``q - d + r``.
        Every depth predicts the token after ``q``; rows ``q < d - 1`` have no such chain.
        """
        p = self.paddle
        B, S = tokens.shape
        embeds = self.target.embed(tokens.reshape([-1])).reshape([B, S, -1])
        logits, keys, values = [], [], []
        for depth in range(1, depths + 1):
            x, q, k, v = self._project(embeds, states, cos, sin)
            keys.append(k)
            values.append(v)
            x = x + self._attend(q, keys, values, depth)
            y = self._rms(x, self.params["post_attention_layernorm.weight"])
            gate = self._linear(y, "mlp.gate_proj.weight")
            x = x + self._linear(p.nn.functional.silu(gate) * self._linear(y, "mlp.up_proj.weight"),
                                 "mlp.down_proj.weight")
            logits.append(p.matmul(self._rms(x), self.head, transpose_y=True))
            states = _shifted(x, 1, axis=1)
        return logits

    def _project(self, embeds, states, cos, sin):
        """The layer's input ``x`` and its queries, keys and values (``[B, n, S, D]``, RoPE
        applied, queries scaled, keys and values repeated to the query heads)."""
        p, c, P = self.paddle, self.config, self.params
        B, S = embeds.shape[:2]
        x = self._linear(self._rms(embeds, P["enorm"]), "embed_proj") + \
            self._linear(self._rms(states, P["hnorm"]), "hidden_proj")
        y = self._rms(x, P["input_layernorm.weight"])
        d, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        q = self._linear(y, "self_attn.q_proj.weight") * (d ** -0.5)
        k = self._linear(y, "self_attn.k_proj.weight")
        v = self._linear(y, "self_attn.v_proj.weight")
        if "self_attn.q_proj.bias" in P:
            q = q + P["self_attn.q_proj.bias"] * (d ** -0.5)
            k, v = k + P["self_attn.k_proj.bias"], v + P["self_attn.v_proj.bias"]

        def heads(t, n):
            t = t.reshape([B, S, n, d])
            t_rot = t * cos + p.roll(t, shifts=d // 2, axis=-1) * sin
            return t_rot.transpose([0, 2, 1, 3])  # [B, n, S, d]

        q, k = heads(q, nh), heads(k, nkv)
        v = v.reshape([B, S, nkv, d]).transpose([0, 2, 1, 3])
        if nh != nkv:
            k = p.repeat_interleave(k, nh // nkv, axis=1)
            v = p.repeat_interleave(v, nh // nkv, axis=1)
        return x, q, k, v

    def _attend(self, q, keys, values, depth: int):
        """Depth ``depth``'s attention output ``[B, S, n * D]`` (see :meth:`forward_depths`)."""
        p = self.paddle
        B, n, S, d = q.shape
        # Depth 1's rows at positions j <= q - depth + 1.
        causal = p.triu(p.full([S, S], float("-inf")), diagonal=2 - depth)
        scores = [p.matmul(q, keys[0], transpose_y=True) + causal]
        shifted_values = []
        for r in range(2, depth + 1):  # one row of depth r, at q - (depth - r)
            shift = depth - r
            key, value = _shifted(keys[r - 1], shift, axis=2), _shifted(values[r - 1], shift, axis=2)
            missing = np.where(np.arange(S) < shift, -np.inf, 0.0).astype(np.float32)[:, None]
            scores.append((q * key).sum(axis=-1, keepdim=True) + p.to_tensor(missing))
            shifted_values.append(value)
        weights = p.nn.functional.softmax(p.concat(scores, axis=-1), axis=-1)
        attn = p.matmul(weights[..., :S], values[0])
        for i, value in enumerate(shifted_values):
            attn = attn + weights[..., S + i: S + i + 1] * value
        return self._linear(attn.transpose([0, 2, 1, 3]).reshape([B, S, n * d]), "self_attn.o_proj.weight")

    def weights(self) -> MtpLayerWeights:
        arrays = {name: self.params[name].numpy() for name in self.names}
        decoder = {name: arrays[name] for name in self.names[4:]}
        return MtpLayerWeights(enorm=arrays["enorm"], hnorm=arrays["hnorm"], embed_proj=arrays["embed_proj"],
                               hidden_proj=arrays["hidden_proj"], decoder=decoder)


def _shifted(x, shift: int, axis: int):
    """``x`` moved ``shift`` rows later along ``axis``: zeros in front, the last rows dropped."""
    if shift == 0:
        return x
    p = require_paddle()
    pad_shape = list(x.shape)
    pad_shape[axis] = shift
    kept = p.slice(x, axes=[axis], starts=[0], ends=[x.shape[axis] - shift])
    return p.concat([p.zeros(pad_shape, dtype=x.dtype), kept], axis=axis)


# --- training ---------------------------------------------------------------------------------


@attrs.define
class TrainOptions:
    """What ``specdec train-mtp`` takes besides the corpus (its flags, same names)."""

    output: Path
    draft_vocab_size: int = 8192
    seq_len: int = 256
    batch_size: int = 8
    learning_rate: float = 1e-3
    max_steps: int = 2000
    max_minutes: float = 30.0
    checkpoint_every: int = 100
    held_out: float = 0.05
    seed: int = 0
    resume: bool = False
    #: Substeps trained, chained as the proposer runs them (``forward_depths``); each adds the
    #: same distillation loss at its rows.
    num_model_steps: int = 1
    #: Start from this head (its weights and draft vocabulary) instead of a fresh one.
    init: Optional[Path] = None


def draft_vocabulary(sequences: list[RecordedSequence], size: int) -> np.ndarray:
    """The ``size`` most frequent labels (the target's own tokens), sorted by id."""
    counts = np.bincount(np.concatenate([s.labels for s in sequences]))
    size = min(size, int((counts > 0).sum()))
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


def _windows(sequences: list[RecordedSequence], seq_len: int) -> list[tuple[int, int]]:
    return [(i, start) for i, s in enumerate(sequences) for start in range(0, len(s.tokens) - 1, seq_len)]


def _batch(sequences, windows, seq_len, lookup, paddle, with_current: bool = False):
    """Padded ``tokens`` and previous ``states`` (paddle), ``targets`` (draft-vocabulary index,
    ``-1`` for padding or a label outside the draft vocabulary) and the ``real`` rows mask;
    with ``with_current`` also each row's own state (paddle), whose logits are the teacher's."""
    B, H = len(windows), sequences[0].states.shape[1]
    tokens = np.zeros((B, seq_len), np.int64)
    states = np.zeros((B, seq_len, H), np.float32)
    current = np.zeros((B, seq_len, H), np.float32) if with_current else None
    targets = np.full((B, seq_len), -1, np.int64)
    real = np.zeros((B, seq_len), bool)
    for row, (i, start) in enumerate(windows):
        s = sequences[i]
        end = min(start + seq_len, len(s.tokens))
        n = end - start
        tokens[row, :n] = s.tokens[start:end]
        if start > 0:
            states[row, :n] = s.states[start - 1: end - 1]
        else:  # position 0 has no state before it: zero, as the proposer does
            states[row, 1:n] = s.states[: n - 1]
        targets[row, :n] = lookup[s.labels[start:end]]
        real[row, :n] = True
        if with_current:
            current[row, :n] = s.states[start:end]
    batch = (paddle.to_tensor(tokens), paddle.to_tensor(states), targets, real)
    return batch + (paddle.to_tensor(current),) if with_current else batch


def evaluate(model: "TrainableMtp", sequences, windows, seq_len, lookup, cos, sin, batch_size=8,
             depths: int = 1) -> list[float]:
    """Per substep, how often the head's argmax is the target's own, teacher-forced (substep 1:
    first-position acceptance under greedy verification; substep ``d``: acceptance of draft
    ``d`` when the drafts before it were right). A label outside the draft vocabulary counts
    as a miss."""
    p = model.paddle
    right, total = np.zeros(depths), np.zeros(depths)
    with p.no_grad():
        for begin in range(0, len(windows), batch_size):
            part = windows[begin: begin + batch_size]
            tokens, states, targets, real = _batch(sequences, part, seq_len, lookup, p)
            rope = _rope_for(cos, sin, [start for _, start in part], seq_len, p)
            for depth, logits in enumerate(model.forward_depths(tokens, states, *rope, depths)):
                rows = real.copy()
                rows[:, :depth] = False
                guess = logits.argmax(axis=-1).numpy()
                right[depth] += int(((guess == targets) & rows & (targets >= 0)).sum())
                total[depth] += int(rows.sum())
    return (right / np.maximum(total, 1)).tolist()


def _rope_for(cos, sin, starts, seq_len, paddle):
    """``[B, S, 1, D]`` RoPE rows for windows starting at ``starts``."""
    index = np.asarray(starts)[:, None] + np.arange(seq_len)[None, :]
    return (paddle.to_tensor(cos[index][:, :, None, :]), paddle.to_tensor(sin[index][:, :, None, :]))


def train(sequences: list[RecordedSequence], target, config, options: TrainOptions, progress: bool = True) -> dict:
    """Train a head on ``sequences``; write it to ``options.output``; return the report."""
    paddle = require_paddle()
    paddle.seed(options.seed)
    rng = np.random.default_rng(options.seed)
    output = Path(options.output)
    output.mkdir(parents=True, exist_ok=True)
    order = rng.permutation(len(sequences))
    num_held = max(1, int(len(sequences) * options.held_out))
    held = [sequences[i] for i in order[:num_held]]
    train_set = [sequences[i] for i in order[num_held:]]
    checkpoint = read_checkpoint(output) if options.resume else None
    if checkpoint is not None:
        saved = {"step": checkpoint.step, "history": checkpoint.meta["history"]}
        vocab = np.asarray(checkpoint.meta["draft_vocab"], dtype=np.int64)
        init = _head_of(checkpoint, config)
    elif options.init is not None:
        init = load_mtp_layers(options.init, config.hidden_size)[0]
        if init.draft_vocab is None:
            raise SpecdecError(f"--init: {options.init} has no draft vocabulary")
        saved, vocab = {"step": 0, "history": []}, np.asarray(init.draft_vocab, dtype=np.int64)
    else:
        saved, vocab, init = {"step": 0, "history": []}, draft_vocabulary(train_set, options.draft_vocab_size), None
    lookup = np.full(config.vocab_size, -1, np.int64)
    lookup[vocab] = np.arange(len(vocab))
    model = TrainableMtp(config, target, vocab, init=init, seed=options.seed)
    params = [model.params[name] for name in model.names]
    schedule = paddle.optimizer.lr.LambdaDecay(options.learning_rate, lambda step: _lr_factor(step, options.max_steps))
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=params, weight_decay=0.0,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    if checkpoint is not None:
        optimizer.set_state_dict(_optimizer_state(checkpoint, model))
    cos, sin = rope_tables(config.head_dim, config.rope_theta, max(len(s.tokens) for s in sequences) + options.seq_len)
    train_windows, held_windows = _windows(train_set, options.seq_len), _windows(held, options.seq_len)
    step, started = saved["step"], time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=options.max_steps, initial=step, desc="train-mtp", unit="step", file=sys.stderr)
    loss_value = float("nan")
    while step < options.max_steps and (time.perf_counter() - started) < options.max_minutes * 60:
        picks = rng.choice(len(train_windows), size=min(options.batch_size, len(train_windows)), replace=False)
        windows = [train_windows[i] for i in picks]
        tokens, states, _, real, current = _batch(train_set, windows, options.seq_len, lookup, paddle,
                                                  with_current=True)
        rope = _rope_for(cos, sin, [s for _, s in windows], options.seq_len, paddle)
        loss = chained_loss(model, model.forward_depths(tokens, states, *rope, options.num_model_steps), current, real)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        step += 1
        loss_value = float(loss)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
        if step % options.checkpoint_every == 0:
            _checkpoint(model, optimizer, output, vocab, step, saved["history"] + [{"step": step, "loss": loss_value}])
    if bar is not None:
        bar.close()
    accuracy = evaluate(model, held, held_windows, options.seq_len, lookup, cos, sin, depths=options.num_model_steps)
    history = saved["history"] + [{"step": step, "loss": loss_value, "held_out_accuracy": accuracy}]
    _checkpoint(model, optimizer, output, vocab, step, history)
    return {"steps": step, "loss": loss_value, "held_out_first_position_acceptance": accuracy[0],
            "held_out_accuracy_per_substep": [round(a, 4) for a in accuracy],
            "held_out_positions": sum(len(s.tokens) for s in held), "train_positions": sum(len(s.tokens) for s in train_set),
            "draft_vocab_size": int(len(vocab)), "minutes": (time.perf_counter() - started) / 60}


def chained_loss(model: TrainableMtp, logits: list, current, real: np.ndarray):
    """The mean of :func:`distillation_loss` over the substeps' logits, each at the rows that
    have a chain (depth ``d`` starts at row ``d - 1``)."""
    losses = []
    for depth, depth_logits in enumerate(logits, start=1):
        rows = real.copy()
        rows[:, : depth - 1] = False
        losses.append(distillation_loss(model, depth_logits, current, rows))
    return sum(losses[1:], losses[0]) / len(losses)


def distillation_loss(model: TrainableMtp, logits, current, real: np.ndarray):
    """Cross-entropy of the head's distribution against the target's own at the same position
    (both over the draft vocabulary), averaged over the real rows: the whole distribution
    teaches more per position than its argmax alone."""
    p = model.paddle
    with p.no_grad():
        teacher = p.nn.functional.softmax(p.matmul(model._rms(current), model.head, transpose_y=True), axis=-1)
    # x - logsumexp(x): paddle's CPU log_softmax takes 20x longer on [2048, 8192].
    log_probs = logits - p.logsumexp(logits, axis=-1, keepdim=True)
    per_row = -(teacher * log_probs).sum(axis=-1)
    mask = p.to_tensor(real.astype(np.float32))
    return (per_row * mask).sum() / max(float(real.sum()), 1.0)


def _lr_factor(step: int, max_steps: int) -> float:
    warmup = max(1, min(50, max_steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, max_steps - warmup))))


def _checkpoint(model, optimizer, output: Path, vocab, step: int, history: list) -> None:
    """The trained head (``head.safetensors``, replaced atomically) and the checkpoint that
    ``--resume`` reads: float32 weights, the optimizer's tensors, and in the manifest's meta
    the draft vocabulary, the history and the learning-rate schedule's state."""
    _save_head_atomically(model.weights(), output / "head.safetensors", vocab)
    # Paddle names parameters by a process-wide counter: keep the optimizer's state under the
    # head's own names, so that another process can resume it.
    logical = {model.params[name].name: name for name in model.names}
    state = _renamed(optimizer.state_dict(), logical)
    schedule = state.pop("LR_Scheduler", None)
    parts = {"head": {name: model.params[name].numpy() for name in model.names},
             "optimizer": {key: np.asarray(value.numpy()) for key, value in state.items()}}
    meta = {"draft_vocab": vocab.tolist(), "history": history, "lr_scheduler": schedule,
            "hidden_size": int(model.config.hidden_size)}
    write_checkpoint(output, step, parts, meta)


def _save_head_atomically(weights: MtpLayerWeights, path: Path, vocab) -> None:
    """``save_mtp_layers`` to a temporary file, fsynced, then renamed over ``path``: a reader
    (or a kill) never sees half a head."""
    temp = path.with_name(f".tmp-{path.name}")
    save_mtp_layers([weights], temp, draft_vocab=vocab)
    with open(temp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)


def _head_of(checkpoint: Checkpoint, config) -> MtpLayerWeights:
    """The checkpoint's head weights, checked against the target (one-line errors)."""
    head = checkpoint.parts.get("head", {})
    if checkpoint.meta.get("hidden_size") != config.hidden_size:
        raise SpecdecError(f"--resume: the checkpoint is of hidden size {checkpoint.meta.get('hidden_size')}, "
                           f"the target's is {config.hidden_size}")
    missing = [name for name in ("enorm", "hnorm", "embed_proj", "hidden_proj") if name not in head]
    if missing or "optimizer" not in checkpoint.parts:
        raise SpecdecError(f"--resume: the checkpoint lacks {missing or ['the optimizer state']}")
    decoder = {name: value for name, value in head.items() if name not in ("enorm", "hnorm", "embed_proj", "hidden_proj")}
    return MtpLayerWeights(enorm=head["enorm"], hnorm=head["hnorm"], embed_proj=head["embed_proj"],
                           hidden_proj=head["hidden_proj"], decoder=decoder)


def _optimizer_state(checkpoint: Checkpoint, model: TrainableMtp) -> dict:
    """The checkpoint's optimizer state under this process's parameter names, as paddle wants it."""
    paddle = model.paddle
    state = {key: paddle.to_tensor(value) for key, value in checkpoint.parts["optimizer"].items()}
    if checkpoint.meta.get("lr_scheduler") is not None:
        state["LR_Scheduler"] = checkpoint.meta["lr_scheduler"]
    return _renamed(state, {name: model.params[name].name for name in model.names})


def _renamed(state: dict, names: dict[str, str]) -> dict:
    """``state`` with every key that starts with a key of ``names`` given its value instead."""
    renamed = {}
    for key, value in state.items():
        old = max((n for n in names if key.startswith(n + "_")), key=len, default=None)
        renamed[names[old] + key[len(old):] if old else key] = value
    return renamed


def read_corpus(paths: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(prompts, texts)``: each line of a ``.jsonl`` file is a prompt (a string, or an object
    with a ``prompt`` string); any other file is text."""
    prompts, texts = [], []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise SpecdecError(f"--corpus: {path} is not a file")
        if path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SpecdecError(f"--corpus: {path}:{number}: not JSON ({exc.msg})") from None
                prompt = item if isinstance(item, str) else item.get("prompt") if isinstance(item, dict) else None
                if not isinstance(prompt, str) or not prompt:
                    raise SpecdecError(f"--corpus: {path}:{number}: expected a string or {{\"prompt\": ...}}")
                prompts.append(prompt)
        else:
            texts.append(path.read_text(errors="replace"))
    return prompts, texts


# --- the command ------------------------------------------------------------------------------


def measure_acceptance(model: Optional[str], head: Path, prompts: list[str], num_model_steps: int, max_tokens: int,
                       progress: bool = False, llm=None) -> dict:
    """Greedy runs of ``mtp`` with ``head`` on ``prompts``: the mean acceptance length (tokens
    per step) and, per draft position ``i``, the share of drafting steps whose first ``i + 1``
    drafts were all accepted."""
    spec = {"method": "mtp", "model": str(head), "num_model_steps": num_model_steps, "adaptive_draft_length": False}
    if llm is None:
        llm = specdec.LLM(model, spec, progress=progress)
    else:  # an already loaded target (``model`` is then ignored)
        llm.set_speculative_config(spec)
    outputs = llm.generate(prompts, specdec.SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           use_chat_template=True)
    total = outputs[0].metrics
    for output in outputs[1:]:
        total = total + output.metrics
    accepted = np.zeros(num_model_steps)
    accepted[: len(total.accepted_per_position)] = total.accepted_per_position[:num_model_steps]
    return {"num_model_steps": num_model_steps, "prompts": len(prompts),
            "mean_acceptance_length": round(total.mean_acceptance_length, 3),
            "acceptance_per_position": (accepted / max(total.num_drafts, 1)).round(3).tolist()}


def train_mtp(model: Optional[str], corpus: list[str], options: TrainOptions, *, max_tokens: int = 256,
              window: int = 512, collect_batch: int = 32, report_prompts: int = 8, progress: bool = True) -> dict:
    """What ``specdec train-mtp`` does: collect (or reuse collected) data, train, report.
    ``model`` None is the engine's default model."""
    from specdec.tools import HiddenStateRecorder, load_recorded, save_recorded

    prompts, texts = read_corpus(corpus)
    if options.resume:
        read_checkpoint(options.output)  # a bad checkpoint fails before the target is loaded
    rng = np.random.default_rng(options.seed)
    rng.shuffle(prompts)
    held_prompts, train_prompts = prompts[:report_prompts], prompts[report_prompts:]
    output = Path(options.output)
    output.mkdir(parents=True, exist_ok=True)
    data_file = output / "data.npz"
    recorder = HiddenStateRecorder(model, collect_batch, progress=progress)
    if options.resume and data_file.exists():
        sequences = load_recorded(data_file)
    else:
        sequences = recorder.record(recorder.prompts(train_prompts, max_tokens) + recorder.texts(texts, window))
        if not sequences:
            raise SpecdecError("--corpus: nothing to train on (every text shorter than 8 tokens?)")
        save_recorded(sequences, data_file)
    report = train(sequences, recorder.context.target, recorder.context.model_config, options, progress=progress)
    if held_prompts:
        report["held_out_prompts"] = measure_acceptance(model, output / "head.safetensors", held_prompts,
                                                        num_model_steps=3, max_tokens=max_tokens, llm=recorder.llm)
    (output / "report.json").write_text(json.dumps(report, indent=2))
    return report

