"""`draft_model`: which draft model a run drafts chains with, its own cache, the target's, or through text."""

from __future__ import annotations

from decoders.base import DecodeState
from decoders.drafting.draft_model import DraftModel, SharedCacheDraft
from decoders.drafting.translate import TranslatedDraftModel


def draft_model(state: DecodeState) -> DraftModel:
    """The run's chain-drafting model: a `DraftModel`, a `SharedCacheDraft` for the target's own quantized copy, or
    for a draft of another vocabulary a `TranslatedDraftModel` (it drafts through text)."""
    if state.draft is not None and state.draft.vocab_key != state.lm.vocab_key:
        return TranslatedDraftModel(state)
    if (
        state.draft is not None
        and state.draft.quantized_from is not None
        and state.draft.quantized_from() is state.lm
        and state.cache.lends
    ):  # (in a batch: on the batch's cache for the copy)
        return SharedCacheDraft(state)
    return DraftModel(state)
