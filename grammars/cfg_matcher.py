"""`CfgMatcher`: one run's position in a context-free grammar, on an llguidance parser; a `grammars.GrammarMatcher`.

llguidance's matcher is a parser with a history: it consumes tokens and rolls them back. A `CfgMatcher` keeps one
parser at the run's accepted tokens and the allowed mask there. Every token is checked against that mask before the
parser sees it (a token the grammar refuses would leave llguidance's parser in a permanent error state, and its mask
is narrower than what it would consume: see `grammars.cfg_index` on fast-forward tokens). Look-ahead (`forced`,
`masks_along`) consumes on the same parser and rolls back, and remembers the masks it computed on the way, so that
`advance` along the same tokens next does not compute them again.

EOS is handled here, not by llguidance: allowed exactly where the grammar can finish, never passed to the parser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from grammars.cfg_index import CompiledGrammar
from grammars.errors import GrammarError
from grammars.protocol import FORCED_LIMIT, MatcherBase

_MASKS_AHEAD = 64  # masks remembered from one look-ahead ([vocab_size] bools each)

Step = tuple[int, torch.Tensor | None]  # a token and the allowed mask after it (None: not kept)


class CfgMatcher(MatcherBase):
    """Where a run stands in a context-free grammar: `allowed()` before each token, `advance` with each accepted one."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        super().__init__(grammar)
        self._parser = grammar.new_matcher()  # llguidance's matcher, at the non-EOS tokens of `_tokens`
        self._mask: torch.Tensor | None = None  # the allowed mask here, computed when first needed
        self._ahead: list[Step] = []  # the last look-ahead's steps from here, to reuse while advancing along them
        self._forced: list[int] | None = None  # forced() here, once computed
        if not self.allowed().any():
            raise self._no_first_token()

    @property
    def grammar(self) -> CompiledGrammar:
        """The compiled grammar (the same as `compiled`)."""
        return self.compiled

    def allowed(self) -> torch.Tensor:
        """The allowed mask [vocab_size] bool for the next token; EOS ids are set exactly where the grammar can finish.

        The tensor is shared with look-ahead results and forks: read it, do not modify it.
        """
        if self._mask is None:
            self._mask = self.grammar.nothing if self._ended() else self.grammar.mask(self._parser)
        return self._mask

    def advance(self, tokens: Sequence[int]) -> None:
        """Move past accepted `tokens`; raises `GrammarError` (and moves nowhere) if one of them is not allowed."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        mask, consumed, memo, on_memo = self.allowed(), 0, self._ahead, True
        try:
            for position, token in enumerate(tokens):
                if not self._allows(mask, token):
                    self._refuse(tokens[:position], token)
                on_memo = on_memo and position < len(memo) and memo[position][0] == token
                after = self._consume(token, memo[position][1] if on_memo else None)
                if after is None:
                    raise self._dead_end(tokens[: position + 1])
                consumed += token not in self.grammar.eos_ids
                mask = after
        except GrammarError:
            self._undo(consumed)
            raise
        self._ahead = memo[len(tokens) :] if on_memo else []
        self._tokens.extend(tokens)
        self._mask, self._forced = mask, None

    def rollback(self, n: int) -> None:
        """Undo the last `n` advanced tokens."""
        self._check_rollback(n)
        if n:
            undone = self._tokens[-n:]
            del self._tokens[-n:]
            self._undo(sum(t not in self.grammar.eos_ids for t in undone))
            self._mask, self._ahead, self._forced = None, [], None

    def is_finished(self) -> bool:
        """True if the text so far is a complete match: the run may end here (EOS is allowed)."""
        return self._ended() or self._parser.is_accepting()

    def is_complete(self) -> bool:
        """True if nothing but EOS can follow: the grammar has ended the output."""
        if self._ended():
            return True
        mask = self.allowed()
        return self._parser.is_accepting() and int(mask.sum()) == int(mask[self.grammar.eos_tensor].sum())

    def forced(self) -> list[int]:
        """The next tokens the grammar alone determines (one allowed token, repeatedly), EOS never included.

        Where llguidance has fast-forward tokens it allows only the first of them, so these are its fast-forward
        tokens (see `grammars.cfg_index`), plus any token that is alone in its mask for another reason (a small
        vocabulary). Does not move the matcher: accept them with `advance` (through `DecodeState.accept`).
        """
        if self._forced is None:
            steps = self._look_ahead(self._only, FORCED_LIMIT, keep=_MASKS_AHEAD)
            self._forced = [token for token, _ in steps]
        return list(self._forced)

    def masks_along(self, tokens: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Walk `tokens` from here without moving: (n, masks) with n the count of leading allowed tokens and masks
        [n + 1, vocab_size] bool, the allowed mask before each of those n tokens and after the n-th.

        For draft-then-verify: cut a draft at `tokens[n]`, mask the target's logits at each verified position.
        """
        tokens = [int(t) for t in tokens]
        steps = self._look_ahead(lambda depth, mask: tokens[depth] if depth < len(tokens) else None, len(tokens))
        return len(steps), torch.stack([self.allowed()] + [mask for _, mask in steps])

    def fork(self) -> CfgMatcher:
        """An independent matcher at the same position (its advances and rollbacks do not touch this one)."""
        twin = object.__new__(type(self))
        twin.compiled, twin._parser = self.compiled, self._parser.deep_copy()
        twin._tokens, twin._mask, twin._ahead = list(self._tokens), self._mask, list(self._ahead)
        twin._forced = None if self._forced is None else list(self._forced)
        return twin

    # ------------------------------------------------------------------------------------------------ internals

    def _ended(self) -> bool:
        return bool(self._tokens) and self._tokens[-1] in self.grammar.eos_ids

    def _allows(self, mask: torch.Tensor, token: int) -> bool:
        return 0 <= token < self.grammar.vocab_size and bool(mask[token])

    def _only(self, depth: int, mask: torch.Tensor) -> int | None:
        """The single token `mask` allows, unless EOS is allowed too (or there is a choice)."""
        if bool(mask[self.grammar.eos_tensor].any()) or int(mask.sum()) != 1:
            return None
        return int(mask.nonzero()[0, 0])

    def _consume(self, token: int, known: torch.Tensor | None) -> torch.Tensor | None:
        """Feed an allowed `token` to the parser; returns the allowed mask after it (`known` if given), or None at a
        dead end (no token allowed and the grammar unfinished), where the token is rolled back again."""
        if token in self.grammar.eos_ids:
            return self.grammar.nothing
        if not self._parser.consume_token(token):
            error = self._parser.get_error()
            raise GrammarError(f"llguidance failed on {self.grammar.describe} at token {token}: {error}")
        after = known if known is not None else self.grammar.mask(self._parser)
        if not after.any():
            self._parser.rollback(1)
            return None
        return after

    def _look_ahead(
        self, pick: Callable[[int, torch.Tensor], int | None], limit: int, keep: int | None = None
    ) -> list[Step]:
        """Walk from here without moving: `pick(depth, mask)` names the next token (None: stop); the walk also stops
        at a token the mask forbids or that leads to a dead end. Returns each step's token and the mask after it (only
        the first `keep` masks, if given), and remembers the steps for `advance`."""
        steps: list[Step] = []
        mask, consumed, memo, on_memo = self.allowed(), 0, self._ahead, True
        try:
            while len(steps) < limit:
                depth = len(steps)
                token = pick(depth, mask)
                if token is None or not self._allows(mask, token):
                    break
                on_memo = on_memo and depth < len(memo) and memo[depth][0] == token
                after = self._consume(token, memo[depth][1] if on_memo else None)
                if after is None:
                    break
                consumed += token not in self.grammar.eos_ids
                steps.append((token, after if keep is None or depth < keep else None))
                mask = after
        finally:
            self._undo(consumed)
        if not (on_memo and len(steps) < len(memo)):  # unless the walk only retraced part of the memo
            self._ahead = [step for step in steps[:_MASKS_AHEAD] if step[1] is not None]
        return steps

    def _undo(self, consumed: int) -> None:
        """Roll the parser back over `consumed` tokens it took in a failed advance or a look-ahead; rebuild it at the
        accepted tokens if llguidance itself failed (its matcher stays in an error state)."""
        if self._parser.is_error():
            self._parser = self.grammar.new_matcher()
            self._parser.consume_tokens([t for t in self._tokens if t not in self.grammar.eos_ids])
        elif consumed:
            self._parser.rollback(consumed)
