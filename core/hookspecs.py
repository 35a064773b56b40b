"""The four extension points of specdec: the contract third-party plugins are written against.

A plugin is a module (or package) that an installed distribution declares in the entry-point
group ``specdec``::

    [project.entry-points.specdec]
    mine = "specdec_plugin_mine"

and that implements one or more of the hooks below with the ``specdec.hookimpl`` marker.
Every built-in method, verify strategy, accept policy and attention backend travels the very
same path: it is an entry point of the ``specdec`` distribution.

Each hook receives ``register``, a callable that takes a class. The class carries a unique
``NAME`` (the string users write in their configuration) and, optionally, an attrs class
``Config`` whose fields become flat keys of the speculative config. Registering a name that
another plugin already registered is an error naming both providers.

Registration hooks run once, when an engine (or ``specdec plugins``) builds its registry; the
step loop then calls plain objects, never pluggy.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("specdec")
hookimpl = pluggy.HookimplMarker("specdec")


@hookspec
def specdec_register_proposers(register):
    """Register proposer classes (speculative methods such as ``ngram`` or ``suffix``).

    :param register: call ``register(ProposerClass)`` once per class. The class subclasses
        :class:`specdec.Proposer`, sets ``NAME`` (the ``method`` users select) and implements
        ``propose(batch: specdec.ProposalBatch) -> specdec.Drafts``. It may declare an attrs
        class ``Config``; its fields become flat keys of ``--speculative-config`` next to the
        core keys, and the engine builds the proposer as ``ProposerClass(config, spec_config)``
        where ``config`` is the structured ``Config`` (or ``None``) and ``spec_config`` the
        whole :class:`specdec.SpeculativeConfig`.

    Optional lifecycle methods, called by the engine on the same object:
    ``on_request_start(request: ProposalRequest)`` when a request is admitted,
    ``on_step(batch: ProposalBatch, accepted: list[numpy.ndarray])`` after every step with the
    tokens each request appended, and ``on_request_finish(request_id: str)`` when a request ends.

    Model-based methods (MTP, EAGLE, Medusa, draft models) may also implement
    ``setup(context: specdec.ProposerContext)``, called once after construction and before the
    first request, which gives them the target's ``model_config``, ``tokenizer``, a
    :class:`specdec.TargetModel` handle (``embed``, ``logits``, the shared embedding, final norm
    and LM head) and ``create_cache_layers`` (decoder layers of their own over the engine's
    paged KV cache); and set ``NEEDS_HIDDEN_STATES = True`` to get, in each
    ``ProposalRequest``, ``hidden_states [n, H]`` (the target's last-layer states, before the
    final norm, at the positions computed since the previous proposal whose next token is
    decided), ``hidden_positions [n]`` and ``block_table``. The additions are optional: a
    proposer that uses none of them works unchanged.
    """


@hookspec
def specdec_register_verify_strategies(register):
    """Register verify strategies (``verify_strategy`` in the config).

    :param register: call ``register(StrategyClass)`` once per class. The class subclasses
        :class:`specdec.VerifyStrategy`, sets ``NAME`` and implements
        ``verify(inputs: specdec.VerifyInputs) -> specdec.VerifyResult``, deciding for the whole
        batch how many drafts each request keeps and which target token follows them. A
        strategy that declares an attrs ``Config`` gets its fields as flat config keys.
    """


@hookspec
def specdec_register_accept_policies(register):
    """Register accept policies (``accept_policy`` in the config).

    :param register: call ``register(PolicyClass)`` once per class. The class subclasses
        :class:`specdec.AcceptPolicy`, sets ``NAME`` and implements
        ``apply(result: specdec.VerifyResult, drafts: specdec.Drafts) -> specdec.VerifyResult``,
        which may override the verify strategy's decision (``accept_all`` keeps every draft,
        ``reject_all`` keeps none) for testing and measurement.
    """


@hookspec
def specdec_register_attention_backends(register):
    """Register attention backends (``attention_backend`` in the engine config).

    :param register: call ``register(BackendClass)`` once per class. The class subclasses
        :class:`specdec.AttentionBackend`, sets ``NAME`` and implements ``setup`` (the model's
        shape and RoPE tables), ``init_cache(num_blocks, block_size)`` (it owns the paged KV
        cache memory; the engine owns the block tables), ``prepare(meta)`` (once per step) and
        ``forward(layer, qkv, meta)`` over the packed rows of a step *before RoPE*: the backend
        applies RoPE, writes the rows' keys and values at ``meta.slot_mapping`` and attends
        causally over each request's blocks (see :class:`specdec.AttentionBackend` and
        :class:`specdec.AttentionMetadata`). ``paddle`` is the reference
        backend every faster backend is tested against.
    """


@hookspec
def specdec_register_commands(subcommands):
    """Add subcommands to the ``specdec`` command line (``specdec train-mtp`` is the mtp plugin's).

    :param subcommands: the ``specdec`` parser's argparse sub-parsers object. Call
        ``subcommands.add_parser(name, help=...)``, add the command's arguments to the parser it
        returns, and ``set_defaults(func=run)``; ``run(args) -> int`` is called with the parsed
        arguments and returns the exit status. Bad input is a :class:`specdec.SpecdecError`
        (or :class:`specdec.ConfigError`) raised from ``run``: the command line prints it as
        one line and exits with 2, as it does for its own commands.

    Called when the command line is built, once per plugin, after the registration hooks.
    Import what the command needs inside ``run``, so that building the parser stays cheap.
    A hook that raises, or a name another command already has, becomes a plugin error (see
    ``specdec plugins``) and the other commands still work.
    """
