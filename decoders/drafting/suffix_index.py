"""The counted suffix trie under `suffix` decoding (Oliaro et al. 2024, "SuffixDecoding", arXiv 2411.04975). A
substring seen once is a *leaf*: an int packing its token's position, read from the sequence itself."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from decoders.drafting.tree import first_branch
from decoders.options import check_whole, probability

SHIFT = 32  # a position packs (sequence number << SHIFT) | index, so later positions pack to larger ints
INDEX = (1 << SHIFT) - 1


@dataclass(frozen=True)
class SuffixOptions:
    """Options of suffix drafting: ArcticInference / vLLM's defaults but `depth_factor` 2.0 (theirs 1.0): in copied
    text a short match precedes a long run seen once."""

    max_tree: int = 24  # the most draft-tree nodes per target call
    depth_factor: float = 2.0  # a match of m tokens drafts at most depth_factor x m nodes
    min_prob: float = 0.1  # drop continuations whose empirical path probability is lower
    max_match: int = 24  # the longest context suffix looked up (also capped by the index depth - 1)
    min_match: int = 1

    def __post_init__(self):
        check_whole(self, max_tree=1, max_match=1, min_match=1)
        probability("min_prob", self.min_prob)
        factor = self.depth_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            raise ValueError(f"depth_factor must be a positive number (nodes per matched token), got {factor!r}")
        if self.min_match > self.max_match:
            raise ValueError(f"min_match ({self.min_match}) must not exceed max_match ({self.max_match})")


@dataclass
class SuffixDraft:
    """A drafted tree: nodes in topological order, siblings distinct and in decreasing frequency."""

    tokens: list[int] = field(default_factory=list)  # [n]
    parents: list[int] = field(default_factory=list)  # [n] -1 for children of the matched suffix
    probs: list[float] = field(default_factory=list)  # [n] empirical path probability
    match: int = 0  # length of the context suffix it continues

    @property
    def score(self) -> float:
        """Expected number of accepted tokens if the index's frequencies were the model's."""
        return sum(self.probs)

    def main_branch(self) -> SuffixDraft:
        """The chain of first children (the most frequent continuation)."""
        keep = first_branch(self.parents)
        return SuffixDraft(
            [self.tokens[n] for n in keep], list(range(-1, len(keep) - 1)), [self.probs[n] for n in keep], self.match
        )


class _Node:
    """A substring that occurs at least twice (or once, when eviction could not tell where)."""

    __slots__ = ("count", "cont", "children", "newest", "ranked")

    def __init__(self, count: int, newest: int) -> None:
        self.count = count  # occurrences of the substring spelled from the root
        self.cont = 0  # the sum of the children's counts
        self.children: dict[int, _Node | int] = {}  # token -> node, or leaf: the packed position of that token
        self.newest = newest  # packed position of the newest occurrence's last token
        self.ranked: list | None = None  # children by (count, recency), descending; None when stale


class SuffixIndex:
    """Counted suffix trie of depth `depth` over token sequences that grow at their end. Not thread-safe."""

    def __init__(self, depth: int = 48) -> None:
        self.depth = depth  # longest substring counted
        check_whole(self, depth=2)
        self.root = _Node(0, 0)
        self._numbers: dict[Hashable, int] = {}  # sequence id -> sequence number (never reused)
        self._tokens: dict[int, list[int]] = {}
        self._open: dict[int, dict[int, _Node]] = {}  # sequence number -> {start: node} of its open suffixes
        self._next = 0

    def __len__(self) -> int:
        """Tokens held."""
        return self.root.count

    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `seq_id` (a new one if unknown)."""
        number = self._numbers.get(seq_id)
        if number is None:
            number = self._numbers[seq_id] = self._next
            self._next += 1
            self._tokens[number], self._open[number] = [], {}
        seq, suffixes, root, depth = self._tokens[number], self._open[number], self.root, self.depth
        for token in map(int, tokens):
            i, here = len(seq), (number << SHIFT) | len(seq)
            seq.append(token)
            suffixes[i] = root  # the empty suffix starting at i
            root.count += 1
            for start, node in list(suffixes.items()):
                node.cont += 1
                node.ranked = None
                child = node.children.get(token)
                if child is None:  # never seen after this suffix: a leaf, the suffix is closed
                    node.children[token] = here
                    del suffixes[start]
                    continue
                if type(child) is int:  # seen once: now twice
                    child = node.children[token] = self._split(child, i - start + 1, here)
                else:
                    child.count += 1
                    child.newest = here
                if i - start + 1 < depth:
                    suffixes[start] = child
                else:
                    del suffixes[start]

    def follow(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Make sequence `seq_id` hold `tokens`, which only grow (a run's tokens)."""
        number = self._numbers.get(seq_id)
        self.extend(seq_id, tokens[0 if number is None else len(self._tokens[number]) :])

    def _split(self, leaf: int, length: int, here: int) -> _Node:
        """The node replacing `leaf` (`length` tokens seen once) now that it occurs again at `here`."""
        node = _Node(2, here)
        number, end = leaf >> SHIFT, leaf & INDEX
        other = self._tokens[number]
        if length < self.depth:
            if end + 1 < len(other):
                node.children[other[end + 1]] = leaf + 1
                node.cont = 1
            else:  # the other occurrence ends its sequence: it is one of that sequence's open suffixes now
                self._open[number][end - length + 1] = node
        return node

    def remove(self, seq_id: Hashable) -> None:
        """Forget sequence `seq_id`; a node left with one occurrence becomes a leaf again if that occurrence is still
        held (always, when the oldest sequence goes first)."""
        number = self._numbers.pop(seq_id)
        seq = self._tokens.pop(number)
        del self._open[number]
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for i in range(start, min(len(seq), start + self.depth)):
                node.cont -= 1
                node.ranked = None
                token = seq[i]
                child = node.children[token]
                if type(child) is int or child.count == 1:  # this was its one occurrence: drop the whole subtree
                    del node.children[token]
                    break
                child.count -= 1
                if child.count == 1 and child.newest >> SHIFT in self._tokens:  # a leaf at its one occurrence again
                    self._open[child.newest >> SHIFT].pop((child.newest & INDEX) - i + start, None)  # its suffix closes
                    node.children[token] = child.newest
                    break
                node = child

    def _walk(self, tokens: Sequence[int]) -> _Node | int | None:
        """Where `tokens` end in the trie: a node, a leaf position, or None."""
        at: _Node | int = self.root
        for token in tokens:
            if type(at) is int:
                seq, end = self._tokens[at >> SHIFT], at & INDEX
                if end + 1 >= len(seq) or seq[end + 1] != token:
                    return None
                at += 1
            else:
                at = at.children.get(token)
                if at is None:
                    return None
        return at

    def _continues(self, at: _Node | int | None) -> bool:
        if type(at) is int:
            return (at & INDEX) + 1 < len(self._tokens[at >> SHIFT])
        return at is not None and at.cont > 0

    def match(self, context: Sequence[int], max_match: int | None = None) -> tuple[_Node | int | None, int]:
        """(place, m): the longest suffix of `context` (m <= `max_match`, `depth - 1`) followed by a token, or m = 0."""
        low, high = 0, min(len(context), self.depth - 1, self.depth if max_match is None else max_match)
        found = self.root if self.root.cont else None
        while low < high:  # a suffix that continues has continuing suffixes: binary search on the length
            middle = (low + high + 1) // 2
            at = self._walk(context[len(context) - middle :])
            if self._continues(at):
                low, found = middle, at
            else:
                high = middle - 1
        return found, low

    def _ranked(self, at: _Node | int | None) -> list[tuple[int, int, _Node | int]]:
        """[(count, token, child)] of what follows `at`: most frequent first, then the one seen latest."""
        if at is None:
            return []
        if type(at) is int:
            seq, end = self._tokens[at >> SHIFT], at & INDEX
            return [(1, seq[end + 1], at + 1)] if end + 1 < len(seq) else []
        if at.ranked is None:
            # sorted on (count, position) alone: siblings' newest positions differ, so tuples never tie
            items = sorted(
                [(1, c, t, c) if type(c) is int else (c.count, c.newest, t, c) for t, c in at.children.items()],
                reverse=True,
            )
            at.ranked = [(count, token, child) for count, _, token, child in items]
        return at.ranked

    def draft(
        self,
        context: Sequence[int],
        max_tokens: int,
        min_prob: float = 0.0,
        *,
        depth_factor: float | None = None,
        max_depth: int | None = None,
        max_match: int | None = None,
        min_match: int = 1,
        vocab: int | None = None,
    ) -> SuffixDraft:
        """A best-first tree by empirical path probability continuing the longest matched suffix of `context`; no
        token >= `vocab`, nor what follows one."""
        at, length = self.match(context, max_match)
        out = SuffixDraft(match=length)
        if length < max(min_match, 1):
            return out
        vocab = math.inf if vocab is None else vocab
        if depth_factor is not None:
            max_tokens = min(max_tokens, int(depth_factor * length + 1e-9))
        levels = self.depth - length if max_depth is None else min(max_depth, self.depth - length)
        order = itertools.count()  # ties: first come, first served (siblings are pushed most frequent first)
        heap: list = []  # candidates: (-path probability, tiebreak, token, place, parent's index, level)
        self._offer(heap, order, at, 1.0, -1, 1, max_tokens, min_prob, vocab)
        while heap and len(out.tokens) < max_tokens:
            minus_p, _, token, at, parent, level = heapq.heappop(heap)
            while True:  # a leaf's chain has the same probability, the highest there is: take it whole
                out.tokens.append(token)
                out.parents.append(parent)
                out.probs.append(-minus_p)
                parent = len(out.tokens) - 1
                if type(at) is not int or level >= levels or len(out.tokens) >= max_tokens:
                    break
                seq, end = self._tokens[at >> SHIFT], at & INDEX
                if end + 1 >= len(seq) or seq[end + 1] >= vocab:
                    break
                token, at, level = seq[end + 1], at + 1, level + 1
            if level < levels and type(at) is not int:
                self._offer(heap, order, at, -minus_p, parent, level + 1, max_tokens - len(out.tokens), min_prob, vocab)
        return out

    def _offer(
        self,
        heap: list,
        order,
        at: _Node | int,
        p: float,
        parent: int,
        level: int,
        room: int,
        min_prob: float,
        vocab: float,
    ) -> None:
        """Push up to `room` continuations of `at` whose path probability stays >= min_prob."""
        total = 1 if type(at) is int else at.cont
        for count, token, child in self._ranked(at)[:room]:
            q = p * count / total
            if q < min_prob:
                break  # ranked: the rest are rarer
            if token >= vocab:
                continue
            heapq.heappush(heap, (-q, next(order), token, child, parent, level))
