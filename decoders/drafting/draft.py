"""What a drafter proposes (`Draft`: a chain or a tree, maybe with a `Window`) and the `Drafter` protocol."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from decoders.models.call import Call

if TYPE_CHECKING:
    from decoders.base import DecodeState


@dataclass
class Window:
    """Tokens scored in a draft's target call but never verified (lookahead's Jacobi window): they see the accepted
    tokens and each other per `mask`, never the draft; the cache drops them after the call."""

    tokens: list[int]  # [w]
    offsets: list[int]  # [w] each one's position minus len(state.tokens)
    mask: torch.Tensor  # [w, w] bool, True where window token i sees window token j
    logits: torch.Tensor | None = None  # [w, vocab] the target's, after each; set by the call


@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree when `parents` is given (nodes in topological order, siblings in the order
    they were drawn, holding distinct tokens)."""

    tokens: list[int]  # [k]
    probs: torch.Tensor | None = None  # [k, vocab] what each (and in a tree its siblings) was drawn from; None: one-hot
    parents: list[int] | None = None  # [k] index of each node's parent in `tokens`, -1 for the root's children
    source: str = "draft"  # what `result.sources` calls an accepted draft token
    window: Window | None = None
    origins: list[str] | None = None  # [k] each node's source in a merged tree (`tree.merge`)

    @property
    def links(self) -> list[int]:
        """`parents`, with a chain spelled out as [-1, 0, 1, ...]."""
        return self.parents if self.parents is not None else list(range(-1, len(self.tokens) - 1))

    @property
    def is_chain(self) -> bool:
        """True when it can take the fast path: no tree, no window."""
        return self.window is None and self.links == list(range(-1, len(self.tokens) - 1))

    def source_of(self, node: int) -> str:
        """What `result.sources` calls node `node` once accepted."""
        return self.origins[node] if self.origins is not None else self.source

    def subset(self, nodes: list[int]) -> Draft:
        """The draft with only `nodes` (increasing, each one's parent kept too)."""
        if len(nodes) == len(self.tokens):
            return self
        index = {node: i for i, node in enumerate(nodes)}
        parents = None if self.parents is None else [index.get(self.parents[n], -1) for n in nodes]
        probs = None if self.probs is None else self.probs[nodes]
        origins = None if self.origins is None else [self.origins[n] for n in nodes]
        return Draft([self.tokens[n] for n in nodes], probs, parents, self.source, self.window, origins)

    def until(self, stop: frozenset[int]) -> Draft:
        """The draft without whatever follows a `stop` token (EOS): the run would end there."""
        links, dropped = self.links, set()
        for node, parent in enumerate(links):
            if parent in dropped or (parent >= 0 and self.tokens[parent] in stop):
                dropped.add(node)
        return self.subset([n for n in range(len(self.tokens)) if n not in dropped])

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes spelling `tokens` from the root: an accepted path."""
        path: list[int] = []
        for token in tokens:
            above = path[-1] if path else -1
            node = next((i for i, p in enumerate(self.links) if p == above and self.tokens[i] == token), None)
            if node is None:
                break
            path.append(node)
        return path


Drafting = Generator[Call, torch.Tensor, Draft]


def drafting(proposed: Draft | Drafting) -> Drafting:
    """A proposal as a generator of draft-model calls (yielded, not run: a batch runs its rows' in one forward)."""
    if isinstance(proposed, Draft):
        return proposed
    return (yield from proposed)


class Drafter(Protocol):
    """Proposes drafts for one run: built as `Drafter(state, options)` and kept in `state.drafter`."""

    def propose(self, state: DecodeState, limit: int) -> Draft | Drafting:
        """Up to `limit` tokens continuing `state.tokens` (maybe none), a tree at most `limit` deep; a drafter with a
        draft model returns a `Drafting` generator."""

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        """After verification: how many drafted tokens were accepted (a tree's path: `draft.follow`)."""

    # Optional: `finish(state)`, called once after the run's last step.
