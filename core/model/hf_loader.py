"""Load a Hugging Face checkpoint directory: ``config.json``, ``*.safetensors``, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import SpecdecError
from .config import ModelConfig


def load_hf_dir(path: str | Path, progress: bool = True):
    """Read ``path``: returns ``(ModelConfig, weights, tokenizer)`` with float32 numpy weights."""
    from safetensors.numpy import load_file
    from tqdm import tqdm

    from .tokenizer import Tokenizer

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpecdecError(f"{path} is not a Hugging Face checkpoint: no config.json")
    config = ModelConfig.from_hf(json.loads(config_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"{path} has no *.safetensors files")
    weights: dict[str, np.ndarray] = {}
    for file in tqdm(files, desc="loading weights", unit="file", disable=not progress, leave=False):
        for name, array in load_file(str(file)).items():
            weights[name] = _to_float32(array)
    return config, weights, Tokenizer.from_hf_dir(path)


def _to_float32(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint16:  # bfloat16 as numpy has no such dtype: widen the bits
        return (array.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(array, dtype=np.float32)


def save_hf_dir(path: str | Path, config: ModelConfig, weights: dict[str, np.ndarray], tokenizer) -> None:
    """Write a Hugging Face style checkpoint (used to cross-check the loaders)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(path / "model.safetensors"))
    tokenizer.to_hf_dir(path)
