"""A cost model of this device: how many seconds a target or draft call takes, measured once and refined online.

One call scoring n new tokens after L cached ones costs t(n, L) = scale * (f(n) + (per_position + per_position_per_token
* (n - 1)) * L) seconds: f piecewise linear in n through a few measured sizes (on a CPU a 16-token call costs 1.2-1.5x
a one-token call, on a GPU almost the same, on a CPU computing bfloat16 in float about 9x; a few knots fit all), and
the context costing more the more tokens attend to it. `calibrate` measures a handful of calls at start-up and caches
the fit per model, dtype, device (a CPU by its model), thread count and torch version under `cache_dir()/calibration/`;
`observe` then keeps a correction factor, the median over the last calls a run makes, and one per knot of the fit,
interpolated between them (`CallCost.offset`).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import os
import re
import statistics
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoders.models.lm import cpu_model

VERSION = 6  # of the cache file format, the measuring plan and what it measures (2: int8 copies run long calls in
# float, which changed their costs; 3: drafts measured at DRAFT_SIZES with every row's logits; 4: the context term
# grows with the tokens scored, `fit`; 5: dear sizes extrapolated, `proportional`, and a context term that comes out
# negative raised to nothing, not dropped; 6: at least ROUNDS rounds): files of another version are measured again
TARGET_SIZES = (1, 2, 3, 4, 8, 16, 32)  # n measured for the target (a chain of k scores k + 1, a tree its nodes + 1);
# beyond 32: extrapolated. Between knots f is linear: on a CPU's convex curve that errs toward dearer, i.e. shorter,
# drafts. The curve need not be convex: on the AMD EPYC, SmolLM2-135M in float32 took 41 ms for 1 token, 67-70 for 2,
# 80-86 for 3, 61-71 for 4 and 57-60 for 6-8 (the 1.5B in bfloat16: 139-168 ms for 1-5, 156-171 for 8); knots at 1,
# 8 and 32 alone costed its 2-token drafts (3 tokens scored) at 46 ms, and auto drafted them for 80 ms calls
DRAFT_SIZES = (1, 2, 3, 4, 5, 8, 16)  # a draft call scores one token, more where it checks guesses at what follows
# (the suffix index's chain: `auto`'s chains and trees, `staged`'s lower stage), whose logits it keeps, or catches up
# after steps it sat out. torch's int8 kernel on the AMD EPYC runs rows in blocks of four: the 1.5B's int8 copy took
# 66-73 ms for 1-4 rows, 116 for 5, 137 for 8 (the 0.5B's 26-32, 42, 54 ms), where knots at 1 and 8 alone costed 2-4
# rows at 80-99 ms and 5 at 108. Measured so, `auto`'s seconds in two interleaved repeats (the 1.5B in bfloat16):
# without a draft on mixed (one prompt per category) 25.1 against 26.0 and on bench 20.9 against 21.3, with the int8
# 0.5B draft on mixed 21.9 against 22.4; SmolLM2-135M's seven prompts (float32, without a draft) 15.5 against 15.7
SHORT, LONG = 16, 512  # the two context lengths measured (LONG capped by the model's context)
BUDGET = 0.25  # seconds per model: measuring rounds repeat until then (at least ROUNDS), so only cheap calls repeat,
# and sizes whose calls would take longer where the time grows with the tokens are extrapolated (`proportional`)
ROUNDS = 2  # measuring rounds at least, each point keeping its fastest: a process's first seconds of calls run slow,
# and calibration runs in them (in `auto`'s first run). Eight single rounds of SmolLM2-135M in bfloat16 in one process
# (AMD EPYC, AVX2 only), 8 / 16 / 32 tokens: the first 229 / 439 / 841 ms, the seven after it 138-166 / 257-298 /
# 490-537. Cached from one round, its 4-16-token calls were costed 1.4-1.5x what they take, and `auto` drafted the
# suffix index's guesses about 2 levels deep on bench's edit prompt, which copies the prompt at length: 30 target calls
# where `prompt_lookup` made 12 (1.12x greedy, prompt_lookup 1.19x); measured in two rounds, 25 calls (1.21x, 1.36x)
LINEAR = 0.8  # a call is compute-bound where each token it scores costs at least this share of a one-token call
# (`proportional`): 0.85-0.90 for the 1.5B in bfloat16 on the AVX2-only AMD EPYC; SmolLM2-135M's 2- and 3-token calls
# in float32 on the AMD EPYC with AVX-512: 0.82 and 0.67
WEIGHT = 0.1  # how far one observation moves a `RunningMean`: about the last 10 values count; the first ones weigh
# 1, 1/2, 1/3 ... (a running mean) until that falls to WEIGHT
WINDOW = 9  # the calls whose median ratio to the fit is a cost's online correction (`CallCost.observe`). The first
# call is believed at once, so a calibration measured on a busy machine (one draft calibration here had a 0.5B call at
# 0.65 of a 1.5B call; runs measured 0.33) is corrected by the run's first call instead of after tens of calls, which
# auto might never make while the draft looks too dear; from the third call on, a stalled call or two among the last
# WINDOW hardly move it. The running mean it replaces weighed a run's second call 1/2, its third 1/3 ...: a call
# stalled by the machine among them moved the costs of the tens of steps after it
TREE_PRIOR = 4  # calls' weight of the prior that a tree call costs what a causal call of as many tokens costs
# (`CostModel.tree_extra`): one call's time varies by 20% or more on a busy CPU, and believed at once, the run's first
# tree call set it for the steps after. On the Intel Xeon (no AMX), the 1.5B in bfloat16 with the int8 0.5B draft on
# mixed's QA: a first tree call 153 ms over its prediction made trees look that much dearer, and auto took ten plain
# steps (0.3 s each) before a probe found them cheap; its next 14 tree calls brought the extra to -30 ms. Measured
# alone there, a tree mask adds 1-5 ms to a call of SmolLM2-135M (float32) and moving the accepted path 3 ms. Two
# interleaved repeats of that suite (one prompt per category): 142.0 s against 141.0 believing the first call
EVIDENCE = 9  # the calls each knot's correction is the median of (`CallCost.offset`): more than twice the WINDOW // 2
# calls by which the level lags a machine that slowed down or sped up, whose ratios to the old level a knot's median
# thereby leaves out
STALE, STALE_CALLS = 2.0, 8  # a cached curve is marked stale where the median of a run's last calls (at least
# STALE_CALLS of them) takes less than 1 / STALE of what it fitted: it was measured on a busy machine. (Slower calls
# mean a busy machine now, or a run's own bookkeeping: the online correction follows those, and a new measurement
# would be no better.)
Sample = tuple[int, int, float]  # (n tokens scored, L cached, seconds)
UNSAVED: dict[Path, dict] = {}  # cache file -> the curve (`CallCost.to_dict`) measured for it that could not be
# written there (a read-only folder, a folder in the file's place): this process measures each such curve once


@dataclass
class RunningMean:
    """The mean of the first 1 / WEIGHT values added, then an exponential average over about the last 1 / WEIGHT (a
    run's costs drift as its context grows). A prior given as `mean` with `count` 1 weighs as one value; with count 0
    the first value replaces it."""

    mean: float = 0.0
    count: int = 0  # values added (and the prior, when it counts)

    def add(self, value: float) -> None:
        self.count += 1
        self.mean += max(WEIGHT, 1.0 / self.count) * (value - self.mean)


@dataclass
class CallCost:
    """Seconds of one forward call of one model in one role,
    t(n, L) = scale * (f(n) + (per_position + per_position_per_token * (n - 1)) * L)."""

    sizes: tuple[int, ...]  # n at the knots of f, increasing, from 1
    seconds: tuple[float, ...]  # f at the knots: seconds at L = 0, nondecreasing
    per_position: float = 0.0  # seconds per cached position (attention over the context) of a one-token call, >= 0
    per_position_per_token: float = 0.0  # and more per position for each further token scored, >= 0 (`fit`)
    scale: float = 1.0  # online correction, the level: observed / fitted seconds over the last WINDOW calls, each
    # divided by its size's `offset` (a median)
    samples: tuple[Sample, ...] = ()  # the measurements it was fitted to, kept for reports and plots
    history: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW), compare=False)  # (n, log
    # of observed / fitted seconds) of the last calls observed since loaded (not saved: each run corrects from its own
    # first call)
    evidence: dict[int, deque[tuple[float, float]]] = field(default_factory=dict, compare=False)  # knot index ->
    # (weight, log ratio beyond the level) of the last EVIDENCE calls whose size weighs on that knot
    corrections: tuple[tuple[int, ...], tuple[float, ...]] = field(default=((), ()), compare=False)  # (knot sizes
    # with evidence, their log corrections): `offset` interpolates between them
    follows: CallCost | None = field(default=None, compare=False, repr=False)  # until this run has observed a call of
    # this cost's, it is scaled as this other one is (`predict`)
    measured: float | None = field(default=None, compare=False)  # when calibration measured it (`time.time()`)
    noise: float | None = field(default=None, compare=False)  # how much slower than the fastest its repeated calls
    # typically ran (`measure_with_noise`)
    source: Path | None = field(default=None, compare=False, repr=False)  # the cache file it is read from or written
    # to, removed where this run's calls find it far off (`observe`); None once removed, or where not cached

    def fitted(self, n: int, context: int) -> float:
        """Seconds of the calibrated fit, before the online correction."""
        i, r = _segment(self.sizes, n)
        f = self.seconds[i] + r * (self.seconds[i + 1] - self.seconds[i]) if r else self.seconds[i]
        return f + (self.per_position + self.per_position_per_token * (n - 1)) * context

    def predict(self, n: int, context: int) -> float:
        """Expected seconds of a call scoring `n` tokens after `context` cached ones: the fit, corrected by this run's
        calls (`observe`), or before any, scaled as the cost it `follows` is (a draft's, as the target's: a machine
        slower or faster than when calibrated is so for both models).

        Scaled by its own calls only, a draft that had not drafted yet was costed as calibrated while the target's
        calls had come to take 1.3x their calibrated seconds (the int8 0.5B draft of the 1.5B in bfloat16, the AMD
        EPYC on a slow day), so the draft looked a quarter cheaper against them than it was: its probes, which only
        a draft that could pay gets (`Chooser.could_pay`), went on, 2-3 s each on a 30 s run (the draft's catching up
        on the prompt, then a chain)."""
        scale = self.scale if self.history or self.follows is None else self.follows.scale
        return scale * self.offset(n) * self.fitted(n, context)

    def observe(self, n: int, context: int, seconds: float) -> None:
        """Correct the fit by a measured call: its log ratio to the fit (within 1/4 and 4) beyond the level teaches the
        knots its size lies between (`offset`), then the level (`scale`) becomes the median over the last WINDOW calls
        of their ratios to the fit divided by their sizes' offsets (the median of two is their geometric mean)."""
        ratio = math.log(min(max(seconds / self.fitted(n, context), 0.25), 4.0))
        self.history.append((n, ratio))
        level = self._level()
        for knot, weight in _weights(self.sizes, n):
            self.evidence.setdefault(knot, deque(maxlen=EVIDENCE)).append((weight, ratio - level))
        knots = sorted(self.evidence)
        self.corrections = (tuple(self.sizes[k] for k in knots), tuple(_correction(self.evidence[k]) for k in knots))
        self.scale = math.exp(self._level())
        if self.source is not None and len(self.history) >= STALE_CALLS:
            off = math.exp(statistics.median(ratio for _, ratio in self.history))
            if off * STALE < 1:
                self._mark_stale(off)

    def _mark_stale(self, off: float) -> None:
        """Remove the cache file that holds this curve, which this run's calls take `off` times, so that the next run
        measures again (not this one: measuring mid-run would disturb its timing); warn once."""
        path, self.source = self.source, None
        try:
            path.unlink(missing_ok=True)
            outcome = "removed: the next run measures it again"
        except OSError as error:
            outcome = f"could not be removed ({error})"
        warnings.warn(f"calibration {path} is stale: this run's calls take {off:.2g}x its curve; {outcome}",
                      stacklevel=3)

    def _level(self) -> float:
        return statistics.median(ratio - math.log(self.offset(n)) for n, ratio in self.history)

    def offset(self, n: int) -> float:
        """How much dearer than the fit says, beyond the level, calls of `n` tokens have been this run. Each knot of the
        fit learns from the calls whose size lies on its segments, weighted as the fit weighs the knot at that size:
        the weighted median of the last EVIDENCE calls' log ratios beyond the level, shrunk toward none as one call's
        weight against a call that ran as fitted (weight w in all: x w / (w + 1)). Between knots with evidence the
        correction is interpolated, beyond them it is the nearest one's; without any, 1.

        The calibrated curve's knots are each the fastest of a few calls, and one call's time varies by 10-20% on a busy
        CPU, so the curve's shape errs by as much; one scale, taken from the last WINDOW calls, most of them plain
        steps, corrected the plain steps and left the drafts' calls as wrong. SmolLM2-135M in bfloat16 on the AVX2-only
        AMD EPYC, 12 interleaved calls of each size after 150 cached tokens: 1-5 tokens took 33 / 47 / 64 / 78 / 92 ms,
        0.88 / 0.83 / 1.04 / 0.99 / 0.96 of the calibrated curve's times, and in `auto`'s runs the suffix index's
        3-5-token steps took 3-19% more than their plans on the prompts with few of them (code, QA, math), whose scale
        the plain steps set. Corrected per size of call, its 11 prompts of bench, mixed and four held-out ones (two
        interleaved repeats) took 124.7 s against 134.2 without edit's (where a bfloat16 tie changed the text); the 1.5B
        in bfloat16 without a draft on four of them 301.3 against 303.9 (the same steps).

        That correction was one per exact size, from the last 32 calls of any size, relative to their median: a size not
        among them was costed as fitted (so where the fit was too cheap, auto drafted the sizes it had not tried yet,
        each too cheap in turn, and forgot a size's lesson after 32 plain steps), and where most of the last calls
        scored several tokens, their ratio became the scale of one-token calls too. Replayed on greedy's outputs,
        draft-free, each call costing the calibrated curve times a ratio per knot, with noise (`python -m
        devtools.replay_auto RESULT.json --ratios ... --noise 0.15 --seed S`, the mean of seeds 1-3; the calibrations
        cached before the CPU joined their key), estimated seconds against those of the correction per size:
        SmolLM2-135M's 11 prompts (bfloat16) 89.5 against 93.1 where calls of 2 / 4 / 8+ tokens cost 1.3 / 1.8 / 2x
        their calibrated seconds, 63.2 against 64.8 where calls of 1-2 / 3-4 / 8+ tokens cost 0.8 / 1.1 / 1.3x, 76.7
        against 77.4 at the 1.28x (1 token) to 1.10x (16) measured on the AMD EPYC after six sessions, 62.0 against 61.9
        where the calibration is right; the 1.5B's (bfloat16) 615.5 against 643.3, 491.2 against 506.8, 588.6 against
        592.2 and 380.6 against 381.1 in those four, 463.6 against 468.7 at 1.1 / 1.25 / 1.3x and 564.8 against 569.0
        where the one-token calls are the ones 2x dearer."""
        sizes, values = self.corrections
        if not sizes:
            return 1.0
        if n <= sizes[0] or n >= sizes[-1]:
            return math.exp(values[0] if n <= sizes[0] else values[-1])
        j = bisect.bisect_right(sizes, n) - 1
        r = (n - sizes[j]) / (sizes[j + 1] - sizes[j])
        return math.exp(values[j] + r * (values[j + 1] - values[j]))

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "per_position": self.per_position,
                "per_position_per_token": self.per_position_per_token, "scale": self.scale,
                "samples": [list(s) for s in self.samples], "measured": self.measured, "noise": self.noise}

    @classmethod
    def from_dict(cls, data: dict) -> CallCost:
        """The cost `to_dict` wrote; ValueError saying what is wrong where `data` is not one (a damaged cache file)."""
        if not isinstance(data, dict):
            raise ValueError(f"the cost is {json.dumps(data, default=repr)[:40]}, not an object")
        sizes, seconds, samples = data.get("sizes"), data.get("seconds"), data.get("samples", [])
        if (not isinstance(sizes, list | tuple) or not sizes or not all(_whole(n) and n > 0 for n in sizes)
                or any(b <= a for a, b in zip(sizes, sizes[1:]))):
            raise ValueError(f"sizes are {sizes!r}, not increasing whole numbers > 0")
        if not isinstance(seconds, list | tuple) or len(seconds) != len(sizes):
            raise ValueError(f"seconds are {seconds!r}, not one for each of the {len(sizes)} sizes")
        if not isinstance(samples, list | tuple) or not all(
                isinstance(s, list | tuple) and len(s) == 3 and _whole(s[0]) and _whole(s[1]) for s in samples):
            raise ValueError("samples are not [tokens, context, seconds] each")
        optional = {name: None if data.get(name) is None else _number(data[name], name)
                    for name in ("measured", "noise")}
        return cls(tuple(sizes), tuple(_number(s, "seconds", positive=True) for s in seconds),
                   _number(data.get("per_position"), "per_position"),
                   _number(data.get("per_position_per_token", 0.0), "per_position_per_token"),
                   _number(data.get("scale", 1.0), "scale", positive=True),
                   tuple((n, L, _number(s, "a sample's seconds")) for n, L, s in samples), **optional)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value, name: str, positive: bool = False) -> float:
    """`value` as a float where it is a finite number >= 0 (> 0 where `positive`), else ValueError naming it."""
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0
            or (positive and value == 0)):
        raise ValueError(f"{name} holds {value!r}, not a finite number {'> 0' if positive else '>= 0'}")
    return float(value)


def _segment(sizes: tuple[int, ...], n: int) -> tuple[int, float]:
    """(i, r): f(n) = f(sizes[i]) + r * (f(sizes[i + 1]) - f(sizes[i])); the last segment extends past the last knot."""
    if len(sizes) == 1 or n <= sizes[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(sizes, n), len(sizes) - 1) - 1
    return i, (n - sizes[i]) / (sizes[i + 1] - sizes[i])


def _weights(sizes: tuple[int, ...], n: int) -> list[tuple[int, float]]:
    """(knot index, weight) of the knots a call of `n` tokens teaches (`CallCost.offset`): the two around it, each as
    the fit weighs it at n (the nearer, the more); below the first knot or past the last, that knot alone."""
    if n <= sizes[0] or n >= sizes[-1]:
        return [(0 if n <= sizes[0] else len(sizes) - 1, 1.0)]
    i, r = _segment(sizes, n)
    return [(i, 1.0 - r), (i + 1, r)] if r else [(i, 1.0)]


def _correction(pairs) -> float:
    """A knot's log correction from its (weight, log ratio) pairs: their weighted median (the value past which lies
    less than half the weight on either side), shrunk toward none by w / (w + 1), w their weight in all."""
    ordered = sorted(pairs, key=lambda pair: pair[1])
    total, running = sum(w for w, _ in ordered), 0.0
    median = ordered[-1][1]
    for weight, value in ordered:
        running += weight
        if running > total / 2:
            median = value
            break
    return median * total / (total + 1)


def _hat(sizes: tuple[int, ...], n: int) -> list[float]:
    """Weights of the knots in f(n), for the least-squares fit."""
    i, r = _segment(sizes, n)
    weights = [0.0] * len(sizes)
    weights[i] += 1 - r
    if r:
        weights[i + 1] += r
    return weights


def fit(samples: list[Sample], sizes: tuple[int, ...]) -> CallCost:
    """Least-squares fit of f at `sizes` and of the context terms to measured calls; f made nondecreasing.

    The context terms are per_position (the cost of a cached position to a one-token call) and per_position_per_token
    (what each further token scored adds to it): every token scored attends to the whole context, so where the
    context costs something at all it costs more the more tokens attend to it. One term for every size misfits both
    ends: SmolLM2-135M in float32 on the Intel Xeon (no AMX) measured 48.4 / 51.0 ms for one token after 16 / 512
    cached positions and 103.5 / 140.4 ms for 32; one slope (40 us a position) fitted one token at 39.9 ms without
    context, and so costed a 3-token call after 200 positions at 1.40x a one-token call, where calibration had
    measured 1.22x at 16 (`suffix`'s 3-token calls in a run: 1.22x its one-token calls, medians), and auto turned
    down the suffix index's 2-token guesses that `suffix` drafts. Fitted so, it drafts them; its seconds on the
    seven prompts (three interleaved repeats, one calibration refitted both ways) were 70.8 against 71.0, `suffix`
    66.3: on this machine one call's time varies by 20% or more from minute to minute. A term is fitted only
    where the samples can tell it (two context lengths measured for one size, for the first; for two sizes, for the
    second). A term the fit makes negative is raised to nothing, the other kept as fitted with it: SmolLM2-135M in
    float32 on the AVX2-only AMD EPYC took 30 / 73 ms for one token after 16 / 512 positions and 554 / 508 ms for
    32, and dropping the term that came out negative and refitting without it (as this fit did before) dropped both,
    and costed one- and two-token calls alike at 51 ms, where plain steps took 35-60 and two-token ones 56-74;
    `auto` then drafted its int8 copy's and the suffix index's guesses in most steps. Fitted so (87 us a position
    for any call), two interleaved repeats of four of its prompts (code, prose, an article, RAG) ran 46.8 s against
    54.3 (the second repeat alone 22.2 against 24.5), 73-97 of the three long ones' steps plain; greedy ran the four
    in 20-23 s there, `suffix` in 24-26."""
    lengths: dict[int, set[int]] = {}
    for n, L, _ in samples:
        lengths.setdefault(n, set()).add(L)
    varied = sum(len(ls) > 1 for ls in lengths.values())  # sizes measured at more than one context length
    terms = min(varied, 2)  # the context terms the samples can tell
    rows = torch.tensor([_hat(sizes, n) + [L, L * (n - 1)] for n, L, _ in samples],
                        dtype=torch.float64)  # [S, knots + 2]: the knots' weights, then both terms' columns
    times = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)  # [S, 1]
    solution = torch.linalg.lstsq(rows[:, :len(sizes) + terms], times, driver="gelsd").solution[:, 0].tolist()
    per_position, per_token = [*solution[len(sizes):], 0.0, 0.0][:2]
    per_position, per_token = max(0.0, per_position), max(0.0, per_token)
    context = torch.tensor([[L * (per_position + per_token * (n - 1))] for n, L, _ in samples], dtype=torch.float64)
    solution = torch.linalg.lstsq(rows[:, :len(sizes)], times - context, driver="gelsd").solution[:, 0].tolist()
    knots, running = [], 1e-9
    for value in solution:
        running = max(running, value)  # a call never gets cheaper by scoring more tokens
        knots.append(running)
    return CallCost(tuple(sizes), tuple(knots), per_position, per_token, 1.0, tuple(samples))


def _resize(cache, length: int) -> None:
    """Make `cache` hold `length` positions: crop it, or tile its keys and values (timing does not read them)."""
    if len(cache) >= length:
        cache.crop(length)
        return
    for layer in cache.hf.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            reps = -(-length // layer.keys.shape[-2])
            layer.keys = layer.keys.repeat_interleave(reps, dim=-2)[..., :length, :]  # [1, heads, length, head_dim]
            layer.values = layer.values.repeat_interleave(reps, dim=-2)[..., :length, :]


def measure(lm, sizes: tuple[int, ...] = TARGET_SIZES, budget: float = BUDGET) -> list[Sample]:
    """The samples of `measure_with_noise`."""
    return measure_with_noise(lm, sizes, budget)[0]


def measure_with_noise(lm, sizes: tuple[int, ...] = TARGET_SIZES, budget: float = BUDGET) -> tuple[list[Sample], float]:
    """Time a few calls of `lm` scoring `sizes` tokens, with the logits of every position (a target scores a draft,
    a draft checks guesses).

    Two warm-up calls (the SHORT prompt, then one token), then the sizes in turn at SHORT context, up to the first
    that `proportional` says need not be measured, then the smallest and largest measured at LONG (9 calls for the
    target's sizes or a draft's where all are measured); then rounds of those calls again, ROUNDS in all and more until
    `budget` seconds have passed, each point keeping its fastest time, since a busy machine only ever adds time. A 1.5B
    model on a CPU gets two rounds. With the samples, their noise: the median over the points of how much slower than
    its fastest a point's median round ran (0.1: 10%).
    """
    long = min(LONG, (lm.context_length or LONG) - max(sizes) - 1)
    ids = [(7 * i + 3) % lm.vocab_size for i in range(max(SHORT, *sizes))]
    begin = time.perf_counter()
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(ids[:SHORT], cache, keep=1)
        lm.forward(ids[:1], cache, keep=1)

        def call(n: int, context: int) -> float:
            _resize(cache, context)
            lm.synchronize()
            start = time.perf_counter()
            lm.forward(ids[:n], cache, keep=n)
            lm.synchronize()
            return time.perf_counter() - start

        timed: list[tuple[int, float]] = []  # (size, seconds) at SHORT
        for n in sizes:
            if proportional(timed, n):
                break
            timed.append((n, call(n, SHORT)))
        plan = [(n, SHORT) for n, _ in timed] + [(n, long) for n in sorted({timed[0][0], timed[-1][0]})
                                                 if long > SHORT]
        rounds = [[seconds for _, seconds in timed] + [call(n, context) for n, context in plan[len(timed):]]]
        while len(rounds) < ROUNDS or time.perf_counter() - begin < budget:
            rounds.append([call(n, context) for n, context in plan])
    points = list(zip(*rounds))  # [points][rounds] seconds
    noise = statistics.median(statistics.median(times) / min(times) - 1 for times in points)
    return [(n, context, min(times)) for (n, context), times in zip(plan, points)], noise


def proportional(timed: list[tuple[int, float]], n: int) -> bool:
    """Whether a call of `n` tokens need not be measured, given the calls `timed` so far ((size, seconds), sizes
    increasing from 1): where every call of several tokens took at least LINEAR of a one-token call per token (a
    compute-bound call: each token scored costs about as much as the first, the weights' reading little) in at least
    two sizes, and a call of `n` tokens, extrapolating the last segment, would take more than BUDGET. The fit extends
    that segment past the last size measured (`_segment`), as calibration would have found it.

    On an AMD EPYC with AVX2 alone (no AVX-512: bfloat16 is computed in float), the 1.5B in bfloat16 took 198, 344,
    504, 753, 1273, 2518 and 5354 ms for 1, 2, 3, 4, 8, 16 and 32 tokens: measuring every size and the smallest and
    largest again after 512 positions took 16 s where the issue asks well under one (now 4.7 s, 2.5 of them the
    warm-up's 16 tokens). Stopping after 3, the last segment costs 4 / 8 / 16 / 32 tokens at 664 / 1304 / 2584 / 5144
    ms. Where the weights' reading dominates (a GPU; a CPU with bfloat16 or int8 kernels: the 1.5B in bfloat16 on an
    AMD EPYC with AVX-512, 139-168 ms for 1-5 tokens; the 0.5B's int8 copy on the AVX2 one, 81 / 94 / 105 / 130 / 200
    ms for 1-5) or the calls are cheap (SmolLM2-135M's 41, 67, 83 ms for 1, 2, 3 in float32, then 61-71 for 4),
    every size is measured."""
    if len(timed) < 3:
        return False
    one = timed[0][1]
    (b, tb), (c, tc) = timed[-2:]
    compute_bound = all(t >= LINEAR * one * m for m, t in timed[1:])
    return compute_bound and tc + (tc - tb) * (n - c) / (c - b) > BUDGET


def machine(device: torch.device) -> str:
    """The device as calibrations tell them apart: "cuda:0 <the GPU's name>", "cpu <`processor`>"."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"{device} {processor()}" if device.type == "cpu" else str(device)


def processor() -> str:
    """This machine's CPU as calibrations tell machines apart: its model (`cpu_model`) and the instruction set torch's
    CPU kernels use (AVX2, AVX512, ...)."""
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def calibration_key(lm, role: str, sizes: tuple[int, ...]) -> dict:
    """What a calibration depends on: the model (name, config, parameter shapes and dtypes), dtype, device (`machine`: a
    GPU by its name, a CPU by `processor`), threads, torch version, role and measured sizes. Another key means another
    cache file: a cache folder shared by machines of different CPUs (a home directory on a cluster's network drive, a
    container volume) holds one calibration per CPU, where a key without the CPU had each machine plan with the costs of
    whichever measured first (the developers' machines so far: an AMD EPYC with AVX2 alone, where a 16-token call of
    SmolLM2-135M in bfloat16 costs about 8x a one-token one, bfloat16 computed in float, and an Intel Xeon with AMX,
    whose matrix units compute it)."""
    model = lm.model
    try:
        config = model.config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a config holding something JSON cannot write
        config = repr(model.config)
    tensors = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in (*model.named_parameters(), *model.named_buffers())]
    fingerprint = hashlib.sha256("\n".join([type(model).__name__, config, *tensors]).encode()).hexdigest()[:16]
    return {"role": role, "name": lm.name, "model": fingerprint, "dtype": str(lm.dtype), "device": machine(lm.device),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "sizes": list(sizes)}


def cache_file(key: dict, folder: Path | None = None) -> Path:
    """The JSON file of a calibration key: `<folder>/<role>-<name>-<hash>.json`; the folder defaults to
    $DECODEKIT_CALIBRATION, else `cache_dir()/calibration` (the tests point the variable at a temporary folder)."""
    if folder is None:
        from decoders.models.zoo import cache_dir

        folder = os.environ.get("DECODEKIT_CALIBRATION") or cache_dir() / "calibration"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key["name"])[-60:]
    return Path(folder) / f"{key['role']}-{name}-{digest}.json"


def planned_sizes(lm, role: str) -> tuple[int, ...]:
    """The call sizes calibration measures `lm` at in `role` ("target" or "draft"): those its context holds after SHORT
    tokens (a tiny draft may hold fewer positions than SHORT + 16)."""
    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    room = (lm.context_length or math.inf) - SHORT
    return tuple(n for n in (TARGET_SIZES if role == "target" else DRAFT_SIZES) if n == 1 or n <= room)


def call_cost(lm, role: str = "target", *, cache: bool = True, refresh: bool = False, folder: Path | None = None,
              budget: float = BUDGET) -> CallCost:
    """The cost of `lm`'s calls in `role` ("target" or "draft"): from the cache file when it matches, else measured
    (and written unless `cache=False`; `refresh=True` measures again). A file that holds no valid curve is warned of
    and replaced; a curve that cannot be written is warned of and kept in memory (`UNSAVED`): a cache never fails a
    run."""
    sizes = planned_sizes(lm, role)
    key = calibration_key(lm, role, sizes)
    path = cache_file(key, folder)
    if cache and not refresh:
        if path in UNSAVED:
            return CallCost.from_dict(UNSAVED[path])
        try:
            cost = _read(path, key)
            if cost is not None:
                return cost
        except ValueError as error:
            warnings.warn(f"calibration {path}: {error}; measuring it again", stacklevel=2)
    samples, noise = measure_with_noise(lm, sizes, budget)
    cost = fit(samples, tuple(sorted({n for n, _, _ in samples})))  # (the sizes measured: see `proportional`)
    cost.measured, cost.noise = time.time(), noise
    if cache:
        partial = path.with_suffix(f".{os.getpid()}.tmp")  # processes of one `accelerate launch` may race here
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"version": VERSION, "key": key, "cost": cost.to_dict()}, indent=1))
            partial.replace(path)
            cost.source = path
            UNSAVED.pop(path, None)
        except OSError as error:  # read-only, full, a file or folder in the way: measured, but not saved
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            warnings.warn(f"calibration {path} could not be saved ({error}); this process keeps it", stacklevel=2)
            UNSAVED[path] = cost.to_dict()
    return cost


def _read(path: Path, key: dict) -> CallCost | None:
    """The curve cached at `path` for `key`; None where there is none, or one of another version or key (measured
    again without a word); ValueError saying what is wrong where the file holds no valid curve."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # unreadable, truncated, empty, binary
        raise ValueError(f"not readable as JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"holds {json.dumps(data)[:40]}, not a calibration")
    if data.get("version") != VERSION or data.get("key") != key:
        return None
    cost = CallCost.from_dict(data.get("cost"))
    cost.source = path
    return cost


@dataclass
class CostModel:
    """Seconds of this run's target and draft calls.

    A target call that scores a token tree (or carries lookahead's window) takes a 4D attention mask and, after it,
    the accepted path is moved into place in the cache: it may cost more than the causal call of as many tokens that
    calibration measures (where attention with a custom mask takes a slower kernel), by `tree_extra` seconds,
    learned from the run's tree calls (not calibrated: a run without trees pays nothing to measure it). On the AMD
    EPYC it came to about nothing: -12 to +14 ms on 131-180 ms calls of the 1.5B (bfloat16), -3 to 0 ms for
    SmolLM2-135M (float32), whose tree steps had looked 30 ms dear until calibration measured 2- and 3-token calls.
    So it starts from nothing, weighed as TREE_PRIOR calls.
    """

    target: CallCost
    draft: CallCost | None = None  # None: no draft model
    observed: dict[str, int] = field(default_factory=dict)  # calls observed per kind, for reports
    tree_extras: RunningMean = field(default_factory=lambda: RunningMean(0.0, TREE_PRIOR))  # seconds tree calls cost
    # beyond causal calls of as many tokens

    def __post_init__(self):
        if self.draft is not None:
            self.draft.follows = self.target  # (the draft scaled as the target until its own calls are observed)

    @property
    def tree_extra(self) -> float:
        """Seconds a tree call costs beyond a causal call of as many tokens, as the run's tree calls measured it."""
        return self.tree_extras.mean

    def target_seconds(self, n: int, context: int, tree: bool = False) -> float:
        """One target call scoring `n` tokens (a draft of n - 1 plus one) after `context` cached ones; `tree`: a
        call with a tree mask."""
        return self.target.predict(n, context) + (max(0.0, self.tree_extra) if tree else 0.0)

    def draft_seconds(self, calls: int, context: int, catch_up: int = 1) -> float:
        """A draft model's chain of `calls` tokens after `context`: its first call feeds the `catch_up` tokens the
        draft has not seen (1 after a step that drafted with it, more after steps it sat out), the others one each."""
        if calls == 0:
            return 0.0
        if self.draft is None:
            raise ValueError("this cost model has no draft model: calibrate(lm, draft=...) to cost draft calls")
        return self.draft.predict(catch_up, context) + (calls - 1) * self.draft.predict(1, context)

    def observe(self, kind: str, n: int, context: int, seconds: float, tree: bool = False) -> None:
        """Refine the `kind` ("target" or "draft") cost with a measured call of `n` tokens after `context`
        (`CallCost.observe`); a target call with a tree mask (`tree`) refines `tree_extra` instead."""
        part = self.target if kind == "target" else self.draft
        if kind not in ("target", "draft") or part is None:
            raise ValueError(f"cannot observe a {kind!r} call: kinds are 'target' and, with a draft model, 'draft'")
        if n > (TARGET_SIZES if kind == "target" else DRAFT_SIZES)[-1]:
            return  # a call longer than calibration measures (a prompt's, or a draft's catch-up on it) is costed by
        # extrapolating far past the last knot: it tells little
        kind = "tree" if tree and kind == "target" else kind
        self.observed[kind] = self.observed.get(kind, 0) + 1
        if kind == "tree":
            self.tree_extras.add(seconds - part.predict(n, context))
        else:
            part.observe(n, context, seconds)

    def to_dict(self) -> dict:
        return {"target": self.target.to_dict(), "draft": None if self.draft is None else self.draft.to_dict(),
                "observed": dict(self.observed), "tree_extra": self.tree_extra}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        draft = None if data.get("draft") is None else CallCost.from_dict(data["draft"])
        observed = dict(data.get("observed", {}))
        return cls(CallCost.from_dict(data["target"]), draft, observed,
                   RunningMean(data.get("tree_extra", 0.0), TREE_PRIOR + observed.get("tree", 0)))


def calibrate(lm, draft=None, *, cache: bool = True, refresh: bool = False, folder: Path | None = None,
              budget: float = BUDGET) -> CostModel:
    """The cost model of `lm` as the target and `draft` (an LM or None) as the draft, measured or from the cache."""
    options = dict(cache=cache, refresh=refresh, folder=folder, budget=budget)
    drafts = None if draft is None else call_cost(draft, "draft", **options)
    return CostModel(call_cost(lm, "target", **options), drafts)
