"""devtools.ablate_auto: `auto` replayed with one mechanism off at a time, in cost regimes it plans and is costed by."""

from __future__ import annotations

import random

import pytest
from conftest import transformers_lm

import decoders
from decoders.drafting.cost import TARGET_SIZES, CallCost
from decoders.proposers.suffix import SuffixProposer
from decoders.strategies.auto import Auto, AutoDrafter
from devtools import ablate_auto
from devtools.ablate_auto import MECHANISMS, ablate, markdown, regime, variant
from devtools.replay import ReplayLM

HERE = CallCost(TARGET_SIZES, (1.0, 1.3, 1.6, 1.8, 2.4, 3.0, 4.5), 0.001, 0.0001)  # a CPU-like curve, in seconds
PHRASES = [[10, 11, 12, 13, 30], [10, 11, 14, 15], [20, 21, 22, 23, 24, 25], [10, 11, 12, 16, 17], [40, 41]]


def text(seed: int, phrases: int) -> list[int]:
    """Phrases that share beginnings and part ways (the suffix index's trees have branches, its matches lengths)."""
    draw = random.Random(seed)
    return [token for _ in range(phrases) for token in draw.choice(PHRASES)]


@pytest.fixture(scope="module")
def suite():
    """A tiny model and three prompts with made-up greedy outputs: the replay's target gives whatever output it is
    told is greedy's, so the outputs can be ones a suffix index drafts well."""
    return transformers_lm("llama"), [(f"p{i}", "c", [1 + i, 2, 3, *text(100 + i, 3)], text(i, 16)) for i in range(3)]


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


def test_every_ablation_keeps_greedys_tokens_plans_with_its_regime_and_changes_autos_steps(suite, monkeypatch):
    """Each variant replays the suite on greedy's path (`replay` raises where it leaves it), plans with the regime's
    curve, and switching each mechanism off changes auto's steps somewhere: online correction only where the calls
    cost other than planned (`stale`)."""
    lm, prompts = suite
    planned = []  # the target curve each drafter planned with
    init = ablate_auto.Planned.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        planned.append(self.cost.target.seconds)

    monkeypatch.setattr(ablate_auto.Planned, "__init__", spy)
    regimes = ("here", "dear", "stale")
    report = ablate(lm, {"a": prompts[:2], "b": prompts[2:]}, regimes, here=HERE, progress=False)
    assert set(planned) == {HERE.seconds, regime("dear", HERE)[0].seconds}
    assert len(planned) == len(regimes) * (1 + len(MECHANISMS)) * len(prompts)
    tokens = sum(len(out) for *_, out in prompts)
    changed = {name: set() for name in regimes}
    for name, entry in report["regimes"].items():
        assert (entry["plans_with"] == entry["costed_by"]) == (name != "stale")
        runs = entry["runs"]
        assert set(runs) == {"full", *MECHANISMS} and entry["greedy"]["all"]["calls"] == tokens
        assert runs["full"]["all"]["calls"] < tokens and runs["full"]["all"]["steps"]["suffix"]  # drafts accepted
        # beats greedy where it plans with what calls cost; where they cost more, its online correction is what pays
        beaten = entry["greedy"] if name != "stale" else runs["online_correction"]
        assert runs["full"]["all"]["seconds"] < beaten["all"]["seconds"]
        for mechanism, run in runs.items():
            assert run["a"]["seconds"] + run["b"]["seconds"] == pytest.approx(run["all"]["seconds"])
            if (run["all"]["seconds"], run["all"]["calls"]) != (runs["full"]["all"]["seconds"],
                                                                 runs["full"]["all"]["calls"]):
                changed[name].add(mechanism)
    assert set().union(*changed.values()) == set(MECHANISMS), changed
    assert "online_correction" in changed["stale"]
    for name in ("here", "dear"):  # the calls cost what auto plans: nothing to correct (but float rounding)
        runs = report["regimes"][name]["runs"]
        assert runs["online_correction"]["all"]["seconds"] == pytest.approx(runs["full"]["all"]["seconds"], rel=0.01)
    text = markdown(report)
    assert "| suffix_trees | " in text and "dear, per suite" in text and "| mechanism off | all | a | b |" in text
    assert "stale (plans with)" in text and "| mechanism off | here | dear | stale |" in text


def test_a_variant_switches_its_mechanism_off_in_autos_own_proposers(suite, monkeypatch):
    """Each variant's drafter is an `AutoDrafter` whose proposers are auto's but for the one mechanism: an untimed
    clock, a suffix proposer on one calibration curve, or one drafting chains only."""
    lm, prompts = suite
    seen = {}  # drafter class -> (drafter, drafts it proposed)
    propose = AutoDrafter.propose

    def spy(self, state, limit, *budget):
        draft = yield from propose(self, state, limit, *budget)  # (yields its draft model's calls)
        seen.setdefault(type(self).__bases__[0], (self, []))[1].append(draft)
        return draft

    monkeypatch.setattr(AutoDrafter, "propose", spy)
    _, _, ids, out = prompts[0]
    target = ReplayLM(lm, HERE)
    for mechanism in (None, *MECHANISMS):
        decoder = variant(mechanism, HERE)
        assert issubclass(decoder, Auto) and issubclass(decoder.drafter, MECHANISMS.get(mechanism, AutoDrafter))
        assert decoder.drafter.planning is HERE
        target.truth = ids + out
        assert decoders.generate(target, ids, strategy=decoder(clock=target.now, self_int8=False),
                                 max_new_tokens=len(out)).tokens == out
    full, full_drafts = seen[ablate_auto.Planned]
    assert full.clock.timed and full.clock.now == target.now
    assert not all(d.is_chain for d in full_drafts if d.tokens)  # the suffix index drafted trees
    assert len({c for c in full.by_name["suffix"].acceptance.fits}) > 1  # on several curves
    untimed, _ = seen[MECHANISMS["online_correction"]]
    assert not untimed.clock.timed and untimed.clock.now == target.now
    one, _ = seen[MECHANISMS["match_curves"]]
    suffix = one.by_name["suffix"]
    assert isinstance(suffix, ablate_auto.OneCurve) and one.proposers[0] is suffix and suffix.trees
    assert one.by_name["lookahead"].suffix is suffix
    assert set(suffix.acceptance.fits) == {"suffix"}
    chains, drafts = seen[MECHANISMS["suffix_trees"]]
    suffix = chains.by_name["suffix"]
    assert type(suffix) is SuffixProposer and chains.proposers[0] is suffix and not suffix.trees
    ours = [d for d in drafts if d.source == "suffix"]
    assert any(d.tokens for d in ours) and all(d.links == list(range(-1, len(d.tokens) - 1)) for d in ours)  # (a
    # window may ride along)


def test_unknown_mechanisms_are_refused_and_noise_gives_each_seeds_ratios(suite):
    lm, prompts = suite
    with pytest.raises(ValueError, match="unknown mechanisms"):
        ablate(lm, {"a": prompts}, ("here",), ("no_such_mechanism",), here=HERE, progress=False)
    noisy = ablate(lm, {"a": prompts[:1]}, ("here",), ("suffix_trees",), noise=0.15, seeds=2, here=HERE,
                   progress=False)
    per_seed = noisy["regimes"]["here"]["runs"]["suffix_trees"]["all"]["per_seed"]
    assert noisy["seeds"] == [1, 2] and len(per_seed) == 2 and per_seed[0] != per_seed[1]
    assert "; " in markdown(noisy)  # the seeds' ratios' range


def test_the_command_line_ablates_a_compare_result(suite, tmp_path, monkeypatch, capsys):
    """`python -m devtools.ablate_auto RESULT.json`: the result's greedy outputs, its model loaded by name."""
    import json

    lm, prompts = suite
    monkeypatch.setattr(decoders, "load", lambda name, dtype=None: lm)
    monkeypatch.setattr(ablate_auto, "load_prompts", lambda result, model: prompts)
    monkeypatch.setattr(ablate_auto, "call_cost", lambda model, role: HERE)
    result = {"model": {"name": "tiny"}, "environment": {"dtype": "float32"}, "config": {"suite": "made-up"}}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    ablate_auto.main([str(path), "--regimes", "here,flat", "--mechanisms", "suffix_trees", "--out",
                      str(tmp_path / "out.json")])
    printed = capsys.readouterr().out
    assert "| mechanism off | here | flat |" in printed and "| suffix_trees | " in printed
    assert json.loads((tmp_path / "out.json").read_text())["suites"] == {"made-up": 3}
