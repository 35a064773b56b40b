"""The suffix tree of ``method: suffix`` on hand-made cases: counts, probabilities, depth
truncation, removal, incremental matching, and speculate's choice of draft."""

from __future__ import annotations

import random

import pytest

from specdec.plugins.suffix.tree import Matcher, Node, SuffixTree, best_child, best_node_draft


def tree_of(*sequences, depth=64) -> SuffixTree:
    tree = SuffixTree(depth)
    for seq_id, tokens in enumerate(sequences):
        tree.extend(seq_id, tokens)
    return tree


def speculate(tree, context, max_tokens=8, factor=1.0, min_prob=0.1):
    draft = tree.speculate(context, max_tokens, factor, min_prob)
    return draft.token_ids, draft.probs, draft.match_len


ISSUE_RESPONSES = ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5], [1, 2, 6, 7])


# -- counts ---------------------------------------------------------------------------------------


def test_counts_are_occurrences_of_every_substring():
    tree = tree_of([1, 2, 1, 2, 3])
    assert tree.root.count == 5  # one suffix per position
    assert [tree.count(p) for p in ([1], [2], [3], [1, 2], [2, 1], [2, 3], [1, 2, 1], [1, 2, 3])] == [
        2, 2, 1, 2, 1, 1, 1, 1]
    assert tree.count([1, 2, 1, 2, 3]) == 1
    assert tree.count([3, 1]) == 0 and tree.count([4]) == 0
    assert tree.children([]) == {1: 2, 2: 2, 3: 1}
    assert tree.children([1, 2]) == {1: 1, 3: 1}
    assert tree.children([2]) == {1: 1, 3: 1}
    assert tree.children([1, 2, 1]) == {2: 1}
    assert tree.children([1, 2, 3]) == {}


def test_counts_add_up_over_sequences():
    tree = tree_of(*ISSUE_RESPONSES)
    assert tree.root.count == 16
    assert tree.count([1, 2]) == 4
    assert tree.children([1, 2]) == {3: 3, 6: 1}
    assert tree.children([1, 2, 3]) == {4: 1, 5: 2}
    assert tree.children([2, 3]) == {4: 1, 5: 2}
    assert tree.children([3]) == {4: 1, 5: 2}
    assert tree.count([5]) == 2 and tree.children([5]) == {}


def test_best_child_is_the_most_frequent():
    tree = tree_of(*ISSUE_RESPONSES)
    node = tree.locate([1, 2])
    assert isinstance(node, Node) and node.count == 4
    assert best_child(node).token == 3
    assert best_child(tree.locate([1, 2, 3])).token == 5


def test_a_single_occurrence_is_one_leaf():
    tree = tree_of([5, 6, 7, 8, 9])
    # Five suffixes, each taken by one occurrence: five leaves under the root, nothing else.
    assert tree.num_nodes() == 5
    assert tree.count([6, 7, 8]) == 1 and tree.children([6, 7]) == {8: 1}


def test_depth_truncation():
    tree = tree_of([1, 2, 3, 1, 2, 3], depth=2)
    assert tree.root.count == 6
    assert tree.count([1, 2]) == 2 and tree.count([2, 3]) == 2 and tree.count([3, 1]) == 1
    assert tree.count([1, 2, 3]) == 0  # longer than the depth: not stored
    assert tree.children([1]) == {2: 2}
    assert tree.children([1, 2]) == {}
    # A match can be at most 2 tokens, and a depth-2 node has nothing below it: the best draft
    # comes from the 1-token match.
    assert speculate(tree, [3, 1, 2], factor=4.0) == ([3], [1.0], 1)


def test_depth_one_counts_tokens():
    tree = tree_of([4, 4, 5, 4], depth=1)
    assert tree.children([]) == {4: 3, 5: 1}
    assert tree.count([4, 4]) == 0
    assert speculate(tree, [4]) == ([], [], 0)  # nothing below depth 1


# -- removal --------------------------------------------------------------------------------------


def test_remove_restores_the_counts_of_the_rest():
    tree = tree_of(*ISSUE_RESPONSES)
    tree.remove(1)  # one [1, 2, 3, 5]
    assert tree.root.count == 12
    assert tree.children([1, 2]) == {3: 2, 6: 1}
    assert tree.children([1, 2, 3]) == {4: 1, 5: 1}
    tree.remove(2)  # the other [1, 2, 3, 5]
    assert tree.children([1, 2, 3]) == {4: 1}
    assert tree.count([5]) == 0 and tree.count([3, 5]) == 0
    assert best_child(tree.locate([1, 2, 3])).count == 1
    assert speculate(tree, [1, 2, 3]) == ([4], [1.0], 3)


def test_remove_everything_frees_every_node():
    tree = tree_of(*ISSUE_RESPONSES, [1, 2, 1, 2, 1, 2])
    assert tree.num_nodes() > 0
    for seq_id in range(5):
        tree.remove(seq_id)
    assert tree.num_nodes() == 0 and tree.root.count == 0 and len(tree) == 0


def test_removed_id_can_be_added_again_and_only_the_last_sequence_grows():
    tree = tree_of([1, 2, 3])
    tree.extend(0, [4])  # still the growing one
    assert tree.sequence(0) == [1, 2, 3, 4]
    tree.extend(1, [9])
    with pytest.raises(ValueError, match="closed"):
        tree.extend(0, [5])
    tree.remove(0)
    tree.extend(0, [7, 8])
    assert tree.count([1]) == 0 and tree.count([7, 8]) == 1


def test_random_sequences_match_brute_force_counts():
    rng = random.Random(1)
    for _ in range(40):
        depth = rng.randint(1, 6)
        sequences = {i: [rng.randrange(3) for _ in range(rng.randint(0, 12))] for i in range(5)}
        tree = SuffixTree(depth)
        for seq_id, tokens in sequences.items():
            for token in tokens:  # token by token, as a request grows
                tree.append(seq_id, token)
            tree.extend(seq_id, [])
        for seq_id in rng.sample(sorted(sequences), 2):
            tree.remove(seq_id)
            del sequences[seq_id]
        for path in _all_paths(sequences.values(), depth):
            expected = sum(1 for s in sequences.values() for i in range(len(s) - len(path) + 1)
                           if s[i:i + len(path)] == path)
            assert tree.count(path) == expected, (path, sequences, depth)


def _all_paths(sequences, depth):
    paths = set()
    for s in sequences:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                paths.add(tuple(s[i:j]))
    return [list(p) for p in sorted(paths)]


# -- matching -------------------------------------------------------------------------------------


def test_suffix_nodes_of_the_growing_sequence():
    tree = SuffixTree(64)
    tree.extend("r", [1, 2, 3, 1, 2])
    # The suffixes [2] and [1, 2] occurred before; [3, 1, 2] only here (inside a leaf).
    assert [node.count for node in tree.suffix_nodes()] == [2, 2]
    assert [node.token for node in tree.suffix_nodes()] == [2, 2]
    assert tree.suffix_nodes()[1] is tree.locate([1, 2])


def test_matcher_follows_the_context_and_refreshes_after_changes():
    tree = tree_of([7, 1, 2, 3, 4, 5])
    matcher = Matcher(tree)
    for token in [9, 1, 2, 3]:
        matcher.push(token)
    # [3], [2, 3], [1, 2, 3] occur once; [9, 1, 2, 3] not at all.
    assert (matcher.nodes, matcher.top, matcher.seq[matcher.index]) == ([], 3, 4)
    assert matcher.best_draft(8, 1.0, 0.1)[:2] == ([4, 5], [1.0, 1.0])
    tree.extend(1, [2, 3, 6])
    assert matcher.stale
    matcher.reset([9, 1, 2, 3])
    assert [node.count for node in matcher.nodes] == [2, 2] and matcher.top == 3
    assert not matcher.stale


# -- speculate ------------------------------------------------------------------------------------


def test_issue_example():
    tree = tree_of(*ISSUE_RESPONSES)
    assert speculate(tree, [8, 1, 2]) == ([3, 5], [0.75, 0.5], 2)
    assert tree.speculate([8, 1, 2], 8, 1.0, 0.1).score == 1.25
    assert speculate(tree, [8, 1, 2], min_prob=0.6) == ([3], [0.75], 2)


def test_num_speculative_tokens_and_spec_factor_cap_the_draft():
    tree = tree_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert speculate(tree, [2, 3, 4], max_tokens=8) == ([5, 6, 7], [1.0] * 3, 3)
    assert speculate(tree, [2, 3, 4], max_tokens=2) == ([5, 6], [1.0] * 2, 3)
    assert speculate(tree, [2, 3, 4], factor=2.0) == ([5, 6, 7, 8, 9], [1.0] * 5, 3)
    assert speculate(tree, [2, 3, 4], factor=0.5) == ([5], [1.0], 3)  # floor(0.5 * 3) = 1
    assert speculate(tree, [0, 4], factor=0.5) == ([], [], 0)  # floor(0.5 * 1) = 0
    assert speculate(tree, [2, 3, 4], max_tokens=0) == ([], [], 0)


def test_a_shorter_match_wins_with_a_better_score():
    # After [7, 1] the tree saw 8, 9 and 10 (1/3 each); after [1] mostly 2 (8 of 11).
    tree = tree_of([7, 1, 8, 0], [7, 1, 9, 0], [7, 1, 10, 0], *[[1, 2, 0]] * 8)
    assert tree.children([7, 1]) == {8: 1, 9: 1, 10: 1}
    assert tree.count([1]) == 11 and tree.children([1]) == {8: 1, 9: 1, 10: 1, 2: 8}
    # Match 2 drafts [8, 0] (1/3 each: score 2/3); match 1 drafts one token at factor 1: [2]
    # with 8/11, the better score.
    assert speculate(tree, [7, 1]) == ([2], [8 / 11], 1)
    # At factor 2 the one-token match may draft two: [2, 0], 8/11 each.
    assert speculate(tree, [7, 1], factor=2.0) == ([2, 0], [8 / 11, 8 / 11], 1)
    # The longest match wins when its draft scores best: after [9, 0] (in one sequence only).
    assert speculate(tree, [1, 9, 0]) == ([], [], 0)  # [9, 0] ends its sequence
    assert speculate(tree, [7, 1, 9]) == ([0], [1.0], 3)


def test_ties_go_to_the_longer_match():
    tree = tree_of([5, 1, 2, 3])
    # [1] -> [2] and [5, 1] -> [2, 3] both reach probability 1; two tokens beat one, and at
    # factor 4 both drafts are [2, 3] (score 2): the longer match is reported.
    assert speculate(tree, [5, 1], factor=4.0) == ([2, 3], [1.0, 1.0], 2)


def test_min_token_prob_zero_and_one():
    tree = tree_of(*ISSUE_RESPONSES)
    assert speculate(tree, [1, 2], min_prob=1.0) == ([], [], 0)
    assert speculate(tree, [1, 2], factor=4.0, min_prob=0.0) == ([3, 5], [0.75, 0.5], 2)
    assert speculate(tree, [1, 2, 3], min_prob=1.0) == ([], [], 0)
    assert speculate(tree, [6], min_prob=1.0) == ([7], [1.0], 1)


def test_best_node_draft_beat():
    tree = tree_of(*ISSUE_RESPONSES)
    nodes = [tree.locate([2]), tree.locate([1, 2])]
    assert best_node_draft(nodes, 8, 1.0, 0.1).score == 1.25
    assert best_node_draft(nodes, 8, 1.0, 0.1, beat=1.25).token_ids == []  # must be strictly better
    assert best_node_draft(nodes, 8, 1.0, 0.1, beat=1.0).token_ids == [3, 5]


@pytest.mark.parametrize("seed", range(0, 160, 20))
def test_the_compiled_tree_is_the_python_trees_twin(seed):
    """Random sequences added (in two pieces), partly copied from each other so that suffixes
    share paths, and removed, over alphabets small enough for ties between equally frequent
    children: after every change the compiled tree (``suffix_trees.cc``) holds as many nodes
    and gives the same drafts as this module's tree, for random contexts and for contexts
    taken from the stored text, over depths, draft lengths, spec factors and probabilities."""
    from specdec.plugins.suffix.compiled import CompiledSuffixTree

    for case in range(seed, seed + 20):
        rng = random.Random(case)
        depth = rng.choice([1, 2, 3, 5, 8, 64])
        vocab = rng.choice([2, 3, 5, 20])
        python, compiled = SuffixTree(depth), CompiledSuffixTree(depth)
        live = []
        for step in range(40):
            if rng.random() < 0.5 or not live:
                tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
                if live and rng.random() < 0.5 and python.sequence(live[-1]):
                    source = python.sequence(rng.choice(live)) or [0]
                    start = rng.randrange(len(source))
                    tokens = source[start: start + rng.randint(1, 30)] + tokens[:5]
                cut = rng.randint(0, len(tokens))
                for tree in (python, compiled):
                    tree.extend(f"s{step}", tokens[:cut])
                    tree.extend(f"s{step}", tokens[cut:])
                live.append(f"s{step}")
            elif rng.random() < 0.6:
                gone = live.pop(rng.randrange(len(live)))
                python.remove(gone)
                compiled.remove(gone)
            assert python.num_nodes() == compiled.num_nodes(), (case, step)
            assert list(python) == list(compiled)
            for _ in range(4):
                context = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
                if live and rng.random() < 0.5 and python.sequence(live[-1]):
                    source = python.sequence(live[-1])
                    end = rng.randrange(len(source))
                    context = source[max(0, end - rng.randint(0, 20)): end + 1]
                settings = (rng.randint(0, 12), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4]))
                assert python.speculate(context, *settings) == compiled.speculate(context, *settings), (case, step)
