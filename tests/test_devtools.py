"""devtools: the replays drive decodekit's real strategies on replayed models (`devtools.replay`)."""

from __future__ import annotations

import copy

import torch
import pytest
from conftest import PROMPTS, tiny_lm

import decoders
from decoders.models.quantize import self_draft


def echo_lm() -> decoders.LM:
    """A tiny model that repeats its input token: its output embedding is its input embedding and its layers add
    next to nothing to the residual stream."""
    base = tiny_lm("qwen2")
    model = copy.deepcopy(base.model)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
    lm = decoders.wrap(model, base.tokenizer, name="tiny-echo")
    lm.native = None  # (transformers' calls: a cost per call that hardly grows with its tokens, as these replays assume)
    return lm


def noisy_draft(lm: decoders.LM) -> decoders.LM:
    """A draft that agrees with `lm` often, not always: its weights with a little noise."""
    model = copy.deepcopy(lm.model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=generator).to(p.device))
    return decoders.wrap(model, lm.tokenizer, name=f"{lm.name}-noisy")


def greedy_outputs(lm: decoders.LM, texts: list[str], tokens: int) -> list[tuple[str, str, list[int], list[int]]]:
    out = []
    for i, text in enumerate(texts):
        ids = lm.encode(text)
        out.append((f"p{i}", "c", ids, decoders.generate(lm, ids, strategy="greedy", max_new_tokens=tokens).tokens))
    return out


def test_replay_drafts_runs_the_real_strategies_to_the_target_calls_of_real_runs():
    """devtools.replay_drafts runs draft-free strategies on a replayed target: its target calls must be those of the
    real runs (greedy in float32 is exact, so no tie can make the run take another branch), each call costed."""
    from types import SimpleNamespace

    from devtools.replay_drafts import replay
    from evals.methods import build

    lm = tiny_lm("llama")
    prompts = greedy_outputs(lm, PROMPTS + PROMPTS[:2], 48)  # two prompts twice: a warm store has something to draft
    cost = SimpleNamespace(predict=lambda n, context: float(n))  # seconds = tokens scored: checks the costing too
    prompt_calls = sum(len(ids) - 1 for _, _, ids, _ in prompts)  # (the first call scores the prompt too)
    for name in ("suffix", "suffix@depth_factor=1", "suffix@store=run", "prompt_lookup", "hf:prompt_lookup"):
        tally = replay(lm, name, prompts, cost)
        if name != "hf:prompt_lookup":
            decoder = build(name).decoder  # store=run: one store across the prompts, in order, as compare keeps it
            for prompt_id, _, ids, out in prompts:
                run = decoders.generate(lm, ids, strategy=decoder, max_new_tokens=48)
                assert run.tokens == out
                assert tally.per_prompt[prompt_id][1] == run.stats.target_calls, (name, prompt_id)
        assert tally.calls < tally.tokens  # drafts were accepted: the replay had something to get right
        assert tally.seconds == prompt_calls + tally.calls + tally.drafted
    with pytest.raises(SystemExit, match="replay without a model"):
        replay(lm, "speculative", prompts, cost)


def test_hf_lookup_copies_the_first_earlier_match_of_the_last_two_or_one_tokens():
    from devtools.replay_drafts import hf_lookup

    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    assert hf_lookup(tokens, 10, k=10, max_ngram=2) == [4, 9, 2, 3, 5, 6, 7, 2, 3]  # the first match, to the end
    assert hf_lookup(tokens, 2, k=10, max_ngram=2) == [4, 9]
    assert hf_lookup([5, 1, 6, 1], 10, k=3, max_ngram=2) == [6, 1]  # one token matched
    assert hf_lookup([5, 6, 7], 10, k=3, max_ngram=2) == []


def test_replay_chains_runs_the_real_strategies_to_the_target_calls_of_real_runs():
    """devtools.replay_chains runs the draft-model strategies on a replayed target and draft from one recorded draft
    call per prompt: its target calls must be those of real `speculative` and `threshold` runs (in float32, where the
    draft's one long call and its one-token calls agree), and `auto` drafts chains that are accepted."""
    from decoders.drafting.cost import CallCost, CostModel
    from devtools.replay import record
    from devtools.replay_chains import replay
    from evals.methods import build

    lm = tiny_lm("llama")
    draft = noisy_draft(lm)
    prompts = greedy_outputs(lm, PROMPTS, 40)
    recordings = {pid: record(draft, ids, out) for pid, _, ids, out in prompts}
    cost = CostModel(CallCost((1, 32), (1.0, 1.0)), CallCost((1, 32), (0.25, 0.25)))  # a call's cost whatever its size
    for name in ("speculative@k=3", "threshold", "threshold@min_threshold=0.1"):
        tally = replay(lm, draft, name, prompts, recordings, cost)
        draft_calls = 0
        for prompt_id, _, ids, out in prompts:
            run = decoders.generate(lm, ids, strategy=build(name).decoder, draft=draft, max_new_tokens=40)
            assert run.tokens == out
            assert tally.per_prompt[prompt_id][1] == run.stats.target_calls, (name, prompt_id)
            draft_calls += run.stats.draft_calls
        assert tally.calls < tally.tokens  # drafts were accepted: the replay had something to get right
        assert tally.seconds == pytest.approx(tally.calls + 0.25 * draft_calls)
    tally = replay(lm, draft, "auto", prompts, recordings, cost)
    assert tally.calls < tally.tokens and tally.steps["draft"]
    with pytest.raises(SystemExit, match="replayable strategies"):
        replay(lm, draft, "suffix", prompts, recordings, cost)


def test_replay_chains_drafts_with_the_targets_own_int8_copy_on_the_targets_cache(monkeypatch):
    """`self:int8`: the replayed copy drafts on the replayed target's cache, as a run's does (no prefill of its own),
    its calls costed as the draft's."""
    from decoders.drafting.cost import CallCost, CostModel
    from devtools.replay import record
    from devtools.replay_chains import replay, shares_cache

    lm = tiny_lm("llama")
    copy8 = self_draft(lm, "int8")
    assert shares_cache(lm, copy8) and not shares_cache(lm, noisy_draft(lm))
    prompts = greedy_outputs(lm, PROMPTS[:3], 24)
    recordings = {pid: record(copy8, ids, out) for pid, _, ids, out in prompts}
    cost = CostModel(CallCost((1, 32), (1.0, 1.0)), CallCost((1, 32), (0.25, 0.25)))
    from decoders.drafting.draft_model import SharedCacheDraft

    shared = []
    chain = SharedCacheDraft.draft_chain

    def spy(self, *args, **kwargs):
        shared.append(self.cache is self.state.cache)
        return chain(self, *args, **kwargs)

    monkeypatch.setattr(SharedCacheDraft, "draft_chain", spy)
    tally = replay(lm, copy8, "speculative@k=4", prompts, recordings, cost)
    assert tally.calls < tally.tokens and shared and all(shared)
    run = decoders.generate(lm, prompts[0][2], strategy="speculative", k=4, draft=copy8, max_new_tokens=24)
    assert tally.per_prompt["p0"][1] == pytest.approx(run.stats.target_calls, abs=1)


def test_the_replayed_target_predicts_greedys_next_token_on_greedys_path_only():
    """`ReplayLM`: a scored token whose path (the cache, then the tokens it attends to) is greedy's output predicts
    greedy's next token, any other a token that is not it; its cache keeps the ids it has seen through crops; each
    call costs the calibrated seconds of its size."""
    from decoders.drafting.cost import CallCost
    from devtools.replay import ReplayLM

    target = ReplayLM(tiny_lm("llama"), CallCost((1, 2), (1.0, 1.5)))
    target.truth = [5, 6, 7, 8, 9, 10]
    cache = target.new_cache()
    assert target.forward([5, 6], cache, keep=1).argmax(-1).tolist() == [7]  # the prompt
    # a tree after [5, 6]: node 0 = 7 (right), node 1 = 3 (wrong sibling), node 2 = 8 under node 0, node 3 = 8 under 1
    mask = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    rows = target.forward([7, 3, 8, 8], cache, positions=[2, 2, 3, 3], tree_mask=mask).argmax(-1).tolist()
    assert rows[0] == 8 and rows[2] == 9 and rows[1] != 8 and rows[3] != 9
    cache.keep([0, 1, 2, 4])  # the accepted path 7, 8
    assert target.forward([9], cache, keep=1).argmax(-1).tolist() == [10]
    cache.crop(2)
    assert target.forward([3], cache, keep=1).argmax(-1).tolist() != [8]  # off greedy's path
    assert target.now() == pytest.approx(1.5 + 2.5 + 1.0 + 1.0)  # 2, 4, 1 and 1 tokens (linear past the last knot)


def test_the_replayed_draft_gives_its_recorded_choice_and_probability_on_the_targets_clock():
    from decoders.drafting.cost import CallCost
    from devtools.replay import Recorded, ReplayDraft, ReplayLM

    lm = tiny_lm("llama")
    target = ReplayLM(lm, CallCost((1, 2), (1.0, 1.5)))
    draft = ReplayDraft(noisy_draft(lm), target, CallCost((1, 2), (0.25, 0.5)))
    target.truth, draft.recorded = [5, 6, 7, 8, 9], Recorded(2, [7, 3, 9], [0.9, 0.4, 0.7])
    probs = torch.softmax(draft.forward([5, 6, 7], draft.new_cache()), -1)  # [3, vocab]: predicting 6, 7, 8
    close = lambda p: pytest.approx(p, rel=1e-5)  # noqa: E731  (float32 softmax: AVX2's exp errs by ~2e-6)
    assert probs[1].argmax() == 7 and probs[1, 7] == close(0.9)
    assert probs[2].argmax() == 3 and probs[2, 3] == close(0.4)  # what it was recorded, though wrong
    assert probs[0].max() == close(1 / lm.vocab_size)  # before the output: nothing recorded
    assert target.now() == pytest.approx(0.5 + 0.25)  # 3 tokens, linear past the last knot


def test_the_auto_replay_can_cost_calls_by_a_stale_calibration_with_noise():
    """`--ratios` scales each knot of the calibrated curve (the context terms as the first), one positive ratio a knot;
    `--noise` makes each call's cost vary by its seed, a prompt's call excepted."""
    from decoders.drafting.cost import CallCost
    from devtools.replay_auto import ReplayLM, replay, stale

    cost = CallCost((1, 2, 4), (1.0, 1.5, 2.0), 0.01, 0.001)
    scaled = stale(cost, [1.0, 2.0, 3.0])
    assert scaled.seconds == (1.0, 3.0, 6.0) and scaled.predict(3, 0) == pytest.approx(4.5)
    assert (scaled.per_position, scaled.per_position_per_token) == (0.01, 0.001)
    for bad in ([1.0, 2.0], [1.0, 0.0, 2.0]):
        with pytest.raises(ValueError, match="one positive ratio per knot"):
            stale(cost, bad)
    lm = tiny_lm("llama")
    with pytest.raises(ValueError, match="spread"):
        replay(lm, [], noise=-0.1)

    def costs(noise: float, seed: int, length: int) -> list[float]:
        target = ReplayLM(lm, cost, noise, seed)
        target.truth = list(range(100))
        seconds = []
        for _ in range(5):
            before = target.now()
            target.forward(list(range(length)), target.new_cache(), keep=1)
            seconds.append(target.now() - before)
        return seconds

    assert costs(0.0, 0, 2) == [1.5] * 5
    noisy = costs(0.15, 1, 2)
    assert len(set(noisy)) == 5 and noisy == costs(0.15, 1, 2) and noisy != costs(0.15, 2, 2)
    assert costs(0.15, 1, 40) == [cost.predict(40, 0)] * 5  # a prompt's call: longer than calibration measures


def test_the_auto_replay_runs_auto_on_its_clock_and_gives_greedys_tokens(tmp_path, monkeypatch, capsys):
    """devtools.replay_auto replays `auto` on greedy outputs (it raises if the replay leaves them): suffix drafts
    accepted, its seconds the calibrated ones; its command line prints a row a prompt."""
    import json

    from devtools import replay_auto
    from devtools.replay import greedy_seconds

    lm = echo_lm()  # repeats its last token: the suffix index soon guesses it
    prompts = greedy_outputs(lm, PROMPTS[:3], 40)
    rows = replay_auto.replay(lm, prompts)
    assert [row["prompt_id"] for row in rows] == ["p0", "p1", "p2"]
    assert all(0 < row["seconds"] < row["greedy"] for row in rows) and all(row["steps"]["suffix"] for row in rows)
    assert sum(row["calls"] for row in rows) < sum(row["tokens"] for row in rows)
    assert rows[0]["greedy"] == greedy_seconds(decoders.drafting.cost.call_cost(lm), *prompts[0][2:])
    eos, = lm.eos_token_ids
    with pytest.raises(AssertionError, match="left greedy's output"):  # a run that ends before greedy's output did
        replay_auto.replay(lm, [("x", "c", prompts[0][2], prompts[0][3][:5] + [eos] + prompts[0][3][5:])])
    monkeypatch.setattr(decoders, "load", lambda name, dtype=None: lm)
    monkeypatch.setattr(replay_auto, "load_prompts", lambda result, model: prompts)
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"model": {"name": "tiny-echo"}, "environment": {"dtype": "float32"}}))
    replay_auto.main([str(path), "--ratios", "1,1.3,1.6,1.8,2,2,2", "--noise", "0.1", "--seed", "1"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| prompt |") and len(printed) == 2 + 3 + 1 and "suffix" in printed[2]


def test_the_draft_and_chain_replays_command_lines_print_a_row_a_method(tmp_path, monkeypatch, capsys):
    import json

    from devtools import replay_chains, replay_drafts

    lm = tiny_lm("llama")
    draft = noisy_draft(lm)
    prompts = greedy_outputs(lm, PROMPTS[:3], 24)
    monkeypatch.setattr(decoders, "load", lambda name, dtype=None: lm)
    for module in (replay_drafts, replay_chains):
        monkeypatch.setattr(module, "load_prompts", lambda result, model: prompts)
    monkeypatch.setattr(replay_chains, "resolve_draft", lambda target, name: draft)
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"model": {"name": "tiny-llama"}, "environment": {"dtype": "float32"}}))
    replay_drafts.main([str(path), "--methods", "suffix,hf:prompt_lookup"])
    replay_chains.main([str(path), "--draft", "noisy", "--methods", "speculative@k=2,threshold,auto"])
    printed = capsys.readouterr().out
    for name in ("suffix", "hf:prompt_lookup", "speculative@k=2", "threshold", "auto"):
        assert f"| {name} | " in printed
    assert "drafted by tiny-llama-0-noisy" in printed
    with pytest.raises(SystemExit, match="replay without a model"):
        replay_drafts.main([str(path), "--methods", "threshold"])
    with pytest.raises(SystemExit, match="replayable strategies"):
        replay_chains.main([str(path), "--draft", "noisy", "--methods", "suffix"])


def test_speedups_are_greedys_estimated_seconds_over_each_methods_per_suite_and_overall(monkeypatch):
    """devtools.speedups: one cell per method and suite, and "all" weighing the suites by their seconds, the calls
    costed by the cached curve (here one where a call costs the same whatever it scores: a GPU's, nearly)."""
    from decoders.drafting.cost import CallCost
    from devtools import replay_drafts, speedups

    lm = tiny_lm("llama")
    suites = {"a": greedy_outputs(lm, PROMPTS[:2], 24), "b": greedy_outputs(lm, PROMPTS[2:4], 24)}
    flat = CallCost((1, 64), (0.01, 0.01))
    monkeypatch.setattr(speedups, "call_cost", lambda model, role: flat)
    monkeypatch.setattr(speedups, "load_prompts", lambda result, model: suites[result["config"]["suite"]])
    results = [{"config": {"suite": name}} for name in suites]
    table = speedups.speedups(lm, results, ["suffix", "auto"])
    tally = replay_drafts.replay(lm, "suffix", suites["a"], flat)
    assert table["suffix"]["a"] == pytest.approx(tally.greedy / tally.seconds)
    assert min(table["suffix"]["a"], table["suffix"]["b"]) <= table["suffix"]["all"] <= max(
        table["suffix"]["a"], table["suffix"]["b"])
    # each call gains a token at least, all calls cost the same: no method is slower than greedy (a call that finds
    # the run over aside)
    assert all(row[s] > 0.95 for row in table.values() for s in ("a", "b", "all")), table
    with pytest.raises(SystemExit, match="unknown methods"):
        speedups.main(["x.json", "--methods", "speculative"])


def test_the_held_out_suite_takes_its_positions_of_each_category_and_loads_as_a_suite(tmp_path, capsys):
    import json

    from devtools import heldout
    from evals import suites

    lines = [{"question_id": n, "category": c, "turns": [f"{c} {n}", "again"]} for n, c in
             enumerate(["writing"] * 3 + ["extraction"] * 3 + [t for t in heldout.TASKS for _ in range(4)])]
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    heldout.main([str(questions)])
    out = tmp_path / "heldout.jsonl"
    out.write_text(capsys.readouterr().out)
    prompts = suites.load(out)
    tasks = [(f"specbench-{n}", c, f"{c} {n}") for c in heldout.TASKS
             for n in [line["question_id"] for line in lines if line["category"] == c][2:4]]
    assert [(p.id, p.category, p.prompt) for p in prompts] == tasks + [
        ("specbench-2", "mt_bench", "writing 2"), ("specbench-5", "mt_bench", "extraction 5")]
    with pytest.raises(SystemExit, match=r"no prompt translation\[4\].*rag\[4\]: is it Spec-Bench"):
        heldout.main([str(questions), "--positions", "0,4"])
    for bad in (["--positions", "-1"], ["--positions", "x"], ["--mt-bench", "writing:-2"], ["--mt-bench", "writing"]):
        with pytest.raises(SystemExit):  # (argparse's usage error)
            heldout.main([str(questions), *bad])
        assert "whole numbers from 0" in capsys.readouterr().err
