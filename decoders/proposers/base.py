"""The `Proposer` protocol, a fixed strategy's drafter of one proposer (`Fixed`) and a run's proposers (`assemble`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from decoders.capabilities import takes_trees
from decoders.drafting.chooser import Chooser, Offer, Plan, expected_tokens
from decoders.drafting.cost import CostModel
from decoders.drafting.draft import Draft, Drafting, drafting

if TYPE_CHECKING:
    from decoders.base import DecodeState


@dataclass
class Clock:
    """What a run times calls by; a seeded sampling run is not `timed`."""

    now: Callable[[], float] = time.perf_counter
    timed: bool = True

    def elapsed(self, since: float, planned: float, until: float | None = None) -> float:
        """Seconds from `since` to `until` (default: now), or `planned` where not `timed`."""
        return ((self.now() if until is None else until) - since) if self.timed else planned


@dataclass
class Step:
    """One verified step, as every proposer learns it."""

    plan: Plan
    draft: Draft  # what the target verified (cut at EOS, under the grammar)
    start: int  # len(state.tokens) before the step's tokens
    accepted: int  # draft nodes on the accepted path (a chain's prefix)
    tokens: list[int] = field(default_factory=list)  # the accepted path, then the target's
    seconds: float = 0.0  # drafting plus the target call (planned seconds where not `timed`)


class Proposer(Protocol):
    """A source of guesses for one run.

    Optional: the class attributes below (absent: these defaults), which `assemble` checks; `build(setup, needed)`;
    `ride(state, draft, carried)`, adding unverified tokens to another's step; `finish(state)`."""

    name: str  # in `auto`'s plans and report
    corrected: bool  # its drafts run past their plans: the chooser corrects its plans by its steps
    needs: ClassVar[tuple[str, ...]] = ()  # proposers it reads, by name: built, and asked to offer, before it
    needs_draft: ClassVar[bool] = False  # it drafts with the run's draft model
    needs_tree_mask: ClassVar[bool] = False  # the target scores its drafts (or its window) under a tree mask
    carries: ClassVar[bool] = False  # another's window may ride along its steps (its guesses are one-hot)

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        """What it could draft after `state.tokens`, at most `limit` levels; None: nothing this step."""

    def draft(self, state: DecodeState, plan: Plan) -> Draft | Drafting:
        """The draft of `plan` (from this proposer's last `offer`); a draft model's proposer yields its calls."""

    def learn(self, state: DecodeState, step: Step) -> None:
        """After verification: `state.tokens` holds the step's tokens."""


@dataclass
class Setup:
    """What a run's proposers are built from (`Proposer.build`)."""

    state: DecodeState
    options: Any  # auto's: `AutoOptions`
    cost: CostModel
    chooser: Chooser
    clock: Clock
    suffix_trees: bool = True  # the suffix index drafts trees (else its main branch) where the target takes them


def assemble(kinds: Sequence[type], setup: Setup, off: Sequence[str] = ()) -> list[Proposer]:
    """The run's proposers, in the order of `kinds`: those not `off` whose needs are there, unless `build` declines."""
    state, trees, built = setup.state, takes_trees(setup.state.lm), {}
    names = [kind.name for kind in kinds]
    for i, kind in enumerate(kinds):
        needs = getattr(kind, "needs", ())
        late = [need for need in needs if need in names[i:]]
        if late:
            raise ValueError(f"proposer {kind.name!r} reads {', '.join(late)}, listed after it: list it first")
        if kind.name in off or any(need not in built for need in needs):
            continue
        if getattr(kind, "needs_draft", False) and state.draft is None:
            continue
        if getattr(kind, "needs_tree_mask", False) and not trees:
            continue
        proposer = kind.build(setup, {need: built[need] for need in needs})
        if proposer is not None:
            built[kind.name] = proposer
    return list(built.values())


class Fixed:
    """A `Drafter` of one proposer: each step drafts `levels(offer)` levels of its offer (default: all)."""

    def __init__(self, proposer: Proposer, levels: Callable[[Offer], int] = lambda offer: len(offer.accept)) -> None:
        self.proposer, self.levels = proposer, levels
        self.plan, self.start = Plan(None, 0, 1.0, 1.0), 0

    @classmethod
    def of(cls, kind: Callable[..., Proposer]) -> staticmethod:
        """A strategy's `drafter`: each run's `kind(state, options)`, all it offers drafted."""
        return staticmethod(lambda state, options: cls(kind(state, options)))

    def propose(self, state: DecodeState, limit: int) -> Drafting:
        offer, self.start = self.proposer.offer(state, limit), len(state.tokens)
        k = self.levels(offer) if offer is not None else 0
        self.plan = Plan(self.proposer.name if k else None, k, expected_tokens(offer.accept[:k]) if k else 1.0, 1.0)
        draft = (yield from drafting(self.proposer.draft(state, self.plan))) if k else Draft([])
        ride = getattr(self.proposer, "ride", None)  # (lookahead's window rides its own steps)
        return draft if ride is None else ride(state, draft, True)

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        self.proposer.learn(state, Step(self.plan, draft, self.start, accepted, state.tokens[self.start :]))

    def finish(self, state: DecodeState) -> None:
        getattr(self.proposer, "finish", lambda state: None)(state)
