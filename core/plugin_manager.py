"""The plugin manager: finds the plugins installed in the ``specdec`` entry-point group, loads
them with pluggy, and collects what they register into four :class:`~specdec.registry.Registry`
objects.

Built-ins (entry points of the ``paddle-specdec`` distribution itself) and third-party plugins travel
the very same path. ``SPECDEC_LOAD_PLUGINS`` chooses which third-party plugins load: unset means
all of them, a comma list names entry points or distributions, and an empty string means
built-ins only (the way out when a broken plugin gets in the way).

Loading never crashes on a bad plugin: a plugin that fails to import, a hook that raises, a
name registered twice, or a hook name with a typo each become one line in
:attr:`Plugins.errors`. "Fails" includes ``BaseException``: a plugin that calls ``sys.exit()``
or raises ``KeyboardInterrupt`` while it imports or registers is reported like any other
failure instead of ending the process (``specdec serve`` would otherwise exit before it
listens, with no word about which plugin did it). The engine raises them only where they matter: looking up a name that
two plugins registered raises the duplicate error, and :meth:`Plugins.check` refuses any error.
"""

from __future__ import annotations

import functools
import os
import re
from importlib import import_module, metadata
from typing import Callable, Iterable, Optional

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError, did_you_mean
from .plugin_kinds import KINDS, KINDS_BY_ATTR, PluginKind
from .registry import Registry

#: The pluggy project name, marker name and entry-point group.
ENTRY_POINT_GROUP = "specdec"
#: The distribution whose entry points are the built-ins (always loaded).
BUILTIN_DISTRIBUTION = "paddle-specdec"
#: Environment variable: comma list of third-party plugins to load ('' = built-ins only).
LOAD_PLUGINS_ENV = "SPECDEC_LOAD_PLUGINS"

#: The built-in plugins as ``(entry point name, module)``, used when specdec runs from a source
#: tree that was never installed (so no entry points exist). Keep in sync with
#: ``[project.entry-points.specdec]`` in pyproject.toml; a test checks it.
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("naive", "specdec.plugins.naive"),
    ("ngram", "specdec.plugins.ngram"),
    ("suffix", "specdec.plugins.suffix"),
    ("mtp", "specdec.plugins.mtp"),
    ("hybrid", "specdec.plugins.hybrid"),
    ("draft_model", "specdec.plugins.draft_model"),
    ("verify_greedy", "specdec.plugins.verify.greedy"),
    ("verify_topp", "specdec.plugins.verify.topp"),
    ("verify_target_match", "specdec.plugins.verify.target_match"),
    ("verify_rejection", "specdec.plugins.verify.rejection"),
    ("accept_normal", "specdec.plugins.accept.normal"),
    ("accept_all", "specdec.plugins.accept.accept_all"),
    ("reject_all", "specdec.plugins.accept.reject_all"),
    ("attention_paddle", "specdec.plugins.attention.paddle_backend"),
    ("attention_cpu", "specdec.plugins.attention.cpu_backend"),
    ("attention_triton", "specdec.plugins.attention.triton_backend"),
)


_FROM_ENV = object()


@attrs.define
class PluginInfo:
    """What ``specdec plugins`` reports about one plugin (one entry point).

    :ivar name: the entry point name, e.g. ``ngram``.
    :ivar module: the entry point value, e.g. ``specdec.plugins.ngram``.
    :ivar distribution: the distribution that declares it, e.g. ``specdec-plugin-lastn``.
    :ivar version: that distribution's version.
    :ivar registered: kind (``proposers``, ``verify_strategies``, ...) -> names it registered.
    :ivar error: why the plugin (or part of it) failed, one line; ``None`` when all went well.
    :ivar builtin: True for the entry points of the ``paddle-specdec`` distribution itself.
    """

    name: str
    module: str
    distribution: str
    version: str
    registered: dict[str, list[str]] = attrs.field(factory=lambda: {kind.attr: [] for kind in KINDS})
    error: Optional[str] = None
    builtin: bool = False

    @property
    def provider(self) -> str:
        """How error messages name this plugin: ``plugin 'ngram' (specdec 0.1.0)``."""
        return f"plugin '{self.name}' ({self.distribution} {self.version})"

    def add_error(self, message: str) -> None:
        self.error = message if self.error is None else f"{self.error}; {message}"


class PluginRegistry(Registry):
    """A :class:`Registry` that knows how loading went, so that looking a name up raises the
    right one-line error: a name two plugins registered raises the duplicate error (naming
    both providers), and an unknown name also names the plugins that had errors, since the
    name may live in one of them."""

    def __init__(self, kind: str):
        super().__init__(kind)
        #: name -> the duplicate-name error, for names that two plugins registered.
        self.conflicts: dict[str, str] = {}
        #: Entry-point names of the plugins that had errors while loading.
        self.broken: list[str] = []

    def get(self, name: str, key: str = "") -> type:
        """Return the class registered as ``name``; ``key`` prefixes errors (a config path)."""
        if isinstance(name, str) and name in self.conflicts:
            raise PluginError((f"{key}: " if key else "") + self.conflicts[name])
        try:
            return super().get(name, key)
        except PluginError as exc:
            if not self.broken:
                raise
            names = ", ".join(f"'{n}'" for n in self.broken)
            raise PluginError(f"{exc}; plugins with errors: {names} (see `specdec plugins`)") from None


class Plugins:
    """Everything the installed plugins registered, plus what went wrong while loading them.

    One :class:`PluginRegistry` per kind of :data:`specdec.plugin_kinds.KINDS`, reachable as
    an attribute named after the kind: ``plugins.proposers``, ``plugins.verify_strategies``,
    ``plugins.accept_policies``, ``plugins.attention_backends``.
    """

    def __init__(self, manager: Optional[pluggy.PluginManager] = None):
        self.registries: dict[str, PluginRegistry] = {kind.attr: PluginRegistry(kind.label) for kind in KINDS}
        #: One entry per plugin (entry point) that was selected to load.
        self.infos: list[PluginInfo] = []
        #: One line per problem: a plugin that failed to load, a hook that raised, a duplicate name.
        self.errors: list[str] = []
        #: The pluggy manager the plugins were loaded into (for hooks added later, and tracing).
        self.manager = manager

    def __getattr__(self, name: str) -> PluginRegistry:
        registries = self.__dict__.get("registries", {})
        if name in registries:
            return registries[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def registry(self, kind: str) -> PluginRegistry:
        """The registry of ``kind``: ``proposers``, ``verify_strategies``, ... ."""
        if kind not in KINDS_BY_ATTR:
            raise ValueError(f"unknown registry kind {kind!r}; expected one of {sorted(KINDS_BY_ATTR)}")
        return self.registries[kind]

    def get(self, kind: str, name: str, key: str = "") -> type:
        """Return the class registered as ``name`` in the registry ``kind`` (``proposers``, ...).

        Raises a one-line :class:`PluginError` when two plugins registered ``name`` (naming
        both) or when nothing did (listing what is installed, with a did-you-mean, and the
        plugins that had errors). ``key`` prefixes the message with the config path, e.g.
        ``--speculative-config.method``. ``plugins.proposers.get(name)`` does the same.
        """
        return self.registry(kind).get(name, key)

    def check(self) -> None:
        """Raise the first loading error as a :class:`PluginError` (for strict callers)."""
        if self.errors:
            more = len(self.errors) - 1
            suffix = f" (and {more} more; see `specdec plugins`)" if more else ""
            raise PluginError(self.errors[0] + suffix)

    def record_error(self, info: Optional[PluginInfo], message: str) -> None:
        """Remember one problem, against ``info`` when it concerns one plugin."""
        self.errors.append(message)
        if info is not None:
            info.add_error(message)


# ---------------------------------------------------------------------------------------------
# Finding the entry points


def normalize_name(name: str) -> str:
    """PEP 503 normalization, so ``Specdec_Plugin.Lastn`` matches ``specdec-plugin-lastn``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _distribution_of(entry_point: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "unknown", "unknown"
    return dist.metadata["Name"] or dist.name, dist.version


def _info_for(entry_point: metadata.EntryPoint) -> PluginInfo:
    distribution, version = _distribution_of(entry_point)
    return PluginInfo(
        name=entry_point.name,
        module=entry_point.value,
        distribution=distribution,
        version=version,
        builtin=normalize_name(distribution) == BUILTIN_DISTRIBUTION,
    )


def _default_plugin_infos() -> list[tuple[PluginInfo, Callable[[], object]]]:
    """The built-ins from :data:`DEFAULT_PLUGINS`, for a source tree without entry points."""
    from . import __version__

    return [
        (
            PluginInfo(name=name, module=module, distribution=BUILTIN_DISTRIBUTION,
                       version=__version__, builtin=True),
            functools.partial(import_module, module),
        )
        for name, module in DEFAULT_PLUGINS
    ]


def _wanted_names(load) -> Optional[set[str]]:
    """The normalized names ``SPECDEC_LOAD_PLUGINS`` asks for; ``None`` means every plugin."""
    if load is _FROM_ENV:
        load = os.environ.get(LOAD_PLUGINS_ENV)
    if load is None:
        return None
    return {normalize_name(part.strip()) for part in load.split(",") if part.strip()}


def _load_order(entry_point: metadata.EntryPoint) -> tuple[bool, str, str]:
    distribution, _ = _distribution_of(entry_point)
    normalized = normalize_name(distribution)
    return normalized != BUILTIN_DISTRIBUTION, normalized, entry_point.name


def _select(entry_points: Iterable[metadata.EntryPoint], load, plugins: Plugins):
    """Pick the entry points to load: every built-in, and the third-party ones ``load`` allows.

    Returns ``(info, loader)`` pairs, built-ins first, then by distribution and name (so the
    plugin that keeps a contested name does not depend on directory order); names in ``load``
    that match nothing become errors.
    """
    wanted = _wanted_names(load)
    chosen, seen_names = [], set()
    for entry_point in sorted(entry_points, key=_load_order):
        info = _info_for(entry_point)
        names = {normalize_name(info.name), normalize_name(info.distribution)}
        seen_names |= names
        if info.builtin or wanted is None or names & wanted:
            chosen.append((info, entry_point.load))
    if not any(info.builtin for info, _ in chosen):
        chosen = _default_plugin_infos() + chosen
        seen_names |= {normalize_name(name) for name, _ in DEFAULT_PLUGINS}
    for name in sorted((wanted or set()) - seen_names):
        plugins.record_error(None, f"{LOAD_PLUGINS_ENV} names '{name}', which is not an installed "
                                   f"plugin{did_you_mean(name, seen_names)}")
    return chosen


# ---------------------------------------------------------------------------------------------
# Loading


def exception_line(exc: BaseException) -> str:
    """``ImportError: No module named 'x'``: the exception on one line."""
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_and_register(pm: pluggy.PluginManager, info: PluginInfo, loader, plugins: Plugins):
    """Import one plugin and register it with pluggy; return the module, or None on failure."""
    try:
        module = loader()
        pm.register(module, name=info.name)
    except BaseException as exc:  # noqa: BLE001 - even sys.exit() in a plugin must not end the process
        plugins.record_error(info, f"{info.provider} failed to load: {exception_line(exc)}")
        return None
    return module


def _report_unknown_hooks(pm: pluggy.PluginManager, info: PluginInfo, module, plugins: Plugins):
    """Per-plugin version of ``pm.check_pending()``: a hookimpl with no matching hookspec (a
    typo such as ``specdec_register_proposer``) becomes an error line for that plugin."""
    known = [kind.hook for kind in KINDS] + [COMMANDS_HOOK]
    for caller in pm.get_hookcallers(module) or []:
        if caller.has_spec():
            continue
        impls = [impl for impl in caller.get_hookimpls() if impl.plugin is module]
        if any(not impl.optionalhook for impl in impls):
            plugins.record_error(info, f"{info.provider} implements unknown hook "
                                       f"'{caller.name}'{did_you_mean(caller.name, known)}")


def _register_callable(kind: PluginKind, info: PluginInfo, plugins: Plugins) -> Callable[[type], None]:
    """The ``register`` a plugin receives for ``kind``: adds a class and records its provider.

    A bad class or a duplicate name becomes an error line (the first registration is kept)
    instead of an exception, so the plugin's other classes still register.
    """
    registry = plugins.registry(kind.attr)

    def register(cls) -> None:
        if not (isinstance(cls, type) and issubclass(cls, kind.base)):
            plugins.record_error(info, f"{info.provider} registered {cls!r} as a {kind.label}, "
                                       f"but it is not a subclass of specdec.{kind.base.__name__}")
            return
        try:
            registry.register(cls, info.provider)
        except PluginError as exc:
            if cls.NAME in registry:
                registry.conflicts.setdefault(cls.NAME, str(exc))
            plugins.record_error(info, str(exc))
            return
        info.registered[kind.attr].append(cls.NAME)

    return register


def _call_hooks(pm: pluggy.PluginManager, loaded: list[tuple[PluginInfo, object]], plugins: Plugins):
    """Call each registration hook plugin by plugin, in load order, so each ``register`` knows
    its provider and the first plugin to register a name keeps it."""
    modules = [module for _, module in loaded]
    for kind in KINDS:
        for info, module in loaded:
            others = [other for other in modules if other is not module]
            caller = pm.subset_hook_caller(kind.hook, remove_plugins=others)
            try:
                caller(register=_register_callable(kind, info, plugins))
            except BaseException as exc:  # noqa: BLE001 - a hook, even sys.exit(), must not take down the others
                plugins.record_error(info, f"{info.provider} failed in {kind.hook}: {exception_line(exc)}")


def load_plugins(load=_FROM_ENV, entry_points: Optional[Iterable[metadata.EntryPoint]] = None) -> Plugins:
    """Load the plugins and return what they registered.

    :param load: which third-party plugins to load: ``None`` for all, or a comma list of entry
        point or distribution names (``""`` = built-ins only). Defaults to the value of
        ``SPECDEC_LOAD_PLUGINS`` (unset = all). Built-ins always load.
    :param entry_points: the entry points to consider; defaults to the installed ones of group
        ``specdec``. When none of them belongs to the ``paddle-specdec`` distribution (a source tree
        that was never installed), the built-ins come from :data:`DEFAULT_PLUGINS`.
    """
    if entry_points is None:
        entry_points = metadata.entry_points(group=ENTRY_POINT_GROUP)
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    plugins = Plugins(manager=pm)

    loaded = []
    for info, loader in _select(entry_points, load, plugins):
        plugins.infos.append(info)
        module = _import_and_register(pm, info, loader, plugins)
        if module is not None:
            loaded.append((info, module))
    for info, module in loaded:
        _report_unknown_hooks(pm, info, module, plugins)
    _call_hooks(pm, loaded, plugins)
    broken = [info.name for info in plugins.infos if info.error is not None]
    for kind in KINDS:
        plugins.registry(kind.attr).broken = broken
    return plugins


#: The hook through which plugins add ``specdec`` subcommands.
COMMANDS_HOOK = "specdec_register_commands"


def register_commands(plugins: Plugins, subcommands) -> None:
    """Let each loaded plugin add its subcommands to ``subcommands`` (argparse sub-parsers),
    plugin by plugin, in load order. A hook that raises (a subcommand name already taken, say)
    becomes an error line of that plugin; the command line works on without its commands."""
    if plugins.manager is None:
        return
    by_name = {info.name: info for info in plugins.infos}
    for name, module in plugins.manager.list_name_plugin():
        if module is None:
            continue
        info = by_name.get(name)
        others = [other for other in plugins.manager.get_plugins() if other is not module]
        caller = plugins.manager.subset_hook_caller(COMMANDS_HOOK, remove_plugins=others)
        try:
            caller(subcommands=subcommands)
        except BaseException as exc:  # noqa: BLE001 - a plugin's failure (even sys.exit()) must not take the CLI down
            provider = info.provider if info is not None else f"plugin '{name}'"
            message = f"{provider} failed in {COMMANDS_HOOK}: {exception_line(exc)}"
            if message not in plugins.errors:  # the parser may be built more than once
                plugins.record_error(info, message)


@functools.cache
def get_plugins() -> Plugins:
    """The process-wide plugins, loaded on first use (honouring ``SPECDEC_LOAD_PLUGINS``)."""
    return load_plugins()


def reset_plugins() -> None:
    """Forget the cached :func:`get_plugins` result; the next call loads afresh."""
    get_plugins.cache_clear()
