from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

import torch

from decoders.base import ALONE, Budget, Decoder, DecodeState, Steps, Verified
from decoders.drafting.draft import Draft, Drafter, Drafting, drafting
from decoders.drafting.grammar import restrict_to_grammar
from decoders.drafting.tree import depth, keep_path, tree_call
from samplers.verify import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling


class DraftVerify(Decoder):
    """Base class of the drafting strategies: subclasses set `drafter(state, options) -> Drafter`, a callable. A step
    scores the uncached tail and the whole draft in one target call and keeps a verified path plus one token."""

    drafter: ClassVar[Callable[..., Drafter]]

    def start(self, state: DecodeState, budget: Budget = ALONE) -> None:
        state.drafter = self.drafter(state, self.options)

    def steps(self, state: DecodeState, budget: Budget = ALONE) -> Steps:
        drafter = state.drafter
        grammar = state.grammar
        if grammar is not None and (forced := grammar.forced()):
            # free, always-accepted drafts: appended now, scored as part of the next target call
            state.accept(forced, ["grammar"] * len(forced))
            if state.finished:
                return
        fed, width = len(state.uncached()), budget.width
        limit = state.remaining - 1  # (room for the target's token)
        if width:  # in a batch: at most `width` tokens a row
            limit = min(limit, width - fed)
        draft = yield from drafting(self.draft(state, max(limit, 0), budget))
        draft = draft.until(state.lm.eos_token_ids)  # nothing after an EOS is ever emitted
        if width:  # (a tree `limit` deep may hold more nodes; topological order: a prefix keeps their parents)
            if draft.window is not None and fed + len(draft.window.tokens) > width:
                draft = replace(draft, window=None)  # a window rides along only where it fits
            window = len(draft.window.tokens) if draft.window is not None else 0
            draft = draft.subset(list(range(min(len(draft.tokens), max(width - fed - window, 0)))))
        masks = None  # [k + 1, vocab] under a grammar: the tokens it allows at each scored position
        if grammar is not None:
            draft, masks = restrict_to_grammar(grammar, draft, type(drafter).__name__, state.lm.eos_token_ids)
        start = len(state.tokens)  # where the draft begins in the target cache
        logits = yield state.call(draft.tokens) if draft.is_chain else tree_call(state, draft)  # [k + 1 (+ w), vocab]
        path, token, rows = verify(state, draft, masks, logits)
        sources = [draft.source_of(i) for i in path] + ["target"]
        added = state.accept([draft.tokens[i] for i in path] + [token], sources, rows)
        kept = min(len(path), added)  # fewer when the run ended (EOS, stop string) inside the accepted draft
        drafted = len(draft.tokens) if kept == len(path) else kept  # a run that ended counts what it used
        state.stats.count_accepted(drafted, kept, levels=drafted if draft.is_chain else depth(draft))
        keep_path(state.cache, start, [start + i for i in path[:kept]])  # the rest of the tree and any window go
        state.cache.crop(min(len(state.cache), len(state.tokens) - 1))
        return self.learn(state, draft, Verified(width, fed, path), budget)

    def draft(self, state: DecodeState, limit: int, budget: Budget) -> Draft | Drafting:
        """The drafter's proposal of at most `limit` tokens (auto's drafter, planning by the budget, is handed it)."""
        return state.drafter.propose(state, limit=limit)

    def learn(self, state: DecodeState, draft: Draft, verified: Verified, budget: Budget) -> Verified:
        """Tell the drafter how far `draft` was accepted; returns what the batch learns from the step."""
        state.drafter.update(state, draft, len(verified.path))
        return verified

    def finish(self, state: DecodeState) -> None:
        getattr(state.drafter, "finish", lambda state: None)(state)


def verify(
    state: DecodeState, draft: Draft, masks: torch.Tensor | None, logits: torch.Tensor
) -> tuple[list[int], int, torch.Tensor]:
    """(accepted nodes, next token, the logits [len(path) + 1, vocab] each was chosen with) of `draft` by `logits`
    under `masks`; a window's rows go back to it."""
    k = len(draft.tokens)
    if draft.window is not None:
        draft.window.logits = logits[k + 1 :]  # [w, vocab]
    logits = logits[: k + 1]
    if masks is not None:
        logits = logits.masked_fill(~masks.to(logits.device), float("-inf"))
    greedy = state.sampling.greedy
    if draft.is_chain:
        drafted = torch.tensor(draft.tokens, dtype=torch.long)  # [k]
        if greedy:
            accepted, token = verify_greedy(drafted, logits)
        else:
            accepted, token = verify_sampling(drafted, draft.probs, state.sampling.probs(logits), state.generator)
        return list(range(accepted)), token, logits[: accepted + 1]
    if greedy:
        path, token = verify_tree_greedy(draft.tokens, draft.links, logits)
    else:
        path, token = verify_tree_sampling(
            draft.tokens, draft.links, draft.probs, state.sampling.probs(logits), state.generator
        )
    return path, token, logits[[0] + [1 + node for node in path]]  # row 0, then the row after each path node
