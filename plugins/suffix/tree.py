"""A suffix trie of bounded depth with occurrence counts, and drafting from it.

The tree holds sequences of token ids. Every suffix of every sequence, cut to ``max_depth``
tokens, is a path from the root; a node's ``count`` is the number of those suffixes that pass
through it, i.e. how often the path's tokens occur in the sequences (occurrences longer than
``max_depth`` are not counted). The root's count is the number of suffixes.

Storage. A path that only one suffix takes (count 1) is not spelled out node by node: it is a
:class:`Leaf` that points into the sequence's token list. Inner nodes are :class:`Node` objects
of one token each, with a children dict and their most frequent child (``best``), so a draft
costs O(draft length) once the match is known. Leaves of the sequence being appended to grow
with it for free (their end is ``min(limit, len(seq))``), so appending a token costs one step
per suffix that ends at an inner node (those that occurred before): at most ``max_depth``.
Memory is at most one node per (position, depth) of the stored sequences and is usually far
less; removing a sequence frees its leaves and the nodes only it used.

Drafting (the semantics of ``method: suffix``, see docs/methods.md): for each match length
``m`` the node of the context's last ``m`` tokens is the match; from there follow the most
frequent child while the path probability, the product of child count / parent count (which
telescopes to count(child) / count(match)), stays at or above ``min_token_prob``, for at most
``min(max_tokens, floor(max_spec_factor * m))`` tokens. A draft's score is the sum of its
probabilities (the expected number of accepted tokens); the best score wins, ties going to the
longer match.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Hashable, Iterable, NamedTuple, Optional, Sequence, Union

_by_count = attrgetter("count")


class Node:
    """An inner node: the path from the root to here ends in ``token`` and occurs ``count``
    times. ``children`` maps the next token to a :class:`Node` or :class:`Leaf`; ``best`` is
    the child with the highest count (``None`` without children, :data:`STALE` until
    recomputed after a removal; not kept for the root: no match ends there)."""

    __slots__ = ("token", "count", "children", "best")

    def __init__(self, token: int, count: int):
        self.token = token
        self.count = count
        self.children: dict = {}
        self.best: Union["Node", "Leaf", None] = None


class Leaf:
    """The rest of a path that a single suffix takes: tokens ``seq[pos:min(limit, len(seq))]``.

    ``seq`` is the token list of the sequence the suffix belongs to; ``limit`` is where its
    suffix is cut (suffix start + ``max_depth``).
    """

    __slots__ = ("seq", "pos", "limit")
    #: One suffix takes a leaf, so every token along it occurs once.
    count = 1

    def __init__(self, seq: list, pos: int, limit: int):
        self.seq = seq
        self.pos = pos
        self.limit = limit

    @property
    def end(self) -> int:
        """One past the last token of the leaf in ``seq``."""
        return min(self.limit, len(self.seq))


class _Stale:
    """``Node.best`` after the best child lost count: recomputed when next read (removing a
    response would otherwise rescan a node's children at every decrement). Its infinite count
    keeps increments from replacing it with a child that may not be the most frequent."""

    __slots__ = ()
    count = float("inf")


STALE = _Stale()


def best_child(node: Node) -> Union[Node, Leaf, None]:
    """``node.best``, recomputed first if a removal left it stale."""
    best = node.best
    if best is STALE:
        best = node.best = max(node.children.values(), key=_by_count) if node.children else None
    return best


#: Where a context suffix ends in a tree: at a Node, or at ``(leaf, index)`` meaning inside
#: ``leaf`` with ``leaf.seq[index]`` the token that follows (the suffix occurs once).
Location = Union[Node, tuple]


class Draft(NamedTuple):
    """A proposed continuation: ``token_ids`` with the path probability of each, their sum
    ``score`` (the expected number of accepted tokens) and the match length it came from."""

    token_ids: list
    probs: list
    score: float
    match_len: int


#: No draft (shared: do not modify its lists).
EMPTY_DRAFT = Draft([], [], 0.0, 0)


class SuffixTree:
    """Suffix trie over sequences (keyed by any hashable id), each suffix cut to ``max_depth``.

    Add tokens with :meth:`append` / :meth:`extend` and drop a whole sequence with
    :meth:`remove`. Only the sequence appended to last can grow: appending to another one
    closes it (a per-request tree holds one sequence; the global tree adds whole responses).
    ``version`` changes with every change, so :class:`Matcher` objects know when to refresh.
    """

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = Node(-1, 0)
        self.version = 0
        self._seqs: dict[Hashable, list] = {}
        self._growing: Optional[Hashable] = None
        #: The nodes where the growing sequence's suffixes of length 1, 2, ... end, as far as
        #: they end at inner nodes (longer suffixes lie in leaves).
        self._active: list[Node] = []

    # -- building --------------------------------------------------------------------------------

    def append(self, seq_id: Hashable, token: int) -> None:
        """Append ``token`` to sequence ``seq_id`` (a new sequence when the id is new)."""
        self.extend(seq_id, (token,))

    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id``: O(max_depth) per token."""
        if seq_id != self._growing:
            if seq_id in self._seqs:
                raise ValueError(f"sequence {seq_id!r} is closed: only the last sequence appended to can grow")
            self._seqs[seq_id] = []
            self._growing = seq_id
            self._active = []
        seq = self._seqs[seq_id]
        active = self._active
        for token in tokens:
            seq.append(int(token))
            active = self._extend_suffixes(seq, active)
        self._active = active
        self.version += 1

    def _extend_suffixes(self, seq: list, active: list) -> list:
        """Extend every suffix of ``seq`` that ends at an inner node by ``seq[-1]``; return the
        inner nodes where the new suffixes end (lengths 1, 2, ...)."""
        token = seq[-1]
        pos = len(seq) - 1
        depth_limit = self.max_depth
        root = self.root
        root.count += 1
        new_active = []
        # The empty suffix (at the root) becomes the suffix of length 1.
        child = root.children.get(token)
        if child is None:
            root.children[token] = Leaf(seq, pos, pos + depth_limit)
        else:
            if type(child) is Leaf:
                child = self._split(root, token, child)
            else:
                child.count += 1
            new_active.append(child)
        # The suffix ending at active[d - 1] has length d; it grows to d + 1.
        depth = 0
        for node in active:
            depth += 1
            if depth >= depth_limit:
                break  # cut at max_depth: this suffix is complete
            children = node.children
            child = children.get(token)
            if child is None:
                leaf = children[token] = Leaf(seq, pos, pos - depth + depth_limit)
                if node.best is None:
                    node.best = leaf
                continue
            if type(child) is Leaf:
                child = self._split(node, token, child)
            else:
                child.count += 1
                best = node.best
                if child is not best and child.count > best.count:
                    node.best = child
            new_active.append(child)
        return new_active

    @staticmethod
    def _split(parent: Node, token: int, leaf: Leaf) -> Node:
        """A second suffix enters ``leaf``: its first token becomes an inner node of count 2."""
        node = Node(token, 2)
        leaf.pos += 1
        if leaf.pos < leaf.end:
            node.children[leaf.seq[leaf.pos]] = leaf
            node.best = leaf
        parent.children[token] = node
        best = parent.best
        if best is leaf or (best is not None and best.count < 2):
            parent.best = node
        return node

    def remove(self, seq_id: Hashable) -> None:
        """Remove sequence ``seq_id``: decrement the counts along its suffixes and delete the
        nodes and leaves nothing else uses. O(len(sequence) * max_depth)."""
        seq = self._seqs.pop(seq_id)
        if seq_id == self._growing:
            self._growing = None
            self._active = []
        root = self.root
        depth_limit = self.max_depth
        length = len(seq)
        for start in range(length):
            root.count -= 1
            node = root
            for i in range(start, min(start + depth_limit, length)):
                token = seq[i]
                child = node.children[token]
                if type(child) is not Leaf:
                    child.count -= 1
                    if child.count:
                        if child is node.best:
                            node.best = STALE
                        node = child
                        continue
                # A leaf, or a node only this suffix used: it goes, with all below it.
                del node.children[token]
                if child is node.best:
                    node.best = STALE if node.children else None
                break
        self.version += 1

    # -- reading ---------------------------------------------------------------------------------

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        """The number of sequences."""
        return len(self._seqs)

    def __iter__(self):
        """The sequence ids, oldest first."""
        return iter(self._seqs)

    def sequence(self, seq_id: Hashable) -> list:
        """The token list of ``seq_id`` (the tree's own list: do not modify it)."""
        return self._seqs[seq_id]

    def suffix_nodes(self) -> list:
        """Where the growing sequence's suffixes of length 1, 2, ... end, as long as they end at
        inner nodes (occurred elsewhere too); the longer ones occur only at the end."""
        return self._active

    def locate(self, path: Sequence[int]) -> Optional[Location]:
        """The :data:`Location` of ``path`` (the root for an empty path), None if absent."""
        location: Location = self.root
        for token in path:
            location = advance(location, token)
            if location is None:
                return None
        return location

    def count(self, path: Sequence[int]) -> int:
        """How often ``path`` occurs in the stored suffixes (0 if absent)."""
        location = self.locate(path)
        if location is None:
            return 0
        return location.count if type(location) is Node else 1

    def children(self, path: Sequence[int]) -> dict:
        """``{next token: count}`` of the continuations of ``path``."""
        location = self.locate(path)
        if location is None:
            return {}
        if type(location) is Node:
            return {token: child.count for token, child in location.children.items()}
        leaf, index = location
        return {leaf.seq[index]: 1} if index < leaf.end else {}

    def num_nodes(self) -> int:
        """Inner nodes plus leaves, the root excluded (a measure of memory)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += len(node.children)
            stack.extend(child for child in node.children.values() if type(child) is Node)
        return total

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1) -> Draft:
        """The best draft for ``context`` from this tree alone (matches it from scratch:
        O(max_depth^2); the proposer keeps matches up to date token by token instead)."""
        matcher = Matcher(self)
        matcher.reset(context)
        return matcher.best_draft(max_tokens, max_spec_factor, min_token_prob)


def advance(location: Location, token: int) -> Optional[Location]:
    """The location one ``token`` further down from ``location``, None if the tree has none."""
    if type(location) is Node:
        child = location.children.get(token)
        if child is None or type(child) is Node:
            return child
        return (child, child.pos + 1)
    leaf, index = location
    if index < leaf.end and leaf.seq[index] == token:
        return (leaf, index + 1)
    return None


class Matcher:
    """Where each suffix of a growing context ends in a tree, kept up to date token by token.

    The context's last ``m`` tokens occur in the tree for ``m = 1 .. top`` (a suffix that is
    absent has no longer suffix present). For ``m <= len(nodes)`` they end at the inner node
    ``nodes[m - 1]``; the longer ones (``m = len(nodes) + 1 .. top``) occur once, all at the same
    place: just before ``seq[index]``. (A suffix inside a leaf occurs once, so every longer
    one occurs at most once, at the same place. It lies in a leaf too: an inner node is made
    only where two suffixes share a path, and both then share the shorter suffix's path as
    well, which would be an inner node then, and an inner node stays while anything passes
    through it.) That is why :meth:`push` costs one step per inner node plus O(1) for all the
    unique matches together.

    When the tree changed since (``stale``), :meth:`reset` replays the context's last
    ``max_depth`` tokens.
    """

    __slots__ = ("tree", "version", "nodes", "seq", "index", "top")

    def __init__(self, tree: SuffixTree):
        self.tree = tree
        self.version = tree.version
        self.nodes: list = []
        self.seq: Optional[list] = None
        self.index = 0
        self.top = 0

    @property
    def stale(self) -> bool:
        return self.version != self.tree.version

    def reset(self, context: Sequence[int]) -> None:
        """Match ``context`` from scratch (only its last ``max_depth`` tokens matter)."""
        self.nodes, self.seq, self.index, self.top = [], None, 0, 0
        self.version = self.tree.version
        for token in context[-self.tree.max_depth:]:
            self.push(int(token))

    def push(self, token: int) -> None:
        """The context grew by ``token``."""
        nodes: list = []
        seq, index, top = None, 0, 0
        first = self.tree.root.children.get(token)
        if first is not None:
            top = 1
            if type(first) is Leaf:
                seq, index = first.seq, first.pos + 1
            else:
                nodes.append(first)
            for node in self.nodes:  # the suffix of length m grows to m + 1
                child = node.children.get(token)
                if child is None:
                    break
                top += 1
                if seq is None:
                    if type(child) is Leaf:
                        seq, index = child.seq, child.pos + 1
                    else:
                        nodes.append(child)
            else:
                # Every inner node grew: the unique matches grow too if their one occurrence
                # goes on with ``token`` (a match of max_depth tokens cannot grow).
                old_seq, old_index = self.seq, self.index
                if self.top > len(self.nodes) and old_index < len(old_seq) and old_seq[old_index] == token:
                    top = min(self.top + 1, self.tree.max_depth)
                    if top > len(nodes):
                        seq, index = old_seq, old_index + 1
        self.nodes, self.seq, self.index, self.top = nodes, seq, index, top

    def best_draft(self, max_tokens: int, max_spec_factor: float, min_token_prob: float,
                   beat: float = 0.0) -> Draft:
        """The best draft over all match lengths with a score above ``beat``, else
        :data:`EMPTY_DRAFT`; ties go to the longer match."""
        best_len, best_m = 0, 0
        nodes = self.nodes
        if self.top > len(nodes):
            # Unique matches: their next tokens each have probability 1, up to the depth cut.
            left = len(self.seq) - self.index
            depth = self.tree.max_depth
            cap = max_tokens if max_tokens < left else left
            for m in range(min(self.top, depth - 1), len(nodes), -1):
                limit = int(m * max_spec_factor + 1e-9)
                if limit > cap:
                    limit = cap
                if limit <= best_len or limit <= beat:
                    break
                length = limit if limit < depth - m else depth - m
                if length > best_len and length > beat:
                    best_len, best_m = length, m
        if best_len:
            beat = float(best_len)
        draft = best_node_draft(nodes, max_tokens, max_spec_factor, min_token_prob, beat)
        if draft.score > beat or not best_len:
            return draft
        return Draft(self.seq[self.index: self.index + best_len], [1.0] * best_len, float(best_len), best_m)


def best_node_draft(nodes: list, max_tokens: int, max_spec_factor: float, min_token_prob: float,
                    beat: float = 0.0) -> Draft:
    """The highest-scoring draft over match lengths ``m = 1 .. len(nodes)`` (``nodes[m - 1]``
    is where the context's last ``m`` tokens end), with a score above ``beat``; else
    :data:`EMPTY_DRAFT`. Ties go to the longer match.

    Scans from the longest match down and skips what cannot win: a draft scores at most its
    length limit times its first probability, and the limit only shrinks with ``m``.
    """
    best = EMPTY_DRAFT
    best_score = beat
    for m in range(len(nodes), 0, -1):
        limit = min(max_tokens, int(m * max_spec_factor + 1e-9))
        if limit <= best_score:
            break
        node = nodes[m - 1]
        child = node.best
        if child is STALE:
            child = best_child(node)
        if child is None:
            continue
        first = child.count / node.count
        if first < min_token_prob or first * limit <= best_score:
            continue
        draft = draft_from(node, limit, min_token_prob)
        if draft.score > best_score:
            best = draft._replace(match_len=m)
            best_score = draft.score
    return best


def draft_from(node: Node, max_tokens: int, min_token_prob: float) -> Draft:
    """Follow the most frequent children from ``node`` for at most ``max_tokens`` tokens while
    the path probability count(child) / count(node) stays at or above ``min_token_prob``."""
    total = node.count
    tokens: list = []
    probs: list = []
    score = 0.0
    while len(tokens) < max_tokens:
        child = node.best
        if child is STALE:
            child = best_child(node)
        if child is None:
            break
        prob = child.count / total
        if prob < min_token_prob:
            break
        if type(child) is Leaf:
            pos = child.pos
            length = min(max_tokens - len(tokens), child.end - pos)
            tokens += child.seq[pos: pos + length]
            probs += [prob] * length
            score += prob * length
            break
        tokens.append(child.token)
        probs.append(prob)
        score += prob
        node = child
    return Draft(tokens, probs, score, 0)
