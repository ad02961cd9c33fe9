from __future__ import annotations

from decoders.drafting import DraftVerify
from decoders.proposers.base import Fixed
from decoders.proposers.draft_tree import StagedOptions, StagedProposer
from decoders.registry import register


@register("staged")
class Staged(DraftVerify):
    """Tree speculative decoding with a draft model, itself sped up by a draft-free lower stage.
    Spector & Re 2023, "Accelerating LLM Inference with Staged Speculative Decoding"."""

    Options = StagedOptions
    drafter = Fixed.of(StagedProposer)
    needs_draft = takes_draft = True
    needs_tree_mask = draft_needs_tree_mask = True
