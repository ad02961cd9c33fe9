"""The draft model's token trees as proposers: `staged`'s (`StagedProposer`) and `auto`'s (`TreeProposer`), grown
by `drafting.growth` with a draft-free lower stage (the suffix index, or prompt lookup) under their likeliest leaf."""

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

WIDE_CALL = 0.05  # a second leaf per draft call pays where it adds less than this to the call (see StagedOptions)


def frontier_width(cost: CallCost) -> int:
    """`StagedOptions.width` for a draft model of these call costs: 2 if a call's rows add under WIDE_CALL of a
    1-token call each (the mean from 1 to 8 rows: a 2-row call alone is within its noise), else 1."""
    one = cost.predict(1, 0)
    return 2 if one + (cost.predict(8, 0) - one) / 7 < (1 + WIDE_CALL) * one else 1


class StagedProposer:
    """`staged`'s trees: the draft model and its cache for one run, plus where the last tree's nodes sit in that cache
    (`propose` and `update` grow a tree and keep its accepted path; `auto`'s `TreeProposer` drives them too)."""

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
    """(min_prob, expand_prob) of a step expected to give `rate` tokens a second: a node (`node` seconds more in the
    target call) pays from a path probability of rate x node, a draft call (`call`) from rate x (call + node)."""
    base = StagedOptions()
    return min(SURE, max(base.min_prob, rate * node)), min(SURE, max(base.expand_prob, rate * (call + node)))


class TreeProposer:
    """`auto`'s draft-model trees: grown as `staged` grows them on the chain proposer's draft model and cache, with
    the suffix proposer's index as the lower stage, cut to what pays for the draft call that checks it."""

    name = "tree"
    corrected = True
    needs = ("draft", "suffix")  # the chain's draft model, cache and estimates; the suffix index as lower stage
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
        # per level of the trees drafted: draft seconds and nodes; priors: one call of `width` leaves, `branching` nodes
        self.level_seconds = RunningMean(cost.draft.predict(width, len(state.tokens)), 1)
        self.level_nodes = RunningMean(float(self.base.branching), 1)
        self.limit = self.step = 0

    @classmethod
    def build(cls, setup: Setup, needed: dict) -> TreeProposer | None:
        """On a draft model with a cache of its own (not the target's, not one of another vocabulary) that scores a
        tree in one call."""
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
