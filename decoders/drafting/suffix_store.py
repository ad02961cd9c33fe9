"""Suffix decoding's memory across calls (`SuffixStore`) and `propose`: the better of the run's and the store's tree."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from decoders.drafting.suffix_index import SuffixDraft, SuffixIndex, SuffixOptions
from decoders.options import check_whole, whole

KINDS = ("output", "prompt")


class SuffixStore:
    """Earlier outputs (and, if added, prompts) shared across `generate` calls: a thread-safe `SuffixIndex` evicting
    whole sequences first in, first out (`depth` 48: max_match + max_tree)."""

    def __init__(self, max_tokens: int = 100_000, depth: int = 48) -> None:
        self.max_tokens = max_tokens  # evict the oldest sequences beyond this many tokens
        check_whole(self, max_tokens=1)
        self._index = SuffixIndex(depth)
        self._kinds: OrderedDict[int, str] = OrderedDict()  # sequence key -> kind, oldest first
        self._added = 0  # keys are never reused
        self._lock = threading.RLock()

    @property
    def depth(self) -> int:
        """`SuffixIndex.depth`."""
        return self._index.depth

    def __len__(self) -> int:
        """Tokens held."""
        with self._lock:
            return len(self._index)

    def __repr__(self) -> str:
        return f"SuffixStore({len(self)} of {self.max_tokens} tokens in {len(self._kinds)} sequences)"

    def add(self, tokens: Iterable[int], kind: str = "output") -> None:
        """Remember a finished sequence (its last `max_tokens`); any vocabulary: a run drafts no id past its own."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        tokens = tokens.tolist() if hasattr(tokens, "tolist") else tokens  # an array or tensor: Python ints
        tokens = [whole(f"SuffixStore.add's tokens[{i}]", t, 0) for i, t in enumerate(tokens)][-self.max_tokens :]
        if not tokens:
            return
        with self._lock:
            while len(self._index) + len(tokens) > self.max_tokens:
                self._index.remove(self._kinds.popitem(last=False)[0])
            self._index.extend(self._added, tokens)
            self._kinds[self._added] = kind
            self._added += 1

    def clear(self) -> None:
        with self._lock:
            self._index = SuffixIndex(self._index.depth)
            self._kinds.clear()

    def sequences(self) -> list[tuple[str, list[int]]]:
        """[(kind, tokens)] of what is held, oldest first (a copy)."""
        with self._lock:
            return [(kind, list(self._index._tokens[self._index._numbers[key]])) for key, kind in self._kinds.items()]

    def draft(self, context: Sequence[int], max_tokens: int, min_prob: float = 0.0, **limits) -> SuffixDraft:
        """`SuffixIndex.draft` on the store."""
        with self._lock:
            return self._index.draft(context, max_tokens, min_prob, **limits)


def propose(
    local: SuffixIndex | None,
    store: SuffixStore | None,
    context: Sequence[int],
    limit: int,
    options: SuffixOptions,
    vocab: int | None = None,
) -> SuffixDraft:
    """The higher-scoring tree of the run's own index and the store's (the run's on a tie), at most `limit` deep."""
    best = SuffixDraft()
    if limit <= 0:
        return best
    for source in (local, store):
        if source is not None:
            tree = source.draft(
                context,
                options.max_tree,
                options.min_prob,
                depth_factor=options.depth_factor,
                max_depth=limit,
                max_match=options.max_match,
                min_match=options.min_match,
                vocab=vocab,
            )
            if tree.score > best.score:
                best = tree
    return best
