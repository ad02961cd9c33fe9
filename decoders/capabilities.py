"""What a strategy needs (`Decoder.needs_*`, `takes_draft`), checked once, up front: `check_request` before any model
is loaded, `check_models` on the loaded models (each probe cached on the `LM`)."""

from __future__ import annotations

from decoders.base import Decoder
from decoders.models.lm import LM


def check_request(strategy: type[Decoder] | Decoder, has_draft: bool, has_grammar: bool | None = None) -> None:
    """Raise ValueError when a draft model or grammar is missing, or a draft is given to a strategy that takes none.
    `has_grammar=None`: not known yet (e.g. a suite decides per prompt)."""
    name = strategy.name
    if strategy.needs_draft and not has_draft:
        raise ValueError(
            f"strategy {name!r} needs a draft model: pass draft=<LM, model name or 'self:int8'> "
            "(--draft on the command line)"
        )
    if has_draft and not (strategy.takes_draft or strategy.needs_draft):
        raise ValueError(
            f"strategy {name!r} takes no draft model, but one was given; drop draft= (--draft), or "
            "pick a strategy that drafts with a model (speculative, threshold, staged ...)"
        )
    if strategy.needs_grammar and has_grammar is False:
        raise ValueError(
            f"strategy {name!r} needs a grammar: pass grammar=grammars.json_schema(...), grammars.regex(...), "
            "grammars.choice(...) or grammars.cfg(...) (--json-schema FILE on the command line)"
        )


def check_models(strategy: type[Decoder] | Decoder, lm: LM, draft: LM | None = None) -> None:
    """Raise when the loaded models cannot serve `strategy`: a draft on another device or (for trees grown in the
    draft's own cache) of another vocabulary, or a model that cannot score a token tree in one call."""
    if draft is not None and draft is not lm:
        # where the weights are now: a model may have moved since it was wrapped
        ours, theirs = (next(m.model.parameters()).device for m in (lm, draft))
        if ours != theirs:
            raise ValueError(
                f"the draft model {draft.name!r} is on {theirs}, the target on {ours}: load or wrap both "
                f'on one device (decoders.load(..., device="{ours}"))'
            )
    if draft is not None and strategy.draft_needs_tree_mask:
        try:
            lm.check_draft(draft)
        except ValueError as error:
            raise ValueError(
                f"{error} for strategy {strategy.name!r}, which grows token trees in the draft's own "
                "vocabulary; speculative, threshold and auto take a draft of another tokenizer "
                "(they translate its drafts through text)"
            ) from error
    if strategy.needs_tree_mask:
        lm.check_tree_mask()  # the error names it the target
    if draft is not None and strategy.draft_needs_tree_mask:
        draft.check_tree_mask("draft")


def takes_trees(lm: LM) -> bool:
    """Whether `lm` scores a token tree in one call (probed once per model: `LM.check_tree_mask`)."""
    try:
        lm.check_tree_mask()
    except TypeError:
        return False
    return True
