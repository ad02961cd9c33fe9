"""Growing a draft model's token tree best first, for `staged` and `auto` (Spector & Re 2023, "Staged Speculative
Decoding"). Sampling draws children without replacement and never drops one: it stays exact."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from decoders.base import DecodeState, Steps
from decoders.drafting.draft_model import DraftModel
from decoders.models.call import Call
from decoders.options import check_whole, probability
from samplers.verify import verify_greedy, verify_sampling

LOWER_STAGES = ("suffix", "lookup")


@dataclass(frozen=True)
class StagedOptions:
    """Options of `staged`, tuned where nodes are cheap and draft calls are not (docs/design/evidence.md)."""

    branching: int = 2  # children per expanded node
    budget: int = 16  # the most tree nodes per target call
    max_depth: int = 12
    width: int | None = None  # leaves expanded per draft call; None: `frontier_width`'s choice
    min_prob: float = 0.05  # add a child only while P(parent's path) x the mass not drawn yet reaches this
    expand_prob: float = 0.3  # another draft call only if the likeliest leaf's path has at least this probability
    ngram: int = 3  # longest suffix prompt lookup matches (lower="lookup"); 0 turns the lower stage off
    lower: str = "suffix"  # "suffix" (the run's suffix index) or "lookup" (prompt lookup)

    def __post_init__(self):
        check_whole(self, branching=1, budget=1, max_depth=1, ngram=0)
        if self.width is not None:
            check_whole(self, width=1)
        if self.lower not in LOWER_STAGES:
            raise ValueError(f"lower must be one of {', '.join(LOWER_STAGES)}, got {self.lower!r}")
        probability("min_prob", self.min_prob, high_open=True)
        probability("expand_prob", self.expand_prob, high_open=True)


@dataclass
class Node:
    """One node of the tree being grown; the root (index 0) stands for the last accepted token."""

    token: int
    parent: int  # -1 for the root
    depth: int  # 0 for the root's children
    cum: float  # the draft's probability of its path
    drawn_from: torch.Tensor | None  # [vocab] its parent's `dist`
    matcher: Any = None  # the grammar after this node's path
    dist: torch.Tensor | None = None  # [vocab] for its children, once known
    slot: int | None = None  # its index in the draft cache, once fed
    children: list[int] = field(default_factory=list)  # their tokens, in the order drawn


Lower = Callable[[list[int], int], list[int]]  # (context, room) -> a chain of at most room tokens


def grow_tree(
    model: DraftModel, state: DecodeState, o: StagedOptions, limit: int, lower: Lower
) -> Generator[Call, torch.Tensor, list[Node]]:
    """Grow one tree; returns the nodes (root first, topological order)."""
    cap = min(o.max_depth, limit, o.budget)
    nodes = [Node(-1, -1, -1, 1.0, None, state.grammar)]
    frontier: list[int] = []  # empty: the root
    while cap >= 1:
        yield from draft_call(model, state, o, nodes, frontier, cap, lower)
        for n in sorted((n for n in range(len(nodes)) if nodes[n].dist is not None), key=lambda n: -nodes[n].cum):
            node = nodes[n]  # more children, most probable parent first, without replacement
            while len(node.children) < o.branching and len(nodes) <= o.budget:
                rest = node.dist.clone()
                rest[node.children] = 0.0
                if node.cum * float(rest.sum()) < o.min_prob or float(rest.max()) <= 0.0:
                    break  # (decided on what was drawn before, never on the new draw: sampling stays exact)
                if state.sampling.greedy:
                    add_child(nodes, n, int(rest.argmax()))
                else:
                    add_child(nodes, n, int(torch.multinomial(rest, 1, generator=state.generator)))
        leaves = [n for n in range(1, len(nodes)) if expandable(nodes[n], cap, state) and nodes[n].cum >= o.min_prob]
        frontier = sorted(leaves, key=lambda n: -nodes[n].cum)[: o.width]
        if not frontier or nodes[frontier[0]].cum < o.expand_prob or len(nodes) > o.budget:
            break
    return nodes


def draft_call(
    model: DraftModel,
    state: DecodeState,
    o: StagedOptions,
    nodes: list[Node],
    frontier: list[int],
    cap: int,
    lower: Lower,
) -> Steps:
    """One draft call on the frontier leaves plus the lower stage's chain under the first; the part of the chain the
    draft agrees with (verified as by a target) and the draft's next token join the tree under that leaf."""
    leaves = frontier or [0]
    head = leaves[0]
    chain = lower_stage(state, o, nodes, head, cap, lower)
    masks = None  # [leaves + chain, vocab] the grammar's allowed tokens after each
    if nodes[head].matcher is not None:
        valid, along = nodes[head].matcher.masks_along(chain)  # [valid + 1, vocab], row 0 = the head's
        chain = chain[:valid]
        masks = torch.cat([torch.stack([nodes[n].matcher.allowed() for n in leaves]), along[1:]])
    logits, slots = yield from feed(model, state, nodes, frontier, chain)  # [leaves + chain, draft vocab], slots
    dists = distributions(state, model, logits, masks)  # [leaves + chain, vocab]
    for n, dist, slot in zip(leaves, dists, slots):
        nodes[n].dist, nodes[n].slot = dist, slot
    rows = torch.cat([dists[:1], dists[len(leaves) :]])  # [chain + 1, vocab]: after the head, after each chain token
    drafted = torch.tensor(chain, dtype=torch.long)
    if state.sampling.greedy:
        agreed, token = verify_greedy(drafted, rows)
    else:
        agreed, token = verify_sampling(drafted, None, rows, state.generator)
    model.cache.crop(len(model.cache) - (len(chain) - agreed))  # the chain tokens it did not agree with, fed last
    parent = head
    for i, t in enumerate(chain[:agreed]):
        add_child(nodes, parent, t)
        parent = len(nodes) - 1
        nodes[parent].dist, nodes[parent].slot = rows[i + 1], slots[len(leaves) + i]
    add_child(nodes, parent, token)


def lower_stage(
    state: DecodeState, o: StagedOptions, nodes: list[Node], head: int, cap: int, lower: Lower
) -> list[int]:
    """The lower stage's chain under `head`, leaving room for the draft's token; cut before an EOS (the draft cannot
    score what follows one)."""
    room = min(cap - nodes[head].depth - 2, o.budget - len(nodes))
    if not o.ngram or room <= 0:
        return []
    path = [nodes[n].token for n in reversed(ancestors(nodes, head))] + ([nodes[head].token] if head else [])
    chain = lower(state.tokens + path, room)
    return chain[: next((i for i, t in enumerate(chain) if t in state.lm.eos_token_ids), len(chain))]


def feed(
    model: DraftModel, state: DecodeState, nodes: list[Node], frontier: list[int], chain: list[int]
) -> Generator[Call, torch.Tensor, tuple[torch.Tensor, list[int | None]]]:
    """One draft call on the frontier leaves and the chain under the first; returns (logits, draft-cache slots)."""
    base, past = len(state.tokens), len(model.cache)
    if not frontier:  # the root: the uncached tail, then the chain, causal
        logits = yield from model.forward(model.uncached() + chain, keep=len(chain) + 1)  # [1 + chain, vocab]
        return logits, [None] + list(range(base, base + len(chain)))
    head, k = frontier[0], len(frontier)
    above = {n: [nodes[a].slot for a in ancestors(nodes, n)] for n in frontier}
    seen = [above[n] + [past + row] for row, n in enumerate(frontier)]
    seen += [above[head] + [past] + list(range(past + k, past + k + i + 1)) for i in range(len(chain))]
    top = base + nodes[head].depth + 1  # the chain's first position
    positions = [base + nodes[n].depth for n in frontier] + list(range(top, top + len(chain)))
    mask = torch.zeros(len(seen), past + k + len(chain), dtype=torch.bool)  # [k + chain, past + k + chain]
    mask[:, :base] = True  # the accepted tokens
    for row, slots in enumerate(seen):
        mask[row, slots] = True
    logits = yield from model.forward(
        [nodes[n].token for n in frontier] + chain, positions=positions, tree_mask=mask, keep=k + len(chain)
    )
    return logits, list(range(past, past + k + len(chain)))


def ancestors(nodes: list[Node], n: int) -> list[int]:
    """The nodes above n, the root excluded."""
    found = []
    while nodes[n].parent > 0:
        n = nodes[n].parent
        found.append(n)
    return found


def add_child(nodes: list[Node], parent: int, token: int) -> None:
    """Append a node under `parent`."""
    above = nodes[parent]
    matcher = None
    if above.matcher is not None:
        matcher = above.matcher.fork()
        matcher.advance([token])
    nodes.append(Node(token, parent, above.depth + 1, above.cum * float(above.dist[token]), above.dist, matcher))
    above.children.append(token)


def expandable(node: Node, cap: int, state: DecodeState) -> bool:
    """A leaf worth a draft call."""
    return (
        node.dist is None
        and node.depth < cap - 1
        and node.token not in state.lm.eos_token_ids
        and (node.matcher is None or not node.matcher.is_complete())
    )


def distributions(state: DecodeState, model: DraftModel, logits: torch.Tensor, masks: torch.Tensor | None):
    """[n, vocab] zero-padded draft distributions, filtered as the run's when sampling (children are drawn from it)."""
    logits = logits[:, : model.width].float()
    if masks is not None:
        logits = logits.masked_fill(~masks[:, : model.width].to(logits.device), float("-inf"))
    probs = torch.zeros(logits.shape[0], state.lm.vocab_size, device=logits.device)  # [n, vocab]
    probs[:, : model.width] = torch.softmax(logits, -1) if state.sampling.greedy else state.sampling.probs(logits)
    return probs
