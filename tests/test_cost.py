"""The cost model: fit, online correction, calibration (measuring and its cache).

Calibration runs on tiny models or a fake clock and is checked for shape (positive, monotone) and for its cache, never
for wall-clock values.
"""

from __future__ import annotations

import json

import pytest
import torch

import decoders
from conftest import tiny_lm, tiny_model, tiny_tokenizer
from decoders.drafting import cost as cost_module
from decoders.drafting.cost import DRAFT_SIZES, ROUNDS, TARGET_SIZES, CallCost, CostModel, calibrate, fit
from decoders.drafting.curve import EVIDENCE, WINDOW


def linear(a: float, b: float, c: float = 0.0) -> CallCost:
    """t(n, L) = a + b (n - 1) + c L seconds."""
    return CallCost((1, 2), (a, a + b), c)


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
    target = model.target_seconds(4, 100)
    model.observe("target", TARGET_SIZES[-1] + 1, 100, 100.0)  # a prompt's call: ignored too
    assert model.target_seconds(4, 100) == target
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

        resize = crop  # (a count of positions: growing it or cutting it alike)

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
    samples, _ = cost_module.measure(proportional)
    # after the warm-up: 1-4 tokens, then 1 and 4 after 512 positions; then that round again
    assert proportional.scored[2:] == [1, 2, 3, 4, 1, 4] * ROUNDS
    fitted = fit(samples, (1, 2, 3, 4))
    for n in (1, 4, 16, 32):
        assert fitted.predict(n, 16) == pytest.approx(0.05 + 0.15 * n)
    # cheap calls, or dear ones whose time flattens, are all measured (a CPU reading weights, a GPU)
    smollm2 = {1: 0.041, 2: 0.067, 3: 0.083, 4: 0.066, 8: 0.058, 16: 0.07, 32: 0.1}  # float32, AMD EPYC (AVX-512)
    # the 1.5B in float32 on an AVX2-only CPU: 2 and 3 tokens cost by the token, 4 and more far less
    qwen = {1: 0.373, 2: 0.700, 3: 0.990, 4: 0.930, 8: 1.04, 16: 1.23, 32: 1.69}
    for seconds in (lambda n: 0.002 * n, lambda n: 0.3 + 0.01 * n, smollm2.get, qwen.get):
        clocked = ClockedLM(seconds)
        monkeypatch.setattr(cost_module, "time", clocked)
        assert [n for n, L, _ in cost_module.measure(clocked)[0] if L == 16] == list(TARGET_SIZES)


def test_calibration_keeps_each_calls_fastest_time_of_at_least_two_rounds(monkeypatch):
    # a process's first seconds of calls run slow, and calibration runs in them: SmolLM2-135M's 8- to 32-token calls
    # took 1.5x their later time in a first round (bfloat16, AMD EPYC)
    warm = 2 + len(TARGET_SIZES) + 2  # the warm-up calls and the first round

    def seconds(n):
        return (0.03 + 0.02 * n) * (1.5 if len(clocked.scored) <= warm else 1.0)

    clocked = ClockedLM(seconds)
    monkeypatch.setattr(cost_module, "time", clocked)
    samples, _ = cost_module.measure(clocked, budget=0.0)
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
        other.setattr(cost_module, "machine", lambda device: f"{device} Another processor")
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


def test_an_int8_copys_calibration_key_holds_whichever_call_sizes_its_timing_ran_on_the_float_weight(monkeypatch):
    from decoders.drafting.cost import calibration_key
    from decoders.models import int8 as module, quantize as quantizing

    lm = tiny_lm("qwen2")
    keys = []
    for float_faster in (False, True):  # two processes whose timings of the float and int8 paths disagree
        monkeypatch.setattr(module, "_crossovers", {})
        timings = iter([0.5, 1.0] * 1000 if float_faster else [2.0, 1.0] * 1000)  # (float, int8) per size tried
        monkeypatch.setattr(module, "_seconds", lambda call, device: next(timings))
        copy = quantizing.quantize(lm, "int8")
        kept = [name for name, _ in copy.model.named_buffers() if name.endswith("float_weight")]
        assert bool(kept) == float_faster  # (the float weight kept in memory only where its timing chose it)
        keys.append(calibration_key(copy, "draft", DRAFT_SIZES))
    assert keys[0] == keys[1]
    assert keys[0] != calibration_key(lm, "draft", DRAFT_SIZES)  # the int8 copy is not its float original
