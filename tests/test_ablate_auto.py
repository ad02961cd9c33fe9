"""devtools.ablate_auto: `auto` replayed with one mechanism off at a time, in cost regimes it plans and is costed by."""

from __future__ import annotations

import pytest
from conftest import PROMPTS

import decoders
from decoders.drafting.cost import TARGET_SIZES, CallCost
from devtools import ablate_auto
from devtools.ablate_auto import MECHANISMS, ablate, markdown, regime, variant

HERE = CallCost(TARGET_SIZES, (1.0, 1.3, 1.6, 1.8, 2.4, 3.0, 4.5), 0.001, 0.0001)  # a CPU-like curve, in seconds


@pytest.fixture(scope="module")
def echo():
    """A tiny model that repeats its last token (the suffix index and prompt lookup soon guess it), and its greedy
    outputs of three prompts as a suite."""
    from test_auto import echo_lm

    lm = echo_lm()
    prompts = []
    for i, text in enumerate(PROMPTS[:3]):
        ids = lm.encode(text)
        prompts.append((f"p{i}", "c", ids, decoders.generate(lm, ids, max_new_tokens=24).tokens))
    return lm, prompts


def test_the_regimes_plan_with_the_curve_they_cost_by_but_stale():
    for name, shape in ablate_auto.SHAPES.items():
        planning, truth = regime(name, HERE)
        assert planning is truth and planning.sizes == TARGET_SIZES
        assert planning.seconds == pytest.approx([1.0 * r for r in shape])
        assert (planning.per_position, planning.per_position_per_token) == (0.001, 0.0001)
    assert regime("here", HERE) == (HERE, HERE)
    planning, truth = regime("stale", HERE)
    assert planning is HERE and truth.seconds == pytest.approx((1.0, 1.69, 2.56, 3.24, 4.8, 6.0, 9.0))
    with pytest.raises(ValueError, match="unknown regime"):
        regime("cheap", HERE)


def test_every_ablation_keeps_greedys_tokens_and_some_change_the_seconds(echo, monkeypatch):
    """Each variant replays the suite on greedy's path (`replay` raises where it leaves it), plans with the regime's
    curve, and switching mechanisms off changes auto's steps."""
    lm, prompts = echo
    planned = []  # the target curve each drafter planned with
    init = ablate_auto.Planned.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        planned.append(self.cost.target.seconds)

    monkeypatch.setattr(ablate_auto.Planned, "__init__", spy)
    report = ablate(lm, {"a": prompts[:2], "b": prompts[2:]}, ("here", "dear"), here=HERE, progress=False)
    assert set(planned) == {HERE.seconds, regime("dear", HERE)[0].seconds} and len(planned) == 2 * (1 + len(MECHANISMS)) * len(prompts)
    tokens = sum(len(out) for *_, out in prompts)
    changed = set()
    for name, entry in report["regimes"].items():
        assert entry["plans_with"] == entry["costed_by"]
        runs = entry["runs"]
        assert set(runs) == {"full", *MECHANISMS} and entry["greedy"]["all"]["calls"] == tokens
        assert runs["full"]["all"]["calls"] < tokens  # drafts were accepted
        for mechanism, run in runs.items():
            assert run["a"]["seconds"] + run["b"]["seconds"] == pytest.approx(run["all"]["seconds"])
            if (run["all"]["seconds"], run["all"]["calls"]) != (runs["full"]["all"]["seconds"],
                                                                 runs["full"]["all"]["calls"]):
                changed.add(mechanism)
    assert changed & {"merged", "ride", "lookahead", "match_curves"}, changed
    text = markdown(report)
    assert "| merged | " in text and "dear, per suite" in text and "| mechanism off | all | a | b |" in text


def test_a_variant_switches_one_mechanism_off_by_subclassing(echo):
    lm, prompts = echo
    for mechanism, drafter in MECHANISMS.items():
        decoder = variant(mechanism, HERE)
        assert issubclass(decoder, decoders.strategies.auto.Auto) and issubclass(decoder.drafter, drafter)
        assert decoder.drafter.planning is HERE
    with pytest.raises(ValueError, match="unknown mechanisms"):
        ablate(lm, {"a": prompts}, ("here",), ("rides",), here=HERE, progress=False)
    noisy = ablate(lm, {"a": prompts[:1]}, ("here",), ("merged",), noise=0.15, seeds=2, here=HERE, progress=False)
    assert noisy["seeds"] == [1, 2] and len(noisy["regimes"]["here"]["runs"]["merged"]["all"]["per_seed"]) == 2
    assert "; " in markdown(noisy)  # the seeds' ratios' range
