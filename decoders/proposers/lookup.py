"""Prompt lookup's proposer (Saxena 2023): n-gram matches in the context as the draft."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoders.base import DecodeState
from decoders.drafting.chooser import Offer, Plan
from decoders.drafting.draft import Draft
from decoders.options import check_whole
from decoders.proposers.base import Step


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
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return []


class LookupProposer:
    """Prompt lookup's guesses (no state: each offer searches the context)."""

    name = "lookup"
    corrected = False

    def __init__(self, state: DecodeState, options: PromptLookupOptions) -> None:
        self.options, self.guess = options, []

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        o = self.options
        self.guess = lookup(state.tokens, min(o.k, limit), o.max_ngram, o.min_ngram)
        return Offer(self.name, (1.0,) * len(self.guess)) if self.guess else None

    def draft(self, state: DecodeState, plan: Plan) -> Draft:
        return Draft(self.guess[: plan.k], source="lookup")

    def learn(self, state: DecodeState, step: Step) -> None:
        pass
