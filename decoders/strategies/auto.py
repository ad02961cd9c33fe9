"""`auto`: each step, draft what a measured cost model predicts to give the most new tokens per second.

Proposers, all through the shared draft-then-verify loop: runs the grammar forces (free, taken by the loop itself),
the suffix index of the context (`suffix`'s trees of what followed the longest matching suffix, near free; cut to the
levels that pay, and to its main branch on a model that cannot take tree masks), the draft model when one is given
(`draft=` a model or "self:int8"; as its own int8 copy where that copy's calls measure cheaper, and without one the
target's own int8 copy where its calls are cheap enough and it fits in memory, `decoders.drafting.copies`; drafted
while the next token still pays, one token a call, or several where the call also checks the suffix index's guess at
what follows and the draft agrees with it; its chain is checked in one target call with the draft-free guesses below
where that pays, `with_guesses`), the draft model's token trees (`staged`'s, grown on the same draft cache by
`staged`'s rule, its thresholds raised to what pays at the step's planned rate, `tree_thresholds`, with the run's
suffix index as their lower stage, whose chain each draft call checks as far as pays, `tree_lower`: where a draft's
first choice is often wrong, its second catches much of the rest - 0.96 acceptance at depth 1 against 0.84 for chains
with the bf16 0.5B draft of the 1.5B), `lookahead`'s n-grams (from its Jacobi window, which runs in the steps that
take them, and the context), the suffix index's and lookahead's guesses merged into one tree (where a call of a few
more tokens costs little more, checking every guess at once takes the tokens of whichever is right), and nothing (a
plain greedy step).

The cost model (`decoders.drafting.cost`) is measured once per model, dtype, device and thread count in a few calls,
cached on disk, and refined from the calls this run makes; acceptance is learned per proposer and depth (and for the
draft model and the suffix index, as a calibration curve of their own probabilities, the index's one per length of the
suffix it matched) by the `decoders.drafting.chooser.Chooser`, which also keeps probing a draft model it has turned
down for a while and weighs its plans by what their steps gave against them. So the same code drafts long where draft
calls are cheap (a GPU, an int8 draft), short or not at all where they are not, and copies wherever the context
repeats itself.

Every token is verified by the target as in any drafting strategy: exact in greedy and in sampling mode. What is
drafted decides how the verifier spends a sampling run's random numbers, so where the caller gives a seed, auto plans
by no clock: its costs stay the calibrated ones, uncorrected by the run's call times (`AutoDrafter.timed`), and the
seed repeats the sample wherever the calibration is cached (the first run on a machine measures it).
"""

from __future__ import annotations

import itertools
import operator
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from decoders.base import DecodeState
from decoders.drafting import Draft, DraftModel, DraftVerify, Window, draft_model, stack_probs
from decoders.drafting.chooser import Candidate, Chooser, Curves, Plan, at_least, expected_tokens, given_above, union
from decoders.drafting.copies import drafting_model
from decoders.drafting.cost import CostModel, RunningMean, calibrate
from decoders.drafting.draft_model import SELF_ACCEPTANCE, SharedCacheDraft
from decoders.drafting.suffix_index import SuffixDraft, SuffixIndex, SuffixOptions, propose
from decoders.drafting.tree import common, depth, depths, first_branch, levels_above, merge, per_level
from decoders.models.lm import LM
from decoders.options import check_whole, whole
from decoders.proposers.draft_tree import StagedOptions, TreeDrafter, frontier_width
from decoders.proposers.lookahead import LookaheadDrafter, LookaheadOptions
from decoders.registry import register


TREE = StagedOptions()  # auto's draft-model trees grow as `staged`'s do by default
LOOKAHEAD = LookaheadOptions()  # and its lookahead window and n-gram guesses are `lookahead`'s
SURE = 0.99  # the highest tree thresholds (`AutoDrafter.tree_options`): `staged`'s must stay below 1
GROWN = ("draft", "tree")  # the proposers whose plans are corrected by what their own steps gave
# (`Chooser.correction`): the draft model's chains run on while its confidences say the next token pays, and its trees
# grow as `staged` grows them, so neither drafts what its plan counted on. The other proposers' drafts are their plans'
# levels, whose errors are acceptance errors their estimates learn already; correcting those plans again made one
# unlucky step stick (a proposer corrected down is seldom taken, and its correction cannot recover): on mixed's
# summarization without a draft model (the 1.5B in bfloat16, AMD EPYC) the suffix index's guesses were corrected to 0.68
# after three steps and its int8 copy drafted instead, 27 calls of 64-110 ms to save 9 target calls. Two interleaved
# repeats of mixed (one prompt per category): without a draft 26.4 s against 27.6, with the int8 0.5B draft 24.6 against
# 25.1; bench without a draft 20.4 against 20.4, SmolLM2-135M's seven prompts 14.8 against 14.5
RIDE = 0.1  # the most a target call may grow to carry lookahead's window along (`AutoDrafter.ride`, which also
# keeps its rides within what its guesses saved): on the AMD EPYC the 6 tokens of the default window add 8% to a plain
# step, and 20% or more to a call of 16 or more tokens


FREE = ("suffix", "lookahead", "merged")  # the proposers whose drafts cost no draft-model call: never probed


@dataclass(frozen=True)
class AutoOptions:
    """Options of `auto`: bounds only; what to draft and how much is measured, not set."""

    max_draft: int = 16  # the most draft-model tokens per target call
    max_tree: int = 24  # the most suffix-tree nodes per target call (suffix's own bound)
    draft_trees: bool = True  # offer the draft model's trees where both models take tree masks
    draft_int8: bool | None = None  # draft with the draft model's own int8 copy (`decoders.quantize`): None where
    # its calls are measured cheaper (`copies.int8_copy`), True always, False never. A draft that is already
    # quantized (a "self:int8" draft, one loaded with quantize="int8") is used as it is
    self_int8: bool | None = None  # without a draft model, draft with the target's own int8 copy ("self:int8"):
    # None where its calls are measured cheap enough and it fits in memory (`copies.int8_copy`), True always, False
    # never
    max_lookup: int | None = None  # deprecated, no effect: auto no longer drafts prompt lookup's chains (the suffix
    # index holds every match they copy)

    def __post_init__(self):
        check_whole(self, max_draft=1, max_tree=1)
        if self.max_lookup is not None:
            whole("max_lookup", self.max_lookup, 1)
            warnings.warn("auto's max_lookup has no effect (auto drafts no prompt-lookup chains of its own: the suffix "
                          "index holds their matches) and will be removed", DeprecationWarning, stacklevel=3)
        if not isinstance(self.draft_trees, bool):
            raise ValueError(f"draft_trees must be True or False, got {self.draft_trees!r}")
        for name in ("draft_int8", "self_int8"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be None (where measured to pay), True or False, got "
                                 f"{getattr(self, name)!r}")


class AutoDrafter:
    """One run's cost model, acceptance estimates and draft model; times the calls it causes to refine the costs."""

    def __init__(self, state: DecodeState, options: AutoOptions, clock: Callable[[], float] = time.perf_counter,
                 chooser: Callable[[CostModel], Chooser] = Chooser) -> None:
        self.options = options
        self.now = clock  # what its steps and calls are timed by (`Auto`)
        state.draft = drafting_model(state.lm, state.draft, len(state.tokens), options.draft_int8,
                                     options.self_int8)  # (the run's draft from here on: its calls and stats are the
        # copy's where a copy drafts)
        self.model = draft_model(state) if state.draft is not None else None
        self.suffix = SuffixOptions(max_tree=options.max_tree)
        self.index = SuffixIndex()  # the run's own text, grown with every accepted token
        self.index.follow("run", state.tokens)
        self.trees = _takes_trees(state.lm)
        self.ahead = LookaheadDrafter(state, LOOKAHEAD) if self.trees else None  # (its window needs tree masks)
        self.cost = calibrate(state.lm, state.draft)
        self.timed = not state.seeded  # refine the costs by the calls' times, and judge steps by them: not where the
        # caller seeded the sampling, whose sample the seed repeats only where what is drafted hangs on no clock.
        # Replayed on greedy's outputs of SmolLM2-135M (`devtools.replay_auto --noise 0.15`, 11 prompts, three seeds),
        # planning by the calibrated costs alone took 61.3 estimated seconds where the calibration was right, 76.6
        # where it was 1.10-1.36x stale, 93.2 where 2-16-token calls cost 1.3-2x their calibrated seconds; corrected
        # by the calls' times (`CallCost.offset`), 62.0, 76.7 and 89.5
        self.chooser = chooser(self.cost)
        self.chooser.watched.update(FREE)
        self.shares_cache = isinstance(self.model, SharedCacheDraft)  # a draft on the target's cache (the target's
        # own int8 copy) is offered once that cache holds the prompt, from the second step: before the first, a draft
        # would compute the prompt's keys and values only to throw them away (0.19 s of SmolLM2's 1.3 s on bench's
        # edit prompt, its 300-token prompt's prefill)
        if self.model is not None:
            expect_draft(self.chooser, self.shares_cache)
        self.tree: TreeDrafter | None = None  # the draft model's trees: on its own cache (not the target's, which a
        # self draft shares and a tree would fill with nodes), in its own vocabulary, both models taking tree masks,
        # as wide as `staged` grows them for this draft's measured costs (`draft_tree.frontier_width`). Where a 2-token
        # draft call costs more (an int8 draft on a CPU), that is width 1: the draft's chain, grown best-first while
        # likely enough, with the suffix index's chain checked in the same calls (as much as pays). Offering those as
        # well, auto's seconds on mixed (one prompt per category, int8 0.5B draft of the 1.5B, AMD EPYC) went 29.0 ->
        # 25.0 and on bench 19.7 -> 18.8, then 22.1 -> 21.3 and 20.3 -> 20.8 in two more pairs (equal within noise;
        # width-2 trees instead: 28.2 and 20.3; before its estimates were mended, wider trees lost to chains in every
        # run here)
        if options.draft_trees and self.trees and type(self.model) is DraftModel and _takes_trees(state.draft):
            width = frontier_width(self.cost.draft)
            self.tree = TreeDrafter(state, replace(TREE, width=width), model=self.model, index=self.index,
                                   lower=self.tree_lower)
            self.chooser.declined["tree"] = self.chooser.options.probe_after
        # what a tree costs per level, learned from the trees drafted: draft seconds (a call grows a level, or more
        # where the draft agrees with the lower stage's chain) and target nodes. Priors: a call of `width` leaves a
        # level (the width the draft's costs set, see StagedOptions), `branching` nodes a level
        if self.tree is not None:
            wide = self.cost.draft.predict(self.tree.options.width, len(state.tokens))
            self.tree_level, self.tree_nodes = RunningMean(wide, 1), RunningMean(float(TREE.branching), 1)
        self.parts: dict[str, Draft] = {}  # this step's drafts of the suffix index and lookahead
        self.levels: list[float] = []  # the suffix index's probability per level of its tree, given the levels above
        self.suffix_curves: list[str] = []  # [levels] the calibration curves those probabilities teach (`match_curve`)
        self.start = 0  # where this step's draft begins in the run's tokens
        self.plan = Plan(None, 0, 1.0, 1.0)  # the last proposal's plan: what it came from, the levels it counted on
        self.curve: Curves = None  # the calibration curves its confidences teach, when not the proposer's own
        self.confidences: list[float] | None = []  # [levels] the proposer's probability of each level it drafted
        # (None: a proposer that knows none)
        self.scored = self.context = 0  # the target call about to verify the last proposal: tokens, cached before
        self.fed = 0  # and the tokens it feeds before the draft (the prompt, in the first step)
        self.clock = self.began = 0.0  # when that call and the step began
        self.drafted = 0.0  # the predicted seconds of the draft model's chain this step (`draft_with_model`)
        self.rides = self.window_gain = 0.0  # the seconds lookahead's window added to the calls it rode along in
        # (`ride`), and the seconds its guesses saved (`credit_window`)
        state.stats.details = {"steps": {}, "predicted_tokens": 0.0, "predicted_seconds": 0.0}
        if state.draft is not None:
            state.stats.details["draft"] = state.draft.name

    def propose(self, state: DecodeState, limit: int) -> Draft:
        context, o, self.began = len(state.cache), self.options, self.now()
        self.fed = len(state.uncached())  # what the target call feeds before the draft: the prompt in the first step,
        # where plans are costed with it (`Chooser.choose`) and guesses that ride along cost a small share of the call
        # (SmolLM2-135M's seven prompts in float32, three interleaved repeats: 14.5 s against 14.9 costing every call
        # as a 1-token one; the 1.5B without a draft on mixed 26.9 against 27.1; AMD EPYC)
        tree = propose(self.index, None, state.tokens, limit, self.suffix)
        if not self.trees:
            tree = tree.main_branch()
        levels = summarize(tree)  # the index's probability per level
        candidates, self.parts = [], {}  # self.parts: the draft-model-free drafts, by proposer
        if levels:
            self.levels, self.suffix_curves = levels, [self.curve_for(tree.match + d) for d in range(len(levels))]
            candidates.append(self.chooser.candidate("suffix", len(levels), levels, self.suffix_curves,
                                                     nodes=per_level(tree.parents)))
            self.parts["suffix"] = Draft(tree.tokens, None, tree.parents, source="suffix")
        guesses = self.ahead.propose(state, limit) if self.ahead is not None else Draft([])
        if guesses.tokens:
            window = len(guesses.window.tokens) if guesses.window is not None else 0
            nodes = tuple(window + n for n in per_level(guesses.parents))
            candidates.append(self.chooser.candidate("lookahead", len(nodes), nodes=nodes, tree=True))
            self.parts["lookahead"] = replace(guesses, window=None)
        if self.trees and len(self.parts) > 1 and self.offers("merged"):
            merged = merge(list(self.parts.values()))
            candidates.append(self.merged_candidate(merged, candidates))
        offered = self.model is not None and (len(state.cache) > 0 or not self.shares_cache)
        if offered and (room := self.model.room(min(o.max_draft, limit))):
            per_token, catch_up = self.draft_call(context)
            # whether to draft at all is judged by the draft's acceptance per depth, how far by its probability of
            # each token it drafts (`draft_with_model`). Judging the start by its probabilities in the last draft
            # instead turned the draft down for 16 steps in a row after one unsure draft (until the next probe):
            # replayed (devtools.replay_chains) on the default and mixed suites that cost 8-16% with the int8 or bf16
            # 0.5B draft of the 1.5B, and within 2% either way with the 1.5B's own int8 copy
            unseen = len(self.model.uncached())  # what the draft's first call feeds (not `self.fed`: the target's)
            guessed = levels and not self.model.translates  # (a draft of another vocabulary drafts through text)
            guess, accept = (tree.main_branch().tokens, candidates[0].accept) if guessed else ([], ())
            lead, drafting = self.lead(guess, accept, room, context, unseen)
            candidates.append(self.chooser.candidate("draft", room, drafting=drafting, catch_up=catch_up))
            if self.tree is not None:
                candidates.append(self.tree_candidate(min(room, TREE.max_depth), catch_up,
                                                      candidates[0] if levels else None, candidates[-1]))
        plan = self.plan = self.chooser.choose(candidates, context, self.fed, state.remaining)
        self.record(state, plan)
        self.confidences, curve = [], None
        self.start = len(state.tokens)
        if plan.proposer == "suffix":
            draft = levels_above(self.parts["suffix"], plan.k)
            self.confidences, curve = self.levels[: plan.k], self.suffix_curves[: plan.k]
        elif plan.proposer == "lookahead":
            draft, self.confidences = levels_above(guesses, plan.k), None
        elif plan.proposer == "merged":  # its parts learn from it (`update`)
            draft, self.confidences = levels_above(merged, plan.k), None
        elif plan.proposer == "draft":  # a probe drafts its tokens, then on while the next one pays, as any chain:
            # stopped at its 2 tokens, the run's first draft (a probe, see __init__) and each later probe of a draft
            # model that draft calls had come to pay gave up the tokens a chain would have run on to. Mixed (one
            # prompt per category, int8 0.5B draft of the 1.5B, AMD EPYC, three interleaved repeats): 26.96 s against
            # 28.28 (QA's target calls 19-21 against 23-24; `threshold` 29.89, `staged` 26.26)
            draft = self.draft_with_model(state, room, plan.k if plan.probe else 1, drafting[0] - per_token, lead)
            draft = self.with_guesses(state, draft, candidates, context)
        elif plan.proposer == "tree":  # grown as staged grows it (best-first while a leaf is likely enough)
            draft, self.confidences = self.draft_tree(state, plan.k if plan.probe else limit), None
        else:
            draft = Draft([])
        if guesses.window is not None and plan.proposer in (None, "suffix", "merged"):
            self.ride(draft, guesses.window, self.fed, context)
        ridden = len(draft.window.tokens) if draft.window is not None else 0
        self.scored, self.context, self.curve = self.fed + len(draft.tokens) + ridden, context, curve
        self.clock = self.now()
        return draft

    def offers(self, proposer: str) -> bool:
        """Whether this drafter offers draft-free `proposer`'s ("merged") guesses: always (a seam for
        `devtools.ablate_auto`, whose subclasses switch one off)."""
        return True

    def curve_for(self, match: int) -> str:
        """The calibration curve of a suffix-index guess continuing a `match`-token match (`match_curve`)."""
        return match_curve(match)

    def with_guesses(self, state: DecodeState, chain: Draft, candidates: list[Candidate], context: int) -> Draft:
        """The draft model's `chain` merged with those of this step's draft-free drafts (`self.parts`) that make the
        step's expected tokens per second highest, the chain the tree's first branch: where a target call of a few
        more tokens costs little more, the guesses are checked in the same call and the step takes the tokens of
        whichever is right. On a model that takes tree masks. A merged draft's source is "merged", the chain's nodes
        "draft". In sampling mode the chain's nodes keep the distributions they were drawn from and each guess is a
        one-hot sibling (`samplers.verify.verify_tree_sampling`), so the step still samples from the target's.

        A draft step had checked the chain alone. Merged so, two interleaved repeats (AMD EPYC): mixed (one prompt
        per category) with the int8 0.5B draft of the 1.5B 22.4 s against 24.1, every prompt faster; SmolLM2-135M's
        seven prompts in float32 (its own int8 copy drafting) 15.1 against 15.8 (edit: 10 target calls against 11,
        its first draft step a probe whose 2 tokens the suffix index's guesses now join); without a draft on mixed
        27.1 against 26.9; the held-out prompts with the int8 draft 31.6 against 30.9, where the bfloat16 target's
        output of one prompt changed length between runs (43 or 45 tokens, a near tie) and with it the steps."""
        if not (self.trees and self.parts and chain.tokens):
            return chain
        accept = {c.proposer: c.accept for c in candidates}
        accept["draft"] = self.chooser.chain("draft", len(chain.tokens), self.confidences)
        drafts = {"draft": replace(chain, probs=None), **self.parts}
        paths = {name: ([d.tokens[n] for n in first_branch(d.links)], accept[name]) for name, d in drafts.items()}
        spent = self.elapsed(self.began, self.drafted)  # the step's seconds so far: the chain's drafting

        trees = {names: merge([drafts[name] for name in ("draft", *names)])  # each subset of the guesses
                 for size in range(len(self.parts) + 1) for names in itertools.combinations(self.parts, size)}

        def rate(names: tuple[str, ...]) -> float:
            seconds = spent + self.cost.target_seconds(self.fed + len(trees[names].tokens), context, bool(names))
            return expected_tokens(union([paths[name] for name in ("draft", *names)])) / seconds

        names = max(trees, key=rate)
        merged = trees[names]
        if len(merged.tokens) == len(chain.tokens):  # no guesses, or only guesses the chain holds already
            return chain
        if chain.probs is None:
            return merged
        guesses = torch.tensor(merged.tokens[len(chain.tokens):], device=chain.probs.device)  # (the chain's nodes
        # come first: merged first, each a new node)
        one_hot = torch.nn.functional.one_hot(guesses, chain.probs.shape[-1]).to(chain.probs.dtype)
        return replace(merged, probs=torch.cat([chain.probs, one_hot]))

    def elapsed(self, since: float, planned: float, until: float | None = None) -> float:
        """The seconds from `since` to `until` (default: now) by auto's clock, or where the run plans by no clock
        (`timed`), `planned`: what the cost model predicted for them."""
        return ((self.now() if until is None else until) - since) if self.timed else planned

    def ride(self, draft: Draft, window: Window, uncached: int, context: int) -> None:
        """Let lookahead's Jacobi window ride along in this step's target call when it costs at most RIDE of the
        call: the window only moves on in calls that score it, and its n-grams are what lookahead's guesses are
        made of. Scored only in the steps that chose lookahead, it moved too seldom for its guesses to be chosen
        (bench, the 1.5B without a draft, AMD EPYC: lookahead chosen in 8 / 5 / 9 steps, target calls 104 / 49 /
        88). Riding where it adds at most RIDE: lookahead chosen in 25 / 3 / 29 steps, 92 / 50 / 80 calls; riding
        in every plain, suffix and lookup step: 87 / 45 / 77 calls, but up to 20% more per call; `lookahead`
        alone: 90 / 50 / 73 calls).

        And only while its rides are paid for: they may cost at most one plain step more than the target calls
        lookahead's guesses saved (`credit_window`), so a window whose guesses give nothing stops riding after about
        a target call's worth of rides, and rides again once they give. Riding wherever it added at most RIDE,
        SmolLM2-135M in float32 (Intel Xeon without AMX, where its 7-token call costs 1.5x a 1-token one, so the
        window rode in the suffix index's longer steps) took lookahead's guesses in 1-2 steps a prompt. Its seven
        prompts, three interleaved repeats: 90.7 s with this budget against 92.1 without (`suffix` 84.0 in the same
        run); in another such run, never riding, 79.9 s against 82.0 (`suffix` 76.5). The 1.5B in bfloat16 without a
        draft on bench, two repeats: 126.2 s with the budget against 133.4; on mixed (one prompt per category) 156.9
        against 159.6."""
        scored = uncached + len(draft.tokens)
        call = self.cost.target_seconds(scored, context, not draft.is_chain)
        extra = self.cost.target_seconds(scored + len(window.tokens), context, tree=True) - call
        if extra <= RIDE * call and self.rides + extra <= self.window_gain + self.cost.target_seconds(1, context):
            draft.window, self.rides = window, self.rides + extra

    def credit_window(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        """Credit the window's rides (`ride`) with the accepted tokens of this step that only lookahead's guesses
        held (not the other draft-free drafts, nor a draft model's chain they were checked with): each is a target call
        saved, a plain step's seconds."""
        guesses = self.parts.get("lookahead")
        if guesses is None or self.plan.proposer not in ("lookahead", "merged", "draft") or not draft.tokens:
            return
        path = state.tokens[self.start: self.start + accepted]
        rivals = [part for name, part in self.parts.items() if name != "lookahead"]
        if self.plan.proposer == "draft":
            rivals.append(draft.drafted_by("draft"))
        verified = len(guesses.subset(common(guesses, draft)).follow(path))
        held = max((len(rival.follow(path)) for rival in rivals), default=0)
        self.window_gain += max(0, verified - held) * self.cost.target_seconds(1, self.context)

    def merged_candidate(self, merged: Draft, candidates: list[Candidate]) -> Candidate:
        """The draft-model-free drafts (`self.parts`: the suffix index's tree, lookahead's n-grams) as one tree
        (`tree.merge`), as likely per level as `union` finds their estimates make it. Where a
        target call of a few more tokens costs little more (the 1.5B in bfloat16 on the AMD EPYC: 3 tokens as 1),
        checking every guess at once takes the tokens of whichever is right: without a draft model, bench's prose
        took 85 target calls instead of 89 and 11.4 / 11.7 s instead of 12.6 / 12.3 (code 104 calls to 106, edit
        49 to 49), equal to `lookahead` run beside it (11.4 / 11.9 s); SmolLM2-135M in float32, whose 3-token calls
        cost twice its 1-token ones, took equal seconds on seven prompts of different kinds (27.0 / 25.7 s before,
        27.5 / 25.9 after)."""
        accept = {c.proposer: c.accept for c in candidates}
        paths = [([part.tokens[n] for n in first_branch(part.links)], accept[name])
                 for name, part in self.parts.items()]
        return Candidate("merged", union(paths), nodes=per_level(merged.links), tree=True)

    def draft_call(self, context: int, more: int = 0) -> tuple[float, float]:
        """(seconds of a one-token draft call after `context` cached tokens, seconds the next draft's first call costs
        beyond that: it feeds what the draft has not seen, plus `more` tokens)."""
        call = self.cost.draft_seconds(1, context)
        return call, self.cost.draft_seconds(1, context, len(self.model.uncached()) + more) - call

    def lead(self, guess: list[int], accept: Sequence[float], room: int, context: int, fed: int
             ) -> tuple[list[int], tuple[float, ...]]:
        """How much of `guess` (the suffix index's main branch, its levels' acceptance `accept`) a draft call that
        feeds `fed` tokens should check (`DraftModel.draft_chain`'s guesses), and the seconds of drafting 1..room
        tokens from there so (later calls' guesses aside).

        The draft agrees with the guess about as far as the target would: its first j tokens with P(first j
        accepted), and each agreed token is a draft call saved, while each guessed token adds a row to the call (on
        the AMD EPYC 8 rows cost 1.7-2.0x one row for the int8 drafts, as much as one for the bfloat16 0.5B). The
        lead is as long as saves most in expectation; token d of the chain then needs a call of its own unless the
        first d - 1 guessed tokens were agreed."""
        per_token = self.cost.draft_seconds(1, context)
        reach = list(itertools.accumulate(accept[: min(len(guess), room - 1)], operator.mul))
        first = [self.cost.draft_seconds(1, context, fed + n) for n in range(len(reach) + 1)]  # the call, n guessed
        length = max(range(len(first)), key=lambda n: per_token * sum(reach[:n]) - first[n])
        calls, drafting = 0.0, []
        for d in range(room):
            calls += 1.0 - (reach[d - 1] if 0 < d <= length else 0.0)
            drafting.append(first[length] + per_token * (calls - 1.0))
        return guess[:length], tuple(drafting)

    def worth_checking(self, tokens: list[int], room: int, context: int, fed: int, options: SuffixOptions
                       ) -> tuple[list[int], float]:
        """The suffix index's chain after `tokens` (`options`' chain, at most `room` tokens), cut to what a draft call
        after `context` cached tokens that feeds `fed` others should check (`lead`), and the seconds checking it adds
        to the call."""
        branch = propose(self.index, None, tokens, room, options).main_branch()
        levels = summarize(branch)
        accept = self.chooser.chain("suffix", len(levels), levels, self.curve_for(branch.match))
        chosen, drafting = self.lead(branch.tokens, accept, room + 1, context, fed)
        return chosen, drafting[0] - self.cost.draft_seconds(1, context, fed)

    def tree_lower(self, tokens: list[int], room: int) -> list[int]:
        """The lower stage of the draft model's trees (`TreeDrafter`): the suffix index's chain under the tree's most
        probable leaf (after `tokens`: the run's and that leaf's path), cut to what pays for the draft call that checks
        it. `staged`'s own lower stage checks the chain as far as it reaches, up to 10 tokens a call, where the int8
        0.5B draft's call of 10-13 tokens costs 2.5x one of one token (55 against 22 ms, AMD EPYC): on mixed's QA its
        trees made 17 such calls in 18 steps, most agreeing with a token or none. Cut so, two interleaved repeats with
        the int8 0.5B draft of the 1.5B: mixed (one prompt per category) 24.1 s against 25.8 (`staged` 25.2), bench
        15.4 against 16.6 (`staged` 16.5), every prompt faster; with the bfloat16 0.5B (drafting as its int8 copy)
        mixed 23.0 against 24.7, bench 16.2 against 16.9."""
        tree, context = self.tree, len(self.model.cache)
        fed = len(self.model.uncached()) if len(tokens) == self.start else tree.options.width  # (the root's call)
        return self.worth_checking(tokens, room, context, fed, tree.suffix)[0]

    def tree_candidate(self, room: int, catch_up: float, suffix: Candidate | None, chain: Candidate) -> Candidate:
        """The draft model's tree, up to `room` levels. Its main branch is the draft model's `chain`, with the
        draft's next choices beside it, so its first d levels are at least as likely to be accepted as the chain's
        (and as the tree's own estimate says), and as the suffix index's main branch (`suffix`'s levels, when it has
        some), which its calls check (`at_least`).

        Each level costs what a level of the trees drafted so far cost: a draft call grows one, or several where the
        draft agrees with the lower stage's chain, and how often it does is this run's text's (the mean learns it).
        Costing the levels that chain covered as free, as if the draft always agreed, auto expected 0.25 s for the
        12-level trees that took 0.57 s on bench's code prompt (int8 0.5B draft of the 1.5B, AMD EPYC) and chose them
        over chains; its predicted / measured seconds of the trees it took on bench were 0.69 / 0.72 / 0.82 (code /
        edit / prose), now 1.26 / 0.96 / 1.14, and on mixed (one prompt per category) 0.85 / 0.94 / 0.84 / 0.66,
        now 0.97 / 1.00 / 1.02 / 0.95. (Counting a call per level the chain is not expected to cover, from the suffix
        candidate's acceptance, was no closer: 0.81 / 1.04 / 1.19 on bench.) Catching the draft up on steps it sat
        out costs once, as for chains (`catch_up` seconds, `draft_call`)."""
        paths = [self.chooser.chain("tree", room), chain.accept, suffix.accept if suffix is not None else ()]
        accept = at_least(paths, room)
        drafting = tuple(catch_up + self.tree_level.mean * d for d in range(1, room + 1))
        nodes = tuple(self.tree_size(d) for d in range(1, room + 1))
        return Candidate("tree", accept, nodes=nodes, drafting=drafting, tree=True, catch_up=catch_up)

    def draft_with_model(self, state: DecodeState, limit: int, planned: int, catch_up: float, lead: list[int]
                         ) -> Draft:
        """Draft the `planned` tokens, then up to `limit` while the next one is predicted to pay, judged by the
        draft's confidence in the tokens so far (a probe plans its probe tokens). The first call checks `lead` too (and
        costs `catch_up` seconds more than a one-token call), each later one the suffix index's guess at what follows
        the tokens drafted, as much of it as `lead` finds worth it. Its calls refine the draft's costs: the first,
        which feeds what the draft has not seen (the whole prompt, at the start) and the lead, on its own."""
        chooser, context, confidences = self.chooser, len(state.cache), self.confidences
        fed, stamps, calls = len(self.model.uncached()) + len(lead), [], state.stats.draft_calls
        guessed = [0.0]  # the predicted seconds later calls spent on guesses (their costs are learned as 1-token calls)

        def guess(drafted: list[int], room: int) -> list[int]:
            if not drafted:
                return lead
            chosen, seconds = self.worth_checking(state.tokens + drafted, room, context, 1, self.suffix)
            guessed[0] += seconds
            return chosen

        def keep_going(cumulative: float) -> bool:
            stamps.append(self.now())  # a call has ended (its token's probability is on the host)
            before = confidences[-1][1] if confidences else 1.0
            confidences.append((cumulative / before if before else 0.0, cumulative))  # (this token's, the chain's)
            return len(confidences) < planned or chooser.keep_drafting("draft", [c for c, _ in confidences], context,
                                                                      catch_up)

        start = self.now()
        tokens, rows, cumulative = (self.model.draft_chain(limit, keep_going) if self.model.translates else
                                    self.model.draft_chain(limit, keep_going, guess))  # (it drafts through text)
        state.lm.synchronize()
        end, calls = self.now(), state.stats.draft_calls - calls
        self.drafted = self.cost.draft_seconds(calls, context, fed) + guessed[0]  # (predicted: `elapsed`)
        first = stamps[0] if stamps else end  # (no stamp: the first token ended the chain)
        if tokens and self.timed:  # (no tokens: the grammar was complete, no call made)
            self.cost.observe("draft", fed, context, first - start)
        if calls > 1 and self.timed:
            self.cost.observe("draft", 1, context, max(0.0, end - first - guessed[0]) / (calls - 1))
        self.confidences = list(given_above(cumulative))
        return Draft(tokens, stack_probs(rows))

    def tree_size(self, levels: int) -> int:
        """The nodes a draft-model tree of `levels` levels is expected to hold (as many a level as the trees so far)."""
        return min(TREE.budget, max(levels, round(self.tree_nodes.mean * levels)))

    def tree_options(self, context: int) -> StagedOptions:
        """`staged`'s options for growing this step's tree, its thresholds raised to what pays at the rate this step's
        plan expects (`tree_thresholds`), a node costed as the nodes past the plan's add to the target call on
        average, a draft call as a call of the tree's width."""
        planned, budget = self.tree_size(self.plan.k), TREE.budget
        big, small = (self.cost.target_seconds(self.fed + n, context, tree=True) for n in (budget, planned))
        node = (big - small) / max(1, budget - planned)
        call = self.cost.draft.predict(self.tree.options.width, context)
        min_prob, expand_prob = tree_thresholds(self.plan.rate, node, call)
        return replace(self.tree.options, min_prob=min_prob, expand_prob=expand_prob)

    def draft_tree(self, state: DecodeState, limit: int) -> Draft:
        """A draft-model tree of at most `limit` levels; learns what it cost per level (catching up aside)."""
        context, start, calls = len(state.cache), self.now(), state.stats.draft_calls
        _, catch_up = self.draft_call(context)
        self.tree.options = self.tree_options(context)
        draft = self.tree.propose(state, limit)
        state.lm.synchronize()
        if levels := depth(draft):
            planned = (state.stats.draft_calls - calls) * self.cost.draft.predict(self.tree.options.width, context)
            self.tree_level.add(max(0.0, self.elapsed(start, planned + catch_up) - catch_up) / levels)
            self.tree_nodes.add(len(draft.tokens) / levels)
        return draft

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        state.lm.synchronize()
        ended = self.now()
        if self.timed:
            self.cost.observe("target", self.scored, self.context, ended - self.clock, not draft.is_chain)
        whole = accepted  # (the step's accepted tokens, whoever drafted them)
        self.credit_window(state, draft, accepted)
        if self.plan.proposer == "draft" and draft.source == "merged":  # its chain merged with guesses
            # (`with_guesses`): the guesses learn as a merged tree's parts do, the chain from its own nodes
            self.teach_parts(state, draft, accepted)
            path = draft.follow(state.tokens[self.start: self.start + accepted])
            draft = draft.drafted_by("draft")
            accepted = sum(1 for n in path if n < len(draft.tokens))  # (the chain's nodes come first)
        if self.plan.proposer in GROWN and self.fed <= 1 and not self.plan.probe:  # (a call that feeds the prompt is
            # costed by extrapolating the calibrated curve far past its last knot: it would teach the correction
            # little. A probe's plan was not chosen for its rate, so how far its steps ran from it tells nothing of how
            # the rates of chosen plans err; planned at 2 tokens, a probe whose chain ran on to 5 corrected the draft's
            # plans to 1.65 at once: with the int8 0.5B draft of the 1.5B in bfloat16 (AMD EPYC), whose plans' rates
            # stay below a plain step's, the draft then drafted 14 steps of translation-de at 0.35 s a token, where
            # plain steps took 0.22)
            self.chooser.learn_rate(self.plan, accepted + 1, self.elapsed(self.began, self.plan.seconds, ended))
        if self.plan.proposer == "merged":  # each part learns how far its own guesses went
            self.teach_parts(state, draft, accepted)
        elif self.plan.proposer is not None and draft.tokens:
            levels = depth(draft)  # fewer than proposed when the grammar or an EOS cut it
            confidences = None if self.confidences is None else self.confidences[:levels]
            # a tree grows as deep as staged's rule finds its leaves likely, which may fall short of the levels the
            # plan counted on: a level it did not grow is one not accepted. Counting only the levels grown, a 12-level
            # plan expected 7.6 tokens where the trees grown gave 2-6 (int8 draft, mixed's QA)
            short = self.plan.proposer == "tree" and levels < self.plan.k and accepted == levels
            self.chooser.update(self.plan.proposer, levels + short, accepted, confidences, self.curve)
        if self.plan.proposer == "tree" and draft.tokens:
            # the tree's first branch is the chain the draft model would have drafted: what the target made of it
            # teaches the chains' estimates too, so chains and trees are weighed on the same evidence. Taught only by
            # their own steps, whichever of the two won the run's first steps kept every later one (the other is
            # probed after 16 steps, and a 128-token run of the int8 0.5B draft on code takes 12-14): code took trees
            # in one run (7.1 s) and chains in the next (5.8 s), which reach 16 levels where trees stop at 12
            main = first_branch(draft.links)
            path = draft.follow(state.tokens[self.tree.start: self.tree.start + accepted])
            taken = next((i for i, (a, b) in enumerate(zip(main, path)) if a != b), min(len(main), len(path)))
            self.chooser.update("draft", len(main), taken)
        if self.plan.proposer == "draft" and self.tree is not None and draft.tokens:
            self.teach_tree(state, draft, accepted)
        if self.plan.proposer == "tree":
            self.tree.update(state, draft, accepted)  # keeps the accepted path in the draft cache
        elif self.model is not None:
            self.model.rewind()
        if self.ahead is not None:  # the window moves on in steps that scored it; the pool learns the text
            self.ahead.update(state, draft, whole)
        self.index.follow("run", state.tokens)

    def teach_parts(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        """Each of this step's draft-free drafts (`self.parts`) in the merged tree `draft` learns how far its own
        guesses went: the suffix index's on its match curves, lookahead's (which gives no probabilities) pooled."""
        path = state.tokens[self.start: self.start + accepted]
        for name, part in self.parts.items():
            verified = part.subset(common(part, draft))
            if verified.tokens:
                confidences, curve = (self.levels, self.suffix_curves) if name == "suffix" else (None, None)
                self.chooser.update(name, depth(verified), len(verified.follow(path)), confidences, curve)

    def teach_tree(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        """What the target made of a draft model's chain, as the tree grown instead would have fared: its main branch
        is that chain, with the draft's second choice beside each token, which the target takes where it rejected the
        chain's (`DraftModel.runner_ups`); below that the tree's fate is unknown. Taught only by their own steps,
        trees were seldom taken where chains had won the first steps, though they would have been faster: taking
        trees wherever offered, mixed (one prompt per category, int8 0.5B draft of the 1.5B, AMD EPYC) ran 4.60 /
        7.74 / 5.88 / 5.88 s (QA / translation / summarization / math) where auto's own choices ran 4.88 / 7.80 /
        6.14 / 7.00 s and `staged` 5.07 / 8.11 / 5.81 / 6.18 s. Taught so, in four interleaved pairs on mixed: 25.9
        s on average against 27.0 (math's target calls 19-22 against 26-27); on bench equal with the int8 draft
        (17.8 against 17.6 s), 23.8 against 22.9 s with the bfloat16 one (code: 20 calls of trees against 22, each
        dearer), and 8.8 against 9.1 s in a third pair of code alone."""
        levels = min(len(draft.tokens), accepted + 1, TREE.max_depth)
        target = state.tokens[self.start + accepted] if self.start + accepted < len(state.tokens) else None
        caught = accepted < levels and target == self.model.runner_ups[accepted]
        self.chooser.update("tree", levels, min(levels, accepted + caught))

    def record(self, state: DecodeState, plan: Plan) -> None:
        """What auto chose, for reports: steps per proposer, and the predicted tokens and seconds."""
        details = state.stats.details
        name = plan.proposer or "none"
        details["steps"][name] = details["steps"].get(name, 0) + 1
        details["predicted_tokens"] += plan.expected_tokens
        details["predicted_seconds"] += plan.seconds


def expect_draft(chooser: Chooser, shares_cache: bool) -> None:
    """What `chooser` expects of a run's draft model before it has drafted: it is probed when first offered (its
    confidences then inform every later choice), and one on the target's cache (the target's own int8 copy) is
    expected to agree with the target as `speculative` expects (SELF_ACCEPTANCE): from the default prior of 0.5 and
    2-token probes every 16 steps it was drafted in 4 of SmolLM2's 55 steps on mixed's math (float32, AMD EPYC), 30 of
    them plain steps, where its copy agrees with it on 0.90 of the tokens `speculative` (k=8) drafts."""
    chooser.declined["draft"] = chooser.options.probe_after
    if shares_cache:
        chooser.priors["draft"] = SELF_ACCEPTANCE


def tree_thresholds(rate: float, node: float, call: float) -> tuple[float, float]:
    """(min_prob, expand_prob) for growing a draft-model tree (`StagedOptions`) in a step expected to give `rate` new
    tokens per second, where a node adds `node` seconds to the target call and a draft call costs `call` seconds: a
    node pays where its path's probability (the tokens it may add) reaches rate x node, and a draft call, which adds
    children under the likeliest leaf, only where that leaf's path reaches rate x (call + node) - never below
    `staged`'s own thresholds, never at 1 (SURE).

    `staged`'s thresholds (0.05, 0.3) were measured on the AMD EPYC, where a 16-token call of the 1.5B cost 1.2-1.5
    one-token calls; on the Intel Xeon without AMX it costs 2.3, and auto's trees outgrew the plans it chose them by:
    on mixed's translation with the int8 0.5B draft, trees planned at 2-5 nodes grew to 10-12, and their steps took
    0.9-1.1 s where their plans said 0.5-0.65 (for that, at rate 5 and 20 ms a node, a 70 ms draft call: 0.1, 0.45).
    Grown so, with the int8 0.5B draft of the 1.5B in bfloat16 there, two interleaved repeats: bench 99.7 s against
    110.1 (the same target calls in cheaper steps), mixed (one prompt per category) 162.9 against 167.1, and its
    translation alone, three repeats, 74.2 against 76.0 (equal: its target calls ran 41-58 either way)."""
    return (min(SURE, max(TREE.min_prob, rate * node)), min(SURE, max(TREE.expand_prob, rate * (call + node))))


def _takes_trees(lm: LM) -> bool:
    """Whether the model can score a token tree in one call (probed once per model and cached on it)."""
    try:
        lm.check_tree_mask()
    except TypeError:
        return False
    return True


def match_curve(match: int) -> str:
    """The calibration curve of a suffix-index draft that continues a `match`-token suffix: one per
    match length 1, 2-3, 4-7, 8+. The index's probabilities are counts of what followed the match, blind to its
    length, and the length tells most: replaying bench's greedy outputs of the 1.5B, first choices of probability 1 were
    accepted 0.39 of the time after a 1-token match, 0.4-0.7 after 2-3, 0.7-1.0 after 4-7, and 0.96-1.0 after 8 or
    more.

    A draft's level d (from 0) continues a (match + d)-token suffix once the levels above it are right, and is judged
    on that curve (`auto` passes one curve per level). Replaying the greedy outputs of SmolLM2-135M's seven prompts and
    the 1.5B's bench and mixed (no model calls), the index's first choices after a 1-token match were accepted 0.24
    / 0.21 / 0.27 of the time at the first level and 0.56 / 0.31 / 0.75 at the second (given the first), where first
    levels after a 2-3 token match were accepted 0.61 / 0.37 / 0.62; after a 2-3 token match, third levels 0.86 /
    0.67 / 0.74, first levels after 4-7 0.86 / 0.81 / 0.67. One curve per draft had judged its second level as
    likely as its first, and cut the index's drafts short: SmolLM2's seven prompts (float32, Intel Xeon without AMX,
    two interleaved repeats) took 49.9 s in 455 target calls against 51.6 s in 461 (`suffix`: 46.5 s, 448)."""
    return f"suffix:{min(8, 1 << (max(match, 1).bit_length() - 1))}"



def summarize(tree: SuffixDraft) -> list[float]:
    """Per level of a suffix tree: the index's probability of its best node given the best node above."""
    found = depths(tree.parents)
    best = [max(p for p, d in zip(tree.probs, found) if d == level) for level in range(max(found, default=-1) + 1)]
    return [min(1.0, p) for p in given_above(best)]


@register("auto")
class Auto(DraftVerify):
    """Per step, the proposer and draft length a measured cost model predicts to be fastest."""

    Options = AutoOptions
    drafter = AutoDrafter
    takes_draft = True

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 chooser: Callable[[CostModel], Chooser] = Chooser, **options) -> None:
        """`clock`: what auto times its steps and calls by (`devtools.replay_auto` replays runs on one that advances by
        each call's calibrated cost); `chooser`: makes a run's `Chooser` from its cost model; `options`: `AutoOptions`.
        """
        if not (callable(clock) and callable(chooser)):
            raise TypeError("auto's clock is a function of no arguments giving seconds, its chooser a Chooser factory")
        super().__init__(**options)
        self.clock, self.chooser = clock, chooser

    def start(self, state: DecodeState) -> None:
        state.drafter = self.drafter(state, self.options, self.clock, self.chooser)
