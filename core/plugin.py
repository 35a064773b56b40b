"""What every plugin class shares, whatever its kind: a ``NAME``, an optional ``Config``, and
how the engine builds it.

The four kinds (:class:`specdec.Proposer`, :class:`specdec.VerifyStrategy`,
:class:`specdec.AcceptPolicy`, :class:`specdec.AttentionBackend`) subclass :class:`Plugin`;
their table is :data:`specdec.plugin_kinds.KINDS`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional


class Plugin:
    """Base of every plugin class.

    :cvar NAME: the name users write in their configuration (``"ngram"``, ``"rejection"``);
        unique within its kind.
    :cvar Config: optional attrs class of the plugin's own options. For the speculative kinds
        (proposer, verify strategy, accept policy) its fields are flat keys of
        ``--speculative-config`` next to the core keys, and the engine passes the structured
        instance as ``config``.

    The engine builds every plugin as ``cls(config, spec_config)``: ``config`` is the
    structured ``Config`` (``None`` when the class declares none) and ``spec_config`` the whole
    :class:`specdec.SpeculativeConfig` (``None`` for attention backends, which are built once
    per engine and outlive any one speculative config; their ``config`` is ``Config()``).
    """

    NAME: ClassVar[str] = ""
    Config: ClassVar[Optional[type]] = None

    def __init__(self, config: Any = None, spec_config: Any = None):
        self.config = config
        self.spec_config = spec_config
