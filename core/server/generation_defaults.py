"""The sampling values a request gets for the fields it leaves out: the model's recommended
settings, as vLLM's ``--generation-config`` has them.

Clients such as simonw's ``llm`` send no temperature at all. Filling the gap with temperature
1.0 and no top-k/top-p makes a small model ramble (the default model answered "hello" with
thousands of tokens of mixed-script text); its recommended settings keep it on track.

- ``auto`` (the default): a Hugging Face checkpoint's ``generation_config.json`` when it has
  one; for a GGUF file, llama.cpp's documented defaults (:data:`LLAMA_CPP_DEFAULTS`:
  temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), which GGUF files do not record.
- ``none``: no defaults; a field left out means temperature 1.0, no top-k, top-p, min-p or
  repetition penalty (the OpenAI API's own defaults).
- a path: a ``generation_config.json`` file, or a folder holding one.

``--override-generation-config JSON`` then sets or replaces single values
(``{"temperature": 0.5}``). Only the keys in :data:`KEYS` are read; the values are checked like
a request's (``SamplingParams``). A request's own values always win.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import attrs

from ..errors import RequestError, SpecdecError
from ..model.resolve import resolve_model_path
from ..sampling import SamplingParams

#: The sampling fields a generation config may set (the names are those of
#: ``generation_config.json`` and of the request).
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
#: llama.cpp's defaults (``llama-server --help``: --temp 0.8, --top-k 40, --top-p 0.95, --min-p 0.05).
LLAMA_CPP_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
#: What a field left out means without any generation config (the OpenAI API's defaults).
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@attrs.define(frozen=True)
class GenerationDefaults:
    """The values a request gets for the sampling fields it leaves out, and where they come from."""

    values: dict = attrs.field(factory=dict)
    #: ``llama.cpp defaults (GGUF)``, ``generation_config.json at PATH``, ``none``, plus ``+ override``.
    source: str = "none"

    def value(self, name: str, given: Any) -> Any:
        """``given`` when the request set it, else the default (then the API's)."""
        if given is not None:
            return given
        return self.values.get(name, API_DEFAULTS[name])

    def describe(self) -> str:
        """One line for the startup message: the values and their source."""
        shown = ", ".join(f"{k} {v:g}" for k, v in self.values.items()) or "the API's (temperature 1)"
        return f"sampling defaults {shown} ({self.source})"


def load_generation_defaults(model: str, generation_config: str = "auto",
                             override: Optional[dict] = None) -> GenerationDefaults:
    """The defaults for ``model`` (as ``--model`` takes it) under ``--generation-config`` and
    ``--override-generation-config``; a :class:`SpecdecError` naming the flag when either is bad."""
    if generation_config == "none":
        values, source = {}, "none"
    elif generation_config == "auto":
        path = resolve_model_path(model)
        config_file = path / "generation_config.json" if path.is_dir() else None
        if config_file is not None and config_file.is_file():
            values, source = _read(config_file), f"{config_file}"
        elif config_file is None:
            values, source = dict(LLAMA_CPP_DEFAULTS), "llama.cpp's defaults for a GGUF model"
        else:
            values, source = {}, "none: the checkpoint has no generation_config.json"
    else:
        path = Path(generation_config).expanduser()
        config_file = path / "generation_config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise SpecdecError(f"--generation-config: {config_file} does not exist (auto, none, or a "
                               "generation_config.json file or folder)")
        values, source = _read(config_file), f"{config_file}"
    if override:
        if not isinstance(override, dict):
            raise SpecdecError("--override-generation-config: expected a JSON object")
        unknown = sorted(set(override) - set(KEYS))
        if unknown:
            raise SpecdecError(f"--override-generation-config: unknown key(s) {', '.join(unknown)}; "
                               f"known: {', '.join(KEYS)}")
        values = {**values, **override}
        source += " + --override-generation-config"
    try:
        SamplingParams(**{k: v for k, v in values.items()})
    except RequestError as exc:
        raise SpecdecError(f"generation config ({source}): {exc}") from None
    return GenerationDefaults({k: values[k] for k in KEYS if k in values}, source)


def _read(config_file: Path) -> dict:
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecdecError(f"--generation-config: cannot read {config_file}: {exc}") from None
    if not isinstance(data, dict):
        raise SpecdecError(f"--generation-config: {config_file} does not hold a JSON object")
    values = {k: data[k] for k in KEYS if data.get(k) is not None}
    if data.get("do_sample") is False:  # transformers' switch for greedy decoding
        values["temperature"] = 0.0
    return values
