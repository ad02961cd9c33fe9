"""The draft model's token trees (`staged`, and `auto`'s `tree` plans), after Spector & Re 2023, "Accelerating LLM
Inference with Staged Speculative Decoding": grown best-first by cumulative draft probability, each draft call
expanding the `width` likeliest leaves (`branching` children each) under a tree mask over the draft's own cache and
carrying a draft-free lower stage's chain (the suffix index, or prompt lookup) under the likeliest leaf, which the
draft verifies as a target verifies drafts. In sampling mode children are drawn without replacement, never dropped.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from decoders.base import Call, DecodeState, Steps
from decoders.drafting import Draft, Drafting, DraftModel
from decoders.drafting.chooser import Acceptance, Offer, Plan, at_least
from decoders.drafting.cost import CallCost, CostModel, RunningMean, call_cost
from decoders.drafting.suffix_index import SuffixIndex, SuffixOptions, propose
from decoders.drafting.tree import depth, first_branch, keep_path, shared_length
from decoders.options import check_whole, probability
from decoders.proposers.base import Clock, Step
from decoders.proposers.draft_chain import ChainProposer
from decoders.proposers.lookup import lookup
from decoders.proposers.suffix import SuffixProposer, summarize
from samplers.verify import verify_greedy, verify_sampling

LOWER_STAGES = ("suffix", "lookup")
WIDE_CALL = 0.05  # a second leaf per draft call pays where it adds less than this to the call (see StagedOptions)


@dataclass(frozen=True)
class StagedOptions:
    """Options of `staged`, tuned where nodes are cheap and draft calls are not (docs/design/evidence.md)."""

    branching: int = 2  # children per expanded node: the draft's top tokens, or draws without replacement
    budget: int = 16  # the most tree nodes per target call
    max_depth: int = 12  # the longest root-to-leaf path (draft tokens accepted per target call at most)
    width: int | None = None  # leaves expanded per draft call, most probable first; None: `frontier_width`'s choice
    min_prob: float = 0.05  # add a child only while P(parent's path) x the mass not drawn yet reaches this (cheap)
    expand_prob: float = 0.3  # another draft call only if the most probable leaf's path has at least this probability
    ngram: int = 3  # longest context suffix prompt lookup matches (lower="lookup"); 0 turns the lower stage off
    lower: str = "suffix"  # the lower stage: "suffix" (the run's suffix index) or "lookup" (prompt lookup)

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
    parent: int  # index in the node list (-1 for the root)
    depth: int  # 0 for the root's children
    cum: float  # the draft's probability of the path from the root to here
    drawn_from: torch.Tensor | None  # [vocab] the distribution this node was drawn from (its parent's `dist`)
    matcher: Any = None  # the grammar after this node's path, or None
    dist: torch.Tensor | None = None  # [vocab] the draft's distribution for its children, once known
    slot: int | None = None  # its index in the draft cache, once the draft model has seen it
    children: list[int] = field(default_factory=list)  # their tokens, in the order drawn


Lower = Callable[[list[int], int], list[int]]  # (context, room) -> a chain of at most room tokens to follow it


def grow_tree(
    model: DraftModel, state: DecodeState, o: StagedOptions, limit: int, lower: Lower
) -> Generator[Call, torch.Tensor, list[Node]]:
    """Grow one tree, best-first, one draft call per frontier; returns the nodes (root first, topological order)."""
    cap = min(o.max_depth, limit, o.budget)
    nodes = [Node(-1, -1, -1, 1.0, None, state.grammar)]
    frontier: list[int] = []  # empty: the first call, which expands the root
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
        frontier = sorted(leaves, key=lambda n: -nodes[n].cum)[: o.width]  # (width: see StagedOptions)
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
    """One draft call on the frontier leaves (none: the root) plus the lower stage's chain under the first; the part
    of the chain the draft agrees with (`samplers.verify`) and the draft's next token join the tree under that leaf."""
    leaves = frontier or [0]
    head = leaves[0]  # the most probable leaf
    chain = lower_stage(state, o, nodes, head, cap, lower)
    masks = None  # [leaves + chain, vocab]: the grammar's allowed tokens after each
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
    """The lower stage on the context plus the path to `head`: a chain to try under it, with room left below it for
    the draft's own token, and never reaching an EOS (whose children the draft could not score)."""
    room = min(cap - nodes[head].depth - 2, o.budget - len(nodes))
    if not o.ngram or room <= 0:
        return []
    path = [nodes[n].token for n in reversed(ancestors(nodes, head))] + ([nodes[head].token] if head else [])
    chain = lower(state.tokens + path, room)
    return chain[: next((i for i, t in enumerate(chain) if t in state.lm.eos_token_ids), len(chain))]


def feed(
    model: DraftModel, state: DecodeState, nodes: list[Node], frontier: list[int], chain: list[int]
) -> Generator[Call, torch.Tensor, tuple[torch.Tensor, list[int | None]]]:
    """Score the frontier leaves and the chain under the first one in one draft call: each sees the accepted tokens,
    its ancestors' cache slots and itself. Returns their logits and their slots in the draft cache."""
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
    """Append a node under `parent`; the grammar follows it on a fork of the parent's matcher."""
    above = nodes[parent]
    matcher = None
    if above.matcher is not None:
        matcher = above.matcher.fork()
        matcher.advance([token])
    nodes.append(Node(token, parent, above.depth + 1, above.cum * float(above.dist[token]), above.dist, matcher))
    above.children.append(token)


def expandable(node: Node, cap: int, state: DecodeState) -> bool:
    """A leaf worth a draft call: room below it, not EOS, not the end of the grammar."""
    return (
        node.dist is None
        and node.depth < cap - 1
        and node.token not in state.lm.eos_token_ids
        and (node.matcher is None or not node.matcher.is_complete())
    )


def distributions(state: DecodeState, model: DraftModel, logits: torch.Tensor, masks: torch.Tensor | None):
    """[n, vocab] draft distributions from draft logits [n, draft vocab], zero-padded to the target's width: the run's
    filtered distribution in sampling mode (children are drawn from it), the plain softmax in greedy mode."""
    logits = logits[:, : model.width].float()
    if masks is not None:
        logits = logits.masked_fill(~masks[:, : model.width].to(logits.device), float("-inf"))
    probs = torch.zeros(logits.shape[0], state.lm.vocab_size, device=logits.device)  # [n, vocab]
    probs[:, : model.width] = torch.softmax(logits, -1) if state.sampling.greedy else state.sampling.probs(logits)
    return probs


def frontier_width(cost: CallCost) -> int:
    """`StagedOptions.width` for a draft model of these call costs: 2 if a call's rows add under WIDE_CALL of a
    1-token call each (the mean from 1 to 8 rows: a 2-row call alone is within its noise), else 1."""
    one = cost.predict(1, 0)
    return 2 if one + (cost.predict(8, 0) - one) / 7 < (1 + WIDE_CALL) * one else 1


class TreeDrafter:
    """The draft model and its cache for one run, plus where the last tree's nodes sit in that cache."""

    def __init__(
        self,
        state: DecodeState,
        options: StagedOptions,
        model: DraftModel | None = None,
        index: SuffixIndex | None = None,
        lower: Lower | None = None,
    ) -> None:
        """`model`, `index`: a draft model and a suffix index of the run's tokens to share (`auto`'s), else new;
        `lower`: a lower stage to use instead of `options.lower`'s."""
        self.model = model if model is not None else DraftModel(state)
        if options.width is None:
            options = replace(options, width=frontier_width(call_cost(state.draft, "draft")))
        self.options = options
        self.start, self.slots = 0, []  # len(state.tokens) at the last proposal; draft-cache index per node
        self.index = index if index is not None else SuffixIndex()  # the run's own tokens, for the suffix lower stage
        # the chain rides in a draft call made anyway: it may run past the match length
        self.suffix = SuffixOptions(max_tree=options.budget, depth_factor=float(options.budget))
        self.stage = lower or self.lower  # (context, room) -> the chain a draft call checks

    def lower(self, context: list[int], room: int) -> list[int]:
        """The lower stage's chain after `context` (the run's tokens plus a tree path), at most `room` tokens."""
        if self.options.lower == "lookup":
            return lookup(context, room, self.options.ngram, 1)
        return propose(self.index, None, context, room, self.suffix).main_branch().tokens

    def propose(self, state: DecodeState, limit: int) -> Drafting:
        if self.options.lower == "suffix" and self.options.ngram:
            self.index.follow("run", state.tokens)
        nodes = (yield from grow_tree(self.model, state, self.options, self.model.room(limit), self.stage))[1:]
        self.start, self.slots = len(state.tokens), [n.slot for n in nodes]
        probs = None if state.sampling.greedy or not nodes else torch.stack([n.drawn_from for n in nodes])
        return Draft([n.token for n in nodes], probs, [n.parent - 1 for n in nodes])

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        path = draft.follow(state.tokens[self.start : self.start + accepted])
        keep_path(self.model.cache, self.start, [self.slots[n] for n in path if self.slots[n] is not None])
        self.model.rewind()


SURE = 0.99  # the highest tree thresholds: `staged`'s must stay below 1


def tree_thresholds(rate: float, node: float, call: float) -> tuple[float, float]:
    """(min_prob, expand_prob) of a step expected to give `rate` tokens a second: a node (`node` seconds more in the
    target call) pays from a path probability of rate x node, a draft call (`call`) from rate x (call + node)."""
    base = StagedOptions()
    return min(SURE, max(base.min_prob, rate * node)), min(SURE, max(base.expand_prob, rate * (call + node)))


class TreeProposer:
    """`auto`'s draft-model trees: grown as `staged` grows them on the chain proposer's draft model and cache, with
    the suffix proposer's index as the lower stage, cut to what pays for the draft call that checks it."""

    name = "tree"
    corrected = True

    def __init__(
        self, state: DecodeState, chain: ChainProposer, suffix: SuffixProposer, cost: CostModel, clock: Clock
    ) -> None:
        self.chain, self.suffix, self.cost, self.clock = chain, suffix, cost, clock
        width = frontier_width(cost.draft)
        self.drafter = TreeDrafter(
            state, replace(StagedOptions(), width=width), model=chain.model, index=suffix.index, lower=self.lower
        )
        self.base = self.drafter.options
        self.acceptance = Acceptance(chain.acceptance.options)
        # per level of the trees drafted: draft seconds and nodes; priors: one call of `width` leaves, `branching` nodes
        self.level_seconds = RunningMean(cost.draft.predict(width, len(state.tokens)), 1)
        self.level_nodes = RunningMean(float(self.base.branching), 1)
        self.limit = self.step = 0

    def size(self, levels: int) -> int:
        """The nodes a tree of `levels` levels is expected to hold."""
        return min(self.base.budget, max(levels, round(self.level_nodes.mean * levels)))

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        chain = self.chain.offered
        if chain is None:
            return None
        room, self.limit = min(len(chain.accept), self.base.max_depth), limit
        suffix = self.suffix.offered.accept if self.suffix.offered is not None else ()
        accept = at_least([self.acceptance.chain(room), chain.accept, suffix], room)
        drafting = tuple(chain.catch_up + self.level_seconds.mean * d for d in range(1, room + 1))
        return Offer(self.name, accept, drafting, tuple(self.size(d) for d in range(1, room + 1)), chain.catch_up)

    def draft(self, state: DecodeState, plan: Plan) -> Drafting:
        context, start, calls = len(state.cache), self.clock.now(), state.stats.draft_calls
        catch_up, self.step = self.chain.offered.catch_up, len(state.tokens)
        planned, budget = self.size(plan.k), self.base.budget
        big, small = (self.cost.target_seconds(1 + n, context) for n in (budget, planned))
        call = self.cost.draft.predict(self.base.width, context)
        node = (big - small) / max(1, budget - planned)
        # in a batch a draft call holds up the rows not drafting beside it (`stall`), as the tree's plan is priced
        min_prob, expand_prob = tree_thresholds(plan.rate, node, self.cost.stall * call)
        self.drafter.options = replace(self.base, min_prob=min_prob, expand_prob=expand_prob)
        draft = yield from self.drafter.propose(state, plan.k if plan.probe else self.limit)
        state.lm.synchronize()
        if levels := depth(draft):
            spent = self.clock.elapsed(start, (state.stats.draft_calls - calls) * call + catch_up)
            self.level_seconds.add(max(0.0, spent - catch_up) / levels)
            self.level_nodes.add(len(draft.tokens) / levels)
        return draft

    def lower(self, context: list[int], room: int) -> list[int]:
        """The suffix index's chain after `context` (the run's tokens and a tree path), cut to the length that saves
        most draft calls in expectation: each guessed token the draft agrees with saves a call, each adds a row."""
        branch = propose(self.drafter.index, None, context, room, self.drafter.suffix).main_branch()
        levels = summarize(branch)
        accept = self.suffix.acceptance.chain(
            len(levels), levels, [self.suffix.curve(branch.match + d) for d in range(len(levels))]
        )
        model = self.chain.model
        draft_context = len(model.cache)
        fed = len(model.uncached()) if len(context) == self.step else self.base.width  # (the root's call)
        per_token = self.cost.draft_seconds(1, draft_context)
        reach = list(itertools.accumulate(accept, operator.mul))
        first = [self.cost.draft_seconds(1, draft_context, fed + n) for n in range(len(reach) + 1)]
        return branch.tokens[: max(range(len(first)), key=lambda n: per_token * sum(reach[:n]) - first[n])]

    def learn(self, state: DecodeState, step: Step) -> None:
        if step.plan.proposer == self.chain.name and step.draft.tokens:
            # what a tree would have caught: the chain plus the draft's second choice beside each token
            levels = min(len(step.draft.tokens), step.accepted + 1, self.base.max_depth)
            missed = step.tokens[step.accepted] if step.accepted < len(step.tokens) else None
            caught = step.accepted < levels and missed == self.chain.model.runner_ups[step.accepted]
            self.acceptance.learn(levels, min(levels, step.accepted + caught))
        if step.plan.proposer != self.name:
            return
        self.drafter.update(state, step.draft, step.accepted)  # keeps the accepted path in the draft cache
        if not step.draft.tokens:
            return
        levels = depth(step.draft)
        # a level the tree did not grow is one not accepted
        self.acceptance.learn(levels + (levels < step.plan.k and step.accepted == levels), step.accepted)
        main, path = first_branch(step.draft.links), step.draft.follow(step.tokens[: step.accepted])
        # its first branch is the chain the draft would have drafted
        self.chain.acceptance.learn(len(main), shared_length(main, path))
