"""A cost model of this device's target and draft calls, measured once and refined online (docs/design/auto.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from decoders.drafting.curve import CallCost, Sample, fit
from decoders.models.device import cpu_model
from decoders.models.linear import native_count

VERSION = 7  # of the cache files and what they measure: other versions are measured again
TARGET_SIZES = (1, 2, 3, 4, 8, 16, 32)  # the target's measured n; dense, as its curve need not be convex
DRAFT_SIZES = (1, 2, 3, 4, 5, 8, 16)  # a draft's measured n; 5 as int8 kernels run rows in blocks of four
SHORT, LONG = 16, 512  # the two context lengths measured (LONG capped by the model's context)
BUDGET = 0.25  # seconds of measuring per model; dearer sizes are extrapolated
ROUNDS = 2  # at least, each point keeping its fastest: a process's first calls run slow
LINEAR = 0.8  # share of a one-token call each further token costs at least where a call is compute-bound
PROPORTIONAL_FROM = 4  # float32 products of 2-3 rows can cost by the row, of 4 not
UNSAVED: dict[Path, dict] = {}  # cache file -> curve that could not be written: measured once per process


def measure(lm, sizes: tuple[int, ...] = TARGET_SIZES, budget: float = BUDGET) -> tuple[list[Sample], float]:
    """(samples, noise) of `lm`'s calls of `sizes` tokens; noise: median over points of median / min - 1."""
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

        timed: list[tuple[int, float]] = []  # at SHORT
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
    """Whether `n` tokens need not be measured: `timed` is compute-bound and `n` extrapolates past BUDGET."""
    if not timed or timed[-1][0] < PROPORTIONAL_FROM:
        return False
    one = timed[0][1]
    (b, tb), (c, tc) = timed[-2:]
    compute_bound = all(t >= LINEAR * one * m for m, t in timed[1:])
    return compute_bound and tc + (tc - tb) * (n - c) / (c - b) > BUDGET


def machine(device: torch.device) -> str:
    """The device as calibrations tell them apart."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"{device} {cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"
    return str(device)


def calibration_key(lm, role: str, sizes: tuple[int, ...]) -> dict:
    """What a calibration depends on: the cache file's key."""
    model = lm.model
    try:
        config = model.config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a config holding something JSON cannot write
        config = repr(model.config)
    # saved tensors only: an int8 layer also keeps in memory float weights for the call sizes its timing picked,
    # which vary from process to process
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
    """`key`'s file; the folder defaults to $DECODEKIT_CALIBRATION, else `cache_dir()/calibration`."""
    if folder is None:
        from decoders.models.zoo import cache_dir

        folder = os.environ.get("DECODEKIT_CALIBRATION") or cache_dir() / "calibration"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key["name"])[-60:]
    return Path(folder) / f"{key['role']}-{name}-{digest}.json"


def planned_sizes(lm, role: str) -> tuple[int, ...]:
    """The call sizes calibration measures `lm` at in `role`."""
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
    """The cost of `lm`'s calls in `role`, cached or measured; a bad or unwritable file is only warned of."""
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
        except OSError as error:  # read-only, full, a file or folder in the way
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            warnings.warn(f"calibration {path} could not be saved ({error}); this process keeps it", stacklevel=2)
            UNSAVED[path] = cost.to_dict()
    return cost


def _read(path: Path, key: dict) -> CallCost | None:
    """The curve cached at `path` for `key`, or None; ValueError if the file is invalid."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
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
    batch_tokens: int = 0  # in a batch, the width of its shared target call (the step's `Budget`)
    stall: float = 1.0  # in a batch, rows' seconds a second of a row's drafting costs (`Budget`)

    def __post_init__(self):
        if self.draft is not None:
            self.draft.follows = self.target

    def target_seconds(self, n: int, context: int) -> float:
        """One target call scoring `n` tokens after `context` cached ones."""
        return self.target.predict(max(n, self.batch_tokens), context)

    def draft_seconds(self, calls: int, context: int, catch_up: int = 1) -> float:
        """A draft chain of `calls` tokens after `context`, its first call feeding `catch_up` tokens."""
        if calls == 0:
            return 0.0
        if self.draft is None:
            raise ValueError("this cost model has no draft model: calibrate(lm, draft=...) to cost draft calls")
        return self.draft.predict(catch_up, context) + (calls - 1) * self.draft.predict(1, context)

    def observe(self, kind: str, n: int, context: int, seconds: float) -> None:
        """Refine the `kind` cost with a measured call; wider calls than calibrated tell little and are ignored."""
        part = self.target if kind == "target" else self.draft
        if kind not in ("target", "draft") or part is None:
            raise ValueError(f"cannot observe a {kind!r} call: kinds are 'target' and, with a draft model, 'draft'")
        if n > (TARGET_SIZES if kind == "target" else DRAFT_SIZES)[-1]:
            return
        part.observe(n, context, seconds)


def calibrate(
    lm, draft=None, *, cache: bool = True, refresh: bool = False, folder: Path | None = None, budget: float = BUDGET
) -> CostModel:
    """The cost model of target `lm` and `draft` (or None)."""
    options = dict(cache=cache, refresh=refresh, folder=folder, budget=budget)
    drafts = None if draft is None else call_cost(draft, "draft", **options)
    return CostModel(call_cost(lm, "target", **options), drafts)
