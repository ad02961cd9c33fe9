"""Drafts under a grammar: cut what the grammar forbids, and the allowed-token masks the target is scored under."""

from __future__ import annotations

import torch

from decoders.drafting.draft import Draft


def restrict_to_grammar(grammar, draft: Draft, drafter: str, eos: frozenset[int] = frozenset()
                        ) -> tuple[Draft, torch.Tensor]:
    """Cut a chain at its first token the grammar forbids, drop tree nodes it forbids on their path (with their
    subtrees); returns the draft and the allowed masks [k + 1, vocab] at each position the target scores.

    Dropping is exact only for drafters without a distribution (the target would reject the token outright and
    sample from q itself); sampled drafts are drawn under the grammar's mask and never lose a node here. After an `eos`
    node the grammar allows nothing, but that row is never emitted (the run ends at the EOS): it is left unmasked
    rather than handing the verifier an empty distribution to draw the bonus token from.
    """
    if draft.is_chain:
        valid, masks = grammar.masks_along(draft.tokens)  # [valid + 1, vocab]
        if valid < len(draft.tokens) and draft.probs is not None:
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
            continue
        matchers[node] = above.fork()
        matchers[node].advance([token])
        masks.append(after[-1])
        kept.append(node)
    if len(kept) < len(draft.tokens) and draft.probs is not None:
        raise RuntimeError(f"{drafter} drafted a tree node the grammar does not allow")
    draft = draft.subset(kept)
    return draft, _open_after_eos(torch.stack(masks), draft, eos)


def _open_after_eos(masks: torch.Tensor, draft: Draft, eos: frozenset[int]) -> torch.Tensor:
    """`masks` [k + 1, vocab] with the rows after EOS nodes allowing every token."""
    after_eos = [1 + i for i, token in enumerate(draft.tokens) if token in eos]
    if after_eos:
        masks = masks.clone()
        masks[after_eos] = True
    return masks
