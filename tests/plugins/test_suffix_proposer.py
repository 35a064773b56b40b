"""The ``suffix`` proposer: its config keys, the lifecycle that keeps its trees in step, the
global tree's cache of responses, and drafting over both trees.

Tests that look inside (a request's tree, the global tree's counts) run on the Python trees
(``native=False``); those that only propose run on both, and a random lifecycle holds the
compiled trees to the Python ones draft for draft."""

from __future__ import annotations

import numpy as np
import pytest

import specdec
from specdec.config import build_speculative_config
from specdec.errors import ConfigError
from specdec.plugin_manager import get_plugins
from specdec.plugins.suffix import SuffixConfig, SuffixProposer
from specdec.sampling import SamplingParams
from specdec.testing import check_proposer


def request(request_id, tokens, num_prompt_tokens=None, max_draft_len=5, tenant=None):
    tokens = np.asarray(tokens, dtype=np.int64)
    tokens.flags.writeable = False
    return specdec.ProposalRequest(request_id, tokens, len(tokens) if num_prompt_tokens is None
                                   else num_prompt_tokens, max_draft_len, tenant=tenant)


def propose(proposer, *requests):
    return proposer.propose(specdec.ProposalBatch(list(requests))).to_lists()


def run_request(proposer, request_id, prompt, generated, tenant=None):
    """Start a request, feed its generated tokens one step at a time, finish it."""
    proposer.on_request_start(request(request_id, prompt, tenant=tenant))
    tokens = list(prompt)
    for token in generated:
        batch = specdec.ProposalBatch([request(request_id, tokens, len(prompt), tenant=tenant)])
        proposer.on_step(batch, [np.array([token], dtype=np.int64)])
        tokens.append(token)
    proposer.on_request_finish(request_id)


def make(native: bool = False, **keys) -> SuffixProposer:
    proposer = SuffixProposer(SuffixConfig(**keys), native=native)
    assert (proposer.native is not None) == native  # this machine has a C++ compiler: the compiled trees load
    return proposer


both_trees = pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])


# -- config ---------------------------------------------------------------------------------------


def test_flat_keys_and_defaults():
    spec = build_speculative_config({"method": "suffix"}, get_plugins())
    assert spec.method_config == SuffixConfig()
    assert attrs_dict(spec.method_config) == {
        "suffix_decoding_max_tree_depth": 64,
        "suffix_decoding_max_cached_requests": 10000,  # vLLM's default: bounded memory
        "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.1,
        "suffix_decoding_cache_scope": "global",
    }
    spec = build_speculative_config({"method": "suffix", "num_speculative_tokens": 8,
                                     "suffix_decoding_max_tree_depth": 24,
                                     "suffix_decoding_max_spec_factor": 2}, get_plugins())
    assert spec.num_speculative_tokens == 8
    assert spec.method_config.suffix_decoding_max_tree_depth == 24
    assert spec.method_config.suffix_decoding_max_spec_factor == 2.0


def attrs_dict(config):
    import attrs

    return attrs.asdict(config)


@pytest.mark.parametrize("key, value, message", [
    ("suffix_decoding_max_tree_depth", 0, "must be >= 1, got 0"),
    ("suffix_decoding_max_cached_requests", -2, "must be >= -1, got -2"),
    ("suffix_decoding_max_spec_factor", 0, "must be > 0, got 0.0"),
    ("suffix_decoding_min_token_prob", 1.5, "must be between 0 and 1, got 1.5"),
    ("suffix_decoding_max_tree_depth", 6.0, "expected int, got float 6.0"),
])
def test_bad_values_are_one_line_errors(key, value, message):
    with pytest.raises(ConfigError) as info:
        build_speculative_config({"method": "suffix", key: value}, get_plugins(), "--speculative-config")
    assert str(info.value) == f"--speculative-config.{key}: {message}"


def test_proposer_contract():
    check_proposer(SuffixProposer)
    check_proposer(SuffixProposer, SuffixConfig(suffix_decoding_max_cached_requests=0))
    check_proposer(SuffixProposer, SuffixConfig(suffix_decoding_max_tree_depth=1,
                                                suffix_decoding_max_cached_requests=1,
                                                suffix_decoding_min_token_prob=0.0))
    check_proposer(SuffixProposer, SuffixConfig(suffix_decoding_max_spec_factor=4.0))


# -- the request's own tree -----------------------------------------------------------------------


def test_drafts_from_the_prompt():
    proposer = make()
    prompt = [1, 2, 3, 4, 9, 1, 2]
    proposer.on_request_start(request("a", prompt))
    # [1, 2] occurred twice, once right here at the end: 3 follows with probability 1/2.
    assert propose(proposer, request("a", prompt)) == [[3, 4]]
    draft = proposer.speculate(proposer.requests["a"], 5)
    assert (draft.probs, draft.match_len) == ([0.5, 0.5], 2)
    assert propose(make(suffix_decoding_min_token_prob=0.6), request("a", prompt)) == [[]]


@both_trees
def test_drafts_are_labelled_with_their_match_length(native):
    """``Drafts.classes``: the match length, capped at MAX_DRAFT_CLASS; 0 without a draft."""
    from specdec.plugins.suffix.proposer import MAX_DRAFT_CLASS

    proposer = make(native)
    loop = list(range(20)) * 2  # the second pass matches the whole first one
    drafts = proposer.propose(specdec.ProposalBatch([
        request("short", [1, 2, 3, 4, 9, 1, 2]), request("long", loop, 20), request("none", [7, 8, 9]),
    ]))
    assert drafts.to_lists()[0] == [3, 4] and drafts.to_lists()[2] == []
    assert drafts.classes.tolist() == [2, MAX_DRAFT_CLASS, 0]


def test_on_step_appends_and_finish_frees():
    proposer = make()
    proposer.on_request_start(request("a", [5, 6, 7]))
    proposer.on_step(specdec.ProposalBatch([request("a", [5, 6, 7])]), [np.array([5, 6], dtype=np.int64)])
    assert proposer.requests["a"].tokens == [5, 6, 7, 5, 6]
    assert propose(proposer, request("a", [5, 6, 7, 5, 6], 3)) == [[7, 5]]
    proposer.on_request_finish("a")
    assert "a" not in proposer.requests


def test_state_is_built_lazily_and_catches_up():
    proposer = make()
    # Never started: propose builds the request's tree from token_ids.
    assert propose(proposer, request("a", [1, 2, 3, 1, 2], 2)) == [[3, 1]]
    # The engine skipped on_step for two tokens: propose catches up from token_ids.
    assert propose(proposer, request("a", [1, 2, 3, 1, 2, 3, 1], 2)) == [[2, 3, 1]]
    assert proposer.requests["a"].tokens == [1, 2, 3, 1, 2, 3, 1]
    # on_step for a request it never saw builds it from the step's context first.
    proposer.on_step(specdec.ProposalBatch([request("b", [4, 5, 4])]), [np.array([5], dtype=np.int64)])
    assert proposer.requests["b"].tokens == [4, 5, 4, 5]


def test_preempted_request_resumes_with_its_tree():
    proposer = make()
    proposer.on_request_start(request("a", [1, 2, 3]))
    proposer.on_step(specdec.ProposalBatch([request("a", [1, 2, 3])]), [np.array([1], dtype=np.int64)])
    tree = proposer.requests["a"].tree
    # Admitted again later with everything it has so far: the same tree goes on.
    proposer.on_request_start(request("a", [1, 2, 3, 1, 2], 3))
    assert proposer.requests["a"].tree is tree and tree.sequence(0) == [1, 2, 3, 1, 2]
    # Fewer tokens than the tree holds is another history: start over.
    proposer.on_request_start(request("a", [7, 8]))
    assert proposer.requests["a"].tokens == [7, 8]


@both_trees
def test_max_draft_len_per_request(native):
    proposer = make(native)
    loop = [1, 2, 3, 4] * 4
    drafts = proposer.propose(specdec.ProposalBatch([
        request("a", loop, 4, 5), request("b", [9, 8, 7], 3, 5), request("c", loop, 4, 2),
        request("d", loop, 4, 0),
    ]))
    assert drafts.to_lists() == [[1, 2, 3, 4, 1], [], [1, 2], []]
    assert drafts.lengths.tolist() == [5, 0, 2, 0]
    assert drafts.token_ids.shape == (4, 5) and drafts.token_ids[1].tolist() == [-1] * 5


# -- the global tree ------------------------------------------------------------------------------


def test_finished_responses_feed_the_global_tree():
    proposer = make()
    run_request(proposer, "a", [100, 101], [1, 2, 3, 4, 5, 6])
    tree = proposer.global_tree
    assert list(tree) == ["a"] and tree.sequence("a") == [1, 2, 3, 4, 5, 6]
    assert tree.count([100]) == 0  # the prompt is not cached, only the response
    # Another request that writes [7, 2, 3] continues as "a" did.
    assert propose(proposer, request("b", [7, 2, 3])) == [[4, 5]]
    draft = proposer.speculate(proposer.requests["b"], 5)
    assert (draft.probs, draft.match_len) == ([1.0, 1.0], 2)


def test_issue_example_through_the_proposer():
    proposer = make()
    for number, response in enumerate(([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 6, 7])):
        run_request(proposer, f"r{number}", [50], response)
    assert propose(proposer, request("x", [60, 1, 2])) == [[3, 5]]
    assert proposer.speculate(proposer.requests["x"], 5).probs == [0.75, 0.5]
    strict = make(suffix_decoding_min_token_prob=0.6)
    for number, response in enumerate(([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 6, 7])):
        run_request(strict, f"r{number}", [50], response)
    assert propose(strict, request("x", [60, 1, 2])) == [[3]]


def test_fifo_eviction():
    proposer = make(suffix_decoding_max_cached_requests=2)
    for name, response in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        run_request(proposer, name, [0], response)
    tree = proposer.global_tree
    assert list(tree) == ["b", "c"]
    assert tree.count([1, 2]) == 0 and tree.count([4, 5]) == 1 and tree.count([7, 8]) == 1
    run_request(proposer, "d", [0], [1, 2])
    assert list(tree) == ["c", "d"] and tree.count([4]) == 0
    # Finishing an id again replaces its response and makes it the newest.
    run_request(proposer, "c", [0], [3, 3])
    assert list(tree) == ["d", "c"] and tree.count([7]) == 0 and tree.count([3, 3]) == 1


def test_unlimited_and_off():
    unlimited = make(suffix_decoding_max_cached_requests=-1)
    for number in range(30):
        run_request(unlimited, f"r{number}", [0], [number, number + 1])
    assert len(unlimited.global_tree) == 30
    off = make(suffix_decoding_max_cached_requests=0)
    run_request(off, "a", [0], [1, 2, 3])
    assert off.global_tree is None
    assert propose(off, request("b", [1, 2])) == [[]]


def test_the_bound_holds_over_many_requests_and_eviction_leaves_the_kept_responses_tree():
    """500 random responses through a cache of 40: the tree never holds more than 40, its
    size stops growing, and what eviction leaves counts as the tree of the last 40 responses
    does (same counts, same drafts): eviction never leaves a draft of evicted text behind."""
    from specdec.plugins.suffix import SuffixTree

    rng = np.random.default_rng(0)
    responses = [rng.integers(0, 50, size=rng.integers(5, 60)).tolist() for _ in range(500)]
    proposer = make(suffix_decoding_max_cached_requests=40)
    sizes = []
    for number, response in enumerate(responses):
        run_request(proposer, f"r{number}", [0], response)
        assert len(proposer.global_tree) <= 40
        sizes.append(proposer.global_tree.num_nodes())
    assert max(sizes[100:]) < 1.5 * max(sizes[:100])
    fresh = SuffixTree(proposer.depth)
    for number in range(460, 500):
        fresh.extend(f"r{number}", responses[number])
    tree = proposer.global_tree
    assert tree.num_nodes() <= 1.2 * fresh.num_nodes()  # removal keeps a few count-1 inner nodes
    for response in (*responses[::25], *responses[460::5]):  # evicted ones and kept ones
        for start in range(0, len(response) - 3, 7):
            for context in (response[start: start + 2], response[start: start + 4]):
                assert tree.count(context) == fresh.count(context)
                draft, expected = tree.speculate(context, 8), fresh.speculate(context, 8)
                # The same draft up to ties between equally frequent tokens: equal probabilities,
                # and the drafted text occurs in the kept responses as often.
                assert (draft.probs, draft.score, draft.match_len) == (expected.probs, expected.score,
                                                                        expected.match_len)
                drafted = [*context[len(context) - draft.match_len:], *draft.token_ids]
                assert not draft.token_ids or tree.count(drafted) == fresh.count(drafted) > 0


@both_trees
def test_tenant_scope_keeps_one_tenants_responses_from_drafting_for_another(native):
    response = list(range(200, 230))  # no token repeats: the request's own tree drafts nothing
    prompt_b = [7] + response[:10]  # B writes the very text of A's response
    drafts = {}
    for scope in ("global", "tenant"):
        proposer = make(native, suffix_decoding_cache_scope=scope)
        run_request(proposer, "a1", [5], response, tenant="key-a")
        drafts[scope, "B"] = propose(proposer, request("b1", prompt_b, tenant="key-b"))
        drafts[scope, "A"] = propose(proposer, request("a2", prompt_b, tenant="key-a"))
        drafts[scope, "anonymous"] = propose(proposer, request("n1", prompt_b))
    assert drafts["global", "B"] == drafts["global", "A"] == [response[10:15]]
    assert drafts["tenant", "B"] == [[]] and drafts["tenant", "anonymous"] == [[]]
    assert drafts["tenant", "A"] == [response[10:15]]  # a tenant still learns from itself


@both_trees
def test_tenant_trees_are_bounded_together(native):
    proposer = make(native, suffix_decoding_cache_scope="tenant", suffix_decoding_max_cached_requests=3)
    for number in range(6):
        run_request(proposer, f"r{number}", [0], [number, number + 1, 9], tenant=f"key-{number % 2}")
    assert sorted(proposer.response_trees) == ["key-0", "key-1"]
    assert sum(len(tree) for tree in proposer.response_trees.values()) == 3
    # A tenant whose last response is evicted leaves no (empty) tree behind; a request of it
    # that started before then drafts from its new tree once there is one.
    proposer.on_request_start(request("x", [9, 1, 2], tenant="key-9"))
    run_request(proposer, "s0", [0], [1, 2, 7], tenant="key-9")
    for number in range(3):
        run_request(proposer, f"t{number}", [0], [number, 4], tenant="key-0")
    assert "key-9" not in proposer.response_trees
    run_request(proposer, "s1", [0], [1, 2, 8], tenant="key-9")
    assert propose(proposer, request("x", [9, 1, 2], tenant="key-9")) == [[8]]


def test_the_best_score_over_both_trees():
    proposer = make()
    # Globally, [5, 6] went on with 7 8 9 every time.
    for number in range(3):
        run_request(proposer, f"r{number}", [0], [5, 6, 7, 8, 9])
    # This request saw [5, 6] go on with 1 once: its own tree drafts [1, 5] (1/2 each: score
    # 1), the global tree [7, 8] (1 each: score 2), which wins.
    proposer.on_request_start(request("x", [5, 6, 1, 5, 6]))
    own = proposer.requests["x"].tree
    assert own.speculate([5, 6, 1, 5, 6], 5, 1.0, 0.1)[:3] == ([1, 5], [0.5, 0.5], 1.0)
    assert propose(proposer, request("x", [5, 6, 1, 5, 6])) == [[7, 8]]


def test_equal_scores_go_to_the_requests_own_tree():
    proposer = make()
    run_request(proposer, "r", [0], [3, 4, 7])
    # Global: [3, 4] went on with 7 (score 1). Own: [3, 4] went on with 8 9 once, and occurs
    # here too: [8, 9] with 1/2 each (score 1). A tie: the request's own tree wins.
    proposer.on_request_start(request("y", [3, 4, 8, 9, 3, 4]))
    assert proposer.global_tree.speculate([3, 4, 8, 9, 3, 4], 5, 1.0, 0.1)[:3] == ([7], [1.0], 1.0)
    draft = proposer.speculate(proposer.requests["y"], 5)
    assert (draft.token_ids, draft.probs, draft.match_len) == ([8, 9], [0.5, 0.5], 2)


@pytest.mark.parametrize("scope, max_cached", [("global", 4), ("tenant", 3), ("global", 0)])
def test_the_compiled_trees_draft_as_the_python_trees(scope, max_cached):
    """A random lifecycle through both proposers: requests of a few tenants start (some
    after a preemption with a new history), step with 0-3 accepted tokens, skip steps, turn
    reproducible, and finish into a small cache that evicts. Every proposal is the same: the
    tokens, the lengths and the match-length classes."""
    rng = np.random.default_rng(len(scope) + max_cached)
    keys = dict(suffix_decoding_max_tree_depth=int(rng.choice([3, 8, 64])), suffix_decoding_cache_scope=scope,
                suffix_decoding_max_cached_requests=max_cached)
    python, compiled = make(False, **keys), make(True, **keys)
    phrases = [rng.integers(0, 12, size=rng.integers(2, 9)).tolist() for _ in range(6)]
    running: dict[str, list] = {}
    for step in range(400):
        if len(running) < 4 and rng.random() < 0.3:
            request_id = f"r{rng.integers(0, 12)}"
            prompt = [token for _ in range(rng.integers(1, 4)) for token in phrases[rng.integers(0, 6)]]
            running.setdefault(request_id, [prompt, len(prompt), f"key-{rng.integers(0, 2)}", False])
            if rng.random() < 0.2:  # preempted: admitted again with another history
                running[request_id][:2] = [prompt, len(prompt)]
            for proposer in (python, compiled):
                proposer.on_request_start(request(request_id, running[request_id][0], running[request_id][1],
                                                  tenant=running[request_id][2]))
        if not running:
            continue
        batch = []
        for request_id, (tokens, prompt_len, tenant, reproducible) in running.items():
            proposal = request(request_id, tokens, prompt_len, int(rng.integers(0, 7)), tenant=tenant)
            batch.append(attrs_evolve(proposal, sampling=SEEDED) if reproducible else proposal)
        drafts = [proposer.propose(specdec.ProposalBatch(batch)) for proposer in (python, compiled)]
        assert drafts[0].to_lists() == drafts[1].to_lists(), step
        assert drafts[0].classes.tolist() == drafts[1].classes.tolist(), step
        accepted = []
        for request_id, entry in running.items():
            phrase = phrases[rng.integers(0, 6)]
            grown = phrase[: rng.integers(0, 4)] if rng.random() < 0.8 else [int(rng.integers(0, 12))]
            accepted.append(np.array(grown, dtype=np.int64))
            entry[3] = entry[3] or rng.random() < 0.05
        if rng.random() < 0.9:  # sometimes the engine skips on_step: propose catches up
            for proposer in (python, compiled):
                proposer.on_step(specdec.ProposalBatch(batch), accepted)
        for (request_id, entry), grown in zip(running.items(), accepted):
            entry[0] = entry[0] + grown.tolist()
        if rng.random() < 0.15:
            request_id = list(running)[rng.integers(0, len(running))]
            del running[request_id]
            for proposer in (python, compiled):
                proposer.on_request_finish(request_id)
    assert sorted(map(str, python.response_trees)) == sorted(map(str, compiled.response_trees))
    for key, tree in python.response_trees.items():
        assert list(tree) == list(compiled.response_trees[key])
        assert tree.num_nodes() == compiled.response_trees[key].num_nodes()


#: A seeded sampled request's settings: its drafts come from its own tree alone.
SEEDED = SamplingParams(temperature=0.8, seed=7)


def attrs_evolve(instance, **changes):
    import attrs

    return attrs.evolve(instance, **changes)


def test_the_compiled_requests_catch_up_start_over_and_free():
    """The compiled path's bookkeeping, as the Python one's above: on_step appends, propose
    catches up from token_ids, fewer tokens than it holds starts the request over, finish
    frees it and hands its response to the global tree."""
    proposer = make(True)
    proposer.on_request_start(request("a", [5, 6, 7]))
    proposer.on_step(specdec.ProposalBatch([request("a", [5, 6, 7])]), [np.array([5, 6], dtype=np.int64)])
    assert proposer.native.tokens("a") == [5, 6, 7, 5, 6]
    assert propose(proposer, request("a", [5, 6, 7, 5, 6, 7, 5], 3)) == [[6, 7, 5]]
    assert proposer.native.tokens("a") == [5, 6, 7, 5, 6, 7, 5]
    proposer.on_request_start(request("a", [7, 8], 1))  # another history: start over
    assert proposer.native.tokens("a") == [7, 8]
    proposer.on_request_finish("a")
    assert "a" not in proposer.native and len(proposer.native) == 0
    assert list(proposer.global_tree) == ["a"] and proposer.global_tree.sequence("a") == [8]
