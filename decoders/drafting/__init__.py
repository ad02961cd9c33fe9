"""The draft-then-verify machinery every drafting strategy shares: `Draft` and the `Drafter` protocol (draft.py), token
trees (tree.py), the loop (draft_verify.py), drafts under a grammar (grammar.py) and the draft model (draft_model.py);
`auto`'s cost model (cost.py), its chooser (chooser.py) and what it drafts with (copies.py).
"""

from decoders.drafting.draft import Draft, Drafter, Drafting, Window, drafting
from decoders.drafting.draft_model import DraftModel, draft_model, stack_probs
from decoders.drafting.draft_verify import DraftVerify

__all__ = ["Draft", "Drafter", "Drafting", "Window", "drafting", "DraftModel", "DraftVerify", "draft_model",
           "stack_probs"]
