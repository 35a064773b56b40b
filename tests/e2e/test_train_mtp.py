"""``specdec train-mtp`` end to end on a tiny corpus: it collects the target's own states,
trains, checkpoints, resumes, and writes a head the ``mtp`` method loads, whose acceptance
beats the same head untrained."""

from __future__ import annotations

import inspect
import json
import shutil
import textwrap

import pytest

from specdec.cli import main
from specdec.plugins.mtp.train import measure_acceptance
from specdec.plugins.mtp.weights import load_mtp_layers

pytestmark = pytest.mark.slow

PROMPTS = ["Write a Python function that reverses a string.", "Explain what a hash table is.",
           "Write a short story about a cat who learns to fly.", "Give three tips for writing clean code.",
           "Write a function to compute the factorial of n.", "Describe the water cycle."]


def train(corpus, output, *extra) -> dict:
    args = ["train-mtp", "--corpus", *corpus, "--output", str(output), "--max-tokens", "48", "--batch-size", "4",
            "--seq-len", "128", "--report-prompts", "0", "--checkpoint-every", "20", "--no-progress", *extra]
    assert main(args) == 0
    return json.loads((output / "report.json").read_text())


def test_train_mtp_beats_an_untrained_head_and_resumes(tmp_path, model_session, capsys):
    corpus = tmp_path / "prompts.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    code = tmp_path / "code.txt"
    code.write_text(inspect.getsource(textwrap))
    out = tmp_path / "head"
    report = train([str(corpus), str(code)], out, "--max-steps", "40")
    assert report["steps"] == 40 and report["train_positions"] > 1000
    assert 0 <= report["held_out_first_position_acceptance"] <= 1
    [layer] = load_mtp_layers(out / "head.safetensors", model_session.llm.engine.model_config.hidden_size)
    assert layer.draft_vocab is not None and len(layer.draft_vocab) == report["draft_vocab_size"]
    assert (out / "head.safetensors").stat().st_size < 10 * 2**20

    # The same data, no training step: the initial head.
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    shutil.copy(out / "data.npz", untrained / "data.npz")
    assert train([str(corpus), str(code)], untrained, "--max-steps", "0", "--resume")["steps"] == 0

    prompts = PROMPTS[:3]
    trained_rate = measure_acceptance(None, out / "head.safetensors", prompts, 1, 48)
    untrained_rate = measure_acceptance(None, untrained / "head.safetensors", prompts, 1, 48)
    assert trained_rate["acceptance_per_position"][0] > untrained_rate["acceptance_per_position"][0] + 0.05, \
        (trained_rate, untrained_rate)

    # --resume continues from the checkpoint: step 40 to 50, with the same draft vocabulary.
    resumed = train([str(corpus), str(code)], out, "--max-steps", "50", "--resume")
    assert resumed["steps"] == 50 and resumed["draft_vocab_size"] == report["draft_vocab_size"]
    history = json.loads((out / "checkpoint.json").read_text())["meta"]["history"]
    assert [h["step"] for h in history][-1] == 50 and any(h["step"] == 40 for h in history)

    # Substeps 2 and 3 trained on top of the trained head (--init), chained as the proposer runs them.
    chained = tmp_path / "chained"
    chained.mkdir()
    shutil.copy(out / "data.npz", chained / "data.npz")
    report = train([str(corpus), str(code)], chained, "--max-steps", "6", "--resume", "--init",
                   str(out / "head.safetensors"), "--num-model-steps", "3")
    assert report["steps"] == 6 and report["draft_vocab_size"] == resumed["draft_vocab_size"]
    first, second, third = report["held_out_accuracy_per_substep"]
    assert abs(first - report["held_out_first_position_acceptance"]) < 1e-3 and 0 <= third <= 1 and 0 <= second <= 1
    capsys.readouterr()


def test_bad_corpus_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n[1, 2]\n')
    assert main(["train-mtp", "--corpus", str(bad), "--output", str(tmp_path / "o"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == f'error: --corpus: {bad}:2: expected a string or {{"prompt": ...}}'
    assert main(["train-mtp", "--corpus", str(bad), "--output", str(tmp_path / "o"), "--held-out", "1"]) == 2
    assert "--held-out: must be in [0, 1), got 1.0" in capsys.readouterr().err
    assert main(["train-mtp", "--corpus", str(bad), "--output", str(tmp_path / "o"), "--num-model-steps", "9"]) == 2
    assert "--num-model-steps: must be between 1 and 8, got 9" in capsys.readouterr().err


def test_self_instructed_prompts_are_finished_distinct_user_turns(llm):
    """``training/mtp_corpus.py --self-instruct``: the target writes user messages from its
    chat template cut at the user's turn; each is a finished turn (no template token left in
    it), none repeats another, none names a topic of the benchmark's chat prompts."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "training" / "mtp_corpus.py"
    spec = importlib.util.spec_from_file_location("mtp_corpus", path)
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    llm.set_speculative_config(None)  # the session's engine: a test before may have left `greedy` verify on
    prompts = corpus.self_instruct(6, llm=llm, batch=12)
    assert len(prompts) == 6 and len(set(prompts)) == 6
    for prompt in prompts:
        assert 16 <= len(prompt) <= 600 and "<|im_" not in prompt and prompt == prompt.strip()
        assert not any(word in prompt.lower() for word in corpus.HELD_OUT_WORDS)
