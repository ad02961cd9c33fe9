"""`lookahead`: lookahead decoding (Fu et al. 2024) - no draft model; the target guesses n-grams and checks them in
the same call (`decoders.proposers.lookahead`)."""

from __future__ import annotations

from decoders.drafting import DraftVerify
from decoders.proposers.lookahead import LookaheadDrafter, LookaheadOptions
from decoders.registry import register


@register("lookahead")
class Lookahead(DraftVerify):
    """Draft-free decoding: n-grams from a Jacobi window and the context, verified as a tree in the same call."""

    Options = LookaheadOptions
    drafter = LookaheadDrafter
    needs_tree_mask = True
