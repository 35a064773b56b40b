"""Registries of named classes (proposers, verify strategies, accept policies, attention backends).

A registry refuses a second class under a name already taken and names both providers; an
unknown name lists what is installed, with a did-you-mean.
"""

from __future__ import annotations

from typing import Iterator

from .errors import PluginError, did_you_mean


class Registry:
    """Named classes of one kind, each remembered with the plugin that provided it."""

    def __init__(self, kind: str):
        #: Human name of the kind, e.g. ``"proposer"`` or ``"verify strategy"``.
        self.kind = kind
        self._classes: dict[str, type] = {}
        self._providers: dict[str, str] = {}

    def register(self, cls: type, provider: str) -> None:
        """Add ``cls`` under ``cls.NAME``; ``provider`` names the plugin (for error messages)."""
        name = getattr(cls, "NAME", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{provider}: {self.kind} class {cls.__qualname__} has no NAME")
        if name in self._classes:
            raise PluginError(
                f"{self.kind} '{name}' is registered twice: by {self._providers[name]} "
                f"({self._classes[name].__qualname__}) and by {provider} ({cls.__qualname__})"
            )
        self._classes[name] = cls
        self._providers[name] = provider

    def get(self, name: str, key: str = "") -> type:
        """Return the class registered as ``name``; ``key`` prefixes the error (a config path)."""
        try:
            return self._classes[name]
        except (KeyError, TypeError):
            prefix = f"{key}: " if key else ""
            installed = ", ".join(sorted(self._classes)) or "none"
            raise PluginError(
                f"{prefix}unknown {self.kind} '{name}'{did_you_mean(name, self._classes)}; "
                f"installed: {installed}"
            ) from None

    def provider(self, name: str) -> str:
        return self._providers[name]

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._classes))

    def __len__(self) -> int:
        return len(self._classes)
