"""Turn ``--model`` (an alias, a ``.gguf`` path or a checkpoint directory) into loaded weights.
Finding the file is :mod:`specdec.model_paths`' (its names are here too, for the loaders' callers)."""

from __future__ import annotations

from ..model_paths import (DEFAULT_MODEL, GGUF_MAGIC, MODEL_ALIASES, is_gguf_file, known_model_name,  # noqa: F401
                           resolve_model_path)


def load_checkpoint(model: str, progress: bool = True, keep_quantized: bool = False):
    """``(ModelConfig, weights, tokenizer)`` for ``model`` (alias, GGUF path or HF directory);
    ``keep_quantized`` keeps a GGUF file's quantized matrices as blocks (see ``load_gguf``)."""
    path = resolve_model_path(model)
    if path.is_dir():
        from .hf_loader import load_hf_dir

        return load_hf_dir(path, progress=progress)
    from .gguf_loader import load_gguf

    return load_gguf(path, progress=progress, keep_quantized=keep_quantized)
