"""`prompt_lookup`: draft by copying from the context - no draft model.

Saxena 2023, "Prompt lookup decoding": the up to k tokens that followed the most recent earlier occurrence of the
context's last n tokens (n from `max_ngram` down to `min_ngram`); without a match a step is a plain step.
"""

from __future__ import annotations

from decoders.drafting import DraftVerify
from decoders.proposers.lookup import LookupDrafter, PromptLookupOptions
from decoders.registry import register


@register("prompt_lookup")
class PromptLookup(DraftVerify):
    """Speculative decoding with n-gram matches from the context as the draft."""

    Options = PromptLookupOptions
    drafter = LookupDrafter
