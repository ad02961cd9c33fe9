"""`speculative`: a small draft model proposes k tokens, the target checks them all in one call.

Leviathan et al. 2023 / Chen et al. 2023. Exact in greedy mode (accept while the target's argmax agrees) and in
sampling mode (rejection sampling in `samplers.verify`).

k is fixed for the run. Unless given, it is the k this device's measured call costs favour (`default_k`): the best k
turns on what a draft call costs against a target call, and that changes with the draft (bfloat16, int8, the
target's own int8 copy) and the machine. Replayed on the 1.5B's greedy outputs (`devtools.replay_chains`, AMD EPYC,
estimated seconds): with the bfloat16 0.5B draft (a call 0.42 of the target's) k=2 / 3 / 5 took 44.9 / 48.1 / 50.6 s
on `mixed` (k=5 lost to greedy on translation, 0.81x in a real run) and 32.2 / 32.3 / 31.4 s on `bench`; with the
int8 0.5B draft (0.19) k=3 / 5 / 8 took 22.3 / 19.6 / 20.8 s on `bench`; with the target's own int8 copy (0.48,
accepted at every position) k=5 / 8 / 12 took 27.8 / 26.4 / 26.7 s. `default_k` picked 3, 5 and 9 there from a
calibration at 1, 8 and 32 tokens; calibrated at 1-4, 8, 16 and 32 (the 1.5B's calls cost the same for 1 to 5 tokens
there) it picks 3, 6 and 11 (not replayed; in compare runs k=6 / k=11 gave 2.84 / 2.80 / 1.83x and 2.01 / 1.70 / 2.15x
greedy on bench's code / edit / prose, k=5 / k=7 2.95 / 3.08 / 2.08x and 2.14 / 1.67 / 2.07x in the session before).
"""

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

ACCEPTANCE = 0.85  # the per-token acceptance `default_k` plans for with a separate draft model: lower planned
# acceptances picked k=3-4 for the int8 0.5B draft, 6-14% slower than k=5 in replays
MOST = 16  # the longest k `default_k` considers


@dataclass(frozen=True)
class SpeculativeOptions:
    """Options of `speculative`."""

    k: int | None = None  # draft tokens per target call; None: what this device's measured costs favour (default_k)

    def __post_init__(self):
        if self.k is not None:
            whole("k (draft tokens per target call)", self.k)


def default_k(cost: CostModel, context: int, acceptance: float) -> int:
    """The k of most expected tokens per second for a draft each of whose tokens is accepted with probability
    `acceptance`: k draft calls and one target call of k + 1 tokens after `context` cached ones, priced by `cost`
    (the chooser's own rule, `Chooser.best`)."""
    call = cost.draft_seconds(1, context)
    draft = Offer("draft", (acceptance,) * MOST, tuple(call * k for k in range(1, MOST + 1)))
    return Chooser(cost).best(draft, context).k


def fixed_chain(state: DecodeState, options: SpeculativeOptions) -> Fixed:
    """The draft model's chain of exactly k tokens a step (fewer only near max_new_tokens)."""
    model, k = draft_model(state), options.k
    if k is None:
        acceptance = SELF_ACCEPTANCE if isinstance(model, SharedCacheDraft) else ACCEPTANCE
        k = default_k(calibrate(state.lm, state.draft), len(state.tokens), acceptance)
        state.stats.details = {"chosen_k": k}  # for reports
    return Fixed(ChainProposer(model, max_draft=k))


@register("speculative")
class Speculative(DraftVerify):
    """Speculative decoding with a fixed draft length k (by default the one this device's measured costs favour)."""

    Options = SpeculativeOptions
    drafter = staticmethod(fixed_chain)
    needs_draft = takes_draft = True
