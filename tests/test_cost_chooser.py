"""The chooser: plans, marginal rule, per-proposer estimates (`Acceptance`), probing (the draft's catch-up and the
break-even guard), on synthetic cost models with hand-computed answers."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from decoders.drafting.chooser import (Acceptance, Chooser, ChooserOptions, Offer, Plan, at_least, expected_tokens,
                                       given_above, union)
from decoders.drafting.cost import CallCost, CostModel
from decoders.proposers.suffix import match_curve


def linear(a: float, b: float, c: float = 0.0) -> CallCost:
    """t(n, L) = a + b (n - 1) + c L seconds."""
    return CallCost((1, 2), (a, a + b), c)


def cpu_like() -> CostModel:
    """A target whose 16-token call costs 1.3x a one-token call, and a draft call of 0.25 target calls."""
    return CostModel(linear(1.0, 0.02), linear(0.25, 0.01))


def chain(name: str, accept: tuple[float, ...], per_token: float, fixed: float = 0.0, catch_up: float = 0.0) -> Offer:
    """A draft model's chain: `fixed` seconds once (its catching up), then `per_token` seconds a level."""
    return Offer(name, accept, tuple(fixed + per_token * k for k in range(1, len(accept) + 1)), catch_up=catch_up)


def taken(chooser: Chooser, *names: str) -> Chooser:
    """`chooser` as after steps that took each of `names`: none is due a first probe (ski rental)."""
    chooser.taken.update(names)
    return chooser


# --- plans on synthetic costs -------------------------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert given_above([0.8, 0.4, 0.0]) == pytest.approx((0.8, 0.5, 0.0))
    assert given_above([0.0, 0.0]) == (0.0, 0.0)  # (nothing past a level never reached)


def test_draft_nothing_when_drafts_are_expensive_and_rarely_accepted():
    chooser = taken(Chooser(CostModel(linear(1.0, 0.1), linear(0.8, 0.0))), "draft")
    draft = chain("draft", (0.3, 0.3, 0.3), per_token=0.8)
    # k=1: 1.3 tokens / (0.8 + 1.1) s = 0.68 tokens/s < 1 token / 1 s of a plain step; longer is worse
    plan = chooser.choose([draft], context=0)
    assert (plan.proposer, plan.k, plan.rate, plan.probe) == (None, 0, 1.0, False)
    assert chooser.best(draft, context=0).k == 1  # (its best prefix)


def test_best_draft_length_hand_computed():
    chooser = Chooser(cpu_like())
    draft = chain("draft", (0.9, 0.8, 0.7, 0.6, 0.5), per_token=0.25)
    # E: 1.9, 2.62, 3.124, 3.4264, 3.5776; S: 1.27, 1.54, 1.81, 2.08, 2.35
    # rate: 1.496, 1.701, 1.726, 1.647, 1.522 -> k = 3
    plan = chooser.choose([draft], context=0)
    assert (plan.proposer, plan.k, plan.probe) == ("draft", 3, False)
    assert plan.expected_tokens == pytest.approx(3.124)
    assert plan.seconds == pytest.approx(1.81)
    # a free guess (1.96 tokens / 1.04 s = 1.885) beats it
    guess = Offer("suffix", (0.6, 0.6))
    plan = chooser.choose([draft, guess], context=0)
    assert (plan.proposer, plan.k) == ("suffix", 2)


def test_free_guesses_taken_whenever_acceptance_is_positive_on_flat_costs():
    chooser = Chooser(CostModel(linear(1.0, 0.0)))  # GPU-like: scoring more tokens costs nothing more
    for p in (0.01, 0.2, 0.9):
        plan = chooser.choose([Offer("suffix", (p,) * 4)], context=100)
        assert (plan.proposer, plan.k) == ("suffix", 4)
    # on a CPU each scored position costs 2% here: a guessed token must be accepted more often than that to pay
    chooser = Chooser(cpu_like())
    assert chooser.choose([Offer("suffix", (0.01,))], context=0).proposer is None
    assert chooser.choose([Offer("suffix", (0.05,))], context=0).proposer == "suffix"
    assert chooser.choose([Offer("suffix", ())], context=0).proposer is None  # (an empty offer: nothing to draft)


def test_tree_levels_cost_their_nodes():
    chooser = Chooser(cpu_like())
    tree = Offer("suffix", (0.9, 0.9), nodes=(3, 7))  # 3 nodes on level 1, 4 more on level 2
    assert chooser.evaluate(tree, 2, context=0).seconds == pytest.approx(1.0 + 0.02 * 7)
    assert chooser.evaluate(tree, 1, context=0).seconds == pytest.approx(1.0 + 0.02 * 3)
    assert chooser.evaluate(tree, 0, context=0) == Plan(None, 0, 1.0, 1.0)  # a plain step
    with_context = Chooser(CostModel(linear(1.0, 0.02, 1e-3)))
    assert with_context.evaluate(tree, 2, context=500).seconds == pytest.approx(1.5 + 0.02 * 7)


def test_drafting_seconds_are_as_offered_per_level():
    chooser = Chooser(cpu_like())
    # a draft-model tree whose first call also grows two copied levels: levels 1-3 cost one call, level 4 another
    tree = Offer("tree", (0.9, 0.9, 0.9, 0.5), drafting=(0.25, 0.25, 0.25, 0.5), nodes=(1, 2, 3, 5))
    assert chooser.evaluate(tree, 3, context=0).seconds == pytest.approx(0.25 + 1.0 + 0.02 * 3)
    assert chooser.evaluate(tree, 4, context=0).seconds == pytest.approx(0.5 + 1.0 + 0.02 * 5)
    # E(3) = 1 + 0.9 + 0.81 + 0.729 = 3.439 over 1.31 s beats E(4) = 3.8035 over 1.6 s
    assert chooser.best(tree, context=0).k == 3


def test_best_takes_the_shortest_prefix_on_ties():
    chooser = Chooser(CostModel(linear(1.0, 0.0)))
    assert chooser.best(Offer("suffix", (1.0, 0.0, 0.0)), context=0).k == 1  # (levels 2-3 add nothing)
    assert chooser.choose([Offer("suffix", (0.0, 0.0))], context=0).proposer is None  # a plain step wins ties


@pytest.mark.parametrize("target", [linear(1.0, 0.02, 1e-4), linear(0.1, 0.05), CallCost((1, 8, 16), (1.0, 1.05, 1.5))])
@pytest.mark.parametrize("fixed", [0.0, 0.3])
def test_marginal_rule_agrees_with_brute_force(target, fixed):
    """Stopping at the first level that lowers the rate finds the best length: from no level where drafting costs
    nothing once, from the first one (which a chain drafts anyway) where it does."""
    rng = random.Random(0)
    first = 1 if fixed else 0
    for _ in range(200):
        chooser = Chooser(CostModel(target))
        accept = [rng.random() ** rng.choice([0.1, 0.5, 1.0]) for _ in range(12)]
        context, per_token = rng.randrange(0, 500), rng.uniform(0.0, 0.6) * target.predict(1, 0)
        k = first
        while k < len(accept) and chooser.should_continue(accept[:k], accept[k], context, per_token, fixed):
            k += 1
        offer = chain("draft", tuple(accept), per_token, fixed)
        rates = [chooser.evaluate(offer, i, context).rate for i in range(first, len(accept) + 1)]
        assert k == first + rates.index(max(rates)), (accept, rates)


def test_should_continue_follows_the_next_tokens_chance():
    chooser = Chooser(cpu_like())
    # 2 levels: 2.71 tokens / 1.54 s = 1.76; a third accepted 0.9 of the time: 3.439 / 1.81 = 1.90, 0.05: 1.52
    assert chooser.should_continue([0.9, 0.9], 0.9, context=0, per_token=0.25)
    assert not chooser.should_continue([0.9, 0.9], 0.05, context=0, per_token=0.25)
    assert not chooser.should_continue([], 0.1, context=0, per_token=0.25)  # not even one draft call pays
    # a chain's catching up is paid once, before its first level: it does not weigh on the next one
    assert chooser.should_continue([0.9, 0.9], 0.9, context=0, per_token=0.25, fixed=5.0)


# --- the estimates: Acceptance ------------------------------------------------------------------------------------


def test_estimates_converge_to_observed_frequencies():
    estimates = Acceptance()
    assert estimates.level(1) == 0.5  # the prior
    assert Acceptance(prior=0.98).level(1) == 0.98  # (a proposer's own prior: the target's int8 copy)
    for _ in range(300):
        for accepted in (2, 2, 1, 0):  # depth 1: 3 of 4 accepted; depth 2, after depth 1: 2 of 3
            estimates.learn(drafted=2, accepted=accepted)
    assert estimates.level(1) == pytest.approx(3 / 4, abs=0.02)
    assert estimates.level(2) == pytest.approx(2 / 3, abs=0.02)
    # never observed: starts from the level above (a short probe's evidence reaches the deeper levels)
    assert estimates.level(3) == pytest.approx(estimates.level(2))
    assert Acceptance().level(3) == 0.5  # nothing observed at all: the prior
    assert estimates.chain(2) == (estimates.level(1), estimates.level(2))
    deep = Acceptance(ChooserOptions(max_depth=2))
    for _ in range(50):
        deep.learn(drafted=4, accepted=4)
    assert deep.level(7) == deep.level(2) > 0.9  # depths past max_depth share one estimate


def test_a_drafters_probabilities_are_calibrated_by_what_was_accepted():
    """P(accepted | probability c) = a * c ** gamma, (a, gamma) learned from every verified token: a draft as sure as
    it is right (accepted with probability c) is judged near c, one right far more often than it believes near 1, and
    one that says 1 and is right half the time near 1/2 (the suffix index's once-seen continuations)."""
    fresh = Acceptance()
    assert 0.4 < fresh.level(1, 0.5) < fresh.level(1, 1.0) < 0.9  # no evidence: hopeful
    assert fresh.level(1, 0.9) > fresh.level(1, 0.5) > fresh.level(1, 0.1)
    honest, sure, overconfident = Acceptance(), Acceptance(), Acceptance()
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        c = float(torch.rand((), generator=generator)) * 0.9 + 0.05
        honest.learn(drafted=1, accepted=int(torch.rand((), generator=generator) < c), confidences=[c])
        sure.learn(drafted=2, accepted=2, confidences=[c, c])
        overconfident.learn(drafted=1, accepted=int(torch.rand((), generator=generator) < 0.5), confidences=[1.0])
    for c in (0.2, 0.5, 0.8):
        assert honest.level(1, c) == pytest.approx(c, abs=0.1)
        assert honest.level(4, c) == honest.level(1, c) == honest.calibrated("", c)  # one curve for every depth
        assert sure.level(2, c) > 0.95
    assert overconfident.level(1, 1.0) == pytest.approx(0.5, abs=0.1)
    assert honest.level(1) == pytest.approx(0.5, abs=0.1)  # the pooled estimate learns as well
    assert sure.chain(1, [0.3]) == (sure.level(1, 0.3),)


def test_a_proposer_can_keep_one_calibration_curve_per_kind_of_draft():
    """The suffix index's probability-1 tokens after a 1-token match are often wrong, after a long match rarely: the
    suffix proposer teaches them to separate curves (`match_curve`), while its pooled estimates stay one."""
    estimates = Acceptance()
    for _ in range(50):
        estimates.learn(drafted=2, accepted=0, confidences=[1.0, 1.0], curves=[match_curve(1)] * 2)
        estimates.learn(drafted=2, accepted=2, confidences=[1.0, 1.0], curves=[match_curve(12)] * 2)
    short = estimates.chain(2, [1.0, 1.0], [match_curve(1)] * 2)
    long = estimates.chain(2, [1.0, 1.0], [match_curve(12)] * 2)
    assert max(short) < 0.15 and min(long) > 0.95  # (the lowest ceiling is 0.1)
    assert estimates.level(1) == pytest.approx(0.5, abs=0.05)  # pooled: half of the steps took both
    assert 0.5 < estimates.calibrated("", 1.0) < 0.9  # the unnamed curve learned nothing: its prior
    assert [match_curve(m) for m in (0, 1, 2, 3, 4, 7, 8, 100)] == ["suffix:1", "suffix:1", "suffix:2", "suffix:2",
                                                                   "suffix:4", "suffix:4", "suffix:8", "suffix:8"]


def test_each_level_of_a_draft_can_be_judged_on_its_own_curve():
    """A suffix-index draft after a 1-token match: once its first token is right, its second continues a 2-token
    match, and is judged and taught on that curve (`Acceptance.chain` and `learn` take a curve name per level)."""
    estimates = Acceptance()
    for _ in range(10):  # guesses after a 1-token match mostly wrong, after a 2-token one mostly right
        estimates.learn(drafted=1, accepted=0, confidences=[1.0], curves=["suffix:1"])
        estimates.learn(drafted=1, accepted=1, confidences=[1.0], curves=["suffix:2"])
    curves = [match_curve(1), match_curve(2)]
    accept = estimates.chain(2, [1.0, 1.0], curves)
    assert accept == pytest.approx((estimates.calibrated("suffix:1", 1.0), estimates.calibrated("suffix:2", 1.0)))
    assert accept == (estimates.level(1, 1.0, "suffix:1"), estimates.level(2, 1.0, "suffix:2"))
    assert accept[0] < 0.5 < accept[1]
    assert estimates.chain(2, [1.0, 1.0], ["suffix:1"] * 2) == (accept[0], accept[0])  # one curve for both
    for _ in range(50):  # now the other way round: the first level right, the second wrong
        estimates.learn(drafted=2, accepted=1, confidences=[1.0, 1.0], curves=curves)
    assert estimates.calibrated("suffix:1", 1.0) > 0.8 and estimates.calibrated("suffix:2", 1.0) < 0.3  # each its own
    before = estimates.calibrated("suffix:4", 1.0)
    estimates.learn(drafted=3, accepted=1, confidences=[1.0, 1.0, 1.0], curves=["suffix:1", "suffix:2", "suffix:4"])
    assert estimates.calibrated("suffix:4", 1.0) == before  # (a level after the rejected one tells nothing)


def test_a_tree_of_several_paths_is_as_likely_as_its_likeliest_path_to_each_depth():
    """A tree holding a draft model's chain (0.8, 0.5) and a suffix branch (0.3, 0.95) reaches depth 1 with
    probability at least 0.8 and depth 2 at least max(0.8 * 0.5, 0.3 * 0.95) = 0.4: its second level's acceptance
    given the first is 0.5, not the suffix branch's 0.95 (that branch's first level is seldom the one accepted)."""
    assert at_least([(0.5, 0.5), (0.8, 0.5), (0.3, 0.95)], 2) == pytest.approx((0.8, 0.5))
    assert at_least([(0.9, 0.9, 0.9), (1.0,), ()], 3) == pytest.approx((1.0, 0.81, 0.9))  # shorter paths end early
    assert at_least([(0.5, 0.0, 1.0)], 3) == (0.5, 0.0, 0.0)  # nothing past a level never accepted


def test_estimates_follow_a_change():
    estimates = Acceptance()
    for accepted in [1] * 200 + [0] * 200:
        estimates.learn(drafted=1, accepted=accepted)
    assert estimates.level(1) < 0.2  # forgetting lets the recent misses dominate


# --- corrections --------------------------------------------------------------------------------------------------


def test_plans_are_weighed_by_what_their_proposers_steps_gave_against_them():
    chooser = taken(Chooser(cpu_like()), "tree", "draft")
    tree = chain("tree", (0.6, 0.6), per_token=0.25)  # k=2: 1.96 tokens / 1.54 s = 1.273 tokens/s
    draft = chain("draft", (0.6,), per_token=0.25)  # k=1: 1.6 tokens / 1.27 s = 1.260
    first = chooser.choose([tree, draft], context=0)
    assert (first.proposer, first.k) == ("tree", 2) and chooser.correction("tree") == 1.0
    chooser.learn_rate(first, tokens=1, seconds=1.54)  # fewer tokens than planned, in the planned time
    # tokens (2 prior steps as planned, decayed, + 1) / (the same + 1.96), seconds as planned: the tree's rate x 0.836
    # = 1.064 < 1.260
    prior = chooser.options.decay * 2 * 1.96
    assert chooser.correction("tree") == pytest.approx((prior + 1) / (prior + 1.96))
    assert chooser.rate(first) == pytest.approx(first.rate * chooser.correction("tree"))
    assert chooser.choose([tree, draft], context=0).proposer == "draft"
    assert chooser.correction("draft") == chooser.correction(None) == 1.0  # (each proposer its own)
    for _ in range(3):  # then three steps of 2 tokens in half the planned time
        chooser.learn_rate(first, tokens=2, seconds=0.77)
    assert chooser.correction("tree") > 1.0
    assert chooser.choose([tree, draft], context=0).proposer == "tree"


# --- probing: the catch-up, then the break-even guard -------------------------------------------------------------


def test_a_draft_never_taken_is_probed_once_its_catch_up_is_a_fifth_of_the_runs_seconds():
    """A draft model that has not seen the run's tokens must first catch up on them (its prefill), paid once. It is
    probed the first step its catch-up is at most `catch_up_share` (0.2) of the run's spent seconds (`Chooser.spend`):
    a run that ends sooner never pays it, one that goes on pays it when it is at most a fifth of its time so far.

    Hand-computed: plain steps of 1 s; a draft that catches up on n tokens in 0.01 n s, a prompt of 50 tokens and one
    more per plain step: at step s (from 0) the catch-up is 0.01 (50 + s - 1) s and the run has spent s s, first
    little enough at s = 3. Taken once, it is probed again after each `probe_after` steps declined, as it could pay."""
    cost = CostModel(linear(1.0, 0.02), linear(0.1, 0.01))
    call = cost.draft_seconds(1, 0)

    def draft_offer(unseen: int) -> Offer:
        catch_up = cost.draft_seconds(1, 0, unseen) - call
        return chain("draft", (0.05,) * 4, per_token=call, fixed=catch_up, catch_up=catch_up)

    def run(steps: int, chooser: Chooser, prompt: int = 50) -> list[int]:
        probes, unseen = [], prompt
        for step in range(steps):
            plan = chooser.choose([draft_offer(unseen), Offer("suffix", (0.01,))], context=prompt + step,
                                  remaining=steps - step)
            unseen = 1 if plan.proposer == "draft" else unseen + 1  # (once probed the draft has caught up)
            if plan.probe:
                assert (plan.proposer, plan.k) == ("draft", chooser.options.probe_tokens)
                probes.append(step)
            chooser.spend(plan.seconds)
        return probes

    assert draft_offer(50).catch_up == pytest.approx(0.49) and draft_offer(1).catch_up == 0.0
    assert run(3, Chooser(cost)) == []  # a short answer never pays for the draft's prefill
    probe_after = ChooserOptions().probe_after
    assert run(40, Chooser(cost)) == [3, 3 + 1 + probe_after, 3 + 2 * (1 + probe_after)]  # (the free guess, never
    # worth it, never probed)
    assert run(40, Chooser(cost, ChooserOptions(catch_up_share=1.0))) == [1, 18, 35]  # (ski rental: 0.49 + 0.01 s <= s)
    assert run(8, Chooser(cost), prompt=1) == [0]  # nothing to catch up on: probed at once
    never_spent = Chooser(cost)  # a run that spends nothing (a call feeding the prompt spends nothing) probes nothing
    assert not any(never_spent.choose([draft_offer(50)], context=50).probe for _ in range(40))
    free = Chooser(cost)  # an offer that costs no drafting seconds is never probed: its estimates learn anyway
    for _ in range(40):
        assert free.choose([Offer("suffix", (0.01,) * 4)], context=0).proposer is None
        free.spend(1.0)


def test_each_drafter_never_taken_is_probed_once_the_run_has_spent_its_own_catch_up():
    chooser = Chooser(cpu_like(), ChooserOptions(catch_up_share=1.0))
    dear = chain("tree", (0.05,) * 3, per_token=0.25, fixed=3.0, catch_up=3.0)
    cheap = chain("draft", (0.05,) * 3, per_token=0.25, fixed=1.0, catch_up=1.0)
    plans = []
    for _ in range(5):
        plans.append(chooser.choose([dear, cheap] if plans else [cheap], context=0))
        chooser.spend(1.0)
    # spent 0 (neither due), 1 (the draft due: probed), 2, 3 (the tree due: probed, the draft declined since)
    assert [(p.proposer, p.probe) for p in plans] == [(None, False), ("draft", True), (None, False),
                                                      ("tree", True), (None, False)]
    # both due at once: the one declined longest first, then the other
    chooser = Chooser(cpu_like(), ChooserOptions(catch_up_share=1.0))
    plans = [chooser.choose([cheap], context=0), chooser.choose([dear, cheap], context=0)]
    chooser.spend(3.0)
    plans += [chooser.choose([dear, cheap], context=0) for _ in range(3)]
    assert [(p.proposer, p.probe) for p in plans] == [(None, False)] * 2 + [("draft", True), ("tree", True),
                                                                           (None, False)]


def test_break_even_guard_probes_after_the_set_number_of_declined_steps():
    chooser = Chooser(CostModel(linear(1.0, 0.1), linear(0.8, 0.0)), ChooserOptions(probe_after=3, probe_tokens=2))
    draft = chain("draft", (0.3,) * 5, per_token=0.8)  # (nothing to catch up on: probed at once)
    plans = [chooser.choose([draft], context=0) for _ in range(9)]
    assert [(p.proposer, p.k, p.probe) for p in plans] == ([("draft", 2, True)] + [(None, 0, False)] * 3) * 2 + \
        [("draft", 2, True)]
    assert plans[0].seconds == pytest.approx(1.6 + 1.2)  # (its 2 levels' drafting and scoring)
    assert chooser.choose([], context=0).proposer is None  # nothing offered: nothing to probe or count
    assert chooser.declined["draft"] == 0


def test_break_even_guard_probes_only_what_could_pay():
    # each token a call scores costs 0.9 of a one-token call (a CPU computing bfloat16 in float): a free guess could
    # pay if every level of it were accepted (3 tokens in 2.8 s beat 1 in 1 s), a draft model's 0.15 s calls cannot
    # (2 tokens in 2.05 s, 3 in 3.1 s, 4 in 4.15 s)
    chooser = Chooser(CostModel(linear(1.0, 0.9), linear(0.15, 0.0)), ChooserOptions(probe_after=2))
    guess = Offer("suffix", (0.3, 0.3))
    draft = chain("draft", (0.3, 0.3, 0.3), per_token=0.15, fixed=0.5, catch_up=0.5)
    assert not chooser.could_pay(draft, context=0, rate=1.0)
    assert chooser.could_pay(guess, context=0, rate=1.0)
    assert not chooser.could_pay(guess, context=0, rate=1.1)  # nor can it beat a plan of 1.1 tokens/s
    plans = [chooser.choose([guess, draft], context=0) for _ in range(4)]  # nothing spent: nothing caught up
    chooser.spend(2.5)  # five times the catch-up: the draft is probed once, then never (it cannot pay)
    plans += [chooser.choose([guess, draft], context=0) for _ in range(8)]
    assert [(p.proposer, p.probe) for p in plans] == [(None, False)] * 4 + [("draft", True)] + [(None, False)] * 7
    # catching up is paid once: a draft whose calls are cheap enough (3 tokens in 2.82 s) could pay for it in a
    # run long enough: 100 tokens in 5 + 33.3 x 2.82 = 99.0 s rather than 100 s, but not 50 tokens (52.0 s)
    cheap = chain("draft", (0.3, 0.3), per_token=0.01, fixed=5.0, catch_up=5.0)
    assert chooser.could_pay(cheap, context=0, rate=1.0)  # (a run without end)
    assert chooser.could_pay(cheap, context=0, rate=1.0, remaining=100)
    assert not chooser.could_pay(cheap, context=0, rate=1.0, remaining=50)
    assert not chooser.could_pay(replace(cheap, catch_up=0.0), context=0, rate=1.0)  # (5 s in every step)
    chooser = Chooser(chooser.cost, chooser.options)
    chooser.spend(25.0)
    assert chooser.choose([cheap], context=0, remaining=50).probe  # caught up once, whatever remains
    assert [chooser.choose([cheap], context=0, remaining=50).probe for _ in range(3)] == [False] * 3  # can't pay
    assert chooser.choose([cheap], context=0, remaining=100).probe  # declined 3 steps, and could pay in 100 tokens


def test_in_a_batch_a_drafter_is_first_probed_only_where_it_could_pay():
    """Alone, a drafter is probed once its catch-up is a fifth of the run's seconds, to measure it, whatever it is
    predicted to cost. In a batch its prefill and its calls stall every row (`CostModel.stall`): a draft call of 0.3 s
    against a 1 s plain step could pay alone (every guess right: 2 tokens in 1.3 s) but not where it holds up four
    rows (2.2 s)."""
    for stall, probed in ((1.0, True), (4.0, False)):
        chooser = Chooser(CostModel(linear(1.0, 0.0), linear(0.3, 0.0)))
        chooser.cost.stall = stall
        draft = chain("draft", (0.3, 0.3), per_token=0.3, fixed=0.5, catch_up=0.5)
        chooser.spend(2.5 * stall)
        assert chooser.choose([draft], context=0).probe == probed


def test_options_are_checked():
    with pytest.raises(ValueError, match="probe_after"):
        ChooserOptions(probe_after=0)
    with pytest.raises(ValueError, match="decay"):
        ChooserOptions(decay=1.5)
    for share in (0, 1.5, "0.2"):
        with pytest.raises(ValueError, match=r"catch_up_share must be in \(0, 1\]"):
            ChooserOptions(catch_up_share=share)
    with pytest.raises(ValueError, match="prior_strength"):
        ChooserOptions(prior_strength=0.0)
    assert math.isclose(Acceptance(ChooserOptions(prior_mean=0.2)).level(1), 0.2)
def test_a_merged_tree_is_likely_as_its_guesses_together_where_they_part_ways():
    """Guesses that agree on their first d tokens count once, as likely as the likeliest says; guesses of different
    tokens each may be right: the level is missed only when all are wrong."""
    # both guess token 1 first (0.5 and 0.8: 0.8), then 2 (0.25) or 3 (0.2): 1 - 0.75 * 0.8 = 0.4 = 0.8 * 0.5
    assert union([([1, 2], (0.5, 0.5)), ([1, 3], (0.8, 0.25))]) == pytest.approx((0.8, 0.5))
    assert union([([1], (0.5,)), ([2], (0.4,))]) == pytest.approx((0.7,))  # 1 - 0.5 * 0.6
    # a shorter guess helps its own levels only: depth 2 is the first path's 0.25, 0.25 / 0.8 of depth 1's
    assert union([([1, 2], (0.5, 0.5)), ([3], (0.6,))]) == pytest.approx((0.8, 0.3125))
    # never likelier at depth 2 than at depth 1: 1 - 0.5 * 0.5 = 0.75 would exceed 0.6 (over-confident parts)
    assert union([([1, 2], (0.6, 0.84)), ([1, 3], (0.6, 0.84))]) == pytest.approx((0.6, 1.0))
    assert union([([1, 2], (1.0, 0.0)), ([1], (0.5,))]) == pytest.approx((1.0, 0.0))

