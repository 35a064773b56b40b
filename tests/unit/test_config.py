"""specdec.config: strict structuring, one-line errors with key paths, defaults, merging."""

from __future__ import annotations

import json

import attrs
import pytest

from specdec.config import (
    EngineConfig,
    SpeculativeConfig,
    build_engine_config,
    build_speculative_config,
    in_range,
    load_yaml_file,
    one_of,
    parse_json_text,
    structure,
)
from specdec.errors import ConfigError, PluginError
from specdec.registry import Registry


# --- small plugins, registered in registries built per test -----------------------------------


class Naive:
    NAME = "naive"
    DRAFTS_NOTHING = True


class Ngram:
    NAME = "ngram"

    @attrs.define(frozen=True, kw_only=True)
    class Config:
        max_ngram_size: int = attrs.field(default=3, validator=in_range(1, 16))
        min_ngram_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
        match_ratio: float = 0.5
        banned_ids: list[int] = attrs.Factory(list)


class ModelBased:
    """Stands for a model-based method such as MTP: it reads FastDeploy's model keys, and
    declares ``mtp_strategy`` in its own Config (as the mtp plugin does)."""

    NAME = "mtp_like"
    USED_MODEL_KEYS = frozenset({"num_model_steps", "model", "quantization"})

    @attrs.define(frozen=True, kw_only=True)
    class Config:
        mtp_strategy: str = attrs.field(default="default", validator=one_of("default", "with_ngram"))


class Topp:
    NAME = "topp"

    @attrs.define(frozen=True, kw_only=True)
    class Config:
        max_candidate_len: int = 5
        verify_window: int = 2


class Greedy:
    NAME = "greedy"


class Rejection:
    NAME = "rejection"


class Normal:
    NAME = "normal"


class AcceptAll:
    NAME = "accept_all"

    @attrs.define(frozen=True, kw_only=True)
    class Config:
        log_every: int = 0
        mode: str = attrs.field(default="all", validator=one_of("all", "first"))


class PaddleBackend:
    NAME = "paddle"


@attrs.define
class FakePlugins:
    """What specdec.plugins.load_plugins() returns, as far as config is concerned."""

    proposers: Registry
    verify_strategies: Registry
    accept_policies: Registry
    attention_backends: Registry


def _registry(kind: str, *classes: type) -> Registry:
    registry = Registry(kind)
    for cls in classes:
        registry.register(cls, "tests")
    return registry


@pytest.fixture
def plugins() -> FakePlugins:
    return FakePlugins(
        proposers=_registry("proposer", Naive, Ngram),
        verify_strategies=_registry("verify strategy", Topp, Greedy, Rejection),
        accept_policies=_registry("accept policy", Normal, AcceptAll),
        attention_backends=_registry("attention backend", PaddleBackend),
    )


@pytest.fixture
def plugins_with_mtp(plugins) -> FakePlugins:
    """The same plugins plus a model-based method that reads FastDeploy's model keys."""
    plugins.proposers = _registry("proposer", Naive, Ngram, ModelBased)
    return plugins


def config_error(call, *args, **kwargs) -> str:
    """Run ``call``, expect a ConfigError, check it is one line, return its message."""
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- defaults ---------------------------------------------------------------------------------


def test_defaults_are_naive_with_zero_drafts(plugins):
    config = build_speculative_config({}, plugins)
    assert config.method == "naive"
    assert config.num_speculative_tokens == 0
    assert config.num_model_steps == 1
    assert config.model is None and config.quantization is None
    assert (config.verify_strategy, config.accept_policy) == ("rejection", "normal")
    assert config.method_config is None
    assert config.verify_config is None
    assert config.accept_config is None
    assert config.notices == ()


def test_drafting_method_defaults_to_five_tokens_and_its_config(plugins):
    config = build_speculative_config({"method": "ngram"}, plugins)
    assert config.num_speculative_tokens == 5
    assert config.method_config == Ngram.Config(max_ngram_size=3, min_ngram_size=1)


def test_flat_plugin_keys_reach_their_configs(plugins):
    config = build_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 4, "max_ngram_size": 5, "min_ngram_size": 2,
         "verify_strategy": "topp", "max_candidate_len": 8, "verify_window": 3, "accept_policy": "accept_all",
         "mode": "first"},
        plugins,
    )
    assert config.num_speculative_tokens == 4
    assert config.method_config == Ngram.Config(max_ngram_size=5, min_ngram_size=2)
    assert config.verify_config == Topp.Config(max_candidate_len=8, verify_window=3)
    assert config.accept_config == AcceptAll.Config(mode="first")


def test_seed_system_keys_work_unchanged(plugins_with_mtp):
    config = build_speculative_config(
        {"method": "mtp_like", "num_speculative_tokens": 5, "num_model_steps": 2, "model": "/m/mtp",
         "quantization": "wint8", "verify_strategy": "topp", "accept_policy": "normal",
         "mtp_strategy": "with_ngram"},
        plugins_with_mtp,
    )
    assert (config.model, config.quantization, config.num_model_steps) == ("/m/mtp", "wint8", 2)
    assert config.method_config.mtp_strategy == "with_ngram"


@pytest.mark.parametrize("key, value", [("num_model_steps", 2), ("model", "/x"), ("quantization", "wint8")])
def test_a_model_key_for_a_method_that_does_not_read_it_is_an_error(plugins, plugins_with_mtp, key, value):
    assert config_error(build_speculative_config, {"method": "ngram", key: value}, plugins_with_mtp) == (
        f"--speculative-config.{key}: method 'ngram' does not use it; it is read by method 'mtp_like'")
    plugins.proposers = _registry("proposer", Naive, Ngram)
    assert config_error(build_speculative_config, {"method": "ngram", key: value}, plugins) == (
        f"--speculative-config.{key}: method 'ngram' does not use it; it is read by model-based methods "
        f"such as 'mtp' (none is installed)")


def test_model_keys_at_their_defaults_are_accepted_with_any_method(plugins, plugins_with_mtp):
    """A seed-system config written out in full (defaults included) still loads: the core
    model keys at their defaults."""
    config = build_speculative_config({"method": "ngram", "num_model_steps": 1, "model": None, "quantization": None},
                                      plugins)
    assert config.method == "ngram" and config.method_config == Ngram.Config()
    # A key of another method's Config, even at its default, names its owner: the user may
    # believe that method is chosen.
    assert config_error(build_speculative_config, {"method": "ngram", "mtp_strategy": "default"},
                        plugins_with_mtp) == ("--speculative-config: unknown key 'mtp_strategy' (it belongs to "
                                              "method 'mtp_like'; method is 'ngram')")


def test_the_old_mtp_strategy_attribute_still_reads_with_a_warning(plugins, plugins_with_mtp):
    config = build_speculative_config({"method": "mtp_like", "mtp_strategy": "with_ngram"}, plugins_with_mtp)
    with pytest.warns(DeprecationWarning, match="mtp_strategy moved to the method's Config"):
        assert config.mtp_strategy == "with_ngram"
    with pytest.warns(DeprecationWarning):
        assert build_speculative_config({"method": "ngram"}, plugins).mtp_strategy == "default"


def test_a_plugin_key_is_checked_by_its_plugins_config(plugins_with_mtp):
    assert config_error(build_speculative_config, {"method": "mtp_like", "mtp_strategy": "eagle"},
                        plugins_with_mtp) == (
        "--speculative-config.mtp_strategy: must be one of default, with_ngram, got 'eagle'")


def test_float_field_accepts_int(plugins):
    config = build_speculative_config({"method": "ngram", "match_ratio": 1}, plugins)
    assert config.method_config.match_ratio == 1.0
    assert type(config.method_config.match_ratio) is float


def test_engine_defaults(plugins):
    config = build_engine_config(None, {}, None, plugins)
    assert config == EngineConfig(speculative=build_speculative_config({}, plugins))
    assert (config.model, config.max_model_len, config.attention_backend) == ("smollm2-135m-instruct", None, "auto")
    assert (config.dtype, config.seed, config.max_num_seqs) == ("auto", 0, 256)
    assert (config.max_num_batched_tokens, config.block_size, config.num_kv_blocks) == (2048, 16, None)
    assert (config.kv_cache_memory_gb, config.enable_prefix_caching) == (4.0, True)
    assert config.speculative.adaptive_draft_length is True


# --- the naive notice -------------------------------------------------------------------------


def test_naive_forces_num_speculative_tokens_to_zero_with_a_notice(plugins):
    config = build_speculative_config({"method": "naive", "num_speculative_tokens": 64}, plugins)
    assert config.num_speculative_tokens == 0
    assert config.notices == (
        "--speculative-config.num_speculative_tokens: method 'naive' drafts nothing; 64 forced to 0",
    )


def test_naive_with_zero_tokens_has_no_notice(plugins):
    assert build_speculative_config({"num_speculative_tokens": 0}, plugins).notices == ()


def test_naive_still_type_checks_num_speculative_tokens(plugins):
    assert config_error(build_speculative_config, {"num_speculative_tokens": "5"}, plugins) == (
        "--speculative-config.num_speculative_tokens: expected int, got str '5'"
    )


# --- error messages: core keys ----------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"method": "ngarm"},
         "--speculative-config.method: unknown proposer 'ngarm' (did you mean 'ngram'?); installed: naive, ngram"),
        ({"verify_strategy": "gredy"},
         "--speculative-config.verify_strategy: unknown verify strategy 'gredy' (did you mean 'greedy'?); "
         "installed: greedy, rejection, topp"),
        ({"accept_policy": "xyz"},
         "--speculative-config.accept_policy: unknown accept policy 'xyz'; installed: accept_all, normal"),
        ({"method": 1}, "--speculative-config.method: expected str, got int 1"),
        ({"method": "ngram", "num_speculative_tokens": 2.9},
         "--speculative-config.num_speculative_tokens: expected int, got float 2.9"),
        ({"method": "ngram", "num_speculative_tokens": 2.0},
         "--speculative-config.num_speculative_tokens: expected int, got float 2.0"),
        ({"method": "ngram", "num_speculative_tokens": True},
         "--speculative-config.num_speculative_tokens: expected int, got bool True"),
        ({"method": "ngram", "num_speculative_tokens": 64},
         "--speculative-config.num_speculative_tokens: must be between 1 and 32, got 64"),
        ({"method": "ngram", "num_speculative_tokens": 0},
         "--speculative-config.num_speculative_tokens: must be between 1 and 32, got 0"),
        ({"num_model_steps": 9}, "--speculative-config.num_model_steps: must be between 1 and 8, got 9"),
        ({"num_model_steps": None}, "--speculative-config.num_model_steps: expected int, got null"),
        ({"model": 7}, "--speculative-config.model: expected str, got int 7"),
    ],
)
def test_core_key_errors(plugins, data, expected):
    assert config_error(build_speculative_config, data, plugins) == expected


def test_not_a_mapping(plugins):
    assert config_error(build_speculative_config, [1], plugins) == "--speculative-config: expected a mapping, got list"


# --- error messages: unknown keys -------------------------------------------------------------


def test_misspelt_plugin_key(plugins):
    assert config_error(build_speculative_config, {"method": "ngram", "max_ngram_sise": 3}, plugins) == (
        "--speculative-config: unknown key 'max_ngram_sise' (did you mean 'max_ngram_size'?)"
    )


def test_misspelt_core_key(plugins):
    assert config_error(build_speculative_config, {"num_speculative_token": 3}, plugins) == (
        "--speculative-config: unknown key 'num_speculative_token' (did you mean 'num_speculative_tokens'?)"
    )


def test_key_of_a_method_not_selected(plugins):
    assert config_error(build_speculative_config, {"method": "naive", "max_ngram_size": 3}, plugins) == (
        "--speculative-config: unknown key 'max_ngram_size' (it belongs to method 'ngram'; method is 'naive')"
    )


def test_key_of_a_verify_strategy_not_selected(plugins):
    assert config_error(build_speculative_config, {"verify_strategy": "greedy", "verify_window": 3}, plugins) == (
        "--speculative-config: unknown key 'verify_window' (it belongs to verify_strategy 'topp'; "
        "verify_strategy is 'greedy')"
    )


def test_unknown_key_without_a_close_match_lists_the_valid_keys(plugins):
    assert config_error(build_speculative_config, {"method": "ngram", "zzz": 1}, plugins) == (
        "--speculative-config: unknown key 'zzz'; valid keys: accept_policy, adaptive_draft_length, banned_ids, "
        "match_ratio, max_ngram_size, method, min_ngram_size, model, num_model_steps, "
        "num_speculative_tokens, quantization, verify_strategy"
    )


# --- error messages: plugin Config fields -----------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"method": "ngram", "max_ngram_size": "4"}, "--speculative-config.max_ngram_size: expected int, got str '4'"),
        ({"method": "ngram", "max_ngram_size": 4.0}, "--speculative-config.max_ngram_size: expected int, got float 4.0"),
        ({"method": "ngram", "max_ngram_size": 40}, "--speculative-config.max_ngram_size: must be between 1 and 16, got 40"),
        # attrs' own validators: the field name moves into the path, comparisons say "got".
        ({"method": "ngram", "min_ngram_size": 0}, "--speculative-config.min_ngram_size: must be >= 1, got 0"),
        ({"method": "ngram", "banned_ids": "12"}, "--speculative-config.banned_ids: expected list, got str '12'"),
        ({"method": "ngram", "match_ratio": "high"}, "--speculative-config.match_ratio: expected float, got str 'high'"),
        ({"method": "ngram", "banned_ids": [1, "x"]}, "--speculative-config.banned_ids[1]: expected int, got str 'x'"),
        ({"verify_strategy": "topp", "max_candidate_len": True},
         "--speculative-config.max_candidate_len: expected int, got bool True"),
        ({"accept_policy": "accept_all", "mode": "some"},
         "--speculative-config.mode: must be one of all, first, got 'some'"),
    ],
)
def test_plugin_config_errors(plugins, data, expected):
    assert config_error(build_speculative_config, data, plugins) == expected


def test_bool_field_rejects_strings():
    @attrs.define(frozen=True, kw_only=True)
    class Flags:
        enabled: bool = False

    assert structure({"enabled": True}, Flags, "--x").enabled is True
    assert config_error(structure, {"enabled": "yes"}, Flags, "--x") == "--x.enabled: expected bool, got str 'yes'"
    assert config_error(structure, {"enabled": 1}, Flags, "--x") == "--x.enabled: expected bool, got int 1"


@attrs.define(frozen=True, kw_only=True)
class Tree:
    depth: int = attrs.field(default=8, validator=in_range(1, 64))


@attrs.define(frozen=True, kw_only=True)
class Nested:
    tree: Tree = attrs.Factory(Tree)
    weights: dict[str, float] = attrs.Factory(dict)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"tree": {"depth": 0}}, "--x.tree.depth: must be between 1 and 64, got 0"),
        ({"tree": {"dept": 2}}, "--x.tree: unknown key 'dept' (did you mean 'depth'?)"),
        ({"tree": {"zzz": 2}}, "--x.tree: unknown key 'zzz'; valid keys: depth"),
        ({"tree": 3}, "--x.tree: expected a mapping, got int"),
        ({"weights": {"a": "x"}}, "--x.weights.a: expected float, got str 'x'"),
        ({"weights": [1]}, "--x.weights: expected a mapping, got list"),
        ({"trees": {}}, "--x: unknown key 'trees' (did you mean 'tree'?)"),
    ],
)
def test_nested_paths_use_dots(data, expected):
    assert config_error(structure, data, Nested, "--x") == expected


def test_required_plugin_field():
    @attrs.define(frozen=True, kw_only=True)
    class Needs:
        path: str

    assert config_error(structure, {}, Needs, "--x") == "--x.path: required key is missing"


def test_plugin_config_shadowing_a_core_key_is_a_plugin_error(plugins):
    class Shadow:
        NAME = "shadow"

        @attrs.define
        class Config:
            model: str = ""

    plugins.proposers.register(Shadow, "tests")
    with pytest.raises(PluginError, match="Config field 'model' shadows a core speculative config key"):
        build_speculative_config({"method": "shadow"}, plugins)


# --- JSON -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"method": "ngram",}',
         "--speculative-config: invalid JSON at line 1, column 20: Expecting property name enclosed in double quotes"),
        ('{\n  "method": "ngram"\n  "num_speculative_tokens": 5\n}',
         "--speculative-config: invalid JSON at line 3, column 3: Expecting ',' delimiter"),
        ("", "--speculative-config: invalid JSON at line 1, column 1: Expecting value"),
        ("[1, 2]", "--speculative-config: expected a JSON object, got list"),
        ('"ngram"', "--speculative-config: expected a JSON object, got str"),
        ("null", "--speculative-config: expected a JSON object, got null"),
        ('{"method": "a", "method": "b"}', "--speculative-config: invalid JSON: duplicate key 'method'"),
        ('{"x": NaN}', "--speculative-config: invalid JSON: NaN is not allowed"),
    ],
)
def test_json_errors(text, expected):
    assert config_error(parse_json_text, text, "--speculative-config") == expected


def test_json_object():
    assert parse_json_text('{"method": "ngram", "num_speculative_tokens": 5}', "--speculative-config") == {
        "method": "ngram", "num_speculative_tokens": 5,
    }


def test_json_from_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text('{"method": "ngram"}')
    assert parse_json_text(f"@{path}", "--speculative-config") == {"method": "ngram"}
    path.write_text('{"method": }')
    assert config_error(parse_json_text, f"@{path}", "--speculative-config") == (
        f"--speculative-config: invalid JSON in {path} at line 1, column 12: Expecting value"
    )


def test_json_file_missing(tmp_path):
    path = tmp_path / "missing.json"
    assert config_error(parse_json_text, f"@{path}", "--speculative-config") == (
        f"--speculative-config: cannot read {path}: No such file or directory"
    )


# --- YAML -------------------------------------------------------------------------------------


def _yaml(tmp_path, text: str):
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return path


def test_yaml_file(tmp_path):
    path = _yaml(tmp_path, "model: m\nspeculative_config:\n  method: ngram\n  max_ngram_size: 4\n")
    assert load_yaml_file(path) == {"model": "m", "speculative_config": {"method": "ngram", "max_ngram_size": 4}}


def test_empty_yaml_is_an_empty_mapping(tmp_path):
    assert load_yaml_file(_yaml(tmp_path, "# nothing\n")) == {}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("model: m\nseed: [1\n", "invalid YAML in {path} at line 3, column 1: expected ',' or ']', but got '<stream end>'"),
        ("model: a: b\n", "invalid YAML in {path} at line 1, column 9: mapping values are not allowed here"),
        ("model: a\nmodel: b\n", "invalid YAML in {path} at line 2, column 1: duplicate key 'model'"),
        ("- model\n", "expected a mapping in {path}, got list"),
        ("just text\n", "expected a mapping in {path}, got str"),
    ],
)
def test_yaml_errors(tmp_path, text, expected):
    path = _yaml(tmp_path, text)
    assert config_error(load_yaml_file, path) == "--config: " + expected.format(path=path)


def test_yaml_file_missing(tmp_path):
    path = tmp_path / "nope.yaml"
    assert config_error(load_yaml_file, path) == f"--config: cannot read {path}: No such file or directory"


# --- the engine config: YAML < CLI overrides, --speculative-config replaces the YAML's --------


def test_yaml_and_overrides_merge(tmp_path, plugins):
    yaml_data = load_yaml_file(_yaml(tmp_path, (
        "model: /models/a.gguf\nmax_num_seqs: 8\ndtype: bfloat16\nseed: 3\n"
        "speculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n  max_ngram_size: 4\n"
    )))
    config = build_engine_config(yaml_data, {"max_num_seqs": 16, "seed": None}, None, plugins)
    assert (config.model, config.max_num_seqs, config.dtype, config.seed) == ("/models/a.gguf", 16, "bfloat16", 3)
    assert config.speculative.method == "ngram"
    assert config.speculative.num_speculative_tokens == 3
    assert config.speculative.method_config.max_ngram_size == 4


def test_speculative_config_json_replaces_the_yaml_one(plugins):
    yaml_data = {"speculative_config": {"method": "ngram", "max_ngram_size": 4}}
    config = build_engine_config(yaml_data, {}, {"num_speculative_tokens": 2}, plugins)
    assert config.speculative.method == "naive"  # not merged key by key: replaced as a whole
    assert config.speculative.num_speculative_tokens == 0


@pytest.mark.parametrize(
    "yaml_data, overrides, expected",
    [
        ({"max_num_seqs": 0}, {}, "--config.max_num_seqs: must be between 1 and 256, got 0"),
        ({}, {"max_num_seqs": 300}, "--max-num-seqs: must be between 1 and 256, got 300"),
        ({"max_num_seqs": 2.0}, {}, "--config.max_num_seqs: expected int, got float 2.0"),
        ({"max_model_len": 0}, {}, "--config.max_model_len: must be >= 1, got 0"),
        ({"seed": -1}, {}, "--config.seed: must be >= 0, got -1"),
        ({"dtype": "fp8"}, {}, "--config.dtype: must be one of auto, float32, float16, bfloat16, got 'fp8'"),
        ({}, {"dtype": "int4"}, "--dtype: must be one of auto, float32, float16, bfloat16, got 'int4'"),
        ({"model": 3}, {}, "--config.model: expected str, got int 3"),
        ({"modle": "m"}, {}, "--config: unknown key 'modle' (did you mean 'model'?)"),
        ({"method": "ngram"}, {}, "--config: unknown key 'method' (it belongs under speculative_config)"),
        ({"zzz": 1}, {},
         "--config: unknown key 'zzz'; valid keys: attention_backend, block_size, dtype, enable_prefix_caching, kernels, "
         "kv_cache_dtype, kv_cache_memory_gb, max_model_len, max_num_batched_tokens, max_num_seqs, "
         "max_stop_string_length, max_stop_strings, model, "
         "num_kv_blocks, quantization, seed, speculative_config, tensor_parallel_size, tensor_parallel_timeout"),
        ({"block_size": 12}, {}, "--config.block_size: must be a multiple of 8, got 12"),
        ({}, {"enable_prefix_caching": "yes"}, "--enable-prefix-caching: expected bool, got str 'yes'"),
        ({"num_kv_blocks": 0}, {}, "--config.num_kv_blocks: must be >= 1, got 0"),
        ({"attention_backend": "triton"}, {},
         "--config.attention_backend: unknown attention backend 'triton'; installed: paddle"),
        ({}, {"attention_backend": "padle"},
         "--attention-backend: unknown attention backend 'padle' (did you mean 'paddle'?); installed: paddle"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2.9}}, {},
         "--config.speculative_config.num_speculative_tokens: expected int, got float 2.9"),
        ({"speculative_config": {"max_ngram_sise": 2}}, {},
         "--config.speculative_config: unknown key 'max_ngram_sise'; valid keys: accept_policy, adaptive_draft_length, "
         "method, model, num_model_steps, num_speculative_tokens, quantization, verify_strategy"),
        ({"speculative_config": ["ngram"]}, {}, "--config.speculative_config: expected a mapping, got list"),
        ([1], {}, "--config: expected a mapping, got list"),
        ({}, {"max_num_seq": 2}, "--max-num-seq: not an engine option; engine options: model, max_model_len, "
         "attention_backend, kernels, dtype, quantization, seed, max_num_seqs, max_num_batched_tokens, block_size, "
         "num_kv_blocks, "
         "kv_cache_memory_gb, kv_cache_dtype, tensor_parallel_size, tensor_parallel_timeout, enable_prefix_caching, "
         "max_stop_strings, max_stop_string_length"),
        ({"kv_cache_dtype": "fp8"}, {}, "--config.kv_cache_dtype: must be one of auto, float32, float16, bfloat16, got 'fp8'"),
        ({}, {"kv_cache_dtype": "float61"},
         "--kv-cache-dtype: must be one of auto, float32, float16, bfloat16, got 'float61' (did you mean 'float16'?)"),
    ],
)
def test_engine_errors(plugins, yaml_data, overrides, expected):
    assert config_error(build_engine_config, yaml_data, overrides, None, plugins) == expected


def test_speculative_config_errors_name_the_flag(plugins):
    assert config_error(build_engine_config, None, {}, {"method": "ngarm"}, plugins) == (
        "--speculative-config.method: unknown proposer 'ngarm' (did you mean 'ngram'?); installed: naive, ngram"
    )


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"method": "ngram", "num_speculative_tokens": 7, "max_ngram_size": 6, "verify_strategy": "topp",
         "verify_window": 1},
        {"method": "ngram", "verify_strategy": "greedy", "accept_policy": "accept_all", "mode": "first",
         "banned_ids": [1, 2]},
        {"method": "mtp_like", "verify_strategy": "greedy", "model": "/m", "quantization": "wint8",
         "mtp_strategy": "with_ngram", "num_model_steps": 3},
    ],
)
def test_speculative_round_trip(plugins_with_mtp, data):
    config = build_speculative_config(data, plugins_with_mtp)
    flat = config.to_dict()
    assert json.loads(json.dumps(flat)) == flat  # plain JSON types only
    assert build_speculative_config(flat, plugins_with_mtp) == config
    for key, value in data.items():
        assert flat[key] == value


def test_speculative_to_dict_is_flat(plugins):
    flat = build_speculative_config({"method": "ngram"}, plugins).to_dict()
    assert flat == {
        "method": "ngram", "num_speculative_tokens": 5, "num_model_steps": 1, "model": None,
        "quantization": None, "verify_strategy": "rejection", "accept_policy": "normal",
        "adaptive_draft_length": True,
        "max_ngram_size": 3, "min_ngram_size": 1, "match_ratio": 0.5, "banned_ids": [],
    }


def test_engine_round_trip(plugins):
    config = build_engine_config({"model": "m", "max_model_len": 512}, {"max_num_seqs": 4},
                                 {"method": "ngram", "max_ngram_size": 2}, plugins)
    assert build_engine_config(config.to_dict(), {}, None, plugins) == config


def test_hand_built_config_is_resolved(plugins):
    config = SpeculativeConfig(method="ngram").resolved(plugins)
    assert config.num_speculative_tokens == 5
    assert config.method_config == Ngram.Config()
    assert config_error(SpeculativeConfig(method="ngarm").resolved, plugins) == (
        "speculative_config.method: unknown proposer 'ngarm' (did you mean 'ngram'?); installed: naive, ngram"
    )


def test_is_resolved_tells_built_configs_from_hand_built_ones(plugins):
    built = build_speculative_config({"method": "ngram", "verify_strategy": "topp"}, plugins)
    assert built.is_resolved(plugins)
    assert build_speculative_config({}, plugins).is_resolved(plugins)
    assert not SpeculativeConfig(method="ngram").is_resolved(plugins)  # k and the Configs open
    assert SpeculativeConfig(method="ngram").resolved(plugins).is_resolved(plugins)
    # Evolved into a config whose plugin configs do not fit its plugins any more:
    assert not attrs.evolve(built, method="naive").is_resolved(plugins)  # ngram's Config on naive
    assert not attrs.evolve(built, verify_strategy="greedy").is_resolved(plugins)
    assert not attrs.evolve(built, accept_policy="unknown").is_resolved(plugins)
    assert attrs.evolve(built, num_speculative_tokens=3).is_resolved(plugins)


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="num_model_steps: must be between 1 and 8, got 0"):
        SpeculativeConfig(num_model_steps=0)
    with pytest.raises(ValueError, match="max_num_seqs: must be between 1 and 256, got 0"):
        EngineConfig(max_num_seqs=0)


def test_docs_list_every_key():
    from pathlib import Path

    from specdec.config import ENGINE_KEYS, SPECULATIVE_KEYS

    docs = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    for key in (*SPECULATIVE_KEYS, *ENGINE_KEYS):
        assert f"| `{key}` |" in docs, key


def test_num_speculative_tokens_is_raised_to_num_model_steps(plugins_with_mtp):
    """As FastDeploy does, for a method that reads num_model_steps (and only for one)."""
    config = build_speculative_config({"method": "mtp_like", "num_speculative_tokens": 2, "num_model_steps": 3},
                                      plugins_with_mtp)
    assert config.num_speculative_tokens == 3
    assert config.notices == ("--speculative-config.num_speculative_tokens: method 'mtp_like' drafts "
                              "num_model_steps (3) tokens; 2 raised to 3",)
    config = build_speculative_config({"method": "mtp_like", "num_speculative_tokens": 5, "num_model_steps": 3},
                                      plugins_with_mtp)
    assert config.num_speculative_tokens == 5 and config.notices == ()


# --- FastDeploy's hybrid spelling, with the real built-in plugins -------------------------------


def test_mtp_with_ngram_selects_the_hybrid_method():
    from specdec.plugin_manager import load_plugins

    real = load_plugins()
    config = build_speculative_config({"method": "mtp", "mtp_strategy": "with_ngram", "num_model_steps": 2,
                                       "num_speculative_tokens": 5}, real)
    assert (config.method, config.num_model_steps, config.num_speculative_tokens) == ("hybrid", 2, 5)
    assert (config.method_config.draft_model_method, config.method_config.draft_lookup_method) == ("mtp", "ngram")
    assert build_speculative_config(config.to_dict(), real) == config
    # Plain mtp stays mtp; hybrid spelled directly takes its own keys.
    assert build_speculative_config({"method": "mtp"}, real).method == "mtp"
    direct = build_speculative_config({"method": "hybrid", "draft_lookup_method": "suffix"}, real)
    assert direct.method_config.draft_lookup_method == "suffix"
    assert config_error(build_speculative_config, {"method": "hybrid", "max_ngram_size": 3}, real).startswith(
        "--speculative-config: unknown key 'max_ngram_size'")
    # The key that spells hybrid, at the value that does not, is ignored by every method (a
    # seed-system config written out in full); at the value that does, it is hybrid's.
    full = {"method": "ngram", "num_model_steps": 1, "model": None, "quantization": None, "mtp_strategy": "default"}
    assert build_speculative_config(full, real).method == "ngram"
    assert config_error(build_speculative_config, {**full, "mtp_strategy": "with_ngram"}, real) == (
        "--speculative-config: unknown key 'mtp_strategy' (it belongs to method 'hybrid', method 'mtp'; "
        "method is 'ngram')")
