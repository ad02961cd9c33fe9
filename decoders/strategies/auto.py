"""`auto`: each step, the plan a measured cost model predicts fastest (docs/design/auto.md). Exact in both modes; a
seeded run plans by no clock, so the seed repeats the sample."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from decoders.base import ALONE, Budget, DecodeState, Verified
from decoders.drafting import Draft, Drafting, DraftVerify, drafting
from decoders.drafting.chooser import Chooser, Plan
from decoders.drafting.copies import drafting_model
from decoders.drafting.cost import CostModel, calibrate
from decoders.options import check_flags, check_whole
from decoders.proposers.base import Clock, Proposer, Setup, Step, assemble
from decoders.proposers.draft_chain import ChainProposer
from decoders.proposers.draft_tree import TreeProposer
from decoders.proposers.lookahead import LookaheadProposer
from decoders.proposers.merged import MergedProposer
from decoders.proposers.suffix import SuffixProposer
from decoders.registry import register


@dataclass(frozen=True)
class AutoOptions:
    """Options of `auto`: bounds only; what to draft and how much is measured, not set."""

    max_draft: int = 16  # the most draft-model tokens per target call
    max_tree: int = 24  # the most suffix-tree nodes per target call (suffix's own bound)
    draft_trees: bool = True  # offer the draft model's trees where both models take tree masks
    draft_int8: bool | None = None  # draft with the draft's int8 copy; None: where it pays (`copies`), not batched
    self_int8: bool | None = None  # without a draft, draft with the target's int8 copy; None: where it pays and fits

    def __post_init__(self):
        check_whole(self, max_draft=1, max_tree=1)
        check_flags(self)
        for name in ("draft_int8", "self_int8"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name} must be None (where measured to pay), True or False, got {getattr(self, name)!r}"
                )


# in the order they offer: each after the proposers it reads
PROPOSERS = (SuffixProposer, LookaheadProposer, MergedProposer, ChainProposer, TreeProposer)


class AutoDrafter:
    """One run of `auto`: its proposers, cost model and chooser."""

    kinds: ClassVar[tuple[type, ...]] = PROPOSERS  # (ablations swap in variants)
    off: ClassVar[tuple[str, ...]] = ()  # names switched off (ablations), with the proposers that read them
    suffix_trees: ClassVar[bool] = True  # False: the suffix index drafts chains (an ablation)

    def __init__(
        self,
        state: DecodeState,
        options: AutoOptions,
        clock: Callable[[], float] = time.perf_counter,
        chooser: Callable[[CostModel], Chooser] = Chooser,
        budget: Budget = ALONE,
    ) -> None:
        # in a batch no int8 copy unless asked for: its prompts' prefills and its calls stall every row
        int8 = [False if flag is None and budget.batched else flag for flag in (options.draft_int8, options.self_int8)]
        state.draft = drafting_model(state.lm, state.draft, len(state.tokens), *int8)
        self.cost = calibrate(state.lm, state.draft)
        self.chooser = chooser(self.cost)
        self.clock = Clock(clock, timed=not state.seeded)
        setup = Setup(state, options, self.cost, self.chooser, self.clock, self.suffix_trees)
        off = (*self.off, *(() if options.draft_trees else ("tree",)))
        self.proposers: list[Proposer] = assemble(self.kinds, setup, off)
        self.by_name = {p.name: p for p in self.proposers}
        self.plan, self.start, self.began, self.called = Plan(None, 0, 1.0, 1.0), 0, 0.0, 0.0
        self.context, self.fed, self.budget = 0, 1, ALONE  # this step's cached positions, tokens fed and budget
        self.guessed, self.guess = False, None  # a batch's step with no room to draft: the suffix index's next token
        self.right = False  # ... and whether the target's token was that guess
        state.stats.details = {"steps": {}, "predicted_tokens": 0.0, "predicted_seconds": 0.0}
        if state.draft is not None:
            state.stats.details["draft"] = state.draft.name

    def propose(self, state: DecodeState, limit: int, budget: Budget = ALONE) -> Drafting:
        self.began, self.context, self.fed = self.clock.now(), len(state.cache), len(state.uncached())
        self.budget = budget
        self.cost.batch_tokens, self.cost.stall = budget.tokens, budget.stall
        # the prompt's call is plain: a tree mask over the whole prompt costs more than untaught guesses save
        prompt = not len(state.cache)
        offers = [] if prompt else [offer for p in self.proposers if (offer := p.offer(state, limit)) is not None]
        suffix = self.by_name.get(SuffixProposer.name)
        self.guessed = bool(budget.width) and not limit and not prompt and state.remaining > 1 and suffix is not None
        self.guess = suffix.current().tokens[0] if self.guessed and suffix.offer(state, 1) else None
        if budget.trying:  # a batch's try at a width: no draft model's prompt prefilled for it (every row would stall)
            offers = [o for o in offers if not o.catch_up or o.proposer in self.chooser.taken]
        self.plan = plan = self.chooser.choose(offers, self.context + self.fed - 1, state.remaining)
        self.start = len(state.tokens)
        details, name = state.stats.details, plan.proposer or "none"  # for reports
        details["steps"][name] = details["steps"].get(name, 0) + 1
        details["predicted_tokens"] += plan.expected_tokens
        details["predicted_seconds"] += plan.seconds
        planned = self.by_name.get(plan.proposer)
        draft = (yield from drafting(planned.draft(state, plan))) if planned is not None else Draft([])
        carried = planned is None or getattr(planned, "carries", False)  # (a plain step carries a window too)
        for proposer in self.proposers:
            if (ride := getattr(proposer, "ride", None)) is not None and not prompt:
                draft = ride(state, draft, carried)
        self.called = self.clock.now()
        return draft

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        state.lm.synchronize()
        ended = self.clock.now()
        alone = not self.budget.width  # (in a batch the clock also counts the other rows' work: the plan's seconds)
        if self.clock.timed and alone:
            window = len(draft.window.tokens) if draft.window is not None else 0
            self.cost.observe("target", self.fed + len(draft.tokens) + window, self.context, ended - self.called)
        seconds = self.clock.elapsed(self.began, self.plan.seconds, ended) if alone else self.plan.seconds
        step = Step(self.plan, draft, self.start, accepted, state.tokens[self.start :], seconds)
        if self.fed <= 1:  # (a prompt's call says nothing of the steps' rates)
            # in a batch a row's share of the shared call: a draft's prefill stalls every row
            self.chooser.spend(step.seconds if alone else step.seconds * self.budget.width / self.budget.tokens)
            proposer = self.by_name.get(self.plan.proposer)
            if proposer is not None and proposer.corrected and not self.plan.probe:
                self.chooser.learn_rate(self.plan, len(step.tokens), step.seconds)
        self.right = step.tokens[:1] == [self.guess]
        for proposer in self.proposers:
            proposer.learn(state, step)

    def reported(self, verified: Verified) -> Verified:
        """What the batch learns: at a step its width left no room to draft, whether one more token (the suffix
        index's guess) would have been accepted, known for free."""
        if not self.guessed:
            return verified
        return Verified(self.fed + 1, self.fed, [0] if self.right else [])


@register("auto")
class Auto(DraftVerify):
    """Per step, the proposer and draft length a measured cost model predicts to be fastest."""

    Options = AutoOptions
    drafter = AutoDrafter
    takes_draft = True

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        chooser: Callable[[CostModel], Chooser] = Chooser,
        **options,
    ) -> None:
        """`clock`: what auto times by; `chooser`: a run's `Chooser` from its cost model; `options`: `AutoOptions`."""
        if not (callable(clock) and callable(chooser)):
            raise TypeError("auto's clock is a function of no arguments giving seconds, its chooser a Chooser factory")
        super().__init__(**options)
        self.clock, self.chooser = clock, chooser

    def start(self, state: DecodeState, budget: Budget = ALONE) -> None:
        state.drafter = self.drafter(state, self.options, self.clock, self.chooser, budget)

    def draft(self, state: DecodeState, limit: int, budget: Budget) -> Drafting:
        return state.drafter.propose(state, limit, budget)  # (it plans by the batch's budget)

    def learn(self, state: DecodeState, draft: Draft, verified: Verified, budget: Budget) -> Verified:
        state.drafter.update(state, draft, len(verified.path))
        return state.drafter.reported(verified)
