"""`prompt_lookup`: draft by copying from the context - no draft model.

Saxena 2023, "Prompt lookup decoding": find the most recent earlier occurrence of the last n tokens (n from
`max_ngram` down to `min_ngram`) in the prompt and the text generated so far, and propose the up to k tokens that
followed it. Strong when the output copies its input (code editing, retrieval-grounded answers); when nothing
matches, a step is a plain greedy step.
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
