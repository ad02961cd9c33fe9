"""`auto`'s merged guesses (`MergedProposer`)."""

from __future__ import annotations

from decoders.base import DecodeState
from decoders.drafting.chooser import Offer, Plan, union
from decoders.drafting.draft import Draft
from decoders.drafting.tree import common, first_branch, levels_above, merge, per_level
from decoders.proposers.base import Setup, Step
from decoders.proposers.lookahead import LookaheadProposer
from decoders.proposers.suffix import SuffixProposer


class MergedProposer:
    """`auto`'s merged guesses: the suffix proposer's and lookahead's drafts of a step as one tree, in one call."""

    name = "merged"
    corrected = False
    needs = ("suffix", "lookahead")  # (offered after theirs: it merges this step's)
    needs_tree_mask = True
    carries = True  # (one-hot guesses: lookahead's window may ride along)

    def __init__(self, suffix: SuffixProposer, lookahead: LookaheadProposer) -> None:
        self.suffix, self.lookahead = suffix, lookahead
        self.parts: list[tuple[Draft, Offer]] = []
        self.tree = Draft([])

    @classmethod
    def build(cls, setup: Setup, needed: dict) -> MergedProposer:
        return cls(needed["suffix"], needed["lookahead"])

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        offered = [(self.suffix.current(), self.suffix.offered), (self.lookahead.current(), self.lookahead.offered)]
        self.parts = [(draft, offer) for draft, offer in offered if offer is not None and draft.tokens]
        if len(self.parts) < 2:
            return None
        self.tree = merge([draft for draft, _ in self.parts], self.name)
        paths = [([draft.tokens[n] for n in first_branch(draft.links)], offer.accept) for draft, offer in self.parts]
        return Offer(self.name, union(paths), nodes=per_level(self.tree.links))

    def draft(self, state: DecodeState, plan: Plan) -> Draft:
        return levels_above(self.tree, plan.k)

    def learn(self, state: DecodeState, step: Step) -> None:
        if step.plan.proposer != self.name or not step.draft.tokens:
            return
        path = step.tokens[: step.accepted]
        suffix, ahead = (draft.subset(common(draft, step.draft)) for draft, _ in self.parts)
        if suffix.tokens:
            self.suffix.teach(suffix, len(suffix.follow(path)))
        if ahead.tokens:
            self.lookahead.teach(state, ahead, len(ahead.follow(path)), path)
