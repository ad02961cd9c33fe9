"""`Matcher`: one run's position in a regular grammar (JSON schema, regex, choice), on an outlines-core index.

The matcher keeps the stack of automaton states it went through: `advance` pushes the states of accepted tokens,
`rollback` pops them, and the look-ahead helpers (`forced`, `masks_along`) walk from the current state without
changing it. It follows `grammars.GrammarMatcher`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grammars.index import END, TokenIndex
from grammars.protocol import FORCED_LIMIT, MatcherBase


class Matcher(MatcherBase):
    """Where a run stands in its grammar: `allowed()` before each token, `advance` with each accepted one."""

    def __init__(self, index: TokenIndex) -> None:
        super().__init__(index)
        self._states = [index.initial]  # [n + 1]: the state before any token, then after each advanced token
        if index.is_dead(index.initial):
            raise self._no_first_token()

    @property
    def index(self) -> TokenIndex:
        """The compiled grammar (the same as `compiled`)."""
        return self.compiled

    @property
    def state(self) -> int:
        """The current automaton state (an outlines-core state id; -1 after EOS)."""
        return self._states[-1]

    def allowed(self) -> torch.Tensor:
        """The allowed mask [vocab_size] bool for the next token; EOS ids are set exactly where the grammar can finish.

        The tensor is cached and shared between matchers: read it, do not modify it.
        """
        return self.index.mask(self.state)

    def advance(self, tokens: Sequence[int]) -> None:
        """Move past accepted `tokens`; raises `GrammarError` (and moves nowhere) if one of them is not allowed."""
        states = []
        state = self.state
        for position, token in enumerate(tokens):
            following = self.index.next_state(state, int(token))
            if following is None:
                self._refuse([int(t) for t in tokens[:position]], int(token))
            if self.index.is_dead(following):
                raise self._dead_end([int(t) for t in tokens[: position + 1]])
            states.append(following)
            state = following
        self._states.extend(states)
        self._tokens.extend(int(t) for t in tokens)

    def rollback(self, n: int) -> None:
        """Undo the last `n` advanced tokens."""
        self._check_rollback(n)
        if n:
            del self._states[-n:]
            del self._tokens[-n:]

    def is_finished(self) -> bool:
        """True if the text so far is a complete match: the run may end here (EOS is allowed)."""
        return self.index.is_final(self.state)

    def is_complete(self) -> bool:
        """True if nothing but EOS can follow: the grammar has ended the output."""
        return self.state == END or (self.index.is_final(self.state) and not self.index.allowed_ids(self.state))

    def forced(self) -> list[int]:
        """The next tokens the grammar alone determines (one allowed token, repeatedly), EOS never included.

        Does not move the matcher: accept them with `advance` (through `DecodeState.accept`).
        """
        return self.index.forced_run(self.state, FORCED_LIMIT) if self.state != END else []

    def masks_along(self, tokens: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Walk `tokens` from here without moving: (n, masks) with n the count of leading allowed tokens and masks
        [n + 1, vocab_size] bool, the allowed mask before each of those n tokens and after the n-th.

        For draft-then-verify: cut a draft at `tokens[n]`, mask the target's logits at each verified position.
        """
        states = [self.state]
        for token in tokens:
            following = self.index.next_state(states[-1], int(token))
            if following is None or self.index.is_dead(following):
                break
            states.append(following)
        return len(states) - 1, torch.stack([self.index.mask(s) for s in states])

    def fork(self) -> Matcher:
        """An independent matcher at the same state (its advances and rollbacks do not touch this one)."""
        twin = object.__new__(type(self))
        twin.compiled, twin._states, twin._tokens = self.compiled, list(self._states), list(self._tokens)
        return twin
