"""`speculative`: a small draft model proposes k tokens, the target checks them all in one call.

Leviathan et al. 2023 / Chen et al. 2023. Exact in greedy mode (accept while the target's argmax agrees) and in
sampling mode (rejection sampling in `samplers.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass

from decoders.base import DecodeState
from decoders.drafting import Draft, DraftVerify, draft_model, stack_probs
from decoders.options import whole
from decoders.registry import register


@dataclass(frozen=True)
class SpeculativeOptions:
    """Options of `speculative`."""

    k: int = 5  # draft tokens per target call

    def __post_init__(self):
        whole("k (draft tokens per target call)", self.k)


class FixedDrafter:
    """Drafts exactly k tokens (fewer only near max_new_tokens) with the draft model."""

    def __init__(self, state: DecodeState, options: SpeculativeOptions) -> None:
        self.model, self.k = draft_model(state), options.k

    def propose(self, state: DecodeState, limit: int) -> Draft:
        tokens, rows, _ = self.model.draft_chain(min(self.k, limit))
        return Draft(tokens, stack_probs(rows))

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        self.model.rewind()


@register("speculative")
class Speculative(DraftVerify):
    """Speculative decoding with a fixed draft length k."""

    Options = SpeculativeOptions
    drafter = FixedDrafter
    needs_draft = takes_draft = True
