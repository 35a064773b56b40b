"""The plugin manager against real installed distributions (see conftest.FakeSite)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

import specdec
from specdec.plugin_manager import (DEFAULT_PLUGINS, KINDS, get_plugins, load_plugins,
                                    reset_plugins)

ROOT = Path(__file__).resolve().parents[2]

BROKEN = "import specdec_missing_dependency_xyz\n"


def third_party(plugins) -> list[str]:
    return [info.name for info in plugins.infos if not info.builtin]


def info_named(plugins, name):
    return next(info for info in plugins.infos if info.name == name)


def test_broken_plugin_is_reported_and_the_others_still_register(site):
    site.install("specdec-plugin-broken", "0.1.0", {"broken": "sdt_broken"}, {"sdt_broken": BROKEN})
    site.install_proposer("specdec-plugin-good", "good", "sdt_good", name="goodprop", version="2.3.4")

    plugins = load_plugins()

    [line] = [e for e in plugins.errors if "'broken'" in e]
    assert line == ("plugin 'broken' (specdec-plugin-broken 0.1.0) failed to load: "
                    "ModuleNotFoundError: No module named 'specdec_missing_dependency_xyz'")
    broken = info_named(plugins, "broken")
    assert broken.error == line and broken.distribution == "specdec-plugin-broken"
    assert broken.registered["proposers"] == []

    assert "goodprop" in plugins.proposers
    good = info_named(plugins, "good")
    assert (good.distribution, good.version, good.error) == ("specdec-plugin-good", "2.3.4", None)
    assert good.registered["proposers"] == ["goodprop"]
    assert plugins.proposers.provider("goodprop") == "plugin 'good' (specdec-plugin-good 2.3.4)"


def test_plugin_raising_any_exception_on_import_is_contained(site):
    site.install("specdec-plugin-boom", "1.0", {"boom": "sdt_boom"},
                 {"sdt_boom": "raise RuntimeError('boom\\nsecond line')\n"})
    plugins = load_plugins()
    [line] = [e for e in plugins.errors if "'boom'" in e]
    assert line == "plugin 'boom' (specdec-plugin-boom 1.0) failed to load: RuntimeError: boom; second line"


def test_plugin_exiting_or_interrupting_on_import_or_in_a_hook_is_contained(site):
    """``sys.exit(3)`` or ``KeyboardInterrupt`` at import, and ``SystemExit`` in a
    registration hook, used to end the process; each is one error line now, and the plugins
    after them in load order still register."""
    site.install("specdec-plugin-exit", "0.1.0", {"exiter": "sdt_exiter"},
                 {"sdt_exiter": "import sys\nsys.exit(3)\n"})
    site.install("specdec-plugin-interrupt", "0.1.0", {"interrupter": "sdt_interrupter"},
                 {"sdt_interrupter": "raise KeyboardInterrupt\n"})
    site.install("specdec-plugin-hook-exit", "0.1.0", {"hook_exit": "sdt_hook_exit"}, {"sdt_hook_exit": '''
        import sys
        import specdec

        @specdec.hookimpl
        def specdec_register_verify_strategies(register):
            sys.exit("no strategies today")
    '''})
    site.install_proposer("specdec-plugin-zz-after", "after", "sdt_after", name="after_prop")

    plugins = load_plugins()

    assert [e for e in plugins.errors if "specdec-plugin-" in e] == [
        "plugin 'exiter' (specdec-plugin-exit 0.1.0) failed to load: SystemExit: 3",
        "plugin 'interrupter' (specdec-plugin-interrupt 0.1.0) failed to load: KeyboardInterrupt",
        "plugin 'hook_exit' (specdec-plugin-hook-exit 0.1.0) failed in specdec_register_verify_strategies: "
        "SystemExit: no strategies today",
    ]
    assert "after_prop" in plugins.proposers and "ngram" in plugins.proposers


def test_duplicate_name_names_both_providers_and_keeps_the_first(site):
    # Installed b first: the winner is decided by load order (distribution name), not by disk.
    site.install_proposer("specdec-plugin-dup-b", "dup_b", "sdt_dup_b", name="dup", version="0.2.0")
    site.install_proposer("specdec-plugin-dup-a", "dup_a", "sdt_dup_a", name="dup")

    plugins = load_plugins()

    [line] = [e for e in plugins.errors if "'dup'" in e]
    assert "proposer 'dup' is registered twice" in line
    assert "plugin 'dup_a' (specdec-plugin-dup-a 0.1.0)" in line
    assert "plugin 'dup_b' (specdec-plugin-dup-b 0.2.0)" in line
    assert plugins.proposers.provider("dup") == "plugin 'dup_a' (specdec-plugin-dup-a 0.1.0)"
    assert info_named(plugins, "dup_a").registered["proposers"] == ["dup"]
    assert info_named(plugins, "dup_b").registered["proposers"] == []

    # Looking the name up (as the config does) raises the duplicate error rather than guessing.
    with pytest.raises(specdec.PluginError) as excinfo:
        plugins.proposers.get("dup", key="--speculative-config.method")
    assert str(excinfo.value) == "--speculative-config.method: " + line
    with pytest.raises(specdec.PluginError, match="registered twice.*dup_a.*dup_b"):
        plugins.get("proposers", "dup")
    with pytest.raises(specdec.PluginError) as excinfo:
        plugins.check()
    assert str(excinfo.value).startswith(plugins.errors[0])


def test_unknown_name_lists_installed_and_suggests(site):
    site.install_proposer("specdec-plugin-ngrams", "ngrams", "sdt_ngrams", name="ngram_x")
    site.install_proposer("specdec-plugin-other", "other", "sdt_other", name="ngram")
    plugins = load_plugins()

    with pytest.raises(specdec.PluginError) as excinfo:
        plugins.proposers.get("ngarm")
    message = str(excinfo.value)
    assert "unknown proposer 'ngarm'" in message
    assert "did you mean 'ngram'?" in message
    assert "installed:" in message and "ngram, ngram_x" in message
    assert "\n" not in message


def test_unknown_name_points_at_plugins_that_failed(site):
    site.install("specdec-plugin-broken", "0.1.0", {"broken": "sdt_broken2"}, {"sdt_broken2": BROKEN})
    plugins = load_plugins()
    with pytest.raises(specdec.PluginError, match=r"^--speculative-config.method: unknown proposer "
                                                  r"'eagle3'.*plugins with errors: .*'broken'"):
        plugins.proposers.get("eagle3", key="--speculative-config.method")


def test_all_four_hooks_register_with_their_provider(site):
    site.install("specdec-plugin-all", "0.5.0", {"all4": "sdt_all4"}, {"sdt_all4": '''
        import specdec

        class P(specdec.Proposer):
            NAME = "p_all"

        class V(specdec.VerifyStrategy):
            NAME = "v_all"

        class A(specdec.AcceptPolicy):
            NAME = "a_all"

        class B(specdec.AttentionBackend):
            NAME = "b_all"

        @specdec.hookimpl
        def specdec_register_proposers(register):
            register(P)

        @specdec.hookimpl
        def specdec_register_verify_strategies(register):
            register(V)

        @specdec.hookimpl
        def specdec_register_accept_policies(register):
            register(A)

        @specdec.hookimpl
        def specdec_register_attention_backends(register):
            register(B)
    '''})
    plugins = load_plugins()
    info = info_named(plugins, "all4")
    assert info.registered == {"proposers": ["p_all"], "verify_strategies": ["v_all"],
                               "accept_policies": ["a_all"], "attention_backends": ["b_all"]}
    for kind, name in zip(KINDS, ["p_all", "v_all", "a_all", "b_all"]):
        assert plugins.get(kind.attr, name).NAME == name
        assert plugins.registry(kind.attr).provider(name) == "plugin 'all4' (specdec-plugin-all 0.5.0)"


def test_typo_in_hook_name_is_an_error_line_not_a_crash(site):
    site.install("specdec-plugin-typo", "0.1.0", {"typo": "sdt_typo"}, {"sdt_typo": '''
        import specdec

        class P(specdec.Proposer):
            NAME = "typo_ok"

        @specdec.hookimpl
        def specdec_register_proposer(register):
            register(P)

        @specdec.hookimpl
        def specdec_register_verify_strategies(register):
            pass
    '''})
    plugins = load_plugins()
    [line] = [e for e in plugins.errors if "'typo'" in e]
    assert line == ("plugin 'typo' (specdec-plugin-typo 0.1.0) implements unknown hook "
                    "'specdec_register_proposer' (did you mean 'specdec_register_proposers'?)")


def test_hook_that_raises_or_registers_junk_is_an_error_line(site):
    site.install("specdec-plugin-bad", "0.1.0", {"bad": "sdt_bad"}, {"sdt_bad": '''
        import specdec

        class Nameless(specdec.Proposer):
            pass

        class Fine(specdec.Proposer):
            NAME = "bad_fine"

        @specdec.hookimpl
        def specdec_register_proposers(register):
            register(object)
            register(Nameless)
            register(Fine)

        @specdec.hookimpl
        def specdec_register_accept_policies(register):
            raise ValueError("nope")
    '''})
    plugins = load_plugins()
    lines = [e for e in plugins.errors if "'bad'" in e]
    assert lines == [
        "plugin 'bad' (specdec-plugin-bad 0.1.0) registered <class 'object'> as a proposer, "
        "but it is not a subclass of specdec.Proposer",
        "plugin 'bad' (specdec-plugin-bad 0.1.0): proposer class Nameless has no NAME",
        "plugin 'bad' (specdec-plugin-bad 0.1.0) failed in specdec_register_accept_policies: ValueError: nope",
    ]
    assert "bad_fine" in plugins.proposers


def test_hookimpl_with_wrong_argument_fails_that_plugin_only(site):
    site.install("specdec-plugin-args", "0.1.0", {"args": "sdt_args"}, {"sdt_args": '''
        import specdec

        @specdec.hookimpl
        def specdec_register_proposers(registr):
            pass
    '''})
    plugins = load_plugins()
    [line] = [e for e in plugins.errors if "'args'" in e]
    assert line.startswith("plugin 'args' (specdec-plugin-args 0.1.0) failed to load: PluginValidationError:")
    assert "registr" in line and "\n" not in line


def test_load_plugins_empty_string_loads_builtins_only(site, monkeypatch):
    site.install_proposer("specdec-plugin-good", "good", "sdt_good_b", name="goodprop_b")
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "")
    plugins = load_plugins()
    assert third_party(plugins) == []
    assert "goodprop_b" not in plugins.proposers
    builtin_names = {name for name, _ in DEFAULT_PLUGINS}
    assert {info.name for info in plugins.infos} == builtin_names
    assert all(info.builtin and info.distribution == "paddle-specdec" for info in plugins.infos)


def test_load_plugins_by_name_loads_only_that_one(site, monkeypatch):
    site.install_proposer("specdec-plugin-good", "good", "sdt_good_c", name="goodprop_c")
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "lastn")
    plugins = load_plugins()
    assert third_party(plugins) == ["lastn"], "is the example installed? pip install -e examples/specdec-plugin-lastn"
    assert "lastn" in plugins.proposers and "goodprop_c" not in plugins.proposers


def test_load_plugins_by_distribution_name_and_argument(site):
    site.install_proposer("specdec-plugin-good", "good", "sdt_good_d", name="goodprop_d")
    site.install_proposer("specdec-plugin-other", "other", "sdt_other_d", name="otherprop_d")
    plugins = load_plugins(load=" Specdec_Plugin.Good ,")
    assert third_party(plugins) == ["good"]
    assert plugins.errors == [e for e in plugins.errors if e.startswith("plugin '")]  # no env complaint


def test_unknown_name_in_load_list_is_reported(site):
    site.install_proposer("specdec-plugin-good", "good", "sdt_good_e", name="goodprop_e")
    plugins = load_plugins(load="goood")
    assert third_party(plugins) == []
    assert ("SPECDEC_LOAD_PLUGINS names 'goood', which is not an installed plugin "
            "(did you mean 'good'?)") in plugins.errors


def test_default_plugins_match_pyproject_entry_points():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"]["specdec"]
    assert dict(DEFAULT_PLUGINS) == declared, "keep DEFAULT_PLUGINS in sync with pyproject.toml"


def test_source_tree_without_entry_points_falls_back_to_default_plugins():
    plugins = load_plugins(load="", entry_points=[])
    assert [(i.name, i.module) for i in plugins.infos] == list(DEFAULT_PLUGINS)
    assert all(info.builtin and info.version == specdec.__version__ for info in plugins.infos)


def test_each_load_builds_a_fresh_manager(site):
    first = load_plugins()
    site.install_proposer("specdec-plugin-late", "late", "sdt_late", name="lateprop")
    second = load_plugins()
    assert "lateprop" not in first.proposers and "lateprop" in second.proposers
    assert first.manager is not second.manager


def test_get_plugins_is_cached_until_reset(monkeypatch):
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "")
    reset_plugins()
    try:
        assert get_plugins() is get_plugins()
        cached = get_plugins()
        reset_plugins()
        assert get_plugins() is not cached
    finally:
        reset_plugins()


def test_builtins_load_without_third_party_modules_imported(site, monkeypatch):
    monkeypatch.setenv("SPECDEC_LOAD_PLUGINS", "")
    site.install_proposer("specdec-plugin-good", "good", "sdt_never", name="never")
    load_plugins()
    assert "sdt_never" not in sys.modules
