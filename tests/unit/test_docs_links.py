"""Every relative link in README.md, CONTRIBUTING.md and docs/**/*.md resolves: the file exists and,
for ``file#anchor`` or ``#anchor``, the file has a heading with that GitHub-style anchor."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
#: ``[text](target)`` and ``![alt](target)``, with an optional title; ``[ref]: target`` definitions.
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^()\s]*)(?:\s+\"[^\"]*\")?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]\n]+\]:\s*(\S+)", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def prose(text: str) -> str:
    """``text`` without fenced code blocks (their ``#`` lines are not headings, their brackets
    not links)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation dropped (but
    ``-`` and ``_``), spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (a repeated one gets ``-1``, ``-2``, ... as on GitHub)."""
    text = prose(path.read_text(encoding="utf-8"))
    seen: Counter[str] = Counter()
    found = set(HTML_ID.findall(text))
    for heading in HEADING.findall(text):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def relative_links(path: Path) -> list[str]:
    """Link targets in ``path`` that point into the repository (not a URL, not in code)."""
    text = INLINE_CODE.sub("", prose(path.read_text(encoding="utf-8")))
    targets = LINK.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {file_part}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {file_part or 'this page'}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_slugs_follow_github():
    assert slug("One quantized matmul: `benchmarks/bench_quant_matmul.py`") == \
        "one-quantized-matmul-benchmarksbench_quant_matmulpy"
    assert slug("Weight formats, quantization") == "weight-formats-quantization"
    assert slug("specdec_verify(ctx, request)") == "specdec_verifyctx-request"
    assert slug("See [gpu.md](gpu.md) now") == "see-gpumd-now"


def test_the_check_catches_broken_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Title\n\n## Part one\n\n## Part one\n", encoding="utf-8")
    page.write_text("[a](other.md#part-one-1) [b](other.md#part-two) [c](missing.md) [d](#here)\n"
                    "[e](https://example.com/x.md) `[f](missing-in-code.md)` [h](other.md \"title\")\n\n"
                    "[ref]: missing-ref.md\n\n"
                    "```\n[g](missing-in-fence.md)\n# not a heading\n```\n\n# Here\n", encoding="utf-8")
    assert broken_links(page) == ["other.md#part-two: no heading with that anchor in other.md",
                                  "missing.md: no file missing.md", "missing-ref.md: no file missing-ref.md"]


#: ``docs/<page>.md`` or ``docs/<page>.md#<anchor>`` cited in code, a comment or a docstring.
CODE_REFERENCE = re.compile(r"docs/([\w/.-]+?\.md)(?:#([\w-]+))?")
SOURCES = [path for folder in ("core", "plugins", "kernels", "benchmarks", "training", "examples", "tests")
           for path in sorted((ROOT / folder).rglob("*"))
           if path.suffix in {".py", ".cc", ".h", ".inc", ".sh"} and path.is_file()]


def test_code_references_to_docs_resolve():
    broken = []
    for path in SOURCES:
        for match in CODE_REFERENCE.finditer(path.read_text(encoding="utf-8", errors="replace")):
            page = ROOT / "docs" / match[1]
            if not page.exists() or (match[2] and match[2] not in anchors(page)):
                broken.append(f"{path.relative_to(ROOT)}: {match[0]}")
    assert broken == []
