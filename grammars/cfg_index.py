"""A context-free grammar (Lark syntax) compiled by llguidance against one tokenizer's vocabulary, with its caches.

outlines-core compiles regular languages only; llguidance (an Earley parser over a lexer, with a token trie) handles
context-free ones. This module turns a transformers tokenizer into llguidance's `LLTokenizer` (offline, once per
tokenizer and EOS ids), checks grammar text, and keeps, per tokenizer and grammar, an llguidance matcher at the
start of the grammar that each run copies (`grammars.cfg_matcher.CfgMatcher` moves the copy).

Canonical fast-forward is llguidance's own, and always on. Where the grammar alone determines the next bytes,
llguidance's mask allows only the first token of the tokenizer's own encoding of them (its fast-forward tokens), so
the model sees the spelling it was trained on and those tokens are forced. It holds back the last tokens of such a
stretch when a longer token could span its end into text the model chooses (a closing quote that `":` could also
spell, say): there every spelling the vocabulary allows stays open. So forced tokens are canonical, as with the
regular constraints' default `canonical=True`, and there is no switch to turn it off.

llguidance checks that each token continues the grammar, not that the rest of the grammar can still be spelled with
this vocabulary: a grammar that needs a character no token holds reaches a state with no allowed token, which the
matcher reports as a `GrammarError` when it gets there.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.hf import from_tokenizer

from grammars.errors import GrammarError
from grammars.lru import Lru
from grammars.vocabulary import token_bytes

_GRAMMARS_KEPT = 16  # compiled grammars cached per process

_lock = threading.Lock()  # guards _tokenizers
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> {EOS ids: LLTokenizer}
_grammars: Lru[CompiledGrammar] = Lru(_GRAMMARS_KEPT)


@functools.lru_cache(maxsize=64)
def check_grammar(text: str, describe: str) -> str:
    """llguidance's grammar for Lark `text`; raises `GrammarError` with llguidance's message if it is invalid."""
    grammar = LLMatcher.grammar_from_lark(text)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid grammar in {describe}: {messages[0].strip()}")
    return grammar


def compile_grammar(text: str, lm, describe: str) -> CompiledGrammar:
    """The `CompiledGrammar` of Lark `text` for `lm`'s tokenizer, built once per (tokenizer, EOS ids, logits width,
    grammar) and cached."""
    eos_ids = frozenset(int(e) for e in lm.eos_token_ids)
    tokenizer = llguidance_tokenizer(lm.tokenizer, eos_ids)
    key = (id(tokenizer), int(lm.vocab_size), eos_ids, text)
    return _grammars.get(
        key,
        lambda: CompiledGrammar(check_grammar(text, describe), tokenizer, int(lm.vocab_size), eos_ids, describe),
        valid=lambda compiled: compiled.tokenizer is tokenizer,  # not another tokenizer that got the same id()
    )


def clear_cache() -> None:
    """Forget every compiled grammar (the llguidance tokenizers go with their transformers tokenizers)."""
    _grammars.clear()


def llguidance_tokenizer(tokenizer, eos_ids: Iterable[int]) -> LLTokenizer:
    """llguidance's `LLTokenizer` for a transformers tokenizer, with `eos_ids` as its EOS tokens; built once per
    tokenizer object and EOS ids, without any hub call.

    Fast tokenizers are read by llguidance itself (from the tokenizer's JSON); others, and decoders it does not know,
    through the bytes of each token as `grammars.vocabulary` reads them and the tokenizer's own `encode`.
    """
    key = tuple(sorted(int(e) for e in eos_ids))
    with _lock:
        try:
            known = _tokenizers.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: built every time
            known = {}
        if key in known:
            return known[key]
    size = len(tokenizer)
    eos = [e for e in key if 0 <= e < size] or None  # None: the tokenizer's own EOS
    try:
        built = from_tokenizer(tokenizer, eos_token=eos)
    except ValueError:  # a slow tokenizer, or a decoder llguidance cannot read ("can't determine decoder type")
        built = LLTokenizer(TokenizerWrapper(_ByteTokenizer(tokenizer, eos)), n_vocab=size, eos_token=eos)
    with _lock:
        known[key] = built
    return built


class CompiledGrammar:
    """One grammar on one tokenizer: llguidance's tokenizer, a matcher at the grammar's start to copy for each run,
    and the conversion of llguidance's bitmasks into masks over the model's logits."""

    def __init__(self, grammar: str, tokenizer: LLTokenizer, vocab_size: int, eos_ids: frozenset, describe: str):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits width, which may exceed the tokenizer's vocabulary (padding)
        self.eos_ids = eos_ids
        self.describe = describe
        self.width = min(tokenizer.vocab_size, vocab_size)  # ids llguidance knows that the model can emit
        self.eos_tensor = torch.tensor(sorted(e for e in eos_ids if 0 <= e < vocab_size), dtype=torch.long)
        self.nothing = torch.zeros(vocab_size, dtype=torch.bool)  # the mask after EOS
        # llguidance sets its EOS bits where the grammar can finish, and also at a dead end (to let the run stop)
        self._its_eos = torch.tensor([e for e in tokenizer.eos_tokens if 0 <= e < self.width], dtype=torch.long)
        self.start = LLMatcher(tokenizer, grammar, log_level=0)
        if self.start.is_error():
            raise GrammarError(f"{describe} cannot be used with this tokenizer: {self.start.get_error()}")

    def new_matcher(self) -> LLMatcher:
        """A fresh llguidance matcher at the start of the grammar."""
        return self.start.deep_copy()

    def mask(self, matcher: LLMatcher) -> torch.Tensor:
        """The allowed mask [vocab_size] bool of `matcher`'s position: llguidance's tokens, padding ids never, and the
        model's EOS ids exactly where the grammar can finish."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[: self.width] = torch.from_numpy(bits[: self.width].astype(bool))
        mask[self._its_eos] = False
        mask[self.eos_tensor] = matcher.is_accepting()
        return mask

    def text(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, EOS and other special tokens left out (invalid UTF-8 shown as U+FFFD)."""
        known = [int(t) for t in tokens if 0 <= t < self.tokenizer.vocab_size]
        return self.tokenizer.decode_str([t for t in known if not self.tokenizer.is_special_token(t)])


class _ByteTokenizer:
    """What llguidance's `TokenizerWrapper` needs from a tokenizer it cannot read itself: the bytes of every id and
    an encoder of text (which llguidance calls to spell forced text canonically)."""

    def __init__(self, tokenizer, eos: list[int] | None) -> None:
        self._tokenizer = weakref.ref(tokenizer)  # a strong one would keep the tokenizer in the cache forever
        self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        table = token_bytes(tokenizer).table
        size = len(tokenizer)
        text = [table[i] if i < len(table) else None for i in range(size)]
        # ids without text (special tokens, unreadable pieces) are special to llguidance: never grammar text
        self.special_token_ids = [i for i in range(size) if text[i] is None]
        names = tokenizer.convert_ids_to_tokens(list(range(size)))
        self.tokens = [
            data if data is not None else str(names[i] or f"<[{i}]>").encode() for i, data in enumerate(text)
        ]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes; refused, it passes text from then on
            raise TypeError("text only")
        return self._tokenizer().encode(text, add_special_tokens=False)
