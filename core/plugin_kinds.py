"""The one table of plugin kinds. The plugin manager's hooks and registries, the speculative
config's plugin keys and the engine's lookups are all derived from :data:`KINDS`."""

from __future__ import annotations

from typing import Optional

import attrs

from .attention import AttentionBackend
from .proposer import Proposer
from .verify import AcceptPolicy, VerifyStrategy


@attrs.frozen
class PluginKind:
    """One kind of plugin class.

    :ivar attr: the registry's name, an attribute of :class:`specdec.plugin_manager.Plugins`
        (``proposers``).
    :ivar label: how messages name one of them (``proposer``).
    :ivar base: the class every plugin of the kind subclasses.
    :ivar hook: the registration hook (a function of :mod:`specdec.hookspecs`).
    :ivar config_key: the configuration key that selects one by ``NAME`` (``method``).
    :ivar config_field: the :class:`specdec.SpeculativeConfig` field that holds the chosen
        plugin's structured ``Config``; ``None`` for a kind chosen in the engine config.
    """

    attr: str
    label: str
    base: type
    hook: str
    config_key: str
    config_field: Optional[str] = None

    @property
    def speculative(self) -> bool:
        """True for the kinds chosen in the speculative config (their Config keys sit there)."""
        return self.config_field is not None


#: The four kinds, in the order their hooks are called.
KINDS: tuple[PluginKind, ...] = (
    PluginKind("proposers", "proposer", Proposer, "specdec_register_proposers", "method", "method_config"),
    PluginKind("verify_strategies", "verify strategy", VerifyStrategy, "specdec_register_verify_strategies",
               "verify_strategy", "verify_config"),
    PluginKind("accept_policies", "accept policy", AcceptPolicy, "specdec_register_accept_policies",
               "accept_policy", "accept_config"),
    PluginKind("attention_backends", "attention backend", AttentionBackend, "specdec_register_attention_backends",
               "attention_backend"),
)
#: The kinds the speculative config chooses (method, verify strategy, accept policy).
SPECULATIVE_KINDS: tuple[PluginKind, ...] = tuple(kind for kind in KINDS if kind.speculative)
KINDS_BY_ATTR: dict[str, PluginKind] = {kind.attr: kind for kind in KINDS}
