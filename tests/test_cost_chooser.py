"""The cost model (fit, online correction, calibration cache) and the chooser (plans, marginal rule, learning, guard).

The chooser runs on synthetic cost models with hand-computed answers; calibration runs on tiny models and is checked
for shape (positive, monotone) and for its cache, never for wall-clock values.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

import decoders
from decoders.drafting import cost as cost_module
from decoders.drafting.chooser import Candidate, Chooser, ChooserOptions, at_least, expected_tokens, union
from decoders.drafting.cost import (DRAFT_SIZES, EVIDENCE, ROUNDS, TARGET_SIZES, TREE_PRIOR, WINDOW, CallCost, CostModel,
                                    calibrate, fit)
from decoders.strategies.auto import match_curve

from conftest import tiny_lm, tiny_model, tiny_tokenizer


def linear(a: float, b: float, c: float = 0.0) -> CallCost:
    """t(n, L) = a + b (n - 1) + c L seconds."""
    return CallCost((1, 2), (a, a + b), c)


def cpu_like() -> CostModel:
    """A target whose 16-token call costs 1.3x a one-token call, and a draft call of 0.25 target calls."""
    return CostModel(linear(1.0, 0.02), linear(0.25, 0.01))


# --- the chooser on synthetic costs -------------------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_draft_nothing_when_drafts_are_expensive_and_rarely_accepted():
    chooser = Chooser(CostModel(linear(1.0, 0.1), linear(0.8, 0.0)))
    draft = Candidate("draft", (0.3, 0.3, 0.3), per_token_seconds=0.8)
    # k=1: 1.3 tokens / (0.8 + 1.1) s = 0.68 tokens/s < 1 token / 1 s of a plain step; longer is worse
    plan = chooser.choose([draft], context=0)
    assert (plan.proposer, plan.k, plan.rate) == (None, 0, 1.0)


def test_best_draft_length_hand_computed():
    chooser = Chooser(cpu_like())
    draft = Candidate("draft", (0.9, 0.8, 0.7, 0.6, 0.5), per_token_seconds=0.25)
    # E: 1.9, 2.62, 3.124, 3.4264, 3.5776; S: 1.27, 1.54, 1.81, 2.08, 2.35
    # rate: 1.496, 1.701, 1.726, 1.647, 1.522 -> k = 3
    plan = chooser.choose([draft], context=0)
    assert (plan.proposer, plan.k) == ("draft", 3)
    assert plan.expected_tokens == pytest.approx(3.124)
    assert plan.seconds == pytest.approx(1.81)
    # a cheaper lookup draft (1.96 tokens / 1.04 s = 1.885) beats it
    lookup = Candidate("lookup", (0.6, 0.6))
    plan = chooser.choose([draft, lookup], context=0)
    assert (plan.proposer, plan.k) == ("lookup", 2)


def test_free_lookup_taken_whenever_acceptance_is_positive_on_flat_costs():
    chooser = Chooser(CostModel(linear(1.0, 0.0)))  # GPU-like: scoring more tokens costs nothing more
    for p in (0.01, 0.2, 0.9):
        plan = chooser.choose([Candidate("lookup", (p,) * 4)], context=100)
        assert (plan.proposer, plan.k) == ("lookup", 4)
    # on a CPU each scored position costs 2% here: a lookup token must be accepted more often than that to pay
    chooser = Chooser(cpu_like())
    assert chooser.choose([Candidate("lookup", (0.01,))], context=0).proposer is None
    assert chooser.choose([Candidate("lookup", (0.05,))], context=0).proposer == "lookup"


def test_a_call_that_feeds_the_prompt_takes_levels_whose_tokens_are_worth_the_seconds_they_add():
    chooser = Chooser(cpu_like())  # each scored position costs 2% of a one-token call; a plain step makes 1 token/s
    # the prompt's 300 tokens cost 6.98 s; one level more adds 0.02 s, worth 0.02 tokens at the later steps' rate:
    # a level accepted 1% of the time does not pay (its 1.01 tokens in 7.0 s have a higher rate than 1 in 6.98 s)
    assert chooser.choose([Candidate("lookup", (0.01,))], context=0, fed=300).proposer is None
    plan = chooser.choose([Candidate("lookup", (0.05,))], context=0, fed=300)  # one accepted 5% of the time does
    assert (plan.proposer, plan.seconds) == ("lookup", pytest.approx(1.0 + 0.02 * 300))
    assert chooser.evaluate(None, 0, context=0, fed=300).seconds == pytest.approx(1.0 + 0.02 * 299)
    # where the prompt's call costs no more for a few tokens more (a GPU), even the unlikely level rides along
    flat = Chooser(CostModel(CallCost((1, 2, 300, 310), (1.0, 1.02, 6.98, 6.98))))
    lookup = Candidate("lookup", (0.01,))
    assert flat.choose([lookup], context=0).proposer is None  # in a later step it adds 0.02 s for 0.01 tokens
    assert flat.choose([lookup], context=0, fed=300).proposer == "lookup"


def test_tree_levels_cost_their_nodes():
    chooser = Chooser(cpu_like())
    tree = Candidate("suffix", (0.9, 0.9), nodes=(3, 7))  # 3 nodes on level 1, 4 more on level 2
    assert chooser.evaluate(tree, 2, context=0).seconds == pytest.approx(1.0 + 0.02 * 7)
    assert chooser.evaluate(tree, 1, context=0).seconds == pytest.approx(1.0 + 0.02 * 3)


def test_listed_drafting_costs_replace_the_per_token_rule():
    chooser = Chooser(cpu_like())
    # a draft-model tree whose first call also grows two copied levels: levels 1-3 cost one call, level 4 another
    tree = Candidate("tree", (0.9, 0.9, 0.9, 0.5), per_token_seconds=9.0, nodes=(1, 2, 3, 5),
                     drafting=(0.25, 0.25, 0.25, 0.5))
    assert chooser.evaluate(tree, 3, context=0).seconds == pytest.approx(0.25 + 1.0 + 0.02 * 3)
    assert chooser.evaluate(tree, 4, context=0).seconds == pytest.approx(0.5 + 1.0 + 0.02 * 5)
    # E(3) = 1 + 0.9 + 0.81 + 0.729 = 3.439 over 1.31 s beats E(4) = 3.8035 over 1.6 s
    assert chooser.best(tree, context=0).k == 3


@pytest.mark.parametrize("target", [linear(1.0, 0.02, 1e-4), linear(0.1, 0.05), CallCost((1, 8, 16), (1.0, 1.05, 1.5))])
def test_marginal_rule_agrees_with_brute_force(target):
    rng = random.Random(0)
    for _ in range(200):
        chooser = Chooser(CostModel(target, linear(rng.uniform(0.0, 0.6) * target.predict(1, 0), 0.0)))
        accept = [rng.random() ** rng.choice([0.1, 0.5, 1.0]) for _ in range(12)]
        context, per_token = rng.randrange(0, 500), chooser.cost.draft_seconds(1, 0)
        k = 0
        while k < len(accept) and chooser.should_continue(accept[:k], accept[k], context):
            k += 1
        candidate = Candidate("draft", tuple(accept), per_token_seconds=per_token)
        rates = [chooser.evaluate(candidate, i, context).rate for i in range(len(accept) + 1)]
        assert k == rates.index(max(rates)), (accept, rates)


def test_should_continue_follows_the_next_tokens_chance():
    chooser = Chooser(cpu_like())
    assert chooser.should_continue([0.9, 0.9], 0.9, context=0)
    assert not chooser.should_continue([0.9, 0.9], 0.05, context=0)
    assert not chooser.should_continue([], 0.1, context=0)  # not even one draft call pays


# --- learning and the break-even guard ----------------------------------------------------------------------------


def test_estimates_converge_to_observed_frequencies():
    chooser = Chooser(cpu_like())
    assert chooser.acceptance("lookup", 1) == 0.5  # the prior
    for _ in range(300):
        for accepted in (2, 2, 1, 0):  # depth 1: 3 of 4 accepted; depth 2, after depth 1: 2 of 3
            chooser.update("lookup", drafted=2, accepted=accepted)
    assert chooser.acceptance("lookup", 1) == pytest.approx(3 / 4, abs=0.02)
    assert chooser.acceptance("lookup", 2) == pytest.approx(2 / 3, abs=0.02)
    # never observed: starts from the level above (a short probe's evidence reaches the deeper levels)
    assert chooser.acceptance("lookup", 3) == pytest.approx(chooser.acceptance("lookup", 2))
    assert Chooser(cpu_like()).acceptance("lookup", 3) == 0.5  # nothing observed at all: the prior
    assert chooser.chain("lookup", 2) == (chooser.acceptance("lookup", 1), chooser.acceptance("lookup", 2))


def test_a_drafters_probabilities_are_calibrated_by_what_was_accepted():
    """P(accepted | probability c) = a * c ** gamma, (a, gamma) learned from every verified token: a draft as sure as
    it is right (accepted with probability c) is judged near c, one right far more often than it believes near 1, and
    one that says 1 and is right half the time near 1/2 (the suffix index's once-seen continuations)."""
    fresh = Chooser(cpu_like())
    assert 0.4 < fresh.acceptance("draft", 1, 0.5) < fresh.acceptance("draft", 1, 1.0) < 0.9  # no evidence: hopeful
    assert fresh.acceptance("draft", 1, 0.9) > fresh.acceptance("draft", 1, 0.5) > fresh.acceptance("draft", 1, 0.1)
    honest, sure, overconfident = Chooser(cpu_like()), Chooser(cpu_like()), Chooser(cpu_like())
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        c = float(torch.rand((), generator=generator)) * 0.9 + 0.05
        honest.update("draft", drafted=1, accepted=int(torch.rand((), generator=generator) < c), confidences=[c])
        sure.update("draft", drafted=2, accepted=2, confidences=[c, c])
        overconfident.update("suffix", drafted=1, accepted=int(torch.rand((), generator=generator) < 0.5),
                             confidences=[1.0])
    for c in (0.2, 0.5, 0.8):
        assert honest.acceptance("draft", 1, c) == pytest.approx(c, abs=0.1)
        assert honest.acceptance("draft", 4, c) == honest.acceptance("draft", 1, c)  # one curve for every depth
        assert sure.acceptance("draft", 2, c) > 0.95
    assert overconfident.acceptance("suffix", 1, 1.0) == pytest.approx(0.5, abs=0.1)
    assert honest.acceptance("draft", 1) == pytest.approx(0.5, abs=0.1)  # the pooled estimate learns as well
    assert sure.candidate("draft", 1, [0.3], per_token_seconds=0.25).accept == (sure.acceptance("draft", 1, 0.3),)


def test_a_proposer_can_keep_one_calibration_curve_per_kind_of_draft():
    """The suffix index's probability-1 tokens after a 1-token match are often wrong, after a long match rarely:
    `auto` teaches them to separate curves (`match_curve`), while the proposer's pooled estimates stay one."""
    chooser = Chooser(cpu_like())
    for _ in range(50):
        chooser.update("suffix", drafted=2, accepted=0, confidences=[1.0, 1.0], curve=match_curve(1))
        chooser.update("suffix", drafted=2, accepted=2, confidences=[1.0, 1.0], curve=match_curve(12))
    short = chooser.candidate("suffix", 2, [1.0, 1.0], curve=match_curve(1)).accept
    long = chooser.candidate("suffix", 2, [1.0, 1.0], curve=match_curve(12)).accept
    assert max(short) < 0.15 and min(long) > 0.95  # (the lowest ceiling is 0.1)
    assert chooser.acceptance("suffix", 1) == pytest.approx(0.5, abs=0.05)  # pooled: half of the steps took both
    assert [match_curve(m) for m in (1, 2, 3, 4, 7, 8, 100)] == ["suffix:1", "suffix:2", "suffix:2", "suffix:4",
                                                                "suffix:4", "suffix:8", "suffix:8"]


def test_each_level_of_a_draft_can_be_judged_on_its_own_curve():
    """A suffix-index draft after a 1-token match: once its first token is right, its second continues a 2-token
    match, and is judged and taught as one (`level_curve`)."""
    chooser = Chooser(cpu_like())
    for _ in range(10):  # guesses after a 1-token match mostly wrong, after a 2-token one mostly right
        chooser.update("suffix", drafted=1, accepted=0, confidences=[1.0], curve="suffix:1")
        chooser.update("suffix", drafted=1, accepted=1, confidences=[1.0], curve="suffix:2")
    curves = [match_curve(1), match_curve(2)]
    accept = chooser.candidate("suffix", 2, [1.0, 1.0], curve=curves).accept
    assert accept == pytest.approx((chooser.calibrated("suffix:1", 1.0), chooser.calibrated("suffix:2", 1.0)))
    assert accept[0] < 0.5 < accept[1]
    assert chooser.chain("suffix", 2, [1.0, 1.0], "suffix:1") == (accept[0], accept[0])  # one curve for both
    for _ in range(50):  # now the other way round
        chooser.update("suffix", drafted=2, accepted=1, confidences=[1.0, 1.0], curve=curves)
    assert chooser.calibrated("suffix:1", 1.0) > 0.8 and chooser.calibrated("suffix:2", 1.0) < 0.3  # each its own


def test_a_tree_of_several_paths_is_as_likely_as_its_likeliest_path_to_each_depth():
    """A tree holding a draft model's chain (0.8, 0.5) and a suffix branch (0.3, 0.95) reaches depth 1 with
    probability at least 0.8 and depth 2 at least max(0.8 * 0.5, 0.3 * 0.95) = 0.4: its second level's acceptance
    given the first is 0.5, not the suffix branch's 0.95 (that branch's first level is seldom the one accepted)."""
    assert at_least([(0.5, 0.5), (0.8, 0.5), (0.3, 0.95)], 2) == pytest.approx((0.8, 0.5))
    assert at_least([(0.9, 0.9, 0.9), (1.0,), ()], 3) == pytest.approx((1.0, 0.81, 0.9))  # shorter paths end early
    assert at_least([(0.5, 0.0, 1.0)], 3) == (0.5, 0.0, 0.0)  # nothing past a level never accepted


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


def test_estimates_follow_a_change():
    chooser = Chooser(cpu_like())
    for accepted in [1] * 200 + [0] * 200:
        chooser.update("lookup", drafted=1, accepted=accepted)
    assert chooser.acceptance("lookup", 1) < 0.2  # forgetting lets the recent misses dominate


def test_plans_are_weighed_by_what_their_proposers_steps_gave_against_them():
    chooser = Chooser(cpu_like())
    tree = Candidate("tree", (0.6, 0.6), per_token_seconds=0.25)  # k=2: 1.96 tokens / 1.54 s = 1.273 tokens/s
    chain = Candidate("draft", (0.6,), per_token_seconds=0.25)  # k=1: 1.6 tokens / 1.27 s = 1.260
    first = chooser.choose([tree, chain], context=0)
    assert (first.proposer, first.k) == ("tree", 2) and chooser.correction("tree") == 1.0
    chooser.learn_rate(first, tokens=1, seconds=1.54)  # fewer tokens than planned, in the planned time
    # tokens (2 prior steps as planned, decayed, + 1) / (the same + 1.96), seconds as planned: the tree's rate x 0.836
    # = 1.064 < 1.260
    prior = chooser.options.decay * 2 * 1.96
    assert chooser.correction("tree") == pytest.approx((prior + 1) / (prior + 1.96))
    assert chooser.choose([tree, chain], context=0).proposer == "draft"
    for _ in range(3):  # then three steps of 2 tokens in half the planned time
        chooser.learn_rate(first, tokens=2, seconds=0.77)
    assert chooser.correction("tree") > 1.0
    assert chooser.choose([tree, chain], context=0).proposer == "tree"


def test_break_even_guard_probes_after_the_set_number_of_plain_steps():
    chooser = Chooser(CostModel(linear(1.0, 0.1), linear(0.8, 0.0)), ChooserOptions(probe_after=3, probe_tokens=2))
    draft = Candidate("draft", (0.3,) * 5, per_token_seconds=0.8)
    plans = [chooser.choose([draft], context=0) for _ in range(8)]
    assert [(p.proposer, p.k, p.probe) for p in plans] == [(None, 0, False)] * 3 + [("draft", 2, True)] + \
        [(None, 0, False)] * 3 + [("draft", 2, True)]
    assert chooser.choose([], context=0).proposer is None  # nothing offered: nothing to probe or count
    chooser.watched.add("draft")  # (its estimates learn from every step: nothing for a probe to recover)
    assert all(chooser.choose([draft], context=0).proposer is None for _ in range(8))


def test_break_even_guard_probes_only_what_could_pay():
    # each token a call scores costs 0.9 of a one-token call (a CPU computing bfloat16 in float): a free guess could
    # pay if every level of it were accepted (3 tokens in 2.8 s beat 1 in 1 s), a draft model's 0.15 s calls cannot
    # (2 tokens in 2.05 s, 3 in 3.1 s, 4 in 4.15 s)
    chooser = Chooser(CostModel(linear(1.0, 0.9), linear(0.15, 0.0)), ChooserOptions(probe_after=2))
    lookup = Candidate("lookup", (0.3, 0.3))
    draft = Candidate("draft", (0.3, 0.3, 0.3), per_token_seconds=0.15, fixed_seconds=0.5, catch_up=0.5)
    assert not chooser.could_pay(draft, context=0, rate=1.0)
    assert chooser.could_pay(lookup, context=0, rate=1.0)
    assert not chooser.could_pay(lookup, context=0, rate=1.1)  # nor can it beat a plan of 1.1 tokens/s
    plans = [chooser.choose([lookup, draft], context=0) for _ in range(6)]
    assert [(p.proposer, p.probe) for p in plans] == [(None, False)] * 2 + [("lookup", True)] + \
        [(None, False)] * 2 + [("lookup", True)]
    # catching up is paid once: a draft whose calls are cheap enough (3 tokens in 2.82 s) could pay for it in a
    # run long enough: 100 tokens in 5 + 33.3 x 2.82 = 99.0 s rather than 100 s, but not 50 tokens (52.0 s)
    cheap = Candidate("draft", (0.3, 0.3), per_token_seconds=0.01, fixed_seconds=5.0, catch_up=5.0)
    assert chooser.could_pay(cheap, context=0, rate=1.0)  # (a run without end)
    assert chooser.could_pay(cheap, context=0, rate=1.0, remaining=100)
    assert not chooser.could_pay(cheap, context=0, rate=1.0, remaining=50)
    assert not chooser.could_pay(replace(cheap, catch_up=0.0), context=0, rate=1.0)  # (5 s in every step)
    assert not chooser.choose([cheap], context=0, remaining=50).probe
    chooser.declined["draft"] = 2
    assert chooser.choose([cheap], context=0, remaining=100).probe


def test_options_are_checked():
    with pytest.raises(ValueError, match="probe_after"):
        ChooserOptions(probe_after=0)
    with pytest.raises(ValueError, match="decay"):
        ChooserOptions(decay=1.5)


# --- the cost model -----------------------------------------------------------------------------------------------


def test_fit_recovers_linear_and_convex_costs():
    samples = [(n, L, 0.1 + 0.01 * (n - 1) + 1e-4 * L) for n in (1, 4, 16) for L in (16, 512)]
    fitted = fit(samples, (1, 4, 16))
    for n in (1, 2, 7, 16, 32):
        assert fitted.predict(n, 300) == pytest.approx(0.1 + 0.01 * (n - 1) + 0.03)
    convex = {1: 1.0, 4: 1.02, 16: 1.4}  # flat, then rising: a CPU
    fitted = fit([(n, 16, convex[n]) for n in (1, 4, 16)], (1, 4, 16))
    assert [fitted.predict(n, 16) for n in (1, 4, 16)] == pytest.approx([1.0, 1.02, 1.4])
    assert fitted.per_position == 0.0  # one context length measured: no context term


def test_the_context_costs_more_the_more_tokens_attend_to_it():
    # measured as `measure` does: every size after 16 positions, the smallest and largest after 512 too
    truth = lambda n, L: 0.04 + 0.002 * (n - 1) + (5e-6 + 2e-6 * (n - 1)) * L  # noqa: E731
    samples = [(n, 16, truth(n, 16)) for n in (1, 2, 4, 8, 32)] + [(n, 512, truth(n, 512)) for n in (1, 32)]
    fitted = fit(samples, (1, 2, 4, 8, 32))
    assert fitted.per_position == pytest.approx(5e-6) and fitted.per_position_per_token == pytest.approx(2e-6)
    for n, L in ((1, 0), (3, 200), (16, 300), (32, 1000)):
        assert fitted.predict(n, L) == pytest.approx(truth(n, L))
    # noise that makes a term negative drops it; the rest is fitted without it
    faster = [(n, L, t - (3e-5 * L if n == 1 else 0.0)) for n, L, t in samples]  # one token faster after 512
    fitted = fit(faster, (1, 2, 4, 8, 32))
    assert fitted.per_position == 0.0 and fitted.per_position_per_token > 0
    both = [(n, L, 0.1 + 0.01 * n - 1e-5 * L) for n in (1, 32) for L in (16, 512)]  # every call faster after 512
    fitted = fit(both, (1, 32))
    assert (fitted.per_position, fitted.per_position_per_token) == (0.0, 0.0)
    assert fitted.predict(1, 0) == pytest.approx(0.1 + 0.01 - 1e-5 * 264)  # the mean of its two contexts
    # one token dearer per position than 32 (which noise made cheaper after 512): the context costs every call the
    # one-token slope, not nothing (SmolLM2-135M in float32, AVX2)
    smollm2 = [(1, 16, 0.030), (2, 16, 0.046), (32, 16, 0.554), (1, 512, 0.073), (32, 512, 0.508)]
    fitted = fit(smollm2, (1, 2, 32))
    assert fitted.per_position == pytest.approx(0.043 / 496) and fitted.per_position_per_token == 0.0
    assert fitted.predict(1, 200) == pytest.approx(0.030 + 184 * 0.043 / 496, rel=0.05)
    # a context term only where the samples tell it: two context lengths for one size tell the first alone
    fitted = fit([(1, 16, 0.1), (1, 512, 0.11), (4, 16, 0.12)], (1, 4))
    assert fitted.per_position > 0 and fitted.per_position_per_token == 0.0


def test_observe_moves_the_prediction_toward_observations():
    model = CostModel(linear(1.0, 0.1, 1e-3), linear(0.2, 0.0))
    before = model.target_seconds(4, 100)
    model.observe("target", 4, 100, 2 * before)  # the run's first call took twice the calibration: believed at once
    assert model.target_seconds(4, 100) == pytest.approx(2 * before)
    for _ in range(WINDOW):
        model.observe("target", 4, 100, before)  # then the calls take what calibration said: the median follows them
    assert model.target_seconds(4, 100) == pytest.approx(before)
    draft = model.draft_seconds(3, 100)
    model.observe("draft", 1, 100, 0.4)  # a draft's first call is believed at once too, the first two averaged
    assert model.draft_seconds(3, 100) == pytest.approx(2 * draft)
    model.observe("draft", 1, 100, 0.1)
    assert model.draft_seconds(3, 100) == pytest.approx(draft)
    for _ in range(WINDOW):
        model.observe("draft", 1, 100, 0.4)
    settled = model.draft_seconds(3, 100)
    assert settled == pytest.approx(2 * draft)
    model.observe("draft", 1, 100, 10.0)  # a stalled call, then another a few calls later: nothing moves
    model.observe("draft", 1, 100, 0.4)
    model.observe("draft", 1, 100, 10.0)
    assert model.draft_seconds(3, 100) == pytest.approx(settled)
    model.observe("draft", DRAFT_SIZES[-1] + 1, 100, 100.0)  # longer than calibration measures (a catch-up on the
    assert model.draft_seconds(3, 100) == pytest.approx(settled)  # prompt): extrapolated, ignored
    assert model.observed == {"target": 1 + WINDOW, "draft": 2 + WINDOW + 3}
    with pytest.raises(ValueError, match="kinds"):
        CostModel(linear(1.0, 0.1)).observe("draft", 1, 0, 1.0)


def test_a_draft_not_yet_observed_is_scaled_as_the_target_is():
    """A machine slower than when calibrated is so for both models: the draft's costs follow the target's correction
    until the run has observed a draft call of its own."""
    model = CostModel(linear(1.0, 0.1), linear(0.25, 0.01))
    model.observe("target", 1, 0, 1.5)
    assert model.target_seconds(1, 0) == pytest.approx(1.5)
    assert model.draft_seconds(2, 0) == pytest.approx(1.5 * 0.5)
    model.observe("draft", 1, 0, 0.2)
    assert model.draft_seconds(2, 0) == pytest.approx(0.8 * 0.5)


def test_each_knot_corrects_how_far_the_fit_errs_near_it():
    """A fit whose 4-token calls run 1.2x what it says, the 1-token ones as it says: the plain steps set the level,
    the 4-token calls correct their knot (calls of weight w in all weigh w / (w + 1)), and sizes between knots with
    evidence are interpolated, sizes beyond them take the nearest one's; a slower machine moves every size; a knot
    keeps its evidence however many calls of other sizes follow; a call between two knots teaches both, by its
    distance from each."""
    cost = CallCost((1, 2, 4, 8), (1.0, 1.1, 1.3, 1.7))
    one, four = cost.fitted(1, 0), cost.fitted(4, 0)
    for i in range(20):
        cost.observe(1, 0, one)
        if i % 5 == 0:
            cost.observe(4, 0, 1.2 * four)
    assert cost.predict(1, 0) == pytest.approx(one)
    corrected = 1.2 ** (4 / 5)  # 4 calls of 4 tokens
    assert cost.predict(4, 0) == pytest.approx(corrected * four)
    assert cost.predict(2, 0) == pytest.approx(corrected ** (1 / 3) * cost.fitted(2, 0))  # a third of the way
    assert cost.predict(8, 0) == pytest.approx(corrected * cost.fitted(8, 0))  # beyond: the nearest knot's
    for _ in range(WINDOW // 2 + 1):
        cost.observe(1, 0, 1.5 * one)  # the machine slows down: the level follows, each knot keeps its correction
    assert cost.predict(1, 0) == pytest.approx(1.5 * one)
    assert cost.predict(4, 0) == pytest.approx(1.5 * corrected * four)
    for _ in range(5 * EVIDENCE):
        cost.observe(1, 0, 1.5 * one)
    assert cost.predict(4, 0) == pytest.approx(1.5 * corrected * four)  # not forgotten for the plain steps
    between = CallCost((1, 2, 4, 8), (1.0, 1.1, 1.3, 1.7))
    for _ in range(3):
        between.observe(1, 0, between.fitted(1, 0))
    between.observe(3, 0, 2.0 * between.fitted(3, 0))  # half way from knot 2 to knot 4: weight 1/2 on each
    assert between.offset(2) == pytest.approx(2.0 ** (1 / 3)) and between.offset(4) == pytest.approx(2.0 ** (1 / 3))
    assert between.offset(1) == 1.0 and between.predict(1, 0) == pytest.approx(between.fitted(1, 0))
    alone = linear(1.0, 0.1)
    for seconds in (2.0, 0.5, 1.0):
        alone.observe(4, 0, seconds * alone.fitted(4, 0))
    assert alone.predict(4, 0) == pytest.approx(alone.fitted(4, 0))  # calls all of one size: as the median says


def test_tree_calls_learn_what_they_cost_beyond_a_causal_call():
    model = CostModel(linear(1.0, 0.1))
    causal = model.target_seconds(4, 0)
    assert model.target_seconds(4, 0, tree=True) == causal  # nothing learned: no extra
    model.observe("target", 4, 0, causal + 0.5, tree=True)
    # the first one weighs as one call against TREE_PRIOR calls that cost nothing more: one slow call is not believed
    assert model.target_seconds(4, 0, tree=True) == pytest.approx(causal + 0.5 / (1 + TREE_PRIOR))
    assert model.target_seconds(4, 0) == causal  # and leaves causal calls' costs alone
    for _ in range(30):
        model.observe("target", 4, 0, causal + 0.1, tree=True)
    assert model.target_seconds(4, 0, tree=True) == pytest.approx(causal + 0.1, abs=0.01)
    model.observe("target", TARGET_SIZES[-1] + 1, 0, 100.0)  # longer than calibration measures (a prompt): ignored
    assert model.target_seconds(4, 0) == causal and model.observed == {"tree": 31}
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_cost_model_round_trips_through_json():
    model = CostModel(fit([(1, 16, 0.1), (4, 16, 0.12), (16, 16, 0.2), (1, 512, 0.11)], (1, 4, 16)), linear(0.05, 0.01))
    model.observe("target", 2, 50, 0.3)
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model
    assert CostModel.from_dict(CostModel(linear(1.0, 0.0)).to_dict()).draft is None


class ClockedLM:
    """An LM whose calls take `seconds(n)` on a fake clock (`cost_module.time`, patched): measuring sees what a slow
    machine would show it, at once."""

    class Cache:
        def __init__(self):
            self.length = 0

        def __len__(self):
            return self.length

        def crop(self, length):
            self.length = length

    def __init__(self, seconds):
        self.seconds, self.now, self.scored = seconds, 0.0, []
        self.context_length, self.vocab_size = 4096, 100

    def perf_counter(self):
        return self.now

    def new_cache(self):
        cache = self.Cache()
        cache.hf = type("HF", (), {"layers": []})()
        return cache

    def forward(self, tokens, cache, keep=1):
        self.scored.append(len(tokens))
        self.now += self.seconds(len(tokens))
        cache.length += len(tokens)

    def synchronize(self):
        pass


def test_calibration_extrapolates_sizes_whose_calls_would_be_dear_and_grow_with_their_tokens(monkeypatch):
    # the 1.5B in bfloat16 on an AVX2-only CPU: every token scored costs about as much as the first
    proportional = ClockedLM(lambda n: 0.05 + 0.15 * n)
    monkeypatch.setattr(cost_module, "time", proportional)
    samples = cost_module.measure(proportional)
    # after the warm-up: 1-3 tokens, then 1 and 3 after 512 positions; then that round again
    assert proportional.scored[2:] == [1, 2, 3, 1, 3] * ROUNDS
    fitted = fit(samples, (1, 2, 3))
    for n in (1, 4, 16, 32):
        assert fitted.predict(n, 16) == pytest.approx(0.05 + 0.15 * n)
    # cheap calls, or dear ones whose time flattens, are all measured (a CPU reading weights, a GPU)
    smollm2 = {1: 0.041, 2: 0.067, 3: 0.083, 4: 0.066, 8: 0.058, 16: 0.07, 32: 0.1}  # float32, AMD EPYC (AVX-512)
    for seconds in (lambda n: 0.002 * n, lambda n: 0.3 + 0.01 * n, smollm2.get):
        clocked = ClockedLM(seconds)
        monkeypatch.setattr(cost_module, "time", clocked)
        assert [n for n, L, _ in cost_module.measure(clocked) if L == 16] == list(TARGET_SIZES)


def test_calibration_keeps_each_calls_fastest_time_of_at_least_two_rounds(monkeypatch):
    # a process's first seconds of calls run slow, and calibration runs in them: SmolLM2-135M's 8- to 32-token calls
    # took 1.5x their later time in a first round (bfloat16, AMD EPYC)
    warm = 2 + len(TARGET_SIZES) + 2  # the warm-up calls and the first round

    def seconds(n):
        return (0.03 + 0.02 * n) * (1.5 if len(clocked.scored) <= warm else 1.0)

    clocked = ClockedLM(seconds)
    monkeypatch.setattr(cost_module, "time", clocked)
    samples = cost_module.measure(clocked, budget=0.0)
    assert len(clocked.scored) == 2 + (len(TARGET_SIZES) + 2) * ROUNDS and ROUNDS >= 2
    assert [s for _, _, s in samples] == pytest.approx([0.03 + 0.02 * n for n, _, _ in samples])


# --- calibration on tiny models -----------------------------------------------------------------------------------


class CountingLM:
    """An LM that counts its forward calls, and keeps how many tokens each scored and how many logits it kept."""

    def __init__(self, lm: decoders.LM) -> None:
        self.lm, self.calls, self.shapes = lm, 0, []

    def forward(self, tokens, cache, *args, **kwargs):
        self.calls += 1
        self.shapes.append((len(tokens), kwargs.get("keep", 0)))
        return self.lm.forward(tokens, cache, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.lm, name)


def test_calibration_is_positive_and_monotone():
    model = calibrate(tiny_lm("llama"), draft=tiny_lm("qwen2"), cache=False, budget=0.0)
    for part in (model.target, model.draft):
        for context in (0, 100, 239):
            costs = [part.predict(n, context) for n in range(1, 41)]
            assert costs[0] > 0 and all(b >= a * (1 - 1e-12) for a, b in zip(costs, costs[1:]))
        assert part.predict(8, 239) >= part.predict(8, 16)
    assert len(model.target.samples) == len(TARGET_SIZES) + 2 and len(model.draft.samples) == len(DRAFT_SIZES) + 2


def test_calibration_cache_is_keyed_invalidated_and_reloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("DECODEKIT_CALIBRATION")  # the tests' own folder; here the default under DECODEKIT_CACHE
    monkeypatch.setattr(cost_module, "proportional", lambda timed, n: False)  # every size measured, however slow its
    # calls on a busy machine (where the rule stopped a tiny model's calibration early, with more threads than cores)
    target, draft = CountingLM(tiny_lm("llama")), CountingLM(tiny_lm("qwen2"))
    first = calibrate(target, draft, budget=0.0)
    one = 2 + (len(TARGET_SIZES) + 2) * ROUNDS  # a target's calibration: 2 warm-up calls, then rounds of every size
    drafts = 2 + (len(DRAFT_SIZES) + 2) * ROUNDS  # and 2 at the long context; and a draft's
    assert target.calls == one and draft.calls == drafts  # ROUNDS rounds each
    # after the warm-up, every size with the logits of each of its tokens: a draft call that checks guesses keeps them
    assert draft.shapes[2:] == [(n, n) for n in (*DRAFT_SIZES, DRAFT_SIZES[0], DRAFT_SIZES[-1])] * ROUNDS
    files = sorted(p.name for p in (tmp_path / "calibration").iterdir())
    assert len(files) == 2 and files[0].startswith("draft-tiny-qwen2-0") and files[1].startswith("target-tiny-llama-0")

    assert calibrate(target, draft) == first and (target.calls, draft.calls) == (one, drafts)  # reloaded, none measured

    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        calibrate(target, budget=0.0)
    finally:
        torch.set_num_threads(threads)
    assert target.calls == 2 * one and len(list((tmp_path / "calibration").iterdir())) == 3

    bf16 = CountingLM(decoders.wrap(tiny_model("llama", 0, torch.bfloat16), tiny_tokenizer(), name="tiny-llama-0"))
    calibrate(bf16, budget=0.0)
    assert bf16.calls == one and len(list((tmp_path / "calibration").iterdir())) == 4

    with monkeypatch.context() as other:  # the cache folder seen from a machine of another CPU
        other.setattr(cost_module, "processor", lambda: "Another CPU (AVX512)")
        calibrate(target, budget=0.0)
    assert target.calls == 3 * one and len(list((tmp_path / "calibration").iterdir())) == 5  # measured, kept beside
    calibrate(target)
    assert target.calls == 3 * one  # back on this machine: its own file

    monkeypatch.setattr(cost_module, "VERSION", cost_module.VERSION + 1)
    calibrate(target, budget=0.0)
    assert target.calls == 4 * one  # another file format: measured again, and the file rewritten
    written = [json.loads(p.read_text()) for p in (tmp_path / "calibration").glob("target-tiny-llama-0-*.json")]
    assert cost_module.VERSION in [data["version"] for data in written]
    calibrate(target)
    assert target.calls == 4 * one
