"""``medusa``: Medusa heads for specdec, a third-party-style plugin on the public contract.

K heads, each one residual block over the target's last hidden state (``x_k = n + SiLU(W_k n +
b_k)`` on the normed state ``n``), share the target's LM head; head ``k`` guesses the token
``k`` positions past the target's own next one, and the draft is the top-1 of each head in
order (chain drafting). Trained heads for the default model ship with the package; train heads
for another target with ``python -m specdec_plugin_medusa.train``.
"""

from __future__ import annotations

import specdec

from .heads import SHIPPED_HEADS, MedusaHeads, load_heads, save_heads
from .proposer import MedusaConfig, MedusaProposer

__all__ = ["MedusaProposer", "MedusaConfig", "MedusaHeads", "load_heads", "save_heads", "SHIPPED_HEADS"]


@specdec.hookimpl
def specdec_register_proposers(register):
    register(MedusaProposer)
