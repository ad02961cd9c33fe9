"""The draft-then-verify machinery of the drafting strategies, and `auto`'s cost model, chooser and copies."""

from decoders.drafting.draft import Draft, Drafter, Drafting, Window, drafting
from decoders.drafting.draft_model import DraftModel, stack_probs
from decoders.drafting.draft_models import draft_model
from decoders.drafting.draft_verify import DraftVerify

__all__ = [
    "Draft",
    "Drafter",
    "Drafting",
    "Window",
    "drafting",
    "DraftModel",
    "DraftVerify",
    "draft_model",
    "stack_probs",
]
