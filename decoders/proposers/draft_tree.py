"""The draft model's token trees: `staged`'s (`StagedProposer`) and `auto`'s (`TreeProposer`)."""

from __future__ import annotations

import itertools
import operator
from dataclasses import replace

import torch

from decoders.base import DecodeState
from decoders.capabilities import takes_trees
from decoders.drafting.chooser import Acceptance, Offer, Plan, at_least
from decoders.drafting.cost import CallCost, CostModel, call_cost
from decoders.drafting.curve import RunningMean
from decoders.drafting.draft import Draft, Drafting
from decoders.drafting.draft_model import DraftModel
from decoders.drafting.growth import Lower, StagedOptions, grow_tree
from decoders.drafting.suffix_index import SuffixIndex, SuffixOptions
from decoders.drafting.suffix_store import propose
from decoders.drafting.tree import depth, first_branch, keep_path
from decoders.models.cache import shared_length
from decoders.proposers.base import Clock, Setup, Step
from decoders.proposers.draft_chain import ChainProposer
from decoders.proposers.lookup import lookup
from decoders.proposers.suffix import SuffixProposer, summarize

WIDE_CALL = 0.05  # a second leaf per draft call pays where it adds under this share to the call


def frontier_width(cost: CallCost) -> int:
    """`StagedOptions.width`: 2 where a row adds under WIDE_CALL to a 1-token call (mean of 1-8 rows: a 2-row call
    alone is noise), else 1."""
    one = cost.predict(1, 0)
    return 2 if one + (cost.predict(8, 0) - one) / 7 < (1 + WIDE_CALL) * one else 1


class StagedProposer:
    """`staged`'s trees on one run's draft model and cache, and where the last tree's nodes sit in it (`auto`'s too)."""

    name = "staged"
    corrected = False

    def __init__(
        self,
        state: DecodeState,
        options: StagedOptions,
        model: DraftModel | None = None,
        index: SuffixIndex | None = None,
        lower: Lower | None = None,
    ) -> None:
        """`model`, `index`: `auto`'s to share (else new); `lower`: a stage instead of `options.lower`'s."""
        self.model = model if model is not None else DraftModel(state)
        if options.width is None:
            options = replace(options, width=frontier_width(call_cost(state.draft, "draft")))
        self.options = options
        self.start, self.slots = 0, []  # len(state.tokens) at the last proposal; draft-cache index per node
        self.index = index if index is not None else SuffixIndex()  # of the run's tokens (suffix lower stage)
        # the chain rides in a draft call made anyway: it may run past the match length
        self.suffix = SuffixOptions(max_tree=options.budget, depth_factor=float(options.budget))
        self.stage = lower or self.lower

    def lower(self, context: list[int], room: int) -> list[int]:
        """The lower stage's chain after `context` (the run's tokens plus a tree path)."""
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

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        room = self.model.room(limit)  # (a tree that deep, as many nodes as it pays to grow)
        return Offer(self.name, (1.0,) * room) if room else None

    def draft(self, state: DecodeState, plan: Plan) -> Drafting:
        return self.propose(state, plan.k)

    def learn(self, state: DecodeState, step: Step) -> None:
        if step.plan.proposer != self.name:  # (no tree this step: the draft cache keeps the accepted tokens)
            self.start, self.slots = step.start, []
        self.update(state, step.draft, step.accepted)


SURE = 0.99  # the highest tree thresholds: `staged`'s must stay below 1


def tree_thresholds(rate: float, node: float, call: float) -> tuple[float, float]:
    """(min_prob, expand_prob) at `rate` tokens a second: a node (`node` target seconds) pays from a path probability
    of rate x node, a draft call (`call` seconds) from rate x (call + node)."""
    base = StagedOptions()
    return min(SURE, max(base.min_prob, rate * node)), min(SURE, max(base.expand_prob, rate * (call + node)))


class TreeProposer:
    """`auto`'s draft-model trees: `staged`'s on the chain's model and cache, the suffix index as lower stage."""

    name = "tree"
    corrected = True
    needs = ("draft", "suffix")  # the chain's model, cache and estimates; the suffix index
    needs_tree_mask = True

    def __init__(
        self, state: DecodeState, chain: ChainProposer, suffix: SuffixProposer, cost: CostModel, clock: Clock
    ) -> None:
        self.chain, self.suffix, self.cost, self.clock = chain, suffix, cost, clock
        width = frontier_width(cost.draft)
        self.drafter = StagedProposer(
            state, replace(StagedOptions(), width=width), model=chain.model, index=suffix.index, lower=self.lower
        )
        self.base = self.drafter.options
        self.acceptance = Acceptance(chain.acceptance.options)
        # per tree level: draft seconds and nodes (priors: one call of `width` leaves, `branching` nodes)
        self.level_seconds = RunningMean(cost.draft.predict(width, len(state.tokens)), 1)
        self.level_nodes = RunningMean(float(self.base.branching), 1)
        self.limit = self.step = 0

    @classmethod
    def build(cls, setup: Setup, needed: dict) -> TreeProposer | None:
        """Only on a draft model with its own cache (not the target's, not another vocabulary's) that takes trees."""
        chain, state = needed["draft"], setup.state
        if type(chain.model) is not DraftModel or not takes_trees(state.draft):
            return None
        return cls(state, chain, needed["suffix"], setup.cost, setup.clock)

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
        # in a batch a draft call stalls the other rows (`stall`), as the tree's plan was priced
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
        """The suffix index's chain after `context`, cut where it saves most draft calls in expectation: each token
        the draft agrees with saves a call, each adds a row."""
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
        self.drafter.update(state, step.draft, step.accepted)
        if not step.draft.tokens:
            return
        levels = depth(step.draft)
        # a level the tree did not grow is one not accepted
        self.acceptance.learn(levels + (levels < step.plan.k and step.accepted == levels), step.accepted)
        main, path = first_branch(step.draft.links), step.draft.follow(step.tokens[: step.accepted])
        # its first branch is the chain the draft would have drafted
        self.chain.acceptance.learn(len(main), shared_length(main, path))
