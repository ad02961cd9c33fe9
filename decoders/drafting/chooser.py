"""What to draft this step, and how much: the `Offer` and first i levels of highest E(i) / S(i) (docs/design/auto.md),
with p_i = P(level i accepted | the levels above) and L cached tokens:

    E(i) = 1 + sum_{j<=i} prod_{l<=j} p_l      tokens (the target's own included)
    S(i) = drafting(i) + t(1 + nodes(i), L)    seconds (t: the target's measured call cost)

i = 0 is a plain step, which wins ties.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from decoders.drafting.cost import CostModel
from decoders.options import check_whole, probability

# A token the drafter gives probability c is accepted with probability a * c ** gamma, (a, gamma) on a grid.
GAMMAS = tuple(0.02 * 200 ** (i / 23) for i in range(24))  # 0.02 to 4, evenly in log
# a: fine near 1, where a chain's length (1 / (1 - a) tokens) turns on it
CEILINGS = tuple(1 - miss for miss in (0.0, 0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
# even odds that a drafter sure of a token is never wrong (a = 1); every gamma equally likely
PRIOR = tuple(math.log(0.5 if a == 1 else 0.5 / (len(CEILINGS) - 1)) for a in CEILINGS)
GRID = np.array(GAMMAS), np.array(CEILINGS)[:, None]  # [GAMMAS], [CEILINGS, 1]


@dataclass(frozen=True)
class ChooserOptions:
    """Options of the estimates and the choice; defaults for runs of a few hundred tokens."""

    max_depth: int = 4  # depths past this share one estimate
    prior_mean: float = 0.5  # prior acceptance of a level without a drafter's probability
    prior_strength: float = 2.0  # pseudo-observations of the prior
    decay: float = 0.99  # per observation: about the last 100 count
    probe_after: int = 16  # declined steps in a row before a drafter that costs something is probed
    probe_tokens: int = 2
    catch_up_share: float = 0.2  # a new drafter is first probed once its catch-up is this share of the run's seconds

    def __post_init__(self):
        check_whole(self, max_depth=1, probe_after=1, probe_tokens=1)
        probability("prior_mean", self.prior_mean)
        probability("decay", self.decay)
        if not (isinstance(self.catch_up_share, (int, float)) and 0 < self.catch_up_share <= 1):
            raise ValueError(f"catch_up_share must be in (0, 1] (of the run's seconds), got {self.catch_up_share!r}")
        if not self.prior_strength > 0:
            raise ValueError(f"prior_strength must be > 0 pseudo-observations, got {self.prior_strength}")


@dataclass(frozen=True)
class Offer:
    """A draft a proposer could verify this step, or its first levels."""

    proposer: str
    accept: tuple[float, ...]  # [k] p_i
    drafting: tuple[float, ...] = ()  # [k] seconds of drafting levels 1..i; (): free
    nodes: tuple[int, ...] = ()  # [k] tokens the target scores for levels 1..i; (): a chain, i
    catch_up: float = 0.0  # the part of `drafting` paid once per run (a draft's prefill)


@dataclass(frozen=True)
class Plan:
    """The first `k` levels of `proposer`'s offer (None, 0: a plain step)."""

    proposer: str | None
    k: int
    expected_tokens: float  # E(k)
    seconds: float  # S(k)
    probe: bool = False  # taken to learn, not for its rate

    @property
    def rate(self) -> float:
        """Expected new tokens per second."""
        return self.expected_tokens / self.seconds


def expected_tokens(accept: Sequence[float]) -> float:
    """E(k) for k = len(accept)."""
    return sum(itertools.accumulate(accept, operator.mul), 1.0)


def given_above(reach: Sequence[float]) -> tuple[float, ...]:
    """[levels] p_d from P(levels 1..d accepted) per level."""
    return tuple(r / above if above else 0.0 for r, above in zip(reach, [1.0, *reach]))


def at_least(paths: list[Sequence[float]], levels: int) -> tuple[float, ...]:
    """p_d of a tree holding each of `paths`: P(d levels accepted) as the likeliest path's."""
    reach = [max((math.prod(path[:d]) for path in paths if len(path) >= d), default=0.0) for d in range(1, levels + 1)]
    return given_above(reach)


def union(paths: list[tuple[Sequence[int], Sequence[float]]]) -> tuple[float, ...]:
    """p_d of a tree merged from drafts' main paths (tokens, p_d): paths agreeing on d tokens are one guess, as likely
    as the likeliest; d levels pass unless every guess fails, at most as d - 1 do."""
    reach = []
    for d in range(1, max((min(len(t), len(a)) for t, a in paths), default=0) + 1):
        guesses: dict[tuple[int, ...], float] = {}
        for tokens, accept in paths:
            if min(len(tokens), len(accept)) >= d:
                guesses[tuple(tokens[:d])] = max(guesses.get(tuple(tokens[:d]), 0.0), math.prod(accept[:d]))
        reach.append(min(reach[-1] if reach else 1.0, 1.0 - math.prod(1.0 - p for p in guesses.values())))
    return given_above(reach)


@dataclass
class Decayed:
    """Evidence fading by `decay` per `add`; a prior is a starting `total` over `weight` pseudo-observations."""

    total: float = 0.0
    weight: float = 0.0
    decay: float = 0.99

    def add(self, value: float) -> None:
        self.total = self.decay * self.total + value
        self.weight = self.decay * self.weight + 1

    @property
    def mean(self) -> float:
        return self.total / self.weight


class Acceptance:
    """A proposer's acceptance estimates: Beta posteriors per depth, with forgetting; curves of its probabilities."""

    def __init__(self, options: ChooserOptions | None = None, prior: float | None = None) -> None:
        self.options = options or ChooserOptions()
        self.prior = self.options.prior_mean if prior is None else prior
        self.counts: dict[int, tuple[Decayed, Decayed]] = {}  # depth -> (accepted, rejected)
        self.fits: dict[str, np.ndarray] = {}  # curve -> [CEILINGS, GAMMAS] log-likelihoods, decayed
        # curve -> ([GAMMAS] posterior weight x mean a, {confidence: probability}), until the curve learns
        self.curves: dict[str, tuple[list[float], dict[float, float]]] = {}

    def level(self, depth: int, confidence: float | None = None, curve: str = "") -> float:
        """p_depth: calibrated from `confidence` where given, else pooled per depth (prior: the depth above's)."""
        if confidence is not None:
            return self.calibrated(curve, confidence)
        depth = min(depth, self.options.max_depth)
        prior = self.prior if depth == 1 else self.level(depth - 1)
        accepted, rejected = (count.total for count in self.counts[depth]) if depth in self.counts else (0.0, 0.0)
        strength = self.options.prior_strength
        return (accepted + strength * prior) / (accepted + rejected + strength)

    def calibrated(self, curve: str, confidence: float) -> float:
        """E[a * confidence ** gamma] under `curve`'s posterior; by the prior alone 0.83 at 1, so drafters get tried."""
        if curve not in self.curves:
            fit = np.asarray(PRIOR)[:, None] + self.fits.get(curve, 0.0)  # [CEILINGS, GAMMAS]
            posterior = np.exp(fit - fit.max())
            self.curves[curve] = ((GRID[1] * posterior).sum(axis=0) / posterior.sum()).tolist(), {}
        weights, known = self.curves[curve]
        if confidence not in known:
            known[confidence] = sum(w * confidence**gamma for w, gamma in zip(weights, GAMMAS))
        return known[confidence]

    def chain(
        self, k: int, confidences: Sequence[float] | None = None, curves: Sequence[str] | None = None
    ) -> tuple[float, ...]:
        """[k] `level` of depths 1..k."""
        return tuple(
            self.level(d + 1, None if confidences is None else confidences[d], "" if curves is None else curves[d])
            for d in range(k)
        )

    def learn(
        self,
        drafted: int,
        accepted: int,
        confidences: Sequence[float] | None = None,
        curves: Sequence[str] | None = None,
    ) -> None:
        """Levels 1..`accepted` of `drafted` were accepted, the next one rejected; later ones tell nothing."""
        decay = self.options.decay
        for depth in range(1, min(accepted + 1, drafted) + 1):
            took = depth <= accepted
            level = min(depth, self.options.max_depth)
            if level not in self.counts:
                self.counts[level] = Decayed(decay=decay), Decayed(decay=decay)
            self.counts[level][0].add(took)
            self.counts[level][1].add(not took)
            if confidences is not None:  # weigh every (a, gamma) of the token's curve by its likelihood
                curve, (gammas, ceilings) = "" if curves is None else curves[depth - 1], GRID
                p = ceilings * min(max(confidences[depth - 1], 1e-6), 1 - 1e-6) ** gammas  # [CEILINGS, GAMMAS]
                self.fits[curve] = decay * self.fits.get(curve, 0.0) + (np.log(p) if took else np.log1p(-p))
                self.curves.pop(curve, None)


class Chooser:
    """Picks each step's plan against a `CostModel`, probes drafters it turned down, corrects plans by their steps."""

    def __init__(self, cost: CostModel, options: ChooserOptions | None = None) -> None:
        self.cost, self.options = cost, options or ChooserOptions()
        self.declined: dict[str, int] = {}  # proposer -> steps in a row it was offered and not taken
        self.taken: set[str] = set()
        self.spent = 0.0  # the run's seconds so far
        # proposer -> [predicted tokens, tokens, predicted seconds, seconds] of its steps
        self.realized: dict[str, list[Decayed]] = {}

    def evaluate(self, offer: Offer | None, k: int, context: int) -> Plan:
        """E(k) and S(k) of `offer` after `context` cached tokens."""
        if offer is None or k == 0:
            return Plan(None, 0, 1.0, self.cost.target_seconds(1, context))
        nodes = offer.nodes[k - 1] if offer.nodes else k
        drafting = self.cost.stall * offer.drafting[k - 1] if offer.drafting else 0.0
        return Plan(
            offer.proposer,
            k,
            expected_tokens(offer.accept[:k]),
            drafting + self.cost.target_seconds(1 + nodes, context),
        )

    def best(self, offer: Offer, context: int) -> Plan:
        """The prefix of `offer` (at least one level) of highest rate; the shortest on ties."""
        return max((self.evaluate(offer, k, context) for k in range(1, len(offer.accept) + 1)), key=self.rate)

    def rate(self, plan: Plan) -> float:
        """`plan`'s rate times its proposer's `correction`."""
        return plan.rate * self.correction(plan.proposer)

    def choose(self, offers: Sequence[Offer], context: int, remaining: int | None = None) -> Plan:
        """The plan of highest corrected rate, or a probe of a drafter due one (docs/design/auto.md)."""
        offered = [o for o in offers if o.accept]
        plan = max([self.evaluate(None, 0, context), *(self.best(o, context) for o in offered)], key=self.rate)

        def pays(o: Offer) -> bool:
            return self.could_pay(o, context, plan.rate, remaining)

        due = [
            o
            for o in offered
            if o.proposer != plan.proposer
            and o.drafting
            and (
                self.options.catch_up_share * self.spent >= o.catch_up and (self.cost.stall == 1 or pays(o))
                if o.proposer not in self.taken
                else self.declined.get(o.proposer, 0) >= self.options.probe_after and pays(o)
            )
        ]
        if due:
            probe = max(due, key=lambda o: (o.proposer not in self.taken, self.declined.get(o.proposer, 0)))
            plan = replace(self.evaluate(probe, min(self.options.probe_tokens, len(probe.accept)), context), probe=True)
        for o in offered:
            self.declined[o.proposer] = 0 if o.proposer == plan.proposer else self.declined.get(o.proposer, 0) + 1
        if plan.proposer is not None:
            self.taken.add(plan.proposer)
        return plan

    def could_pay(self, offer: Offer, context: int, rate: float, remaining: int | None = None) -> bool:
        """Whether a prefix of `offer`, all accepted, would beat `rate` over `remaining` tokens, catch-up paid once."""
        perfect, once = replace(offer, accept=(1.0,) * len(offer.accept)), self.cost.stall * offer.catch_up
        return any(
            once / (remaining or math.inf) + (self.evaluate(perfect, k, context).seconds - once) / (k + 1) < 1 / rate
            for k in range(1, len(offer.accept) + 1)
        )

    def spend(self, seconds: float) -> None:
        """Count a step's seconds toward the run's (a catch-up is weighed against them)."""
        self.spent += seconds

    def learn_rate(self, plan: Plan, tokens: int, seconds: float) -> None:
        """A step on `plan` gave `tokens` new tokens in `seconds`."""
        o = self.options
        if plan.proposer not in self.realized:
            prior = (plan.expected_tokens,) * 2 + (plan.seconds,) * 2
            self.realized[plan.proposer] = [Decayed(o.prior_strength * v, decay=o.decay) for v in prior]
        for sums, value in zip(self.realized[plan.proposer], (plan.expected_tokens, tokens, plan.seconds, seconds)):
            sums.add(value)

    def correction(self, proposer: str | None) -> float:
        """Realized / predicted tokens times predicted / realized seconds of `proposer`'s steps (1 before any)."""
        sums = self.realized.get(proposer)
        return 1.0 if sums is None else sums[1].total / sums[0].total * sums[2].total / sums[3].total

    def should_continue(
        self, accept: Sequence[float], p_next: float, context: int, per_token: float, fixed: float = 0.0
    ) -> bool:
        """Whether one more level (`p_next`, `per_token` seconds, `fixed` once) after `accept` [k >= 1] raises the
        rate (E concave in k, S convex: stop at the first that does not)."""
        k = len(accept)
        offer = Offer("", (*accept, p_next), tuple(fixed + per_token * i for i in range(1, k + 2)))
        return self.evaluate(offer, k + 1, context).rate > self.evaluate(offer, k, context).rate
