"""``--generation-config`` and ``--override-generation-config``: where the sampling values of the
fields a request leaves out come from (the server's side is tested in tests/server/test_serve_cli.py)."""

from __future__ import annotations

import json

import pytest

from specdec.errors import SpecdecError
from specdec.server.generation_defaults import GenerationDefaults, load_generation_defaults


def test_auto_gives_a_gguf_llama_cpp_defaults():
    defaults = load_generation_defaults("smollm2-135m-instruct")
    assert defaults.values == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    assert defaults.value("temperature", None) == 0.8 and defaults.value("temperature", 0) == 0


def test_none_keeps_the_api_defaults():
    defaults = load_generation_defaults("smollm2-135m-instruct", "none")
    assert defaults.values == {} and defaults.value("temperature", None) == 1.0
    assert GenerationDefaults().value("top_k", None) == 0


def test_a_checkpoint_folder_or_file_and_an_override(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "eos_token_id": 2, "max_length": 99}))
    assert load_generation_defaults("x", str(tmp_path)).values == {"temperature": 0.6, "top_p": 0.9}
    overridden = load_generation_defaults("x", str(tmp_path / "generation_config.json"), {"temperature": 0.2})
    assert overridden.values == {"temperature": 0.2, "top_p": 0.9} and "override" in overridden.source
    (tmp_path / "greedy.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_generation_defaults("x", str(tmp_path / "greedy.json")).values["temperature"] == 0.0


@pytest.mark.parametrize("config, override, message", [
    ("/no/such/folder", None, "--generation-config: /no/such/folder does not exist"),
    ("none", {"temprature": 1}, "--override-generation-config: unknown key(s) temprature"),
    ("none", {"top_p": 2}, "top_p: must be in (0, 1]"),
])
def test_bad_configs_name_the_flag(config, override, message):
    with pytest.raises(SpecdecError) as caught:
        load_generation_defaults("smollm2-135m-instruct", config, override)
    assert message in str(caught.value)
