"""Griffe extension for the API page (docs/api.md): the docstrings are written for Sphinx, with
roles such as :class:`~specdec.errors.RequestError`, which Markdown would show as they are. Each
becomes inline code of the name (its last part where the role has ``~``, as Sphinx shows it)."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def plain(text: str) -> str:
    return ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
