from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders.base import DecodeState
from decoders.drafting import Draft
from decoders.options import check_whole


@dataclass(frozen=True)
class PromptLookupOptions:
    """Options of `prompt_lookup`."""

    k: int = 10  # the most tokens copied per target call
    max_ngram: int = 3  # longest suffix to look up
    min_ngram: int = 1  # shortest suffix to look up

    def __post_init__(self):
        check_whole(self, k=1, max_ngram=1, min_ngram=1)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")


def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The up to k tokens that followed the most recent earlier match of the longest matching suffix."""
    context = torch.tensor(tokens, dtype=torch.long)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        earlier = context.unfold(0, n, 1)[:-1]  # [L - n, n]: every n-gram but the suffix itself
        hits = (earlier == context[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # most recent match
            return tokens[start : start + k]
    return []


class LookupDrafter:
    """Stateless: each proposal searches the current context."""

    def __init__(self, state: DecodeState, options: PromptLookupOptions) -> None:
        self.options = options

    def propose(self, state: DecodeState, limit: int) -> Draft:
        o = self.options
        return Draft(lookup(state.tokens, min(o.k, limit), o.max_ngram, o.min_ngram), source="lookup")

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        pass
