from __future__ import annotations

from decoders.drafting import DraftVerify
from decoders.proposers.lookahead import LookaheadDrafter, LookaheadOptions
from decoders.registry import register


@register("lookahead")
class Lookahead(DraftVerify):
    """Draft-free decoding: n-grams from a Jacobi window and the context, verified as a tree in the same call.
    Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding"."""

    Options = LookaheadOptions
    drafter = LookaheadDrafter
    needs_tree_mask = True
