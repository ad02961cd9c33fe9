"""Lookahead's proposer (Fu et al. 2024): each target call scores pool n-grams continuing the last token (a tree) and
a Jacobi window, whose full columns become pool n-grams. One-hot drafts: exact."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from decoders.base import DecodeState
from decoders.drafting import Draft, Window
from decoders.drafting.chooser import Acceptance, ChooserOptions, Offer, Plan
from decoders.drafting.cost import CostModel
from decoders.drafting.tree import depth, levels_above, merge, per_level
from decoders.options import check_whole
from decoders.proposers.base import Setup, Step
from decoders.proposers.suffix import SuffixProposer


@dataclass(frozen=True)
class LookaheadOptions:
    """Options of `lookahead`: at most 19 tokens a call (docs/design/evidence.md)."""

    window: int = 2  # W: Jacobi window columns (0: n-grams of the prompt and text only)
    ngram: int = 4  # N: n-gram size; the window has N - 1 levels, candidates are N - 1 tokens
    guesses: int = 4  # G: candidate n-grams verified per call (and kept per key in the pool)

    def __post_init__(self):
        check_whole(self, window=0, ngram=2, guesses=1)


class NgramPool:
    """Continuations (N - 1 tokens) keyed by the token before them, and by the two tokens before them."""

    def __init__(self, size: int) -> None:
        self.size = size  # the most continuations kept per key, most recent first
        self.by_token: dict[int, list[tuple[int, ...]]] = {}
        self.by_pair: dict[tuple[int, int], list[tuple[int, ...]]] = {}

    def add(self, before: int | None, key: int, continuation: tuple[int, ...]) -> None:
        """Remember that `continuation` followed `key` (itself after `before`, if known)."""
        for table, index in ((self.by_token, key), (self.by_pair, (before, key))):
            if index == (None, key):
                continue
            known = table.setdefault(index, [])
            if continuation in known:
                known.remove(continuation)
            known.insert(0, continuation)
            del known[self.size :]

    def add_text(self, tokens: list[int], n: int, start: int = 0) -> None:
        """Add every n-gram of `tokens` that ends at index >= start + n - 1, in order (so later ones rank first)."""
        for i in range(max(start, 0), len(tokens) - n + 1):
            self.add(tokens[i - 1] if i else None, tokens[i], tuple(tokens[i + 1 : i + n]))

    def candidates(self, before: int, key: int, count: int) -> list[tuple[int, ...]]:
        """Up to `count` continuations of `key`: those also matching `before` first."""
        found = self.by_pair.get((before, key), []) + self.by_token.get(key, [])
        return list(dict.fromkeys(found))[:count]


def prefix_tree(candidates: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of one tree of the candidates, topological, shared prefixes stored once."""
    tree = merge([Draft(list(candidate)) for candidate in candidates])
    return tree.tokens, tree.parents


@functools.cache  # (every step asks for one of a few shapes; callers only read it)
def window_mask(levels: int, width: int) -> torch.Tensor:
    """[levels * width, levels * width] bool: token (l, j) sees (0, j') for j' <= j and (l', j) for 1 <= l' <= l."""
    rows = []
    for level in range(levels):
        for column in range(width):
            seen = {*range(column + 1), *(other * width + column for other in range(1, level + 1))}
            rows.append([j in seen for j in range(levels * width)])
    return torch.tensor(rows, dtype=torch.bool).reshape(levels * width, levels * width)


class JacobiWindow:
    """One run's Jacobi window and its n-gram pool (also fed the prompt's and the text's n-grams)."""

    def __init__(self, state: DecodeState, options: LookaheadOptions) -> None:
        self.options = o = options
        self.pool = NgramPool(o.guesses)
        self.pool.add_text(state.tokens, o.ngram)
        self.levels = [[state.tokens[(7 * j + 1) % len(state.tokens)] for j in range(o.window)]] if o.window else []
        self.seen = len(state.tokens)  # tokens already added to the pool
        self.last = state.tokens[-1]

    def propose(self, state: DecodeState, limit: int) -> Draft:
        o, tokens = self.options, state.tokens
        self.last = tokens[-1]  # the token this proposal continues
        before = tokens[-2] if len(tokens) > 1 else None
        guesses = [c[:limit] for c in self.pool.candidates(before, tokens[-1], o.guesses)] if limit > 0 else []
        nodes, parents = prefix_tree([g for g in guesses if g])
        window = None
        fits = state.lm.context_length is None or len(tokens) + o.window + o.ngram < state.lm.context_length
        if self.levels and fits:
            width = len(self.levels[0])
            offsets = [level + column for level in range(len(self.levels)) for column in range(width)]
            window = Window(sum(self.levels, []), offsets, window_mask(len(self.levels), width))
        return Draft(nodes, None, parents, source="lookahead", window=window)

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        o = self.options
        if draft.window is not None and draft.window.logits is not None:
            width = len(self.levels[0])
            top = draft.window.logits[-width:].argmax(dim=-1).tolist()  # the next Jacobi iteration's guesses
            if len(self.levels) == o.ngram - 1:  # every column is a full trajectory: N-grams for the pool
                for column in range(width):
                    gram = [level[column] for level in self.levels] + [top[column]]
                    self.pool.add(self.levels[0][column - 1] if column else self.last, gram[0], tuple(gram[1:]))
                self.levels.pop(0)
            self.levels.append(top)
        self.pool.add_text(state.tokens, o.ngram, start=self.seen - o.ngram + 1)
        self.seen = len(state.tokens)


RIDE = 0.1  # the largest share a ride may add to another proposer's target call


class LookaheadProposer:
    """The pool's n-grams as guesses, the window riding every step; in `auto` only steps that carry it, while a ride
    adds at most RIDE to the call and the target calls its guesses saved pay for the rides so far."""

    name = "lookahead"
    corrected = False
    needs = ("suffix",)  # (in `auto`: its guesses the suffix index holds too save nothing)
    needs_tree_mask = True

    def __init__(
        self,
        state: DecodeState,
        options: LookaheadOptions | None = None,
        suffix: SuffixProposer | None = None,
        cost: CostModel | None = None,
        chooser: ChooserOptions | None = None,
    ) -> None:
        """`suffix`, `cost`: auto's, whose window rides only where it pays; None: the window rides every step."""
        self.drafter, self.suffix, self.cost = JacobiWindow(state, options or LookaheadOptions()), suffix, cost
        self.acceptance = Acceptance(chooser)
        self.guesses, self.offered = Draft([]), None
        self.rides = self.saved = 0.0  # seconds the window's rides added, seconds its guesses saved

    @classmethod
    def build(cls, setup: Setup, needed: dict) -> LookaheadProposer:
        return cls(setup.state, LookaheadOptions(), needed["suffix"], setup.cost, setup.chooser.options)

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        self.guesses, self.offered = self.drafter.propose(state, limit), None
        if self.guesses.tokens:
            window = len(self.guesses.window.tokens) if self.guesses.window is not None else 0
            nodes = tuple(window + n for n in per_level(self.guesses.parents))
            self.offered = Offer(self.name, self.acceptance.chain(len(nodes)), nodes=nodes)
        return self.offered

    def current(self) -> Draft:
        """This step's guesses (from the last `offer`), without the window."""
        return replace(self.guesses, window=None)

    def draft(self, state: DecodeState, plan: Plan) -> Draft:
        return levels_above(self.guesses, plan.k)  # (the window rides along)

    def ride(self, state: DecodeState, draft: Draft, carried: bool) -> Draft:
        """`draft` with the window, where the step `carried` it and, in `auto`, where that pays."""
        window = self.guesses.window
        if window is None or draft.window is not None or not carried:
            return draft
        if self.cost is None:
            return replace(draft, window=window)
        context, scored = len(state.cache), len(state.uncached()) + len(draft.tokens)
        call = self.cost.target_seconds(scored, context)
        extra = self.cost.target_seconds(scored + len(window.tokens), context) - call
        if extra > RIDE * call or self.rides + extra > self.saved + self.cost.target_seconds(1, context):
            return draft
        self.rides += extra
        return replace(draft, window=window)

    def teach(self, state: DecodeState, draft: Draft, accepted: int, path: list[int]) -> None:
        """Learn `accepted` levels of `draft`; those the suffix index did not hold too count as saved target calls."""
        self.acceptance.learn(depth(draft), accepted)
        if self.suffix is not None:
            held = len(self.suffix.current().follow(path))
            self.saved += max(0, accepted - held) * self.cost.target_seconds(1, len(state.cache))

    def learn(self, state: DecodeState, step: Step) -> None:
        if step.plan.proposer == self.name and step.draft.tokens:
            self.teach(state, step.draft, step.accepted, step.tokens[: step.accepted])
        self.drafter.update(state, step.draft, step.accepted)
