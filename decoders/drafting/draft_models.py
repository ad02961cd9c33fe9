"""`draft_model`: which draft model a run drafts chains with."""

from __future__ import annotations

from decoders.base import DecodeState
from decoders.drafting.draft_model import DraftModel, SharedCacheDraft
from decoders.drafting.translate import TranslatedDraftModel


def draft_model(state: DecodeState) -> DraftModel:
    """The run's chain-drafting model."""
    if state.draft is not None and state.draft.vocab_key != state.lm.vocab_key:
        return TranslatedDraftModel(state)
    if (
        state.draft is not None
        and state.draft.quantized_from is not None
        and state.draft.quantized_from() is state.lm
        and state.cache.lends
    ):  # (a batch gives the copy a cache of its own)
        return SharedCacheDraft(state)
    return DraftModel(state)
