from __future__ import annotations

from decoders.drafting import DraftVerify
from decoders.proposers.base import Fixed
from decoders.proposers.lookahead import LookaheadOptions, LookaheadProposer
from decoders.registry import register


@register("lookahead")
class Lookahead(DraftVerify):
    """Draft-free decoding: n-grams from a Jacobi window and the context, verified as a tree in the same call.
    Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding"."""

    Options = LookaheadOptions
    drafter = Fixed.of(LookaheadProposer)  # (its window rides along every step)
    needs_tree_mask = True
