"""The `Proposer` protocol: one source of guesses, as `auto` weighs it and a fixed strategy (`Fixed`) runs it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from decoders.drafting.chooser import Offer, Plan, expected_tokens
from decoders.drafting.draft import Draft, Drafting, drafting

if TYPE_CHECKING:
    from decoders.base import DecodeState


@dataclass
class Clock:
    """What a run times calls by; `timed` False (a seeded sampling run): no clock, `elapsed` gives planned seconds."""

    now: Callable[[], float] = time.perf_counter
    timed: bool = True

    def elapsed(self, since: float, planned: float, until: float | None = None) -> float:
        """Seconds from `since` to `until` (default: now), or `planned` where the run plans by no clock."""
        return ((self.now() if until is None else until) - since) if self.timed else planned


@dataclass
class Step:
    """One verified step, as every proposer learns it."""

    plan: Plan
    draft: Draft  # what the target verified (cut at EOS, under the grammar)
    start: int  # len(state.tokens) before the step's tokens
    accepted: int  # draft nodes on the accepted path (a chain's prefix)
    tokens: list[int] = field(default_factory=list)  # the step's new tokens (the accepted path, then the target's)
    seconds: float = 0.0  # drafting plus the target call, by the run's clock (planned where it plans by none)


class Proposer(Protocol):
    """A source of guesses for one run, built from the run's state."""

    name: str  # what `result.sources`, `auto`'s report and its estimates call it
    corrected: bool  # its drafts run past their plans, so the chooser corrects its plans by what its steps gave

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        """What it could draft after `state.tokens`, at most `limit` levels; None: nothing this step."""

    def draft(self, state: DecodeState, plan: Plan) -> Draft | Drafting:
        """The draft of `plan` (from this proposer's last `offer`); a draft model's proposer yields its calls."""

    def learn(self, state: DecodeState, step: Step) -> None:
        """After verification: `state.tokens` holds the step's tokens."""

    # Optional: `ride(state, draft, plan) -> Draft`: the step's draft plus what rides along unverified (lookahead's).


class Fixed:
    """A `Drafter` from a proposer: each step drafts `levels(offer)` levels of what it offers (default: all)."""

    def __init__(self, proposer: Proposer, levels: Callable[[Offer], int] = lambda offer: len(offer.accept)) -> None:
        self.proposer, self.levels = proposer, levels
        self.plan, self.start = Plan(None, 0, 1.0, 1.0), 0

    def propose(self, state: DecodeState, limit: int) -> Drafting:
        offer, self.start = self.proposer.offer(state, limit), len(state.tokens)
        k = self.levels(offer) if offer is not None else 0
        self.plan = Plan(self.proposer.name if k else None, k, expected_tokens(offer.accept[:k]) if k else 1.0, 1.0)
        return (yield from drafting(self.proposer.draft(state, self.plan))) if k else Draft([])

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        self.proposer.learn(state, Step(self.plan, draft, self.start, accepted, state.tokens[self.start :]))

    def finish(self, state: DecodeState) -> None:
        getattr(self.proposer, "finish", lambda state: None)(state)
