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
        draft = drafter.propose(state, limit=state.remaining - 1)  # leave room for the target's own token
        drafted = torch.tensor(draft.tokens, dtype=torch.long)  # [k]
        logits = state.score(draft.tokens)  # [k + 1, vocab]
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

    def next_token(self, feed: list[int], want_prob: bool = False) -> tuple[int, torch.Tensor | None, float]:
        """Feed tokens to the draft model; returns (token, its distribution [vocab] or None, its probability).

        Greedy mode takes the argmax (the distribution is only computed when `want_prob`); sampling mode draws from
        the run's filtered distribution, zero-padded to the target's vocabulary width.
        """
        state = self.state
        state.stats.draft_calls += 1
        logits = self.lm.forward(feed, self.cache, keep=1)[-1, : self.width]  # [width]
        if state.sampling.greedy:
            token = int(logits.argmax())
            prob = float(torch.softmax(logits.float(), -1)[token]) if want_prob else 1.0
            return token, None, prob
        probs = torch.zeros(state.lm.vocab_size, device=state.lm.device)  # [vocab]
        probs[: self.width] = state.sampling.probs(logits).to(probs.device)
        token = int(torch.multinomial(probs, 1, generator=state.generator))
        return token, probs, float(probs[token])

    def uncached(self) -> list[int]:
        """The run's tokens this draft model has not seen yet."""
        return self.state.tokens[len(self.cache):]

    def rewind(self) -> None:
        """Forget drafted positions the target did not accept: keep only a prefix of the run's tokens."""
        self.cache.crop(min(len(self.cache), len(self.state.tokens) - 1))


def stack_probs(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[k, vocab] from per-token draft distributions, or None in greedy mode (or for an empty draft)."""
    if not rows or rows[0] is None:
        return None
    return torch.stack(rows)
