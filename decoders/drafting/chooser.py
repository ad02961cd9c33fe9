"""`Chooser`: what to draft this step, and how much, to maximize the expected new tokens per second.

A proposer ("grammar", "lookup", "suffix", "draft", ...) offers a `Candidate`: up to k drafted levels (the tokens of a
chain, or the levels of a tree) with p_i = P(level i accepted | levels before it accepted) and what drafting costs.
Verifying its first i levels in one target call, after L cached tokens, gains and costs

    E(i) = 1 + sum_{j=1..i} prod_{l<=j} p_l               tokens (the target's own next token included)
    S(i) = extra(i) + t(1 + nodes(i), L)                   seconds, extra(i) = fixed + i * per_token (extra(0) = 0)
                                                           or as the candidate lists it

and the plan is the candidate and i of highest E / S; i = 0 is a plain step (one token per target call), which wins
ties. E's increments prod p never grow, so E is concave in i; where S is convex in i (measured costs are: flat, then
rising) E / S rises, then falls, and stopping at the first i >= 1 where one more level lowers it is optimal. That is
`should_continue`, for a draft model that drafts one token at a time. Whether to start drafting at all is for
`choose`, which sees every prefix: a fixed cost (e.g. catching up) makes S jump at i = 1, so one level may not pay
where three do.

The p_i are learned online per proposer and depth (depths past `max_depth` share one estimate) as Beta posteriors
with forgetting. A drafter that knows its own probability c of a drafted token (a draft model, the suffix index) gets
a calibration curve instead: P(accepted | c) = a * c ** gamma, one (a, gamma) per proposer, weighed over a grid by
how well each explained every drafted token it verified, whatever its depth (`calibrated`). Two parameters learn from
a few steps what a table of probability buckets by depth took a whole run to fill: a draft's low-probability tokens
are rare, and while their cells still held optimistic priors `auto` drafted through them (replayed with the int8 0.5B
draft of the 1.5B, `devtools.replay_chains`: 8-16% more estimated seconds than with a curve). The ceiling a is for
drafters that are sure and wrong: the suffix index gives a token it saw once after the matched suffix probability 1,
and with c ** gamma alone (1 for c = 1, whatever gamma) `auto` expected every such level accepted (3.0 tokens for
two-level drafts that gave 1.3 on average: predicted 164 tokens for a 110-token run on the AMD EPYC).
Break-even guard: a proposer declined `probe_after` steps in a row is taken once with `probe_tokens` tokens (a draft
model's chain: at least), so that estimates it lost can recover - unless it is `watched` (a drafter that drafts for
free, whose steps a caller does not probe), and if it could pay: if drafting the rest of the run with it, every level
accepted, would beat the rate of the plan chosen, its drafter's catching up paid once (`could_pay`). Where a call
costs about as much per token it scores as a plain step (a CPU computing bfloat16 in float) hardly any draft can, and
probes only lose. A proposer whose acceptance is known better than the priors before a run (`Chooser.priors`) starts
from that.

A call that feeds the prompt (a run's first) costs far more than the later steps; there the plan is the one of highest
value: expected tokens less its seconds at the rate the later steps are expected to make (`choose`), so a level rides
along in it where its tokens are worth the seconds it adds, not where it adds little to that one call's rate.

Last, what a proposer's steps gave against what their plans predicted may correct how its plans are compared
(`correction`, learned from the steps the caller passes to `learn_rate`): a plan's E and S are for the levels it
counts on, while a draft model's chain runs on while its confidences say the next token pays and its tree grows as
`staged` grows it, so what is drafted is not what was planned, and the chosen levels' estimates err in ways no single
step shows. With the int8 0.5B draft of the 1.5B (AMD EPYC), trees' steps gave 96 tokens where their plans expected
59, in 4.71 s for 3.72; the plans' rates alone took trees in 11 of math's 22 steps, corrected in 12 of 16. Mixed (one
prompt per category), two interleaved repeats: 23.5 s against 25.0 (`staged` 23.5); bench 16.9 against 17.1; without
a draft and with SmolLM2-135M equal within 1%. (`auto` corrects those two so: see `decoders.strategies.auto.GROWN`.)

"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from decoders.drafting.cost import CostModel
from decoders.options import probability, whole


GAMMAS = tuple(0.02 * 200 ** (i / 23) for i in range(24))  # the calibration exponents weighed, 0.02 to 4 evenly in
# log: from a draft whose every guess is accepted (its int8 copy: c ** 0.02 is near 1 for any c it drafts) to one
# far less often right than it believes
CEILINGS = tuple(1 - miss for miss in (0.0, 0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
# the calibration ceilings a = P(accepted | c = 1) weighed, fine near 1, where a draft's chain length turns on them
# (1 / (1 - a) tokens)
PRIOR = tuple(math.log(0.5 if a == 1 else 0.5 / (len(CEILINGS) - 1)) for a in CEILINGS)  # log prior of each ceiling:
# even odds that the drafter is never wrong when sure (a draft model; one miss at probability 1 rules that out), the
# other half spread evenly; every gamma equally likely
GRID = np.array(GAMMAS), np.array(CEILINGS)[:, None]  # the same as arrays: [GAMMAS], [CEILINGS, 1]


@dataclass(frozen=True)
class ChooserOptions:
    """Options of the `Chooser`; defaults chosen for runs of a few hundred tokens (tens of steps)."""

    max_depth: int = 4  # depths past this share one estimate: few steps reach them, and p barely changes there
    prior_mean: float = 0.5  # prior acceptance without a drafter's probability (with one: see GAMMAS)
    prior_strength: float = 2.0  # pseudo-observations of the prior: two steps of evidence outweigh it
    decay: float = 0.99  # per observation of a cell or curve, old evidence fades: about the last 100 count
    probe_after: int = 16  # declined steps in a row before a proposer is probed; 1 probe in 17 costs little
    probe_tokens: int = 2  # levels of a probe: a small draft that also teaches depth 2

    def __post_init__(self):
        for name in ("max_depth", "probe_after", "probe_tokens"):
            whole(name, getattr(self, name))
        probability("prior_mean", self.prior_mean)
        probability("decay", self.decay)
        if not self.prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0 pseudo-observations, got {self.prior_strength}")


@dataclass(frozen=True)
class Candidate:
    """A draft that could be verified this step, or its first levels."""

    proposer: str  # who drafts it: the key of its acceptance estimates
    accept: tuple[float, ...]  # [k] p_i = P(level i accepted | levels < i accepted)
    per_token_seconds: float = 0.0  # drafting cost per level: one draft-model call each; lookup and grammar: 0
    fixed_seconds: float = 0.0  # drafting cost of any nonempty prefix (e.g. a draft model catching up)
    nodes: tuple[int, ...] = ()  # [k] tree nodes in levels 1..i, scored by the target; empty: a chain (i nodes)
    drafting: tuple[float, ...] = ()  # [k] seconds of drafting levels 1..i when not fixed + i * per_token (a draft
    # model's tree, whose first call also grows the levels a lower stage proposes)
    tree: bool | None = None  # whether the target scores it with a tree mask (`CostModel.tree_extra`); None: where
    # its levels hold more nodes than one each
    catch_up: float = 0.0  # of its drafting seconds, those that feed the drafter what it has not seen (a draft model
    # catching up on the prompt or the steps it sat out): paid once, not in each step it drafts (`Chooser.could_pay`)


@dataclass(frozen=True)
class Plan:
    """What to verify this step: the first `k` levels of `proposer`'s draft (None, 0: a plain step)."""

    proposer: str | None
    k: int
    expected_tokens: float  # E(k), the target's own token included
    seconds: float  # S(k): drafting plus the target call
    probe: bool = False  # taken by the break-even guard, not for its rate: draft k levels (a draft model's chain:
    # at least k, then on while the next one pays)

    @property
    def rate(self) -> float:
        """Expected new tokens per second."""
        return self.expected_tokens / self.seconds


Curves = str | Sequence[str] | None  # the calibration curve of a draft's levels: one for every level, one per level,
# or None (the proposer's own)


def level_curve(curve: Curves, level: int) -> str | None:
    """The calibration curve of level `level` (from 0) of a draft whose levels are judged on `curve`."""
    return curve if curve is None or isinstance(curve, str) else curve[level]


def expected_tokens(accept: Sequence[float]) -> float:
    """E = 1 + sum_i prod_{j<=i} p_j: expected tokens from verifying a draft with these acceptance probabilities."""
    total, running = 1.0, 1.0
    for p in accept:
        running *= p
        total += running
    return total


def at_least(paths: list[Sequence[float]], levels: int) -> tuple[float, ...]:
    """[levels] acceptance per level of a tree that holds each of `paths` ([levels or fewer] acceptance per level
    of one path, given the levels above), when all that is known is that: P(the first d levels accepted) is at least
    each path's own, so it is taken as their largest. (The largest of each level's acceptance instead is optimistic:
    the paths part ways, a suffix path sure of its second level once its first is right does not make the draft
    model's second level likelier. With it, auto's int8-draft trees on mixed's QA expected 77 tokens and gave 62.)"""
    reach = [max(math.prod(path[:d]) for path in paths if len(path) >= d) for d in range(1, levels + 1)]
    return given_above(reach)


def union(paths: list[tuple[Sequence[int], Sequence[float]]]) -> tuple[float, ...]:
    """Acceptance per level of a tree merged from several drafts, from each one's main path (tokens) and its
    acceptance per level. Paths that agree on their first d tokens are one guess at them, as likely as the likeliest
    says; paths that part ways guess different tokens, and the tree's first d levels are accepted unless every guess
    is wrong (taken as independent: 1 - prod(1 - P)), and never more often than its first d - 1."""
    reach = []
    for d in range(1, max((min(len(t), len(a)) for t, a in paths), default=0) + 1):
        guesses: dict[tuple[int, ...], float] = {}
        for tokens, accept in paths:
            if min(len(tokens), len(accept)) >= d:
                guess = tuple(tokens[:d])
                guesses[guess] = max(guesses.get(guess, 0.0), math.prod(accept[:d]))
        reach.append(min(reach[-1] if reach else 1.0, 1.0 - math.prod(1.0 - p for p in guesses.values())))
    return given_above(reach)


def given_above(reach: Sequence[float]) -> tuple[float, ...]:
    """[levels] P(level d accepted | the levels above accepted), from P(levels 1..d accepted) per level (0 below a
    level never reached)."""
    return tuple(r / above if above else 0.0 for r, above in zip(reach, [1.0, *reach]))


class Chooser:
    """Per-run acceptance estimates and the choice of a plan against a `CostModel`."""

    def __init__(self, cost: CostModel, options: ChooserOptions | None = None) -> None:
        self.cost, self.options = cost, options or ChooserOptions()
        self.counts: dict[tuple[str, int], list[float]] = {}  # (proposer, depth) -> [accepted, rejected]
        self.declined: dict[str, int] = {}  # proposer -> steps in a row it was offered and not taken
        self.fits: dict[str, np.ndarray] = {}  # curve -> [CEILINGS, GAMMAS] log-likelihoods, decayed
        self.curves: dict[str, tuple[list[float], dict[float, float]]] = {}  # curve -> ([GAMMAS] posterior weight x
        # mean ceiling, the calibrated probability of each confidence asked so far): cached until the curve learns
        self.watched: set[str] = set()  # proposers never probed (they draft for free)
        self.priors: dict[str, float] = {}  # proposer -> its prior acceptance where known better than prior_mean
        self.realized: dict[str | None, list[float]] = {}  # proposer -> [predicted tokens, tokens, predicted seconds,
        # seconds] of the steps it was taken, decayed (`correction`)

    def acceptance(self, proposer: str, depth: int, confidence: float | None = None, curve: str | None = None
                   ) -> float:
        """Estimated P(level `depth` (from 1) accepted | the levels before it accepted): from the drafter's own
        probability for that token when known (`calibrated`, on the proposer's curve or the one named `curve`), else
        pooled per depth. A pooled level past the first starts from the estimate of the level above it, so what the
        first levels learned reaches the deeper ones before any draft has gone that deep (a short probe would
        otherwise never lift them); the first level starts from the proposer's own prior (`priors`) if it has one,
        else from `prior_mean`."""
        if confidence is not None:
            return self.calibrated(curve or proposer, confidence)
        depth = min(depth, self.options.max_depth)  # deeper levels share the last estimate
        first = self.priors.get(proposer, self.options.prior_mean)
        prior = first if depth == 1 else self.acceptance(proposer, depth - 1)
        accepted, rejected = self.counts.get((proposer, depth), (0.0, 0.0))
        strength = self.options.prior_strength
        return (accepted + strength * prior) / (accepted + rejected + strength)

    def calibrated(self, curve: str, confidence: float) -> float:
        """P(accepted | the drafter gave the token probability `confidence`) = E[a * confidence ** gamma], (a, gamma)
        weighed over CEILINGS x GAMMAS by how well each explained the verified tokens of this `curve` (a proposer's,
        or a kind of its drafts; a posterior from PRIOR). A draft that is right more often than it believes (the
        target's int8 copy) gets a near 1 and a small gamma, one as sure as it is right a near 1 and gamma near 1, the
        suffix index's once-seen continuations (probability 1) a well below 1. Before any evidence a token of
        probability 1 is judged 0.83 likely and one of 0.5 0.57, so a drafter is tried and learns."""
        if curve not in self.curves:
            fit = np.asarray(PRIOR)[:, None] + self.fits.get(curve, 0.0)  # [CEILINGS, GAMMAS]
            posterior = np.exp(fit - fit.max())
            weights = (GRID[1] * posterior).sum(axis=0) / posterior.sum()  # [GAMMAS]
            self.curves[curve] = (weights.tolist(), {})
        weights, known = self.curves[curve]
        if confidence not in known:
            known[confidence] = sum(w * confidence ** gamma for w, gamma in zip(weights, GAMMAS))
        return known[confidence]

    def chain(self, proposer: str, k: int, confidences: Sequence[float] | None = None, curve: Curves = None
              ) -> tuple[float, ...]:
        """[k] estimates for levels 1..k (`confidences` [k]: the drafter's probability of each drafted token;
        `curve`: the calibration curve they are judged on, one for every level or one per level)."""
        given = confidences if confidences is not None else [None] * k
        return tuple(self.acceptance(proposer, d + 1, given[d], level_curve(curve, d)) for d in range(k))

    def candidate(self, proposer: str, k: int, confidences: Sequence[float] | None = None, curve: Curves = None,
                  **costs) -> Candidate:
        """A `Candidate` of k levels with this chooser's estimates; `costs`: per_token_seconds, fixed_seconds, nodes."""
        return Candidate(proposer, self.chain(proposer, k, confidences, curve), **costs)

    def update(self, proposer: str, drafted: int, accepted: int, confidences: Sequence[float] | None = None,
               curve: Curves = None) -> None:
        """Learn from a verification that accepted `accepted` of `drafted` levels: levels 1..accepted were accepted,
        the next one rejected, later ones tell nothing (they were conditional on it). `curve`: the calibration curve
        the confidences teach, when not the proposer's own (a drafter whose tokens are calibrated apart by kind, as
        the suffix index's by match length), one for every level or one per level."""
        decay = self.options.decay
        for depth in range(1, min(accepted + 1, drafted) + 1):
            confidence = None if confidences is None else confidences[depth - 1]
            took = depth <= accepted
            counts = self.counts.setdefault((proposer, min(depth, self.options.max_depth)), [0.0, 0.0])
            counts[0], counts[1] = decay * counts[0] + took, decay * counts[1] + (not took)
            if confidence is not None:  # the calibration curve learns from every token with a probability
                self.learn_curve(level_curve(curve, depth - 1) or proposer, confidence, took)

    def learn_curve(self, curve: str, confidence: float, took: bool) -> None:
        """Weigh every (a, gamma) of the calibration curve `curve` by the likelihood of one verified token."""
        gammas, ceilings = GRID
        accepted = ceilings * min(max(confidence, 1e-6), 1 - 1e-6) ** gammas  # [CEILINGS, GAMMAS] a * c ** gamma
        likelihood = np.log(accepted) if took else np.log1p(-accepted)
        self.fits[curve] = self.options.decay * self.fits.get(curve, 0.0) + likelihood
        self.curves.pop(curve, None)

    def evaluate(self, candidate: Candidate | None, k: int, context: int, fed: int = 1) -> Plan:
        """E(k) and S(k) of verifying the first `k` levels of `candidate` after `context` cached tokens, in a target
        call that feeds `fed` tokens before the draft (the last one accepted; in a run's first step, the prompt)."""
        if candidate is None or k == 0:
            return Plan(None, 0, 1.0, self.cost.target_seconds(fed, context))
        nodes = candidate.nodes[k - 1] if candidate.nodes else k
        if candidate.drafting:
            extra = candidate.drafting[k - 1]
        else:
            extra = candidate.fixed_seconds + k * candidate.per_token_seconds
        tree = candidate.tree if candidate.tree is not None else nodes > k
        seconds = extra + self.cost.target_seconds(fed + nodes, context, tree)
        return Plan(candidate.proposer, k, expected_tokens(candidate.accept[:k]), seconds)

    def best(self, candidate: Candidate, context: int, fed: int = 1, rate: float | None = None) -> Plan:
        """The prefix of `candidate` (at least one level) of highest rate; the shortest on ties. Given `rate`, the
        tokens per second the run's steps make, the one of highest `value` instead."""
        plans = [self.evaluate(candidate, k, context, fed) for k in range(1, len(candidate.accept) + 1)]
        return max(plans, key=lambda plan: plan.rate if rate is None else self.value(plan, rate))

    def value(self, plan: Plan, rate: float) -> float:
        """What `plan` is worth where a second is worth `rate` tokens: its expected tokens (corrected by what its
        proposer's steps gave, `correction`) less its seconds."""
        return plan.expected_tokens * self.correction(plan.proposer) - rate * plan.seconds

    def choose(self, candidates: Sequence[Candidate], context: int, fed: int = 1, remaining: int | None = None
               ) -> Plan:
        """The plan of highest expected tokens per second among `candidates` and a plain step, each rate corrected by
        what its proposer's steps gave against their plans (`correction`), except that a proposer declined
        `probe_after` steps in a row is probed with `probe_tokens` levels where it could pay in the `remaining` tokens
        of the run (`could_pay`), unless it is `watched`.

        `fed`: as in `evaluate`. A call that feeds the prompt costs many steps' seconds; the plan for it is the one of
        highest `value` at the rate of the plan a later step would choose, so a level rides along where its expected
        tokens are worth the seconds it adds. (Chosen by their rates, the levels of any guess that added a smaller share
        to the call than to its tokens rode along: on the AVX2-only AMD EPYC, where SmolLM2-135M's calls in float32 cost
        0.5-0.8 of a one-token call for each token scored, a run's first step scored 13 guesses with its 40-150
        prompt tokens, for 0.1-0.3 s, and the first answer token seldom follows the prompt's text.)"""
        offered = [c for c in candidates if c.accept]
        later = context + fed - 1  # the context of the steps after this one, which feed one token each
        steady = [self.evaluate(None, 0, later), *(self.best(c, later) for c in offered)]
        rates = [p.rate * self.correction(p.proposer) for p in steady]
        best = max(range(len(steady)), key=rates.__getitem__)  # (the first of the highest: a plain step wins ties)
        plan, rate = steady[best], rates[best]  # (rate: what a later step is expected to make)
        if fed > 1:
            plan = max([self.evaluate(None, 0, context, fed), *(self.best(c, context, fed, rate) for c in offered)],
                       key=lambda p: self.value(p, rate))
        due = [c for c in offered if c.proposer != plan.proposer and c.proposer not in self.watched
               and self.declined.get(c.proposer, 0) >= self.options.probe_after
               and self.could_pay(c, later, rate, remaining)]
        if due:
            probe = max(due, key=lambda c: self.declined[c.proposer])
            k = min(self.options.probe_tokens, len(probe.accept))
            plan = replace(self.evaluate(probe, k, context, fed), probe=True)
        for c in offered:
            self.declined[c.proposer] = 0 if c.proposer == plan.proposer else self.declined.get(c.proposer, 0) + 1
        return plan

    def could_pay(self, candidate: Candidate, context: int, rate: float, remaining: int | None = None) -> bool:
        """Whether drafting the `remaining` tokens of the run (None: without end) with some prefix of `candidate`
        every step, every level accepted, in steps that feed one token, would take less time than steps at `rate`
        tokens per second: its drafter catching up (`Candidate.catch_up`) once, then each step without it. What the
        break-even guard probes.

        On the AVX2-only AMD EPYC, where the 1.5B in bfloat16 costs 198 / 344 / 504 ms for 1 / 2 / 3 tokens, no
        probe of lookahead (its window rides along) can pay, and a draft model's (80 ms a call for the int8 0.5B) just
        about breaks even if always right, which never pays for its catching up on the prompt (1.5 s on mixed's
        math). Probed every 16 declined steps, auto's probes of its six proposers took 10.9 s of a 38.0 s run on
        bench's prose (int8 0.5B draft; greedy: 30.5 s) for 24 tokens, which plain steps made in 5.2 s."""
        perfect = replace(candidate, accept=(1.0,) * len(candidate.accept))
        once = candidate.catch_up / remaining if remaining else 0.0  # its share of each token's seconds
        return any(once + (self.evaluate(perfect, k, context).seconds - candidate.catch_up) / (k + 1) < 1 / rate
                   for k in range(1, len(candidate.accept) + 1))

    def learn_rate(self, plan: Plan, tokens: int, seconds: float) -> None:
        """Learn from a step taken on `plan` that gave `tokens` new tokens (the target's own included) in `seconds`
        (drafting, the target call and the step's own work), for `correction`."""
        predicted = (plan.expected_tokens, plan.expected_tokens, plan.seconds, plan.seconds)
        prior = [self.options.prior_strength * value for value in predicted]  # (steps that ran as predicted)
        sums = self.realized.setdefault(plan.proposer, prior)
        for i, value in enumerate((plan.expected_tokens, tokens, plan.seconds, seconds)):
            sums[i] = self.options.decay * sums[i] + value

    def correction(self, proposer: str | None) -> float:
        """How much faster than predicted `proposer`'s steps have run (`learn_rate`): realized over predicted tokens
        times predicted over realized seconds, each a ratio of sums over the steps it was taken, from a prior of
        `prior_strength` steps that ran as predicted (1 before any)."""
        sums = self.realized.get(proposer)
        return 1.0 if sums is None else sums[1] / sums[0] * sums[2] / sums[3]

    def keep_drafting(self, proposer: str, confidences: Sequence[float], context: int, fixed_seconds: float = 0.0
                      ) -> bool:
        """Whether a drafter that has drafted tokens it gave these probabilities [k >= 1] should draft one more, the
        next one judged by the probability of the last (`should_continue` with this chooser's estimates)."""
        accept = self.chain(proposer, len(confidences), confidences)
        next_token = self.acceptance(proposer, len(confidences) + 1, confidences[-1])
        return self.should_continue(accept, next_token, context, fixed_seconds=fixed_seconds)

    def should_continue(self, accept: Sequence[float], p_next: float, context: int,
                        per_token_seconds: float | None = None, fixed_seconds: float = 0.0) -> bool:
        """Whether drafting one more level (acceptance `p_next`) after the levels `accept` [k] raises the expected
        tokens per second: the marginal rule, for k >= 1 (`choose` decides k >= 1 or not). `per_token_seconds`
        defaults to one draft-model call; `fixed_seconds` counts in both rates, as in `evaluate`."""
        if per_token_seconds is None:
            per_token_seconds = self.cost.draft_seconds(1, context) if self.cost.draft is not None else 0.0
        candidate = Candidate("", (*accept, p_next), per_token_seconds, fixed_seconds)
        k = len(accept)
        return self.evaluate(candidate, k + 1, context).rate > self.evaluate(candidate, k, context).rate
