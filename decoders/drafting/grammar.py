"""Drafts under a grammar: cut what the grammar forbids, and the allowed-token masks the target is scored under."""

from __future__ import annotations

import torch

from decoders.drafting.draft import Draft
from samplers.verify import guessed


def restrict_to_grammar(
    grammar, draft: Draft, drafter: str, eos: frozenset[int] = frozenset()
) -> tuple[Draft, torch.Tensor]:
    """Cut what the grammar forbids: (draft, allowed masks [k + 1, vocab]). Only guesses may go (`verify.guessed`),
    the masked target rejects them anyway; a sampled node was drawn under the mask, so one raises. Rows after `eos`
    stay open rather than empty."""
    if draft.is_chain:
        valid, masks = grammar.masks_along(draft.tokens)  # [valid + 1, vocab]
        if valid < len(draft.tokens) and not guessed(draft.probs, valid, draft.tokens[valid]):
            raise RuntimeError(f"{drafter} drafted a token the grammar does not allow")
        draft = draft.subset(list(range(valid)))
        return draft, _open_after_eos(masks, draft, eos)
    matchers, masks, kept = {-1: grammar}, [grammar.allowed()], []  # matchers: node -> grammar after its path
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.links)):
        above = matchers.get(parent)
        if above is None:
            continue  # under a dropped node
        valid, after = above.masks_along([token])  # [valid + 1, vocab]
        if not valid:
            if not guessed(draft.probs, node, token):
                raise RuntimeError(f"{drafter} drafted a tree node the grammar does not allow")
            continue
        matchers[node] = above.fork()
        matchers[node].advance([token])
        masks.append(after[-1])
        kept.append(node)
    draft = draft.subset(kept)
    return draft, _open_after_eos(torch.stack(masks), draft, eos)


def _open_after_eos(masks: torch.Tensor, draft: Draft, eos: frozenset[int]) -> torch.Tensor:
    """`masks` [k + 1, vocab] with the rows after EOS nodes allowing every token."""
    after_eos = [1 + i for i, token in enumerate(draft.tokens) if token in eos]
    if after_eos:
        masks = masks.clone()
        masks[after_eos] = True
    return masks
