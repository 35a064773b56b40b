"""Medusa head weights: the file format, and the heads that ship with the package.

A heads file is a safetensors file with two tensors and a little metadata:

- ``medusa.weight`` ``[K, H, H]``: ``W_k`` of head ``k`` (``k = 1..K`` at index ``k - 1``), used as
  ``x @ W_k.T`` (the ``nn.Linear`` convention);
- ``medusa.bias`` ``[K, H]``: ``b_k``;
- metadata ``format = "specdec-medusa"``, ``hidden_size``, ``num_heads``, ``model`` (the target
  the heads were trained for).

Head ``k`` maps the target's normed last hidden state ``n`` (its final RMSNorm applied, what
its LM head reads) to ``n + SiLU(W_k n + b_k)``, which the target's LM head turns into logits
for the token ``k`` positions past the target's own next token.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

from specdec.sdk import SpecdecError

FORMAT = "specdec-medusa"
HEADS_DIR = Path(__file__).resolve().parent / "heads"
#: The heads that ship with this package, by the model name that selects their target.
SHIPPED_HEADS = {"smollm2-135m-instruct": HEADS_DIR / "smollm2-135m-instruct.safetensors"}


@attrs.define
class MedusaHeads:
    """``weight [K, H, H]`` and ``bias [K, H]`` (float32), and the target they were trained for."""

    weight: np.ndarray
    bias: np.ndarray
    model: str = ""

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[-1])

    @classmethod
    def zeros(cls, num_heads: int, hidden_size: int, model: str = "") -> "MedusaHeads":
        """Untrained heads: each reproduces the target's own LM head (``W = 0``, ``b = 0``)."""
        return cls(np.zeros((num_heads, hidden_size, hidden_size), np.float32),
                   np.zeros((num_heads, hidden_size), np.float32), model)


def save_heads(heads: MedusaHeads, path, dtype=np.float16) -> None:
    """Write ``heads`` to ``path`` (float16 by default: half the size, no measurable loss)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"medusa.weight": np.ascontiguousarray(heads.weight, dtype=dtype),
               "medusa.bias": np.ascontiguousarray(heads.bias, dtype=dtype)}, str(path),
              metadata={"format": FORMAT, "hidden_size": str(heads.hidden_size), "num_heads": str(heads.num_heads),
                        "model": heads.model})


def load_heads(path) -> MedusaHeads:
    """Read a heads file; a one-line :class:`SpecdecError` for a missing or malformed one."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"medusa_heads_path: no such file: {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            keys = set(f.keys())
            if not {"medusa.weight", "medusa.bias"} <= keys:
                raise SpecdecError(f"medusa_heads_path: {path} holds no Medusa heads (expected medusa.weight and "
                                   f"medusa.bias, found {', '.join(sorted(keys)) or 'nothing'})")
            weight = f.get_tensor("medusa.weight").astype(np.float32)
            bias = f.get_tensor("medusa.bias").astype(np.float32)
    except SpecdecError:
        raise
    except Exception as exc:  # noqa: BLE001 - not a safetensors file
        raise SpecdecError(f"medusa_heads_path: cannot read {path}: {' '.join(str(exc).split())}") from None
    if weight.ndim != 3 or weight.shape[1] != weight.shape[2] or bias.shape != weight.shape[:2]:
        raise SpecdecError(f"medusa_heads_path: {path}: medusa.weight must be [K, H, H] and medusa.bias [K, H], "
                           f"got {list(weight.shape)} and {list(bias.shape)}")
    return MedusaHeads(weight, bias, metadata.get("model", ""))
