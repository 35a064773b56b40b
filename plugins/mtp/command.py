"""``specdec train-mtp``: the mtp plugin's command (docs/methods.md#specdec-train-mtp), added to
the command line through the ``specdec_register_commands`` hook."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.sdk import SpecdecError

#: The numeric flags: (flag, type, default, help).
TRAIN_FLAGS = (
    ("--max-tokens", int, 256, "response tokens per prompt when the target answers the corpus's prompts"),
    ("--window", int, 512, "tokens per window when reading text files"),
    ("--collect-batch", int, 32, "requests at once while collecting"),
    ("--draft-vocab-size", int, 8192, "the head drafts among this many most frequent tokens"),
    ("--seq-len", int, 256, "training sequence length"),
    ("--batch-size", int, 8, "sequences per training step"),
    ("--learning-rate", float, 1e-3, "peak learning rate (AdamW, warm-up then cosine)"),
    ("--max-steps", int, 2000, "training steps"),
    ("--max-minutes", float, 30.0, "stop training after this many minutes"),
    ("--checkpoint-every", int, 100, "steps between checkpoints"),
    ("--held-out", float, 0.05, "share of sequences kept out of training for the accuracy report"),
    ("--report-prompts", int, 8, "prompts kept out to measure acceptance with the engine at the end"),
    ("--seed", int, 0, "seed of the split, the batches and the initial weights"),
    ("--num-model-steps", int, 1, "substeps trained, chained as the mtp proposer runs them (1 to 8)"),
)
#: The flags that may be 0 (the others must be >= 1, or > 0 for a float).
_MAY_BE_ZERO = ("--report-prompts", "--seed", "--max-steps")


def add_train_command(subcommands) -> None:
    """``train-mtp`` on the ``specdec`` command line."""
    train = subcommands.add_parser("train-mtp", help="train an MTP head for a target model on local text (CPU)")
    train.add_argument("--model", default=None, help="the target model (default: the default model)")
    train.add_argument("--corpus", nargs="+", required=True,
                       help="text files, and/or .jsonl files of prompts the target answers (one per line)")
    train.add_argument("--output", required=True, help="directory for head.safetensors, checkpoints and the report")
    for flag, kind, default, text in TRAIN_FLAGS:
        train.add_argument(flag, type=kind, default=default, help=text)
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint and data in --output (its "
                       "checkpoint.json hashes are verified; a pickle or a changed file is refused)")
    train.add_argument("--init", default=None, help="start from this head (weights and draft vocabulary), "
                                                      "e.g. to train more substeps of a trained head")
    train.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars")
    train.set_defaults(func=run_train_mtp)


def check_train_args(args) -> None:
    """One-line errors for flag values out of range."""
    for flag, kind, _, _ in TRAIN_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if flag == "--held-out" and not 0 <= value < 1:
            raise SpecdecError(f"{flag}: must be in [0, 1), got {value}")
        if kind is float and flag != "--held-out" and not value > 0:
            raise SpecdecError(f"{flag}: must be > 0, got {value}")
        low = 0 if flag in _MAY_BE_ZERO else 1
        if kind is int and value < low:
            raise SpecdecError(f"{flag}: must be >= {low}, got {value}")
    if args.num_model_steps > 8:
        raise SpecdecError(f"--num-model-steps: must be between 1 and 8, got {args.num_model_steps}")
    if args.init is not None and not Path(args.init).exists():
        raise SpecdecError(f"--init: no such file: {args.init}")


def run_train_mtp(args) -> int:
    """Collect, train and report (:func:`specdec.plugins.mtp.train.train_mtp`); print the report."""
    from .train import TrainOptions, train_mtp

    check_train_args(args)
    options = TrainOptions(output=Path(args.output), draft_vocab_size=args.draft_vocab_size, seq_len=args.seq_len,
                           batch_size=args.batch_size, learning_rate=args.learning_rate, max_steps=args.max_steps,
                           max_minutes=args.max_minutes, checkpoint_every=args.checkpoint_every,
                           held_out=args.held_out, seed=args.seed, resume=args.resume,
                           num_model_steps=args.num_model_steps, init=None if args.init is None else Path(args.init))
    report = train_mtp(args.model, args.corpus, options, max_tokens=args.max_tokens, window=args.window,
                       collect_batch=args.collect_batch, report_prompts=args.report_prompts, progress=args.progress)
    print(json.dumps(report, indent=2))
    return 0
