"""``specdec bench`` without a model: its workloads (built-ins, JSONL, ShareGPT JSON), its
one-line errors, and the client against a server that is not specdec.

llama-server is not built in CI (docs/benchmarks.md records a run against the real one), so a
minimal real HTTP server (the standard library's) stands in for it, answering as llama-server
does: the model named by the path it was started with, OpenAI's streaming chat format, a final
``usage`` chunk without ``usage.speculative`` (or, like older servers, no usage at all). The
bench must then send that name, show the file's name alone, count the tokens itself, report
acceptance as n/a, and still write results.json and the plots. It also checks that the client
sends only standard OpenAI fields.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdec.bench.prompts import load_workload
from specdec.bench_cli import parse_batch_sizes
from specdec.cli import main

#: The request fields of OpenAI's chat completions API that the bench may send (ignore_eos
#: only with --ignore-eos).
STANDARD_FIELDS = {"model", "messages", "max_tokens", "temperature", "stream", "stream_options"}
PIECES = ["Hello", ",", " world", "!"]
#: llama-server's model id: the path given to -m.
MODEL_ID = "/srv/models/llama-test.Q4_1.gguf"


class OpenAIStreamHandler(BaseHTTPRequestHandler):
    """``GET /v1/models`` and streamed ``POST /v1/chat/completions``, as llama-server answers."""

    send_usage = True
    bodies: list = []

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        if self.path != "/v1/models":
            self.send_error(404)
            return
        self._reply("application/json", json.dumps({"object": "list", "data": [{"id": MODEL_ID}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
        events += [{**chunk, "choices": [{"index": 0, "delta": {"content": piece}}]} for piece in PIECES]
        events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if self.send_usage:
            events.append({**chunk, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": len(PIECES),
                                                              "total_tokens": 9 + len(PIECES)}})
        stream = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
        self._reply("text/event-stream", stream.encode())

    def _reply(self, content_type: str, payload: bytes):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(params=[True, False], ids=["usage-without-speculative", "no-usage"])
def llama_like_server(request):
    handler = type("Handler", (OpenAIStreamHandler,), {"send_usage": request.param, "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_bench_against_a_server_without_speculative_usage(llama_like_server, tmp_path, capsys):
    url, handler = llama_like_server
    code = main(["bench", "--base-url", url, "--num-prompts", "2", "--max-tokens", "8", "--batch-sizes", "1,2",
                 "--workload", "chat", "--output-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["setup"]["model"] == MODEL_ID and results["setup"]["target"] == url + "/v1"
    assert [(s["method"], s["batch_size"], s["requests"]) for s in results["summaries"]] == [
        ("llama-test.Q4_1.gguf", 1, 2), ("llama-test.Q4_1.gguf", 2, 2)]
    for summary in results["summaries"]:
        assert summary["tokens"] == 2 * len(PIECES)  # from usage, or counted chunk by chunk
        assert summary["mean_acceptance_length"] is None and summary["acceptance_per_position"] is None
    assert "n/a" in out and "llama-test.Q4_1.gguf" in out and "/srv/models" not in out
    for name in ("tokens_per_s.png", "acceptance_per_position.png", "batch_scaling.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # warm-up + 2 requests per batch size, each with standard fields only
    assert len(handler.bodies) == 5
    assert all(set(body) <= STANDARD_FIELDS for body in handler.bodies), handler.bodies
    assert handler.bodies[-1]["messages"][0]["role"] == "user" and handler.bodies[-1]["max_tokens"] == 8
    assert {body["model"] for body in handler.bodies} == {MODEL_ID}


def test_workloads_from_sharegpt_and_jsonl(tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "Hi"}]},
    ]))
    assert load_workload(str(sharegpt), 10) == [[{"role": "user", "content": "What is 2+2?"}],
                                                [{"role": "user", "content": "Hi"}]]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "one"}\n\n{"messages": [{"role": "system", "content": "s"}, '
                     '{"role": "user", "content": "two"}]}\n')
    assert load_workload(str(jsonl), 1) == [[{"role": "user", "content": "one"}]]
    assert load_workload(str(jsonl), 5)[1][1]["content"] == "two"
    assert len(load_workload("code-edit", 3)) == 3
    assert parse_batch_sizes("1,8,8") == [1, 8]


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "ok"}\n{"text": "no prompt"}\n', "line 2: expected"),
    ('{"prompt": "ok"}\nnot json\n', "line 2: invalid JSON"),
    ('[{"conversations": [{"from": "human"}]}, 5]', "item 2: expected"),
])
def test_a_bad_workload_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "workload.jsonl"
    path.write_text(content)
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--workload", str(path), "--no-plots",
                 "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --workload:") and message in err[0]


@pytest.mark.parametrize("flags, message", [
    (["--batch-sizes", "1,x"], "--batch-sizes: expected positive integers"),
    (["--num-prompts", "0"], "--num-prompts: must be >= 1"),
    (["--base-url", "http://127.0.0.1:9", "--methods", "ngram"], "against --base-url the method is the server's"),
    (["--base-url", "http://127.0.0.1:9", "--no-plots"], "cannot reach http://127.0.0.1:9/v1/models"),
    (["--methods", "ngram", "--speculative-config", '{"method": "suffix"}'], "not both"),
    (["--base-url", "http://127.0.0.1:9", "--output-dir", "/proc/no-such-dir"], "--output-dir: cannot create"),
])
def test_bad_bench_flags_are_one_line_and_exit_2(capsys, tmp_path, flags, message):
    assert main(["bench", "--output-dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_unknown_method_fails_before_the_model_loads(capsys, tmp_path):
    assert main(["bench", "--methods", "naive,nosuchmethod", "--no-plots", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --methods: unknown method 'nosuchmethod'; installed:"), err


def test_without_matplotlib_the_plots_say_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the plots need matplotlib: pip install 'paddle-specdec[bench]' (or --no-plots)"]
