"""Train Medusa heads for a target on CPU, by self-distillation, through specdec's public API.

    python -m specdec_plugin_medusa.train --prompts prompts.jsonl --output heads.safetensors
    python -m specdec_plugin_medusa.train --measure heads.safetensors     # acceptance only

1. **Collect.** The target answers the prompts itself (greedy, its chat template) through the
   public engine, and reads the texts; :class:`specdec.tools.HiddenStateRecorder` keeps every
   position's hidden state, and the target's own argmax there (the token a draft must equal to
   be accepted).
2. **Train.** Head ``k`` reads the normed state at position ``p`` and learns what the target
   predicts at ``p + k``, i.e. the token at ``p + k + 1`` of the target's greedy text: the loss
   is the cross-entropy against the target's whole distribution there, over a restricted
   vocabulary (the most frequent labels; the full 49152-row LM head is too slow to train
   through on CPU). At inference the heads use the target's full LM head.
3. **Report.** Per head, how often its full-vocabulary argmax equals the target's on held-out
   sequences, then the engine's acceptance per draft position on held-out prompts
   (``held_out_prompts.json``: prompts none of the training prompts are).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import attrs
import numpy as np

import specdec
from specdec.sdk import SpecdecError, require_paddle
from specdec.tools import HiddenStateRecorder, RecordedSequence, load_recorded, save_recorded

from .heads import MedusaHeads, save_heads

HELD_OUT_PROMPTS = Path(__file__).resolve().parent / "held_out_prompts.json"
DEFAULT_MODEL = "smollm2-135m-instruct"


# --- 1. collecting hidden states and labels ---------------------------------------------------


def text_requests(recorder: HiddenStateRecorder, texts: list[str], window: int,
                  max_text_tokens: Optional[int]) -> list[tuple[list[int], int]]:
    """:meth:`HiddenStateRecorder.texts`, cut to at most ``max_text_tokens`` tokens in all."""
    requests = []
    budget = max_text_tokens
    for ids, max_tokens in recorder.texts(texts, window):
        if budget is not None:
            if budget < 8:
                break
            ids, budget = ids[:budget], budget - len(ids[:budget])
        requests.append((ids, max_tokens))
    return requests


# --- 2. training ------------------------------------------------------------------------------


@attrs.define
class TrainOptions:
    num_heads: int = 3
    vocab_size: int = 8192
    batch_size: int = 512
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    max_steps: int = 600
    max_minutes: float = 10.0
    held_out: float = 0.05
    seed: int = 0


class _Positions:
    """Every position's normed state (``[N, H]`` float32) over the concatenated sequences, and
    for each the target's label and how many positions of its sequence follow it."""

    def __init__(self, sequences: list[RecordedSequence], gain: np.ndarray, eps: float):
        states = np.concatenate([s.states for s in sequences]).astype(np.float32)
        self.normed = states * (1.0 / np.sqrt(np.mean(states * states, axis=-1, keepdims=True) + eps)) * gain
        self.labels = np.concatenate([s.labels for s in sequences])
        #: positions of the same sequence after each position
        self.after = np.concatenate([np.arange(len(s.labels) - 1, -1, -1) for s in sequences])
        self.starts = np.flatnonzero(self.after >= 1)  # positions at least head 1 can learn from


def draft_vocabulary(labels: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent labels, sorted by id."""
    counts = np.bincount(labels)
    size = min(size, int((counts > 0).sum()))
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


class TrainableHeads:
    """The K residual blocks as one ``[H, K*H]`` matrix and a ``[K*H]`` bias, from zero."""

    def __init__(self, hidden_size: int, num_heads: int):
        paddle = require_paddle()
        self.paddle, self.H, self.K = paddle, hidden_size, num_heads
        zeros = paddle.nn.initializer.Constant(0.0)
        self.weight = paddle.create_parameter([hidden_size, num_heads * hidden_size], "float32",
                                              default_initializer=zeros)
        self.bias = paddle.create_parameter([num_heads * hidden_size], "float32", default_initializer=zeros)
        for param in (self.weight, self.bias):
            param.stop_gradient = False

    def forward(self, normed):
        """``[B, K, H]``: every head's output over normed states ``[B, H]``."""
        p = self.paddle
        y = p.nn.functional.silu(p.matmul(normed, self.weight) + self.bias).reshape([-1, self.K, self.H])
        return y + normed.unsqueeze(1)

    def heads(self, model: str = "") -> MedusaHeads:
        weight = self.weight.numpy().reshape(self.H, self.K, self.H).transpose(1, 2, 0)  # W_k [out, in]
        return MedusaHeads(np.ascontiguousarray(weight), self.bias.numpy().reshape(self.K, self.H), model)


def _lr_factor(step: int, max_steps: int) -> float:
    warmup = max(1, min(50, max_steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, max_steps - warmup))))


def train(sequences: list[RecordedSequence], target, options: TrainOptions, log=print) -> tuple[TrainableHeads, dict]:
    """Train ``options.num_heads`` heads on ``sequences`` with ``target`` (a
    :class:`specdec.TargetModel`); return them and a report."""
    paddle = require_paddle()
    paddle.seed(options.seed)
    rng = np.random.default_rng(options.seed)
    K = options.num_heads
    order = rng.permutation(len(sequences))
    num_held = max(1, int(len(sequences) * options.held_out))
    held = _Positions([sequences[i] for i in order[:num_held]], np.asarray(target.final_norm), target.rms_norm_eps)
    data = _Positions([sequences[i] for i in order[num_held:]], np.asarray(target.final_norm), target.rms_norm_eps)
    vocab = draft_vocabulary(data.labels, options.vocab_size)
    coverage = float(np.isin(data.labels, vocab).mean())
    log(f"training on {len(data.labels)} positions ({len(held.labels)} held out); vocabulary of {len(vocab)} "
        f"labels covers {coverage:.1%} of them")
    with paddle.no_grad():
        # [V', H]: the LM head's rows of the training vocabulary (the normed state already has the gain).
        vocab_head = paddle.gather(target.lm_head, paddle.to_tensor(vocab))
    heads = TrainableHeads(data.normed.shape[1], K)
    schedule = paddle.optimizer.lr.LambdaDecay(options.learning_rate, lambda s: _lr_factor(s, options.max_steps))
    optimizer = paddle.optimizer.AdamW(learning_rate=schedule, parameters=[heads.weight, heads.bias],
                                       weight_decay=options.weight_decay,
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    offsets = np.arange(1, K + 1)
    step, started, losses = 0, time.perf_counter(), []
    while step < options.max_steps and time.perf_counter() - started < options.max_minutes * 60:
        base = rng.choice(data.starts, size=options.batch_size, replace=False)
        valid = offsets[None, :] <= data.after[base][:, None]  # [B, K]: position p + k exists
        later = np.where(valid, base[:, None] + offsets[None, :], base[:, None])
        normed = paddle.to_tensor(data.normed[base])
        with paddle.no_grad():
            teacher_in = paddle.to_tensor(data.normed[later.reshape(-1)])
            teacher = paddle.nn.functional.softmax(paddle.matmul(teacher_in, vocab_head, transpose_y=True), axis=-1)
        logits = paddle.matmul(heads.forward(normed).reshape([-1, heads.H]), vocab_head, transpose_y=True)
        log_probs = logits - paddle.logsumexp(logits, axis=-1, keepdim=True)
        mask = paddle.to_tensor(valid.reshape(-1).astype(np.float32))
        loss = ((-(teacher * log_probs).sum(axis=-1)) * mask).sum() / float(valid.sum())
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        schedule.step()
        step += 1
        losses.append(float(loss))
        if step % 50 == 0:
            log(f"step {step}: loss {np.mean(losses[-50:]):.4f} ({time.perf_counter() - started:.0f} s)")
    minutes = (time.perf_counter() - started) / 60
    accuracy = evaluate(heads, held, target)
    log(f"held-out accuracy per head (full vocabulary): {accuracy}")
    return heads, {"steps": step, "minutes": round(minutes, 2), "loss": round(float(np.mean(losses[-50:])), 4),
                   "train_positions": int(len(data.labels)), "held_out_positions": int(len(held.labels)),
                   "vocab_size": int(len(vocab)), "vocab_coverage": round(coverage, 4),
                   "held_out_accuracy_per_head": accuracy}


def evaluate(heads: TrainableHeads, held: _Positions, target, chunk: int = 256) -> list[float]:
    """Per head ``k``: how often its argmax over the full vocabulary is the target's label at
    ``p + k`` (the first-position acceptance of that head alone, under greedy verification)."""
    p = heads.paddle
    right, total = np.zeros(heads.K), np.zeros(heads.K)
    offsets = np.arange(1, heads.K + 1)
    with p.no_grad():
        for start in range(0, len(held.starts), chunk):
            base = held.starts[start: start + chunk]
            x = heads.forward(p.to_tensor(held.normed[base])).reshape([-1, heads.H])
            guess = np.asarray(p.argmax(p.matmul(x, target.lm_head, transpose_y=True), axis=-1)).reshape(-1, heads.K)
            valid = offsets[None, :] <= held.after[base][:, None]
            labels = held.labels[np.where(valid, base[:, None] + offsets[None, :], base[:, None])]
            right += ((guess == labels) & valid).sum(axis=0)
            total += valid.sum(axis=0)
    return (right / np.maximum(total, 1)).round(4).tolist()


# --- 3. measuring acceptance with the engine --------------------------------------------------


def held_out_prompts() -> list[str]:
    """The shipped held-out prompts: 6 code edits and 6 chat prompts, none in the training set."""
    return json.loads(HELD_OUT_PROMPTS.read_text())


def measure_acceptance(llm, heads_path, prompts: list[str], *, max_tokens: int,
                       num_heads: Optional[int] = None) -> dict:
    """Greedy ``medusa`` on ``prompts`` (one ``generate`` call) with the heads at
    ``heads_path``: per draft position ``i``, the share of drafting steps whose first ``i + 1``
    drafts were all accepted, and the mean acceptance length (tokens per target step)."""
    spec = {"method": "medusa", "adaptive_draft_length": False}
    if heads_path is not None:  # else the heads that ship for the target
        spec["medusa_heads_path"] = str(heads_path)
    if num_heads:
        spec.update(medusa_num_heads=num_heads, num_speculative_tokens=num_heads)
    llm.set_speculative_config(spec)
    outputs = llm.generate(prompts, specdec.SamplingParams(max_tokens=max_tokens, temperature=0.0),
                           use_chat_template=True)
    total = outputs[0].metrics
    for output in outputs[1:]:
        total = total + output.metrics
    per_position = np.asarray(total.accepted_per_position, dtype=np.float64) / max(total.num_drafts, 1)
    return {"prompts": len(prompts), "max_tokens": max_tokens, "num_drafts": int(total.num_drafts),
            "acceptance_per_position": per_position.round(3).tolist(),
            "mean_acceptance_length": round(float(total.mean_acceptance_length), 3)}


# --- the command ------------------------------------------------------------------------------


def read_prompts(path: Path) -> list[str]:
    """A JSONL file (one string, or ``{"prompt": ...}``, a line) or a JSON list of strings."""
    text = Path(path).read_text()
    if Path(path).suffix == ".json":
        items = json.loads(text)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    prompts = [item if isinstance(item, str) else item.get("prompt") for item in items]
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise SpecdecError(f"--prompts: {path}: expected strings or {{\"prompt\": ...}} objects")
    return prompts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec_plugin_medusa.train", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target (default: %(default)s)")
    parser.add_argument("--prompts", type=Path, help="training prompts: JSONL (a string or {\"prompt\"} a line)")
    parser.add_argument("--text", type=Path, nargs="*", default=[], help="text files the target reads (prefill only)")
    parser.add_argument("--max-text-tokens", type=int, default=50000, help="at most this many tokens of --text")
    parser.add_argument("--output", type=Path, help="where to write the heads (.safetensors)")
    parser.add_argument("--data", type=Path, help="collected data (.npz): reused when it exists, else written")
    parser.add_argument("--measure", type=Path, metavar="HEADS",
                        help="only measure the acceptance of these heads on the held-out prompts")
    parser.add_argument("--eval-prompts", type=Path, help="held-out prompts (default: the package's 12)")
    parser.add_argument("--eval-max-tokens", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256, help="answer length collected per prompt")
    parser.add_argument("--collect-batch", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--max-minutes", type=float, default=10.0, help="training stops after this long")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    eval_prompts = read_prompts(args.eval_prompts) if args.eval_prompts else held_out_prompts()
    if args.measure is not None:
        llm = specdec.LLM(args.model, progress=False)
        report = measure_acceptance(llm, args.measure, eval_prompts, max_tokens=args.eval_max_tokens)
        print(json.dumps(report, indent=2))
        return 0
    if args.output is None or (args.prompts is None and (args.data is None or not args.data.exists())):
        parser.error("--output and --prompts (or an existing --data) are required to train")
    recorder = HiddenStateRecorder(args.model, args.collect_batch, progress=False)
    llm = recorder.llm
    if args.data is not None and args.data.exists():
        sequences = load_recorded(args.data)
        log(f"loaded {sum(len(s.labels) for s in sequences)} positions from {args.data}")
    else:
        prompts = read_prompts(args.prompts)
        overlap = set(prompts) & set(eval_prompts)
        if overlap:
            raise SpecdecError(f"--prompts: {len(overlap)} of the held-out prompts are in the training prompts")
        texts = [path.read_text(errors="replace") for path in args.text]
        sequences = recorder.record(recorder.prompts(prompts, args.max_tokens)
                                    + text_requests(recorder, texts, 512, args.max_text_tokens))
        log(f"collected {sum(len(s.labels) for s in sequences)} positions from {len(sequences)} sequences")
        if args.data is not None:
            save_recorded(sequences, args.data)
    collected = time.perf_counter() - started
    options = TrainOptions(num_heads=args.num_heads, vocab_size=args.vocab_size, batch_size=args.batch_size,
                           learning_rate=args.learning_rate, max_steps=args.max_steps, max_minutes=args.max_minutes,
                           seed=args.seed)
    heads, report = train(sequences, recorder.context.target, options, log=log)
    save_heads(heads.heads(args.model), args.output)
    report["collect_minutes"] = round(collected / 60, 2)
    report["total_minutes"] = round((time.perf_counter() - started) / 60, 2)
    log(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB)")
    report["held_out_prompts"] = measure_acceptance(llm, args.output, eval_prompts, max_tokens=args.eval_max_tokens)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
