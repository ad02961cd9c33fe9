"""`DraftModel`: a draft LM with its own KV cache, following the run's accepted tokens.

The draft never decides what is emitted (the target verifies every token), so whatever the draft cannot do is simply
not drafted: past its own context length it stops proposing, and a token id its embedding lacks (a target with a
padded vocabulary) is fed to it as a stand-in id. A draft of another tokenizer drafts through text instead
(`decoders.drafting.translate`); `draft_model(state)` picks the one the run's models need.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from decoders.base import DecodeState
from decoders.models.lm import LM
from samplers.verify import verify_greedy, verify_sampling

Guess = Callable[[list[int], int], list[int]]  # (tokens drafted so far, room) -> a guess at the tokens after them


def draft_model(state: DecodeState) -> DraftModel:
    """The run's chain-drafting model: a `DraftModel` when the draft shares the target's vocabulary (a
    `SharedCacheDraft` when it is the target's own quantized copy), else a `TranslatedDraftModel`, which drafts in
    the target's ids through text."""
    if state.draft is not None and state.draft.vocab_key != state.lm.vocab_key:
        from decoders.drafting.translate import TranslatedDraftModel

        return TranslatedDraftModel(state)
    if state.draft is not None and state.draft.quantized_from is not None and state.draft.quantized_from() is state.lm:
        return SharedCacheDraft(state)
    return DraftModel(state)


class DraftModel:
    """A draft LM with its own KV cache, following the run's accepted tokens one draft token at a time."""

    translates = False  # drafts in the target's ids from a draft of another vocabulary

    def __init__(self, state: DecodeState) -> None:
        draft: LM | None = state.draft
        if draft is None:  # checked before the run by decoders.capabilities; kept for drafters built by hand
            raise ValueError("this strategy needs a draft model: pass draft=<LM or model name>")
        if not self.translates and draft.vocab_key != state.lm.vocab_key:
            raise ValueError(f"draft model {draft.name!r} does not share the tokenizer of {state.lm.name!r}: build "
                             "the drafter's model with decoders.drafting.draft_model.draft_model(state), which "
                             "translates through text")
        self.state, self.lm, self.cache = state, draft, draft.new_cache()
        self.width = min(draft.vocab_size, state.lm.vocab_size)  # ids past it are padding of one of the two models
        self.embeds = draft.model.get_input_embeddings().num_embeddings  # ids the draft can read
        self.warned = False
        self.runner_ups: list[int] = []  # the draft's second choice at each token of the last chain drafted (what a
        # tree of its top choices holds beside it)

    def room(self, limit: int) -> int:
        """How many of `limit` tokens the draft may propose before its next position would pass its context."""
        context = self.lm.context_length
        if context is None:
            return limit
        room = max(0, min(limit, context - len(self.state.tokens)))
        if room < limit and not self.warned:
            self.warned = True
            warnings.warn(f"draft model {self.lm.name!r} reaches its context of {context} tokens; "
                          "the target goes on without drafts", stacklevel=2)
        return room

    def readable(self, tokens: list[int]) -> list[int]:
        """`tokens` with ids the draft cannot embed replaced by a stand-in (its drafts there are then just guesses)."""
        return [t if t < self.embeds else 0 for t in tokens]

    def forward(self, tokens: list[int], **kwargs) -> torch.Tensor:
        """One draft call on `tokens` (counted in the run's stats); the arguments as for `LM.forward`."""
        self.state.stats.draft_calls += 1
        return self.lm.forward(self.readable(tokens), self.cache, **kwargs)

    def check(self, feed: list[int], lead: list[int], allowed: torch.Tensor | None = None
              ) -> tuple[list[int], list[torch.Tensor | None], list[float], list[int]]:
        """One draft call on `feed` + `lead` that checks the guessed chain `lead` as a target checks a draft (greedy:
        the draft's argmax; sampling: rejection sampling against the draft's distribution, so every token returned
        is a draw from it) and adds its own next token. Returns (the part of `lead` it agrees with plus that token,
        their distributions [vocab] or None, their probabilities, the likeliest other token at each). `allowed`: a
        grammar's mask for a call without a lead."""
        state = self.state
        logits = self.forward(feed + lead, keep=len(lead) + 1)[:, : self.width]  # [lead + 1, width]
        if allowed is not None:
            logits = logits.masked_fill(~allowed[: self.width].to(logits.device), float("-inf"))
        if state.sampling.greedy:
            agreed, token = verify_greedy(torch.tensor(lead, dtype=torch.long), logits)
            tokens = lead[:agreed] + [token]  # the draft's argmax at each
            probs = torch.softmax(logits[: agreed + 1].float(), -1)  # [agreed + 1, width]
            return tokens, [None] * len(tokens), [float(p[t]) for p, t in zip(probs, tokens)], _others(probs, tokens)
        rows = torch.zeros(len(lead) + 1, state.lm.vocab_size, device=state.lm.device)  # [lead + 1, vocab]
        rows[:, : self.width] = state.sampling.probs(logits).to(rows.device)
        if lead:
            agreed, token = verify_sampling(torch.tensor(lead, dtype=torch.long), None, rows, state.generator)
        else:
            agreed, token = 0, int(torch.multinomial(rows[0], 1, generator=state.generator))
        tokens = lead[:agreed] + [token]
        return (tokens, list(rows[: agreed + 1]), [float(row[t]) for row, t in zip(rows, tokens)],
                _others(rows[: agreed + 1], tokens))

    def uncached(self) -> list[int]:
        """The run's tokens this draft model has not seen yet."""
        return self.state.tokens[len(self.cache):]

    def draft_chain(self, limit: int, keep_going=lambda prob: True, guess: Guess | None = None
                    ) -> tuple[list[int], list, list[float]]:
        """Draft up to `limit` tokens one call at a time, under the run's grammar if any, while `keep_going(p)` holds
        for p = the draft's probability of the chain so far. Returns (tokens, distributions, cumulative probs).

        `guess(drafted, room)`: before each call, a guess at up to `room` tokens after the ones drafted so far (the
        suffix index's copy of the context, say), which the call checks (`check`): what the draft agrees with of it
        is drafted in that one call. Not with a grammar."""
        grammar = self.state.grammar.fork() if self.state.grammar is not None else None
        tokens, rows, cumulative = [], [], []
        self.runner_ups = []
        room = self.room(limit)
        feed, running = self.uncached(), 1.0
        while len(tokens) < room:
            if grammar is not None and grammar.is_complete():
                break
            allowed = grammar.allowed() if grammar is not None else None
            left = room - len(tokens) - 1  # room for guessed tokens, the draft's own next one after them
            lead = guess(tokens, left)[:left] if guess is not None and grammar is None and left > 0 else []
            new, new_rows, probs, others = self.check(feed, lead, allowed)
            if len(new) <= len(lead):
                self.cache.crop(len(self.cache) - (len(lead) + 1 - len(new)))  # the guesses it did not agree with
            for token, row, prob, other in zip(new, new_rows, probs, others):
                running *= prob
                tokens.append(token)
                rows.append(row)
                cumulative.append(running)
                self.runner_ups.append(other)
                if token in self.state.lm.eos_token_ids or not keep_going(running):
                    return tokens, rows, cumulative
            if grammar is not None:
                grammar.advance(new)
            feed = [new[-1]]
        return tokens, rows, cumulative

    def rewind(self) -> None:
        """Forget drafted positions the target did not accept: keep only a prefix of the run's tokens."""
        self.cache.crop(min(len(self.cache), len(self.state.tokens) - 1))


SELF_ACCEPTANCE = 0.98  # the acceptance expected of the target's own quantized copy (`SharedCacheDraft`), which agreed
# with it at every position measured (`speculative`'s k and `auto`'s prior plan for it)


class SharedCacheDraft(DraftModel):
    """The target's own quantized copy (`decoders.quantize`, "self:int8"), drafting on the target's KV cache.

    Both models have the same layers, so the copy can attend to the keys and values the target computed: it needs no
    prefill of its own (a second prompt's worth of calls: 3.4 s for 400 tokens of the 1.5B here) and no catch-up after
    steps it sat out or long accepted runs, and it drafts from the target's own view of the context. Its drafted
    positions are cut from the cache before the target verifies, so the target's cache holds only its own work.
    """

    def __init__(self, state: DecodeState) -> None:
        super().__init__(state)
        self.cache = state.cache

    def draft_chain(self, limit: int, keep_going=lambda prob: True, guess: Guess | None = None
                    ) -> tuple[list[int], list, list[float]]:
        committed = len(self.cache)
        try:
            return super().draft_chain(limit, keep_going, guess)
        finally:
            self.cache.crop(committed)

    def rewind(self) -> None:
        """Nothing to forget: `draft_chain` left the target's cache as it found it."""


def _others(probs: torch.Tensor, tokens: list[int]) -> list[int]:
    """The likeliest token other than tokens[i] under each row of `probs` [len(tokens), vocab]."""
    top = probs.topk(2, dim=-1).indices.tolist()  # [len(tokens), 2]
    return [second if first == token else first for (first, second), token in zip(top, tokens)]


def stack_probs(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """[k, vocab] from per-token draft distributions, or None in greedy mode (or for an empty draft)."""
    if not rows or rows[0] is None:
        return None
    return torch.stack(rows)
