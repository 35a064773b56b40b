"""The docs site's hook (docs/hooks.py): a link from a page to the repository's source becomes its
text on the site, which holds docs/ only; any other link stays, for ``mkdocs build --strict``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def render(markdown: str, page: str = "config.md") -> str:
    docs = ROOT / "docs"
    return hooks.on_page_markdown(markdown, page=SimpleNamespace(file=SimpleNamespace(abs_src_path=str(docs / page))),
                                  config={"docs_dir": str(docs)}, files=None)


def test_source_links_become_their_text():
    assert render("in [`core/config.py`](../core/config.py) and [README](../README.md#glossary).") == \
        "in `core/config.py` and README."
    assert render("[the cluster](../../core/cluster/)", page="benchmarks/serving.md") == "the cluster"


def test_other_links_stay():
    kept = ("[gone](../core/no_such_file.py) [page](methods.md#ngram) [up](../benchmarks.md) "
            "![plot](../core/config.py) [web](https://example.com/x.py)")
    assert render(kept, page="benchmarks/decode.md") == kept


def test_sphinx_roles_become_code():
    spec = importlib.util.spec_from_file_location("sphinx_roles", ROOT / "docs" / "sphinx_roles.py")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    assert roles.plain("a :class:`~specdec.errors.RequestError` from :func:`specdec.sdk.one_hot`, ``x``") == \
        "a `RequestError` from `specdec.sdk.one_hot`, ``x``"


def test_the_api_page_covers_the_public_api():
    """docs/api.md renders all of ``specdec.sdk`` and ``specdec.tools``; every other name of
    ``specdec.__all__`` needs its own ``:::`` entry there."""
    import specdec
    import specdec.sdk

    entries = {line.split()[1].rsplit(".", 1)[-1] for line in (ROOT / "docs" / "api.md").read_text().splitlines()
               if line.startswith("::: ")}
    assert {"sdk", "tools"} <= entries
    assert sorted(set(specdec.__all__) - set(specdec.sdk.__all__) - entries) == []
