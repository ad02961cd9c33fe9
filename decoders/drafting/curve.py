"""`CallCost`: a model's call seconds, fitted to measured calls (`fit`) and corrected by a run's own (`observe`)."""

from __future__ import annotations

import bisect
import itertools
import json
import math
import statistics
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

WEIGHT = 0.1  # how far one value moves a `RunningMean`
WINDOW = 9  # the last calls whose median ratio to the fit is the level (`CallCost.scale`); the first is believed
EVIDENCE = 9  # calls per knot whose weighted median is its correction (`CallCost.offset`)
STALE, STALE_CALLS = 2.0, 8  # stale: a run's last calls (>= STALE_CALLS) take under 1 / STALE of the cached fit
Sample = tuple[int, int, float]  # (n tokens scored, L cached, seconds)


@dataclass
class RunningMean:
    """The mean of the first 1 / WEIGHT values, then an exponential average of about the last 1 / WEIGHT; a prior
    `mean` with `count` 1 weighs as one value, with 0 the first value replaces it."""

    mean: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.count += 1
        self.mean += max(WEIGHT, 1.0 / self.count) * (value - self.mean)


@dataclass
class CallCost:
    """Seconds of one forward call of one model in one role: scoring n new tokens after L cached ones costs
    scale * offset(n) * (f(n) + (per_position + per_position_per_token * (n - 1)) * L), f piecewise linear."""

    sizes: tuple[int, ...]  # n at the knots of f, increasing, from 1
    seconds: tuple[float, ...]  # f at the knots (L = 0), nondecreasing
    per_position: float = 0.0  # >= 0
    per_position_per_token: float = 0.0  # >= 0
    scale: float = 1.0  # the level (`observe`)
    samples: tuple[Sample, ...] = ()  # for reports
    # (n, log observed / fitted) of the run's last calls
    history: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW), compare=False)
    # knot index -> (weight, log ratio beyond the level) of its last EVIDENCE calls
    evidence: dict[int, deque[tuple[float, float]]] = field(default_factory=dict, compare=False)
    # (knots with evidence, their log corrections)
    corrections: tuple[tuple[int, ...], tuple[float, ...]] = field(default=((), ()), compare=False)
    follows: CallCost | None = field(default=None, compare=False, repr=False)  # its scale until a call of its own
    measured: float | None = field(default=None, compare=False)  # `time.time()` of calibration
    noise: float | None = field(default=None, compare=False)  # typical slowdown of calls over the fastest
    source: Path | None = field(default=None, compare=False, repr=False)  # its cache file; None: none or stale

    def fitted(self, n: int, context: int) -> float:
        """Seconds of the calibrated fit, uncorrected."""
        i, r = _segment(self.sizes, n)
        f = self.seconds[i] + r * (self.seconds[i + 1] - self.seconds[i]) if r else self.seconds[i]
        return f + (self.per_position + self.per_position_per_token * (n - 1)) * context

    def predict(self, n: int, context: int) -> float:
        """Expected seconds of a call scoring `n` tokens after `context` cached ones."""
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
        """The cost `to_dict` wrote; ValueError saying what is wrong (a damaged cache file)."""
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
        if any(b < a for a, b in zip(seconds, seconds[1:])):  # hand-edited or damaged: `fit` never writes one
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
    """`value` as a float, else ValueError naming it."""
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
    """(knot index, weight) of the knots a call of `n` tokens teaches, weighted as in f."""
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
    """Weights of the knots in f(n)."""
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
    varied = sum(len(ls) > 1 for ls in lengths.values())
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
