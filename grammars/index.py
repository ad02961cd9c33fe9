"""A regex compiled against one tokenizer's vocabulary: outlines-core's `Index` plus per-state caches.

States are outlines-core's DFA state ids. For each state the index answers, and caches: the allowed token ids, the
allowed mask over the model's logits, and the one token the grammar forces there, if any. EOS ids are handled here, not
by outlines-core, because a model may have several (`LM.eos_token_ids`): they are allowed exactly in final states.

Canonical fast-forward. With a real BPE vocabulary a fixed stretch of text such as `{"name":"` can be spelled by many
token sequences (`{`, `{"`, `{"name` ...), so "exactly one allowed token" would almost never happen. Where the grammar
determines the next bytes, a canonical index allows only the first token of the tokenizer's own encoding of those
bytes: the model sees the spelling it was trained on, and the whole stretch is forced without a model call. The
language of texts stays the same; only other spellings of determined text are left out. `canonical=False` keeps every
spelling the vocabulary allows.
"""

from __future__ import annotations

from array import array

import torch
from outlines_core import Index

from grammars.errors import GrammarError
from grammars.lru import Lru
from grammars.vocabulary import TokenBytes, token_bytes

END = -1  # the state after an accepted EOS: nothing more is allowed
_END_MARK = r"\x00"  # appended to every pattern; JSON text never holds a raw NUL
_MAX_DETERMINED = 512  # bytes of determined text looked at from one state
_MASKS_KEPT = 256  # allowed masks cached per index ([vocab] bools each)
_INDEXES_KEPT = 16  # compiled indexes cached per process

_indexes: Lru[TokenIndex] = Lru(_INDEXES_KEPT)


def compile_index(pattern: str, lm, canonical: bool, describe: str) -> TokenIndex:
    """The `TokenIndex` of `pattern` for `lm`'s tokenizer, built once per (vocabulary, EOS ids, regex) and cached."""
    tokens = token_bytes(lm.tokenizer)
    eos_ids = frozenset(int(e) for e in lm.eos_token_ids)
    key = (tokens.digest, int(lm.vocab_size), eos_ids, pattern, canonical)
    return _indexes.get(
        key, lambda: TokenIndex(pattern, tokens, lm.tokenizer, int(lm.vocab_size), eos_ids, canonical, describe)
    )


def clear_cache() -> None:
    """Forget every compiled index (for tests and memory)."""
    _indexes.clear()


class TokenIndex:
    """The token-level automaton of one regex over one vocabulary; immutable apart from its caches."""

    def __init__(
        self,
        pattern: str,
        tokens: TokenBytes,
        tokenizer,
        vocab_size: int,
        eos_ids: frozenset,
        canonical: bool,
        describe: str,
    ) -> None:
        self.pattern = pattern
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.canonical = canonical
        self.describe = describe
        self.width = len(tokens.table)  # ids with known text
        self.mark = vocab_size  # a pseudo-token for the end mark, beyond the logits: the model never picks it
        try:
            vocabulary = tokens.outlines_vocabulary(vocab_size, self.mark)
            self.index = Index(f"(?:{pattern}){_END_MARK}", vocabulary)
        except ValueError as error:
            message = str(error).replace(f"(?:{pattern}){_END_MARK}", pattern)
            raise GrammarError(f"{describe} cannot be generated with this tokenizer's vocabulary: {message}") from None
        self.initial: int = self.index.get_initial_state()
        self._final: dict[int, bool] = {}
        self._eos = torch.tensor(sorted(i for i in eos_ids if 0 <= i < vocab_size), dtype=torch.long)
        self._allowed: dict[int, array] = {}  # state -> allowed ids, EOS left out
        self._only: dict[int, int | None] = {}  # state -> the one token allowed there (None: several, or EOS too)
        self._determined: dict[int, bytes] = {}  # state -> the bytes the grammar alone determines from there
        self._masks: Lru[torch.Tensor] = Lru(_MASKS_KEPT)

    def text(self, tokens) -> str:
        """The text of `tokens` (EOS and other special tokens have none)."""
        return self.tokens.text(tokens)

    def allowed_ids(self, state: int) -> array:
        """Token ids the raw index allows in `state`, EOS and the end mark left out (array of int64)."""
        ids = self._allowed.get(state)
        if ids is None:
            raw = torch.tensor(self.index.get_allowed_tokens(state) if state != END else [], dtype=torch.long)
            keep = (raw < self.vocab_size) & ~torch.isin(raw, self._eos)  # the end mark lies past vocab_size
            ids = array("q", raw[keep].numpy().tobytes())
            self._allowed[state] = ids
        return ids

    def is_final(self, state: int) -> bool:
        """True where the text so far is a complete match (EOS allowed): the end mark may follow.

        outlines-core keeps, out of a matching state, only the tokens that lead to another matching state (so `1(x5)?`
        would never reach "1x5"), and matches leftmost-first (`a|ab` would never reach "ab"). Matching `pattern` then
        an end mark that text never holds (a NUL byte: no token with one is ever allowed) sidesteps both: only the
        state after the mark matches.
        """
        final = self._final.get(state)
        if final is None:
            after = None if state == END else self.index.get_next_state(state, self.mark)
            final = state == END or (after is not None and self.index.is_final_state(after))
            self._final[state] = final
        return final

    def is_dead(self, state: int) -> bool:
        """True where no token at all is allowed: not final and nothing in this vocabulary continues the text."""
        return not self.is_final(state) and not self.allowed_ids(state)

    def only(self, state: int) -> int | None:
        """The single token allowed in `state` (never EOS), or None where there is a choice."""
        if state in self._only:
            return self._only[state]
        token = None
        if not self.is_final(state):
            ids = self.allowed_ids(state)
            if self.canonical and ids:
                token = self._canonical_first(state)
            if token is None and len(ids) == 1:
                token = ids[0]
        self._only[state] = token
        return token

    def next_state(self, state: int, token: int) -> int | None:
        """The state after `token`, or None if the mask forbids it in `state`."""
        if state == END or not 0 <= token < self.vocab_size:
            return None
        if token in self.eos_ids:
            return END if self.is_final(state) else None
        only = self.only(state)
        if only is not None and token != only:
            return None
        return self.index.get_next_state(state, token)

    def forced_run(self, state: int, limit: int) -> list[int]:
        """The tokens forced one after another from `state` (at most `limit`), stopping where there is a choice."""
        run = []
        while len(run) < limit and (token := self.only(state)) is not None:
            run.append(token)
            state = self.index.get_next_state(state, token)
        return run

    def mask(self, state: int) -> torch.Tensor:
        """The allowed mask [vocab_size] bool of `state` (cached and shared: do not modify it)."""
        return self._masks.get(state, lambda: self._build_mask(state))

    def _build_mask(self, state: int) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if state != END:
            only = self.only(state)
            if only is not None:
                mask[only] = True
            else:
                ids = self.allowed_ids(state)
                if ids:
                    mask[torch.frombuffer(ids, dtype=torch.int64)] = True
                if self.is_final(state):
                    mask[self._eos] = True
        return mask

    def determined(self, state: int) -> bytes:
        """The bytes every continuation from `state` starts with (up to a choice, a final state or a length cap).

        Walks byte by byte: the next byte is determined when every allowed token starts with it; the single-byte
        token of that byte leads to the state one byte further. Every state on the walk is cached with its tail.
        """
        if state in self._determined:
            return self._determined[state]
        table, walk, data = self.tokens.table, [], bytearray()
        current = state
        while len(data) < _MAX_DETERMINED:
            if current in self._determined:
                data += self._determined[current]
                break
            if self.is_final(current):
                break
            ids = self.allowed_ids(current)
            if not ids:
                break
            first = table[ids[0]][0]
            if any(table[t][0] != first for t in ids):
                break
            byte_token = self.tokens.single.get(first)
            following = None if byte_token is None else self.index.get_next_state(current, byte_token)
            if following is None:
                break
            walk.append(current)
            data.append(first)
            current = following
        for offset, walked in enumerate(walk):
            self._determined[walked] = bytes(data[offset:])
        self._determined.setdefault(state, bytes(data))
        return self._determined[state]

    def _canonical_first(self, state: int) -> int | None:
        """The first token of the tokenizer's own encoding of the determined text from `state` (None: no such text)."""
        data = self.determined(state)
        text = None
        for cut in range(len(data), max(len(data) - 4, 0), -1):  # a multi-byte character may be cut at the end
            try:
                text, data = data[:cut].decode("utf-8"), data[:cut]
                break
            except UnicodeDecodeError:
                continue
        if not text:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        table = self.tokens.table
        if not ids or any(not 0 <= i < len(table) or table[i] is None for i in ids):
            return None
        if b"".join(table[i] for i in ids) != data or self.index.get_next_state(state, ids[0]) is None:
            return None  # the tokenizer spells it differently (e.g. a SentencePiece prefix): no canonical token
        return ids[0]
