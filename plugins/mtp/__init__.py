"""``mtp``: multi-token prediction over the target's hidden states (FastDeploy's
``method: mtp``; docs/methods.md#mtp), and its ``specdec train-mtp`` command."""

from __future__ import annotations

import specdec

from .proposer import MtpProposer
from .weights import MtpLayerWeights, load_mtp_layers, save_mtp_layers

__all__ = ["MtpProposer", "MtpLayerWeights", "load_mtp_layers", "save_mtp_layers"]


@specdec.hookimpl
def specdec_register_proposers(register):
    register(MtpProposer)


@specdec.hookimpl
def specdec_register_commands(subcommands):
    from .command import add_train_command

    add_train_command(subcommands)
