"""Token trees: masks, levels, one target call for a tree (and window), rolling a cache back to the accepted path. A
node sees the accepted tokens, its ancestors and itself, at position len(tokens) + its depth."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from decoders.drafting.draft import Draft, Window
from decoders.models.cache import Cache
from decoders.models.call import Call

if TYPE_CHECKING:
    from decoders.base import DecodeState


def ancestry(parents: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """(mask [k, k]: node i sees j iff j is i or an ancestor, `depths`); nodes must come after their parents."""
    mask = torch.eye(len(parents), dtype=torch.bool)  # [k, k]
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask, depths(parents)


def depths(parents: Sequence[int]) -> list[int]:
    """The depth of each node: 0 at the root's children."""
    found: list[int] = []
    for parent in parents:
        found.append(found[parent] + 1 if parent >= 0 else 0)
    return found


def tree_call(state: DecodeState, draft: Draft) -> Call:
    """The target call on tail + tree + window; its logits [k + 1 + w, vocab]: row 0 after the last accepted token,
    row 1 + i after node i, then the window's."""
    tail = state.uncached()
    window = draft.window or Window([], [], torch.zeros(0, 0, dtype=torch.bool))
    t, k, w = len(tail), len(draft.tokens), len(window.tokens)
    tree, levels = ancestry(draft.links)
    mask = torch.zeros(t + k + w, t + k + w, dtype=torch.bool)  # [T, T]
    mask[:t, :t] = torch.ones(t, t, dtype=torch.bool).tril()
    mask[t:, :t] = True
    mask[t : t + k, t : t + k] = tree
    mask[t + k :, t + k :] = window.mask
    base = len(state.tokens)
    positions = list(range(len(state.cache), base)) + [base + d for d in levels] + [base + o for o in window.offsets]
    return Call(tail + draft.tokens + window.tokens, positions, mask, keep=k + w + 1)


def keep_path(cache: Cache, start: int, slots: Sequence[int]) -> None:
    """Keep the cache's first `start` positions and `slots` (increasing): a crop where they follow on, else a gather."""
    slots = list(slots)
    if slots == list(range(start, start + len(slots))):
        cache.crop(min(len(cache), start + len(slots)))
    else:
        cache.keep(list(range(start)) + slots)


def depth(draft: Draft) -> int:
    """How many levels the draft has."""
    return len(draft.tokens) if draft.parents is None else max(depths(draft.parents), default=-1) + 1


def first_branch(parents: Sequence[int]) -> list[int]:
    """The nodes from the root down each first child: a suffix tree's likeliest path."""
    path, above = [], -1
    for node, parent in enumerate(parents):
        if parent == above:
            path.append(node)
            above = node
    return path


def merge(drafts: Sequence[Draft], source: str = "draft") -> Draft:
    """One tree of every path of one-hot `drafts`, each node credited to the first draft holding it (`origins`)."""
    tokens: list[int] = []
    parents: list[int] = []
    origins: list[str] = []
    nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for draft in drafts:
        place: list[int] = []
        for node, parent in enumerate(draft.links):
            key = (place[parent] if parent >= 0 else -1, draft.tokens[node])
            if key not in nodes:
                nodes[key] = len(tokens)
                tokens.append(key[1])
                parents.append(key[0])
                origins.append(draft.source)
            place.append(nodes[key])
    return Draft(tokens, None, parents, source, origins=origins)


def common(part: Draft, whole: Draft) -> list[int]:
    """The nodes of `part` whose paths `whole` holds too (what is left of a merged tree's part, cut)."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(whole.links, whole.tokens))}
    place, kept = {-1: -1}, []
    for node, parent in enumerate(part.links):
        found = children.get((place[parent], part.tokens[node])) if parent in place else None
        if found is not None:
            place[node] = found
            kept.append(node)
    return kept


def per_level(parents: Sequence[int]) -> tuple[int, ...]:
    """[levels] the nodes of a tree in levels 1..d, for each d."""
    found = depths(parents)
    return tuple(itertools.accumulate(found.count(level) for level in range(max(found, default=-1) + 1)))


def levels_above(draft: Draft, levels: int) -> Draft:
    return draft.subset([n for n, d in enumerate(depths(draft.links)) if d < levels])
