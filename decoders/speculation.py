"""The one draft-then-verify loop that every drafting strategy shares.

A step: the drafter proposes a `Draft`; the target scores the uncached tail plus the whole draft in one call; a
verifier (`samplers.verify`, which defines drafted / accepted / rejected / bonus / recovered) keeps a prefix and adds
one target token; the target cache is cropped back to the accepted tokens; the drafter learns how far it got.

A drafting strategy is a `DraftVerify` subclass that only says how to build its drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from decoders.base import DecodeState, Decoder
from decoders.lm import LM
from samplers.verify import verify_greedy, verify_sampling


@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree when `parents` is given."""

    tokens: list[int]  # [k]
    probs: torch.Tensor | None = None  # [k, vocab] the draft distributions they were sampled from; None = one-hot
    parents: list[int] | None = None  # [k] index of each node's parent in `tokens`, -1 for the root's children
    source: str = "draft"  # what `result.sources` calls an accepted draft token


class Drafter(Protocol):
    """Proposes drafts for one run; created per run and kept in `state.scratch`, so it may hold per-run state."""

    def propose(self, state: DecodeState, limit: int) -> Draft:
        """Up to `limit` tokens that continue `state.tokens` (may be empty)."""

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        """Called after verification with how many drafted tokens were accepted."""


class DraftVerify(Decoder):
    """Base class of the chain-drafting strategies: subclasses implement `new_drafter`."""

    scratch_key: ClassVar[str] = "drafter"

    def new_drafter(self, state: DecodeState) -> Drafter:
        raise NotImplementedError

    def start(self, state: DecodeState) -> None:
        state.scratch[self.scratch_key] = self.new_drafter(state)

    def step(self, state: DecodeState) -> None:
        drafter: Drafter = state.scratch[self.scratch_key]
        grammar = state.grammar
        if grammar is not None and (forced := grammar.forced()):
            # free, always-accepted drafts: appended now, scored as part of the next target call
            state.accept(forced, ["grammar"] * len(forced))
            if state.finished:
                return
        draft = drafter.propose(state, limit=state.remaining - 1)  # leave room for the target's own token
        masks = None
        if grammar is not None:
            valid, masks = grammar.masks_along(draft.tokens)  # [valid + 1, vocab]
            if valid < len(draft.tokens):
                # Exact only for drafters without a distribution (the target would reject the token outright and
                # sample from q itself); sampled drafts are drawn under the grammar's mask and never land here.
                if draft.probs is not None:
                    raise RuntimeError(f"{type(drafter).__name__} drafted a token the grammar does not allow")
                draft = Draft(draft.tokens[:valid], None, None, draft.source)
        drafted = torch.tensor(draft.tokens, dtype=torch.long)  # [k]
        logits = state.score(draft.tokens)  # [k + 1, vocab]
        if masks is not None:
            logits = logits.masked_fill(~masks.to(logits.device), float("-inf"))
        if state.sampling.greedy:
            accepted, token = verify_greedy(drafted, logits)
        else:
            accepted, token = verify_sampling(drafted, draft.probs, state.sampling.probs(logits), state.generator)
        added = state.accept(draft.tokens[:accepted] + [token], [draft.source] * accepted + ["target"])
        kept = min(accepted, added)  # fewer when the run ended (EOS, stop string) inside the accepted draft
        state.stats.count_accepted(len(draft.tokens) if kept == accepted else kept, kept)
        state.cache.crop(min(len(state.cache), len(state.tokens) - 1))  # drop the rejected positions
        drafter.update(state, draft, accepted)


class DraftModel:
    """A draft LM with its own KV cache, following the run's accepted tokens one draft token at a time."""

    def __init__(self, state: DecodeState) -> None:
        draft: LM | None = state.draft
        if draft is None:
            raise ValueError("this strategy needs a draft model: pass draft=<LM or model name>")
        state.lm.check_draft(draft)
        self.state, self.lm, self.cache = state, draft, draft.new_cache()
        self.width = min(draft.vocab_size, state.lm.vocab_size)  # ids past it are padding of one of the two models

    def next_token(self, feed: list[int], allowed: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None, float]:
        """Feed tokens to the draft model; returns (token, its distribution [vocab] or None, its probability).

        Greedy mode takes the argmax; sampling mode draws from the run's filtered distribution, zero-padded to the
        target's vocabulary width. `allowed` [vocab] (a grammar's mask) restricts both.
        """
        state = self.state
        state.stats.draft_calls += 1
        logits = self.lm.forward(feed, self.cache, keep=1)[-1, : self.width]  # [width]
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: self.width].to(logits.device), float("-inf"))
        if state.sampling.greedy:
            token = int(logits.argmax())
            return token, None, float(torch.softmax(logits.float(), -1)[token])
        probs = torch.zeros(state.lm.vocab_size, device=state.lm.device)  # [vocab]
        probs[: self.width] = state.sampling.probs(logits).to(probs.device)
        token = int(torch.multinomial(probs, 1, generator=state.generator))
        return token, probs, float(probs[token])

    def uncached(self) -> list[int]:
        """The run's tokens this draft model has not seen yet."""
        return self.state.tokens[len(self.cache):]

    def draft_chain(self, limit: int, keep_going=lambda prob: True) -> tuple[list[int], list, list[float]]:
        """Draft up to `limit` tokens one call at a time, under the run's grammar if any, while `keep_going(p)` holds
        for p = the draft's probability of the chain so far. Returns (tokens, distributions, cumulative probs)."""
        grammar = self.state.grammar.fork() if self.state.grammar is not None else None
        tokens, rows, cumulative = [], [], []
        feed, running = self.uncached(), 1.0
        for _ in range(limit):
            if grammar is not None and grammar.is_complete():
                break
            allowed = grammar.allowed() if grammar is not None else None
            token, probs, prob = self.next_token(feed, allowed)
            running *= prob
            tokens.append(token)
            rows.append(probs)
            cumulative.append(running)
            if token in self.state.lm.eos_token_ids or not keep_going(running):
                break
            if grammar is not None:
                grammar.advance([token])
            feed = [token]
        return tokens, rows, cumulative

    def rewind(self) -> None:
        """Forget drafted positions the target did not accept: keep only a prefix of the run's tokens."""
        self.cache.crop(min(len(self.cache), len(self.state.tokens) - 1))


def stack_probs(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[k, vocab] from per-token draft distributions, or None in greedy mode (or for an empty draft)."""
    if not rows or rows[0] is None:
        return None
    return torch.stack(rows)
