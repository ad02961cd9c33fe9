from __future__ import annotations

import warnings
from collections.abc import Generator

import torch

from decoders.base import DecodeState
from decoders.models.call import Call
from decoders.models.lm import LM

Chain = Generator[Call, torch.Tensor, tuple[list[int], list, list[float]]]


class DraftModel:
    """A draft LM with its own KV cache, following the run's accepted tokens. It never decides what is emitted, so what
    it cannot do is not drafted: past its context it stops, an id it cannot embed is fed as a stand-in."""

    translates = False  # drafts target ids from another vocabulary

    def __init__(self, state: DecodeState) -> None:
        draft: LM = state.draft  # (a missing one is refused before the run: `capabilities.check_request`)
        if not self.translates and draft.vocab_key != state.lm.vocab_key:
            raise ValueError(
                f"draft model {draft.name!r} does not share the tokenizer of {state.lm.name!r}: build "
                "the drafter's model with decoders.drafting.draft_model(state), which "
                "translates through text"
            )
        self.state, self.lm = state, draft
        # in a batch, its row of the batch's draft cache (the rows' calls run in one forward)
        self.cache = state.cache.beside(draft, state.expected_length)
        self.width = min(draft.vocab_size, state.lm.vocab_size)  # ids past it are padding of one of the two models
        self.embeds = draft.model.get_input_embeddings().num_embeddings  # ids the draft can read
        self.warned = False
        self.runner_ups: list[int] = []  # the draft's second choice at each token of the last chain

    def _space(self) -> int | None:
        """Draft tokens that fit in the draft's context (None: no limit)."""
        context = self.lm.context_length
        return None if context is None else max(0, context - len(self.state.tokens))

    def room(self, limit: int) -> int:
        """How many of `limit` tokens fit in the draft's context; warns once when fewer."""
        space = self._space()
        room = limit if space is None else min(limit, space)
        if room < limit and not self.warned:
            self.warned = True
            warnings.warn(
                f"draft model {self.lm.name!r} reaches its context of {self.lm.context_length} tokens; "
                "the target goes on without drafts",
                stacklevel=2,
            )
        return room

    def forward(self, tokens: list[int], **kwargs) -> Generator[Call, torch.Tensor, torch.Tensor]:
        """One counted draft call on `tokens`, yielded as a `Call`; returns its logits."""
        self.state.stats.draft_calls += 1
        readable = [t if t < self.embeds else 0 for t in tokens]  # a stand-in for ids the draft cannot embed
        return (yield Call(readable, lm=self.lm, cache=self.cache, **kwargs))

    def next_token(
        self, feed: list[int], allowed: torch.Tensor | None = None
    ) -> Generator[Call, torch.Tensor, tuple[int, torch.Tensor | None, float, int]]:
        """One draft call on `feed`: (token, [vocab] drawn from or None if greedy, its probability, runner-up)."""
        state = self.state
        logits = (yield from self.forward(feed, keep=1))[0, : self.width]  # [width]
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: self.width].to(logits.device), float("-inf"))
        if state.sampling.greedy:
            token, row = int(logits.argmax()), None
            probs = torch.softmax(logits.float(), -1)
        else:
            row = torch.zeros(state.lm.vocab_size, device=state.lm.device)  # [vocab]
            row[: self.width] = state.sampling.probs(logits[None])[0].to(row.device)
            token = int(torch.multinomial(row, 1, generator=state.generator))
            probs = row
        first, second = probs.topk(2).indices.tolist()
        return token, row, float(probs[token]), second if first == token else first

    def uncached(self) -> list[int]:
        return self.state.tokens[len(self.cache) :]

    def draft_chain(self, limit: int, keep_going=lambda prob: True) -> Chain:
        """Draft up to `limit` tokens while `keep_going(chain probability)`: (tokens, distributions, cumulative)."""
        grammar = self.state.grammar.fork() if self.state.grammar is not None else None
        tokens, rows, cumulative = [], [], []
        self.runner_ups = []
        room = self.room(limit)
        feed, running = self.uncached(), 1.0
        while len(tokens) < room:
            if grammar is not None and grammar.is_complete():
                break
            allowed = grammar.allowed() if grammar is not None else None
            token, row, prob, other = yield from self.next_token(feed, allowed)
            self.runner_ups.append(other)
            running *= prob
            tokens.append(token)
            rows.append(row)
            cumulative.append(running)
            if token in self.state.lm.eos_token_ids or not keep_going(running):
                break
            if grammar is not None:
                grammar.advance([token])
            feed = [token]
        return tokens, rows, cumulative

    def rewind(self) -> None:
        """Forget drafted positions the target did not accept."""
        self.cache.crop(min(len(self.cache), len(self.state.tokens) - 1))


SELF_ACCEPTANCE = 0.98  # expected of the target's own quantized copy (`SharedCacheDraft`)


class SharedCacheDraft(DraftModel):
    """The target's own quantized copy ("self:int8") drafting on the target's KV cache (same layers: no prefill of its
    own); its drafted positions are cut before the target verifies."""

    def __init__(self, state: DecodeState) -> None:
        super().__init__(state)
        self.cache = state.cache

    def draft_chain(self, limit: int, keep_going=lambda prob: True) -> Chain:
        committed = len(self.cache)
        try:
            return (yield from super().draft_chain(limit, keep_going))
        finally:
            self.cache.crop(committed)

    def rewind(self) -> None:
        """Nothing to forget: `draft_chain` left the target's cache as it found it."""


def stack_probs(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[k, vocab] from per-token draft distributions, or None (greedy, or an empty draft)."""
    if not rows or rows[0] is None:
        return None
    return torch.stack(rows)
