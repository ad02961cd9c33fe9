"""The suffix index's proposer (`suffix`, `auto`): trees of what followed the longest matching suffix."""

from __future__ import annotations

from decoders.base import DecodeState
from decoders.capabilities import takes_trees
from decoders.drafting.chooser import Acceptance, ChooserOptions, Offer, Plan, given_above
from decoders.drafting.draft import Draft
from decoders.drafting.suffix_index import SuffixDraft, SuffixIndex, SuffixOptions
from decoders.drafting.suffix_store import SuffixStore, propose
from decoders.drafting.tree import depth, depths, levels_above, per_level
from decoders.proposers.base import Setup, Step


def match_curve(match: int) -> str:
    """The calibration curve of a guess continuing a `match`-token suffix: one per match length 1, 2-3, 4-7, 8+."""
    return f"suffix:{min(8, 1 << (max(match, 1).bit_length() - 1))}"


def summarize(tree: SuffixDraft) -> list[float]:
    """Per level of a suffix tree: the index's probability of its best node given the best node above."""
    found = depths(tree.parents)
    best = [max(p for p, d in zip(tree.probs, found) if d == level) for level in range(max(found, default=-1) + 1)]
    return [min(1.0, p) for p in given_above(best)]


class SuffixProposer:
    """The run's suffix index, grown with every accepted token, and its trees, judged on one curve per match length."""

    name = "suffix"
    corrected = False
    carries = True  # (one-hot guesses: lookahead's window may ride along)

    def __init__(
        self,
        state: DecodeState,
        options: SuffixOptions,
        store: SuffixStore | None = None,
        trees: bool = True,
        chooser: ChooserOptions | None = None,
        remember_prompts: bool = False,
    ) -> None:
        """`trees`: False drafts the main branch alone (no tree masks); `store`: earlier outputs to draft from, which
        the run's output (with `remember_prompts` its prompt too) joins."""
        self.options, self.store, self.trees, self.remember = options, store, trees, remember_prompts
        self.vocab = state.lm.vocab_size  # (a store may hold a bigger vocabulary's ids)
        self.index = SuffixIndex(store.depth if store is not None else 48)
        self.index.follow("run", state.tokens)
        self.acceptance = Acceptance(chooser)
        self.tree, self.levels, self.curves = SuffixDraft(), [], []
        self.offered: Offer | None = None

    @classmethod
    def build(cls, setup: Setup, needed: dict) -> SuffixProposer:
        """`auto`'s: up to its `max_tree` nodes, from the run's tokens only."""
        trees = setup.suffix_trees and takes_trees(setup.state.lm)
        return cls(
            setup.state, SuffixOptions(max_tree=setup.options.max_tree), trees=trees, chooser=setup.chooser.options
        )

    def curve(self, match: int) -> str:
        """`match_curve` (a seam: an ablation overrides it)."""
        return match_curve(match)

    def offer(self, state: DecodeState, limit: int) -> Offer | None:
        tree = propose(self.index, self.store, state.tokens, limit, self.options, self.vocab)
        self.tree = tree if self.trees else tree.main_branch()
        self.levels = summarize(self.tree)
        self.curves = [self.curve(self.tree.match + d) for d in range(len(self.levels))]
        self.offered = (
            Offer(
                self.name,
                self.acceptance.chain(len(self.levels), self.levels, self.curves),
                nodes=per_level(self.tree.parents),
            )
            if self.levels
            else None
        )
        return self.offered

    def current(self) -> Draft:
        """This step's tree (from the last `offer`)."""
        return Draft(self.tree.tokens, None, self.tree.parents, source=self.name)

    def draft(self, state: DecodeState, plan: Plan) -> Draft:
        return levels_above(self.current(), plan.k)

    def teach(self, draft: Draft, accepted: int) -> None:
        """Learn that `accepted` levels of `draft` (this step's tree, cut from below) were accepted."""
        levels = depth(draft)  # fewer than planned where an EOS or the grammar cut it
        self.acceptance.learn(levels, accepted, self.levels[:levels], self.curves[:levels])

    def learn(self, state: DecodeState, step: Step) -> None:
        if step.plan.proposer == self.name and step.draft.tokens:
            self.teach(step.draft, step.accepted)
        self.index.follow("run", state.tokens)

    def finish(self, state: DecodeState) -> None:
        """Add the run's output (and its prompt, if remembered) to the store."""
        if self.store is not None:
            if self.remember:
                self.store.add(state.tokens[: state.prompt_len], kind="prompt")
            self.store.add(state.new_tokens)
