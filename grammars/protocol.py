"""`GrammarMatcher`: what a decoding loop may ask of a grammar, and `MatcherBase`: what the two matchers share.

A matcher is one run's position in a grammar. Only the decoding loop moves it, and only with accepted tokens
(`advance`, `rollback`); everything else reads from where it stands. outlines infers its grammar state from the last
input token instead, which breaks under speculation (drafted tokens are not accepted tokens).

`grammars.Matcher` (regular constraints, on an outlines-core index) and `grammars.CfgMatcher` (context-free grammars,
on an llguidance parser) both follow the protocol, on a `MatcherBase`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, Protocol, runtime_checkable

import torch

from grammars.errors import GrammarError

FORCED_LIMIT = 1024  # longest forced run returned at once


@runtime_checkable
class GrammarMatcher(Protocol):
    """One run's position in a grammar: `allowed()` before each token, `advance` with each accepted one."""

    def allowed(self) -> torch.Tensor:
        """The allowed mask for the next token.

        Returns:
            [vocab_size] bool over the model's logits, EOS ids set exactly where the grammar can finish. Cached and
            shared between matchers: read it, never modify it.
        """

    def forced(self) -> list[int]:
        """The next tokens the grammar alone determines (one allowed token, repeatedly), EOS never included.

        Returns:
            At most `FORCED_LIMIT` token ids, in order; empty where the model has a choice. Does not move the matcher:
            accepting them is the loop's job (`advance`, through `DecodeState.accept`).
        """

    def advance(self, tokens: Sequence[int]) -> None:
        """Move past tokens the run accepted.

        Args:
            tokens: accepted token ids, in order; an EOS id ends the grammar (nothing is allowed after it).

        Raises:
            GrammarError: a token is not allowed where it comes, or leads to a dead end. The matcher has not moved.
        """

    def rollback(self, n: int) -> None:
        """Undo the last advanced tokens.

        Args:
            n: how many, 0 <= n <= the number advanced so far.

        Raises:
            ValueError: n is out of that range (or not an int). The matcher has not moved.
        """

    def masks_along(self, tokens: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Walk `tokens` from here without moving (for draft-then-verify: cut a draft, mask the verified logits).

        Args:
            tokens: proposed token ids (a draft), in order.

        Returns:
            (n, masks): n, the count of leading tokens the grammar allows one after another; masks, [n + 1, vocab_size]
            bool, the allowed mask before each of those n tokens and after the n-th.
        """

    def fork(self) -> GrammarMatcher:
        """An independent matcher at the same position: its advances and rollbacks do not touch this one.

        Returns:
            A matcher of the same kind, sharing the compiled grammar and its caches.
        """

    def is_finished(self) -> bool:
        """True if the text so far is a complete match: the run may end here (EOS is allowed)."""

    def is_complete(self) -> bool:
        """True if nothing but EOS can follow: the grammar has ended the output."""


class MatcherBase:
    """What both matchers share: the tokens advanced so far, their text, the check of `rollback`'s argument and the
    messages of a refused move.

    A subclass sets `compiled`, its compiled grammar (a `TokenIndex` or a `CompiledGrammar`, both with `describe`,
    `eos_ids`, `width` and `text(tokens)`), and keeps `_tokens`, the tokens advanced so far.
    """

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self._tokens: list[int] = []  # the tokens advanced so far

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compiled.describe}, after {self.text!r})"

    @property
    def tokens(self) -> list[int]:
        """The tokens advanced so far (a copy)."""
        return list(self._tokens)

    @property
    def text(self) -> str:
        """The text advanced so far."""
        return self.compiled.text(self._tokens)

    def _check_rollback(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self._tokens):
            raise ValueError(f"can roll back 0..{len(self._tokens)} tokens, not {n!r}")

    def _no_first_token(self) -> GrammarError:
        return GrammarError(f"{self.compiled.describe} allows no first token in this tokenizer's vocabulary")

    def _dead_end(self, after: list[int]) -> GrammarError:
        """The error for a token that leaves no allowed token, `after` the advanced ones."""
        text = self.compiled.text(self._tokens + after)
        return GrammarError(
            f"{self.compiled.describe} reaches a state with no allowed token in this vocabulary after {text!r}"
        )

    def _refuse(self, before: list[int], token: int) -> NoReturn:
        """Raise for `token`, which the grammar does not allow after the advanced tokens and then `before`."""
        text = self.compiled.text(self._tokens + before)
        piece = self.compiled.text([token]) if 0 <= token < self.compiled.width else "?"
        why = "EOS before the grammar can finish" if token in self.compiled.eos_ids else f"token {token} ({piece!r})"
        raise GrammarError(f"{self.compiled.describe} does not allow {why} after {text!r}")
