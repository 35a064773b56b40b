"""``include_token_sources`` (docs/server.md, "Token sources"), and the playground's files and
model card, against the real server (ngram, greedy verification).

Each choice's ``token_sources`` cut its text into its tokens: put together, the entries of a
chunk are its text exactly, and a request's entries hold every generated token once (a token
that a chunk boundary cuts keeps its ``index`` in both parts). On the code-edit prompt ngram's
drafts are accepted, so some entries are ``draft``; with ``num_speculative_tokens: 0`` all are
``decode``.
"""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import API_KEY, MODEL_NAME, PROMPT, SPECULATIVE, serving

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
        "temperature": 0}
SOURCES = {"decode", "draft", "bonus"}


def _stream(server, path: str, body: dict) -> tuple[list[dict], dict]:
    """The content chunks of a streamed request with token sources, and its usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "include_token_sources": True}
    chunks = []
    with server.http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()[:500]
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    *content, last = chunks
    return [c for c in content if c["choices"]], last["usage"]


def _text(choice: dict) -> str:
    return choice["delta"].get("content") or "" if "delta" in choice else choice["text"]


def _check_entries(entries: list[dict], num_tokens: int) -> None:
    """Every generated token has entries, in order, under its index; parts of one token are adjacent."""
    assert all(set(e) == {"index", "text", "source"} and e["source"] in SOURCES for e in entries), entries[:3]
    indices = [e["index"] for e in entries]
    assert indices == sorted(indices)
    assert sorted(set(indices)) == list(range(num_tokens))


def test_streamed_chat_sources_are_its_text(server):
    chunks, usage = _stream(server, "/v1/chat/completions", CHAT)
    entries = []
    for chunk in chunks:
        [choice] = chunk["choices"]
        if "token_sources" not in choice:  # the opening chunk (role), and the finish chunk
            assert _text(choice) == ""
            continue
        assert "".join(e["text"] for e in choice["token_sources"]) == _text(choice)
        entries += choice["token_sources"]
    _check_entries(entries, usage["completion_tokens"])
    sources = [e["source"] for e in entries]
    assert "draft" in sources and "bonus" in sources, sources  # ngram drafted, and the target added
    assert sources.count("draft") == usage["speculative"]["num_accepted_tokens"]
    # The non-streamed response: the same tokens, text and sources, in one list.
    response = server.http.post("/v1/chat/completions", json={**CHAT, "include_token_sources": True}).json()
    [choice] = response["choices"]
    assert choice["token_sources"] == _merged(entries)
    assert "".join(e["text"] for e in choice["token_sources"]) == choice["message"]["content"]


def _merged(entries: list[dict]) -> list[dict]:
    """``entries`` with the parts of each token put back together."""
    merged = []
    for entry in entries:
        if merged and merged[-1]["index"] == entry["index"]:
            merged[-1] = {**merged[-1], "text": merged[-1]["text"] + entry["text"]}
        else:
            merged.append(dict(entry))
    return merged


def test_completion_sources_with_a_stop_string_and_without_speculation(server):
    """Completions too. A stop string holds text back, so chunk boundaries cut tokens; the
    tokens generated past the stop string keep entries (with no text). Without drafts every
    token is ``decode``."""
    plain = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    full = server.http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 5]
    assert len(stop) == 5 and stop.strip(), full
    body = {**plain, "stop": [stop], "speculative": {"num_speculative_tokens": 0}}
    chunks, usage = _stream(server, "/v1/completions", body)
    entries = []
    for chunk in chunks:
        [choice] = chunk["choices"]
        if "token_sources" in choice:
            assert "".join(e["text"] for e in choice["token_sources"]) == choice["text"]
            entries += choice["token_sources"]
        else:
            assert choice["text"] == ""
    _check_entries(entries, usage["completion_tokens"])
    assert len(entries) > len({e["index"] for e in entries})  # the held-back text cut some token in two
    assert {e["source"] for e in entries} == {"decode"}
    assert "".join(e["text"] for e in entries) == full[: full.index(stop)]
    response = server.http.post("/v1/completions", json={**body, "include_token_sources": True}).json()
    [choice] = response["choices"]
    assert "".join(e["text"] for e in choice["token_sources"]) == choice["text"] == full[: full.index(stop)]
    _check_entries(choice["token_sources"], response["usage"]["completion_tokens"])


def test_without_the_flag_there_are_no_sources(server):
    response = server.http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4}).json()
    assert "token_sources" not in response["choices"][0]
    with server.http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 4, "stream": True}) as stream:
        assert "token_sources" not in stream.read().decode()


def test_bad_or_refused_flag_is_a_400_naming_it(server):
    response = server.http.post("/v1/chat/completions", json={**CHAT, "include_token_sources": "yes"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "include_token_sources"
    with serving(server.engine_loop, hide_speculative_usage=True) as hidden:
        response = httpx.post(hidden.url + "/v1/chat/completions", json={**CHAT, "include_token_sources": True},
                              headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "include_token_sources", error
    assert "--hide-speculative-usage" in error["message"]


def test_the_model_card_names_the_method_and_k(server):
    [card] = server.http.get("/v1/models").json()["data"]
    assert card["speculative"] == {"method": SPECULATIVE["method"],
                                   "num_speculative_tokens": server.engine_loop.num_speculative_tokens}
    assert card["speculative"]["num_speculative_tokens"] > 0


def test_the_playground_files_are_public_offline_and_host_checked(server):
    """``/`` and its two files need no API key (the API they call does), name no other host
    (the page works offline; its CSP allows nothing else), and answer only to allowed hosts."""
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        page = anonymous.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        bodies = [page.text]
        for path, kind in (("/playground/playground.js", "text/javascript"), ("/playground/playground.css", "text/css"),
                           ("/playground/favicon.svg", "image/svg+xml")):
            response = anonymous.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
            assert path in page.text
            bodies.append(response.text)
        # (the icon's only URL is its SVG namespace, a name that is never fetched)
        bodies[-1] = bodies[-1].replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert not any(marker in body for body in bodies for marker in ("http:", "https:", "//cdn", "src=\"//"))
        assert anonymous.get("/playground/nothing.js").status_code == 404
        assert anonymous.get("/v1/models").status_code == 401
        rebound = anonymous.get("/", headers={"Host": "attacker.example"})
        assert rebound.status_code == 421, rebound.text
