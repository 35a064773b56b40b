"""MkDocs hook: a page's links to the repository's source (``[core/config.py](../core/config.py)``)
work on GitHub, where the whole tree is, but not on the site, which holds docs/ only. On the
site such a link becomes its text. A link to a file that does not exist is left as it is, for
``mkdocs build --strict`` to report."""

from __future__ import annotations

import re
from pathlib import Path

#: ``[text](../target)`` (not an image), with an optional ``#anchor``.
SOURCE_LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\((\.\./[^()\s#]*)(#[^()\s]*)?\)")


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    here = Path(page.file.abs_src_path).parent

    def unlink(match: re.Match) -> str:
        target = (here / match[2]).resolve()
        outside = target != docs and docs not in target.parents
        return match[1] if outside and target.exists() else match[0]

    return SOURCE_LINK.sub(unlink, markdown)
