"""`speculative` (Leviathan et al. 2023, Chen et al. 2023): k draft tokens checked in one target call; exact."""

from __future__ import annotations

from dataclasses import dataclass

from decoders.base import DecodeState
from decoders.drafting import DraftVerify, draft_model
from decoders.drafting.chooser import Chooser, Offer
from decoders.drafting.cost import CostModel, calibrate
from decoders.drafting.draft_model import SELF_ACCEPTANCE, SharedCacheDraft
from decoders.options import whole
from decoders.proposers.base import Fixed
from decoders.proposers.draft_chain import ChainProposer
from decoders.registry import register

ACCEPTANCE = 0.85  # the per-token acceptance `default_k` plans for with a separate draft (lower ones pick too short k)
MOST = 16  # the longest k `default_k` considers


@dataclass(frozen=True)
class SpeculativeOptions:
    """Options of `speculative`."""

    k: int | None = None  # draft tokens per target call; None: `default_k`

    def __post_init__(self):
        if self.k is not None:
            whole("k (draft tokens per target call)", self.k)


def default_k(cost: CostModel, context: int, acceptance: float) -> int:
    """The k of most expected tokens per second (`Chooser.best`), each draft token accepted with `acceptance`."""
    call = cost.draft_seconds(1, context)
    draft = Offer("draft", (acceptance,) * MOST, tuple(call * k for k in range(1, MOST + 1)))
    return Chooser(cost).best(draft, context).k


def k_chain(state: DecodeState, options: SpeculativeOptions) -> ChainProposer:
    """The draft model's chain of exactly k tokens a step (fewer only near max_new_tokens)."""
    model, k = draft_model(state), options.k
    if k is None:
        acceptance = SELF_ACCEPTANCE if isinstance(model, SharedCacheDraft) else ACCEPTANCE
        k = default_k(calibrate(state.lm, state.draft), len(state.tokens), acceptance)
        state.stats.details = {"chosen_k": k}  # for reports
    return ChainProposer(model, max_draft=k)


@register("speculative")
class Speculative(DraftVerify):
    """Speculative decoding with a fixed draft length k (by default the one this device's measured costs favour)."""

    Options = SpeculativeOptions
    drafter = Fixed.of(k_chain)
    needs_draft = takes_draft = True
