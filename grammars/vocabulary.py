"""The bytes each token id stands for, read offline from a transformers tokenizer, as outlines-core needs them.

A grammar constrains text, so the index must know the exact bytes behind every token id - not the vocabulary's
display strings. Byte-level BPE (GPT-2, SmolLM2, Qwen2.5) stores byte 0x20 as "Ġ" and splits multi-byte UTF-8
characters across tokens ("é" may be "Ã" + "©"), so each character of a token maps back to one byte.
SentencePiece-style vocabularies (Llama 2, Gemma) write a space as "▁" and keep single bytes as "<0xAB>" tokens.
Special tokens (BOS, EOS, chat markers) never match grammar text and are left out.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import weakref
from dataclasses import dataclass

from outlines_core import Vocabulary

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class TokenBytes:
    """The bytes of every token id of one tokenizer; `None` for ids that can never be part of grammar text."""

    table: tuple[bytes | None, ...]  # [len(tokenizer)] bytes of each id
    digest: str  # sha256 of the table: equal digests mean interchangeable vocabularies
    single: dict[int, int]  # byte value -> the id of a token that is exactly that one byte

    def text(self, tokens) -> str:
        """The text of `tokens` (invalid UTF-8 shown as U+FFFD), for error messages."""
        return b"".join(self.table[t] or b"" for t in tokens if 0 <= t < len(self.table)).decode("utf-8", "replace")

    def outlines_vocabulary(self, vocab_size: int, mark: int) -> Vocabulary:
        """An outlines-core `Vocabulary` of every usable id below `vocab_size`, plus id `mark` for a NUL end mark.

        Its EOS id (`mark` + 1) is a placeholder: the model's EOS ids are handled by `grammars.index`.
        """
        return _outlines_vocabulary(self, vocab_size, mark)


def token_bytes(tokenizer) -> TokenBytes:
    """The `TokenBytes` of a transformers tokenizer, computed once per tokenizer object."""
    try:
        return _cache[tokenizer]
    except (KeyError, TypeError):
        pass
    table = _table(tokenizer)
    digest = hashlib.sha256(b"".join(b"\x00" if t is None else b"\x01%d:" % len(t) + t for t in table)).hexdigest()
    single = {}
    for token_id, data in enumerate(table):
        if data is not None and len(data) == 1:
            single.setdefault(data[0], token_id)
    result = TokenBytes(table=tuple(table), digest=digest, single=single)
    try:
        _cache[tokenizer] = result
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return result


def _table(tokenizer) -> list[bytes | None]:
    vocab = tokenizer.get_vocab()  # str -> id, added tokens included
    size = max(vocab.values(), default=-1) + 1
    table: list[bytes | None] = [None] * size
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    special = set(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if t.special}
    kind = _decoder_kind(tokenizer)
    to_byte = _unicode_to_byte()
    for piece, token_id in vocab.items():
        if token_id in special:
            continue
        if token_id in added:  # added tokens are stored as plain text, not in the model's byte encoding
            data = added[token_id].content.encode("utf-8")
        elif kind == "byte_level" and all(c in to_byte for c in piece):
            data = bytes(to_byte[c] for c in piece)
        elif kind == "sentencepiece":
            match = _BYTE_FALLBACK.match(piece)
            data = bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8")
        else:  # unknown decoder: what the tokenizer itself renders, unless it cannot render the token alone
            text = tokenizer.convert_tokens_to_string([piece])
            if piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text
            data = None if "\ufffd" in text else text.encode("utf-8")
        table[token_id] = data or None  # an empty token would let the grammar loop without progress
    return table


def _decoder_kind(tokenizer) -> str:
    """ "byte_level", "sentencepiece" or "other", from the fast tokenizer's decoder pipeline."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "sentencepiece" if any(p.startswith("\u2581") for p in list(tokenizer.get_vocab())[:5000]) else "other"
    try:
        spec = json.dumps(json.loads(decoder.__getstate__()))
    except Exception:  # noqa: BLE001 - an exotic decoder: fall back to rendering tokens one by one
        return "other"
    if '"ByteLevel"' in spec:
        return "byte_level"
    if '"ByteFallback"' in spec or '"Metaspace"' in spec or "\\u2581" in spec:
        return "sentencepiece"
    return "other"


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


@functools.lru_cache(maxsize=8)
def _outlines_vocabulary(tokens: TokenBytes, vocab_size: int, mark: int) -> Vocabulary:
    grouped: dict[bytes, list[int]] = {}
    for token_id, data in enumerate(tokens.table[:vocab_size]):
        if data is not None and b"\x00" not in data:  # NUL is the end mark: text under a grammar never holds it
            grouped.setdefault(data, []).append(token_id)
    grouped[b"\x00"] = [mark]
    return Vocabulary(mark + 1, grouped)
