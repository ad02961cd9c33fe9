"""`threshold`: speculative decoding whose draft length follows the draft's confidence ("How to make LLMs go fast",
vgel.me)."""

from __future__ import annotations

from dataclasses import dataclass

from decoders.base import DecodeState
from decoders.drafting import Draft, Drafting, DraftVerify, draft_model, stack_probs
from decoders.drafting.chooser import Offer, Plan
from decoders.options import probability, whole
from decoders.proposers.base import Fixed, Step
from decoders.registry import register


@dataclass(frozen=True)
class ThresholdOptions:
    """Options of `threshold` (a drafted token pays only while its acceptance beats a draft call's relative cost)."""

    max_draft: int = 16  # the most draft tokens per target call
    threshold: float = 0.4  # initial cumulative-probability threshold
    step: float = 0.05  # how far the threshold drops after a fully accepted draft
    min_threshold: float = 0.3  # clamp bounds of the threshold
    max_threshold: float = 0.95

    def __post_init__(self):
        whole("max_draft", self.max_draft)
        for name in ("threshold", "step", "min_threshold", "max_threshold"):
            probability(name, getattr(self, name))
        if not self.min_threshold <= self.max_threshold:
            raise ValueError(f"need min_threshold <= max_threshold, got {self.min_threshold} and {self.max_threshold}")
        if not self.min_threshold <= self.threshold <= self.max_threshold:
            raise ValueError(f"threshold {self.threshold} must lie in [min_threshold, max_threshold]")


def adapt_threshold(threshold: float, cumulative: list[float], accepted: int, options: ThresholdOptions) -> float:
    """The next threshold after `accepted` of len(cumulative) drafted tokens were accepted; cumulative[i]: the draft's
    probability of its first i + 1 tokens."""
    if accepted < len(cumulative):
        threshold = (threshold + cumulative[accepted]) / 2  # toward the confidence at the first rejection
    else:
        threshold -= options.step  # all accepted: we were too cautious
    return min(max(threshold, options.min_threshold), options.max_threshold)


class ThresholdProposer:
    """Chains of the draft model, drafted while its cumulative probability stays at or above the run's threshold."""

    name = "threshold"
    corrected = False

    def __init__(self, state: DecodeState, options: ThresholdOptions) -> None:
        self.model, self.options = draft_model(state), options
        self.threshold = options.threshold  # per run: this object lives with the run's drafter
        self.cumulative: list[float] = []  # [k] the last draft's cumulative probabilities

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        limit = min(self.options.max_draft, limit)  # (how far the chain goes is its threshold's to say)
        return Offer(self.name, (1.0,) * limit) if limit > 0 else None

    def draft(self, state: DecodeState, plan: Plan) -> Drafting:
        tokens, rows, self.cumulative = yield from self.model.draft_chain(plan.k, lambda p: p >= self.threshold)
        return Draft(tokens, stack_probs(rows))

    def learn(self, state: DecodeState, step: Step) -> None:
        self.model.rewind()
        if step.draft.tokens:
            self.threshold = adapt_threshold(self.threshold, self.cumulative, step.accepted, self.options)


@register("threshold")
class Threshold(DraftVerify):
    """Speculative decoding with an adaptive, confidence-driven draft length."""

    Options = ThresholdOptions
    drafter = Fixed.of(ThresholdProposer)
    needs_draft = takes_draft = True
