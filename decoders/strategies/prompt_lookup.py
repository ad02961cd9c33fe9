from __future__ import annotations

from decoders.drafting import DraftVerify
from decoders.proposers.base import Fixed
from decoders.proposers.lookup import LookupProposer, PromptLookupOptions
from decoders.registry import register


@register("prompt_lookup")
class PromptLookup(DraftVerify):
    """Speculative decoding with n-gram matches from the context as the draft.
    Saxena 2023, "Prompt lookup decoding" (`proposers.lookup`)."""

    Options = PromptLookupOptions
    drafter = Fixed.of(LookupProposer)
