"""``specdec bench --base-url`` and ``specdec chat --base-url`` against the real server of the
server tests (ngram, greedy verification): streamed chat completions with standard fields,
tokens and timings per request, and the acceptance per draft position from specdec's
``usage.speculative``."""

from __future__ import annotations

import io
import json
import sys

from server_harness import API_KEY, MODEL_NAME

from specdec.cli import main


def test_bench_against_specdec_serve_reads_usage_speculative(server, tmp_path, capsys):
    code = main(["bench", "--base-url", server.url, "--api-key", API_KEY, "--workload", "chat", "--num-prompts", "2",
                 "--max-tokens", "8", "--batch-sizes", "1,2", "--output-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["setup"]["model"] == MODEL_NAME and results["setup"]["cpu"]
    assert [(s["batch_size"], s["requests"]) for s in results["summaries"]] == [(1, 2), (2, 2)]
    for sample in results["samples"]:
        assert 1 <= sample["completion_tokens"] <= 8 and 0 < sample["ttft_s"] <= sample["elapsed_s"]
        assert sample["accepted_per_position"] is not None and sample["num_drafts"] is not None
    for summary in results["summaries"]:
        assert summary["mean_acceptance_length"] >= 1.0 and summary["throughput_tokens_per_s"] > 0
        rates = summary["acceptance_per_position"]
        assert rates is not None and all(0.0 <= r <= 1.0 for r in rates)
        assert rates == sorted(rates, reverse=True)  # token i+1 is accepted only after token i
    assert MODEL_NAME in out and "n/a" not in out.split("thru:")[0]
    for name in ("tokens_per_s.png", "acceptance_per_position.png", "batch_scaling.png"):
        assert (tmp_path / name).stat().st_size > 1000
    server.wait_idle()


def test_chat_against_specdec_serve(server, monkeypatch, capsys):
    """The chat's remote end, fed a script of lines on stdin: answers stream in, the stats line
    shows the server's acceptance, and /method says that a server's method is fixed."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/method naive\n/reset\nWhat is 2+2?\n"))
    monkeypatch.setenv("SPECDEC_API_KEY", API_KEY)
    assert main(["chat", "--base-url", server.url, "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    stats = [line for line in out.splitlines() if line.startswith("[")]
    assert len(stats) == 2, out
    assert all("tokens/s" in line and "acceptance length n/a" not in line and MODEL_NAME in line for line in stats)
    assert "error: /method: a server's method is set when it starts" in out
    assert "(conversation reset)" in out
    server.wait_idle()
