"""A cost model of this device: how many seconds a target or draft call takes, measured once and refined online
(`calibrate`, cached per model, dtype, device, CPU, threads and torch version; evidence in docs/design/auto.md)."""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
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

from decoders.models.device import cpu_model
from decoders.models.linear import native_count

VERSION = 7  # of the cache file format and what it measures: files of another version are measured again
TARGET_SIZES = (1, 2, 3, 4, 8, 16, 32)  # the target's measured n; dense, as its curve need not be convex
DRAFT_SIZES = (1, 2, 3, 4, 5, 8, 16)  # a draft's measured n; 5 as int8 kernels run rows in blocks of four
SHORT, LONG = 16, 512  # the two context lengths measured (LONG capped by the model's context)
BUDGET = 0.25  # seconds per model: rounds repeat until then (at least ROUNDS); dearer sizes are extrapolated
ROUNDS = 2  # measuring rounds at least, each point keeping its fastest: a process's first calls run slow
LINEAR = 0.8  # share of a one-token call each further token costs at least where a call is compute-bound
PROPORTIONAL_FROM = 4  # the least size that shows it: float32 products of 2-3 rows can cost by the row, of 4 not
WEIGHT = 0.1  # how far one value moves a `RunningMean`: about the last 1 / WEIGHT count
WINDOW = 9  # the last calls whose median ratio to the fit is the level (`CallCost.scale`); the first is believed
EVIDENCE = 9  # the last calls per knot whose weighted median is its correction (`CallCost.offset`)
STALE, STALE_CALLS = 2.0, 8  # stale: a run's last calls (>= STALE_CALLS) take under 1 / STALE of the cached fit
Sample = tuple[int, int, float]  # (n tokens scored, L cached, seconds)
UNSAVED: dict[Path, dict] = {}  # cache file -> curve (`CallCost.to_dict`) that could not be written: measured once


@dataclass
class RunningMean:
    """The mean of the first 1 / WEIGHT values added, then an exponential average over about the last 1 / WEIGHT. A
    prior `mean` with `count` 1 weighs as one value; with count 0 the first value replaces it."""

    mean: float = 0.0
    count: int = 0  # values added, the prior included when it counts

    def add(self, value: float) -> None:
        self.count += 1
        self.mean += max(WEIGHT, 1.0 / self.count) * (value - self.mean)


@dataclass
class CallCost:
    """Seconds of one forward call of one model in one role: scoring n new tokens after L cached ones costs
    scale * offset(n) * (f(n) + (per_position + per_position_per_token * (n - 1)) * L), f piecewise linear through the
    measured sizes, `observe` correcting it by the run's calls."""

    sizes: tuple[int, ...]  # n at the knots of f, increasing, from 1
    seconds: tuple[float, ...]  # f at the knots: seconds at L = 0, nondecreasing
    per_position: float = 0.0  # seconds per cached position of a one-token call, >= 0
    per_position_per_token: float = 0.0  # more per position for each further token scored, >= 0
    scale: float = 1.0  # the level: median over the last WINDOW calls of observed / fitted / offset
    samples: tuple[Sample, ...] = ()  # the measurements fitted, for reports
    # (n, log observed / fitted) of this run's last calls
    history: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW), compare=False)
    # knot index -> (weight, log ratio beyond the level) of its last EVIDENCE calls
    evidence: dict[int, deque[tuple[float, float]]] = field(default_factory=dict, compare=False)
    # (sizes of the knots with evidence, their log corrections)
    corrections: tuple[tuple[int, ...], tuple[float, ...]] = field(default=((), ()), compare=False)
    follows: CallCost | None = field(default=None, compare=False, repr=False)  # its scale until a call of its own
    measured: float | None = field(default=None, compare=False)  # `time.time()` when calibration measured it
    noise: float | None = field(default=None, compare=False)  # typical slowdown of repeated calls over the fastest
    source: Path | None = field(default=None, compare=False, repr=False)  # its cache file; None: none or stale

    def fitted(self, n: int, context: int) -> float:
        """Seconds of the calibrated fit, before the online correction."""
        i, r = _segment(self.sizes, n)
        f = self.seconds[i] + r * (self.seconds[i + 1] - self.seconds[i]) if r else self.seconds[i]
        return f + (self.per_position + self.per_position_per_token * (n - 1)) * context

    def predict(self, n: int, context: int) -> float:
        """Expected seconds of a call scoring `n` tokens after `context` cached ones: scale * offset(n) * fit."""
        scale = self.scale if self.history or self.follows is None else self.follows.scale
        return scale * self.offset(n) * self.fitted(n, context)

    def observe(self, n: int, context: int, seconds: float) -> None:
        """Correct the fit by a measured call: its log ratio to the fit (clipped to 1/4..4) beyond the level teaches
        the knots around n (`offset`), and sets the level (`scale`). Removes the cache file once it is STALE."""
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
            if off * STALE < 1:  # measured on a busy machine: the next run measures it again
                path, self.source = self.source, None
                try:
                    path.unlink(missing_ok=True)
                    outcome = "removed: the next run measures it again"
                except OSError as error:
                    outcome = f"could not be removed ({error})"
                warnings.warn(
                    f"calibration {path} is stale: this run's calls take {off:.2g}x its curve; {outcome}", stacklevel=2
                )

    def _level(self) -> float:
        return statistics.median(ratio - math.log(self.offset(n)) for n, ratio in self.history)

    def offset(self, n: int) -> float:
        """How much dearer than fit and level calls of `n` tokens ran: knots' `_correction`s interpolated, else 1."""
        sizes, values = self.corrections
        if not sizes:
            return 1.0
        if n <= sizes[0] or n >= sizes[-1]:
            return math.exp(values[0] if n <= sizes[0] else values[-1])
        j, r = _segment(sizes, n)
        return math.exp(values[j] + r * (values[j + 1] - values[j]))

    def to_dict(self) -> dict:
        return {
            "sizes": list(self.sizes),
            "seconds": list(self.seconds),
            "per_position": self.per_position,
            "per_position_per_token": self.per_position_per_token,
            "scale": self.scale,
            "samples": [list(s) for s in self.samples],
            "measured": self.measured,
            "noise": self.noise,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CallCost:
        """The cost `to_dict` wrote; ValueError saying what is wrong where `data` is not one (a damaged cache file)."""
        if not isinstance(data, dict):
            raise ValueError(f"the cost is {json.dumps(data, default=repr)[:40]}, not an object")
        sizes, seconds, samples = data.get("sizes"), data.get("seconds"), data.get("samples", [])
        if (
            not isinstance(sizes, list | tuple)
            or not sizes
            or not all(_whole(n) and n > 0 for n in sizes)
            or any(b <= a for a, b in zip(sizes, sizes[1:]))
        ):
            raise ValueError(f"sizes are {sizes!r}, not increasing whole numbers > 0")
        if not isinstance(seconds, list | tuple) or len(seconds) != len(sizes):
            raise ValueError(f"seconds are {seconds!r}, not one for each of the {len(sizes)} sizes")
        if not isinstance(samples, list | tuple) or not all(
            isinstance(s, list | tuple) and len(s) == 3 and _whole(s[0]) and _whole(s[1]) for s in samples
        ):
            raise ValueError("samples are not [tokens, context, seconds] each")
        seconds = tuple(_number(s, "seconds", positive=True) for s in seconds)
        if any(b < a for a, b in zip(seconds, seconds[1:])):  # (`fit` never writes one: hand-edited or damaged)
            raise ValueError(
                f"seconds are {list(seconds)}, falling as the tokens rise: extended, the curve would "
                "predict negative seconds for wider calls"
            )
        optional = {
            name: None if data.get(name) is None else _number(data[name], name) for name in ("measured", "noise")
        }
        return cls(
            tuple(sizes),
            seconds,
            _number(data.get("per_position"), "per_position"),
            _number(data.get("per_position_per_token", 0.0), "per_position_per_token"),
            _number(data.get("scale", 1.0), "scale", positive=True),
            tuple((n, L, _number(s, "a sample's seconds")) for n, L, s in samples),
            **optional,
        )


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value, name: str, positive: bool = False) -> float:
    """`value` as a float where it is a finite number >= 0 (> 0 where `positive`), else ValueError naming it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise ValueError(f"{name} holds {value!r}, not a finite number {'> 0' if positive else '>= 0'}")
    return float(value)


def _segment(sizes: tuple[int, ...], n: int) -> tuple[int, float]:
    """(i, r): f(n) = f(sizes[i]) + r * (f(sizes[i + 1]) - f(sizes[i])); the last segment extends past the last knot."""
    if len(sizes) == 1 or n <= sizes[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(sizes, n), len(sizes) - 1) - 1
    return i, (n - sizes[i]) / (sizes[i + 1] - sizes[i])


def _weights(sizes: tuple[int, ...], n: int) -> list[tuple[int, float]]:
    """(knot index, weight) of the knots a call of `n` tokens teaches: the two around n as f weighs them, or the end."""
    if n <= sizes[0] or n >= sizes[-1]:
        return [(0 if n <= sizes[0] else len(sizes) - 1, 1.0)]
    i, r = _segment(sizes, n)
    return [(i, 1.0 - r), (i + 1, r)] if r else [(i, 1.0)]


def _correction(pairs) -> float:
    """A knot's log correction from (weight, log ratio) pairs: their weighted median times w / (w + 1), w the total."""
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
    """Least-squares fit of f at `sizes` and of the context terms to `samples`; f made nondecreasing. A context term
    is fitted per size measured at two context lengths (up to two); one fitted negative is 0, the rest refitted."""
    lengths: dict[int, set[int]] = {}
    for n, L, _ in samples:
        lengths.setdefault(n, set()).add(L)
    varied = sum(len(ls) > 1 for ls in lengths.values())  # sizes measured at more than one context length
    terms = min(varied, 2)
    rows = torch.tensor(
        [_hat(sizes, n) + [L, L * (n - 1)] for n, L, _ in samples], dtype=torch.float64
    )  # [S, knots + 2]: the knots' weights, then both terms' columns
    times = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)  # [S, 1]
    solution = torch.linalg.lstsq(rows[:, : len(sizes) + terms], times, driver="gelsd").solution[:, 0].tolist()
    per_position, per_token = [*solution[len(sizes) :], 0.0, 0.0][:2]
    per_position, per_token = max(0.0, per_position), max(0.0, per_token)
    context = torch.tensor([[L * (per_position + per_token * (n - 1))] for n, L, _ in samples], dtype=torch.float64)
    solution = torch.linalg.lstsq(rows[:, : len(sizes)], times - context, driver="gelsd").solution[:, 0].tolist()
    knots = list(itertools.accumulate(solution, max, initial=1e-9))[1:]  # a call never gets cheaper by scoring more
    return CallCost(tuple(sizes), tuple(knots), per_position, per_token, 1.0, tuple(samples))


def measure(lm, sizes: tuple[int, ...] = TARGET_SIZES, budget: float = BUDGET) -> tuple[list[Sample], float]:
    """(samples, noise) of `lm`'s calls of `sizes` tokens (all logits kept) at SHORT until `proportional`, the least and
    most at LONG, each point's fastest of ROUNDS+ rounds in `budget` s; noise: median over points of median/min - 1."""
    long = min(LONG, (lm.context_length or LONG) - max(sizes) - 1)
    ids = [(7 * i + 3) % lm.vocab_size for i in range(max(SHORT, *sizes))]
    begin = time.perf_counter()
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(ids[:SHORT], cache, keep=1)
        lm.forward(ids[:1], cache, keep=1)

        def call(n: int, context: int) -> float:
            cache.resize(context)  # (its keys as they come: timing does not read them)
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
        plan = [(n, SHORT) for n, _ in timed] + [(n, long) for n in sorted({timed[0][0], timed[-1][0]}) if long > SHORT]
        rounds = [[seconds for _, seconds in timed] + [call(n, context) for n, context in plan[len(timed) :]]]
        while len(rounds) < ROUNDS or time.perf_counter() - begin < budget:
            rounds.append([call(n, context) for n, context in plan])
    points = list(zip(*rounds))  # [points][rounds] seconds
    noise = statistics.median(statistics.median(times) / min(times) - 1 for times in points)
    return [(n, context, min(times)) for (n, context), times in zip(plan, points)], noise


def proportional(timed: list[tuple[int, float]], n: int) -> bool:
    """Whether a call of `n` tokens need not be measured after `timed` ((size, seconds), sizes from 1): sizes through
    PROPORTIONAL_FROM timed, all compute-bound (LINEAR of a one-token call per token), the last segment extrapolated to
    `n` past BUDGET."""
    if not timed or timed[-1][0] < PROPORTIONAL_FROM:
        return False
    one = timed[0][1]
    (b, tb), (c, tc) = timed[-2:]
    compute_bound = all(t >= LINEAR * one * m for m, t in timed[1:])
    return compute_bound and tc + (tc - tb) * (n - c) / (c - b) > BUDGET


def machine(device: torch.device) -> str:
    """The device as calibrations tell them apart: "cuda:0 <GPU name>", "cpu <CPU model> (<AVX2, AVX512, ...>)"."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"{device} {cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"
    return str(device)


def calibration_key(lm, role: str, sizes: tuple[int, ...]) -> dict:
    """What a calibration depends on: role, name, model, attention, the native step or layers, dtype, `machine`,
    threads, torch and sizes."""
    model = lm.model
    try:
        config = model.config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a config holding something JSON cannot write
        config = repr(model.config)
    # the weights and saved buffers, not the ones kept only in memory: an int8 layer keeps the float weight for the call
    # sizes its timing found faster there, which varies from process to process
    tensors = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in model.state_dict(keep_vars=True).items()]
    fingerprint = hashlib.sha256("\n".join([type(model).__name__, config, *tensors]).encode()).hexdigest()[:16]
    attention = getattr(model.config, "_attn_implementation", None)
    return {
        "role": role,
        "name": lm.name,
        "model": fingerprint,
        "attention": attention,
        "native": getattr(lm, "native", None) is not None,
        "native_layers": native_count(model),
        "dtype": str(lm.dtype),
        "device": machine(lm.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "sizes": list(sizes),
    }


def cache_file(key: dict, folder: Path | None = None) -> Path:
    """The JSON file of a calibration key: `<folder>/<role>-<name>-<hash>.json`; the folder defaults to
    $DECODEKIT_CALIBRATION, else `cache_dir()/calibration`."""
    if folder is None:
        from decoders.models.zoo import cache_dir

        folder = os.environ.get("DECODEKIT_CALIBRATION") or cache_dir() / "calibration"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key["name"])[-60:]
    return Path(folder) / f"{key['role']}-{name}-{digest}.json"


def planned_sizes(lm, role: str) -> tuple[int, ...]:
    """The call sizes calibration measures `lm` at in `role` ("target" or "draft") that fit after SHORT tokens."""
    if role not in ("target", "draft"):
        raise ValueError(f"role must be 'target' or 'draft', got {role!r}")
    room = (lm.context_length or math.inf) - SHORT
    return tuple(n for n in (TARGET_SIZES if role == "target" else DRAFT_SIZES) if n == 1 or n <= room)


def call_cost(
    lm,
    role: str = "target",
    *,
    cache: bool = True,
    refresh: bool = False,
    folder: Path | None = None,
    budget: float = BUDGET,
) -> CallCost:
    """The cost of `lm`'s calls in `role`: from the cache file when it matches, else measured (and written unless
    `cache=False`; `refresh=True` measures again). A bad or unwritable file is warned of: a cache never fails a run."""
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
    samples, noise = measure(lm, sizes, budget)
    cost = fit(samples, tuple(sorted({n for n, _, _ in samples})))  # the sizes measured (`proportional`)
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
    """The curve cached at `path` for `key`; None where none (or of another version or key); ValueError if invalid."""
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
    """Seconds of this run's target and draft calls (a tree-masked call costed as a causal one)."""

    target: CallCost
    draft: CallCost | None = None  # None: no draft model
    batch_tokens: int = 0  # in a batch, the tokens its shared target call scores in all rows (`DecodeState`)
    stall: float = 1.0  # in a batch, what a second of a row's drafting costs the batch in rows' seconds (`DecodeState`)

    def __post_init__(self):
        if self.draft is not None:
            self.draft.follows = self.target

    def target_seconds(self, n: int, context: int) -> float:
        """One target call scoring `n` tokens after `context` cached ones (in a batch, the shared call's width)."""
        return self.target.predict(max(n, self.batch_tokens), context)

    def draft_seconds(self, calls: int, context: int, catch_up: int = 1) -> float:
        """A draft chain of `calls` tokens after `context`, its first call feeding `catch_up` tokens, the others one."""
        if calls == 0:
            return 0.0
        if self.draft is None:
            raise ValueError("this cost model has no draft model: calibrate(lm, draft=...) to cost draft calls")
        return self.draft.predict(catch_up, context) + (calls - 1) * self.draft.predict(1, context)

    def observe(self, kind: str, n: int, context: int, seconds: float) -> None:
        """Refine the `kind` ("target" or "draft") cost with a measured call of `n` tokens after `context`; calls
        longer than calibration measures are ignored (extrapolated far past the last knot, they tell little)."""
        part = self.target if kind == "target" else self.draft
        if kind not in ("target", "draft") or part is None:
            raise ValueError(f"cannot observe a {kind!r} call: kinds are 'target' and, with a draft model, 'draft'")
        if n > (TARGET_SIZES if kind == "target" else DRAFT_SIZES)[-1]:
            return
        part.observe(n, context, seconds)


def calibrate(
    lm, draft=None, *, cache: bool = True, refresh: bool = False, folder: Path | None = None, budget: float = BUDGET
) -> CostModel:
    """The cost model of `lm` as the target and `draft` (an LM or None) as the draft, measured or from the cache."""
    options = dict(cache=cache, refresh=refresh, folder=folder, budget=budget)
    drafts = None if draft is None else call_cost(draft, "draft", **options)
    return CostModel(call_cost(lm, "target", **options), drafts)
