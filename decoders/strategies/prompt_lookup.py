"""`prompt_lookup`: prompt lookup decoding (Saxena 2023) - no draft model; the draft is what followed the most recent
earlier occurrence of the context's last n tokens (`decoders.proposers.lookup`)."""

from __future__ import annotations

from decoders.drafting import DraftVerify
from decoders.proposers.lookup import LookupDrafter, PromptLookupOptions
from decoders.registry import register


@register("prompt_lookup")
class PromptLookup(DraftVerify):
    """Speculative decoding with n-gram matches from the context as the draft."""

    Options = PromptLookupOptions
    drafter = LookupDrafter
