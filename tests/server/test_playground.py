"""The playground (docs/server.md, "The playground") in a real headless browser: Debian's
``chromium``, driven by playwright, against the real server (ngram, greedy verification).

The page loads, reads the method and k, takes a prompt, streams the answer and colours each
token by how it came: the spans' text must be the API's answer to the same greedy request, with
tokens of at least two sources (ngram's drafts are accepted on the code-edit prompt). The
screenshot is left in the test's temporary folder (``--basetemp`` to keep it somewhere).
"""

from __future__ import annotations

import shutil

import pytest
from server_harness import API_KEY, MODEL_NAME, PROMPT

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
#: `make install-test` installs it (apt-get install chromium); playwright's own browser
#: download needs a CDN that CI cannot reach.
CHROMIUM = shutil.which("chromium")


@pytest.fixture(scope="module")
def browser():
    """Headless chromium (Debian's), through playwright."""
    if CHROMIUM is None:
        pytest.fail("Debian's chromium is not installed: `make install-test` installs it "
                    "(apt-get install chromium); the playground's test needs a real browser")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # (a container's /dev/shm is often too small for chromium's shared memory)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


def test_the_playground_streams_coloured_tokens(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1100, "height": 1000})
    problems = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("console", lambda message: message.type == "error" and problems.append(message.text))
    page.goto(server.url + "/")  # without the key /v1/models is a 401, and the page says so
    page.wait_for_selector("#server-info[data-state=error]", timeout=30_000)
    assert "API key" in page.text_content("#server-info")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_selector("#server-info[data-state=ready]", timeout=30_000)
    k = server.engine_loop.num_speculative_tokens
    assert page.text_content("#method") == "ngram"
    options = page.eval_on_selector_all("#num-speculative-tokens option", "options => options.map(o => o.value)")
    assert options == [str(i) for i in range(k + 1)] and page.input_value("#num-speculative-tokens") == str(k)

    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#prompt", PROMPT)
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-state]:not([data-state=streaming])", timeout=180_000)
    assert page.get_attribute(".message.assistant", "data-state") == "done", page.text_content(".message.assistant")

    spans = page.eval_on_selector_all(
        ".message.assistant span.tok",
        "spans => spans.map(s => [s.className, s.textContent, getComputedStyle(s).backgroundColor])")
    colours = {}
    for class_name, _, colour in spans:
        colours.setdefault(class_name.removeprefix("tok tok-"), set()).add(colour)
    assert len(colours) >= 2 and "draft" in colours, colours
    assert set(colours) <= {"draft", "bonus", "decode"}
    assert all(len(c) == 1 for c in colours.values()) and len(set.union(*colours.values())) == len(colours)

    reference = server.http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
        "temperature": 0}).json()
    assert "".join(text for _, text, _ in spans) == reference["choices"][0]["message"]["content"]
    usage = reference["usage"]
    assert page.text_content("#stat-tokens") == str(usage["completion_tokens"])
    drafted = 100 * usage["speculative"]["num_accepted_tokens"] / usage["completion_tokens"]
    assert page.text_content("#stat-drafted") == f"{int(drafted + 0.5)} %"  # counted live from the sources
    assert page.eval_on_selector_all("#acceptance-table tr", "rows => rows.length") >= 1

    screenshot = tmp_path / "playground.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and screenshot.stat().st_size > 10_000
    assert [p for p in problems if "401 (Unauthorized)" not in p] == [], problems  # the 401 is logged, as expected
    page.close()
