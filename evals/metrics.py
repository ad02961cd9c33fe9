"""Per-strategy and per-category figures from the runs of one compare (run records as JSON dicts).

tokens/s of a strategy in one repeat = its new tokens summed over the prompts / its seconds summed over them.
Speed-up in one repeat = that figure / greedy's tokens/s over the same prompts in the same repeat; the reported
speed-up is the mean over repeats, with the standard deviation, minimum and maximum as the spread.

A batched compare (`--batch-size`, `summarize_batched`) has one summary per strategy and batch size: tokens/s is the
throughput of its queue in one repeat (new tokens over the whole suite / the queue's wall time), speed-up that /
greedy's throughput at the same batch size in the same repeat, and latency and TTFT are per request (p50, p90).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

BASELINE = "greedy"


def _total(runs: list[dict], key: str) -> float | None:
    """Sum of `key` over the runs, None if any run lacks it."""
    values = [r.get(key) for r in runs]
    return None if not values or any(v is None for v in values) else sum(values)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _sum_lists(runs: list[dict], key: str) -> list[float]:
    """Element-wise sum of the runs' lists under `key` (shorter lists count as zeros past their end)."""
    total: list[float] = []
    for r in runs:
        values = r.get(key) or []
        total.extend([0] * (len(values) - len(total)))
        for i, v in enumerate(values):
            total[i] += v
    return total


def _spread(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values)}


def _by_repeat(runs: list[dict], baseline: list[dict]) -> tuple[list[float], list[float]]:
    """tokens/s and speed-up over the baseline, one value per repeat, each on the prompts this strategy ran."""
    speeds, speedups = [], []
    for repeat in sorted({r["repeat"] for r in runs}):
        mine = [r for r in runs if r["repeat"] == repeat]
        prompt_ids = {r["prompt_id"] for r in mine}
        base = [r for r in baseline if r["repeat"] == repeat and r["prompt_id"] in prompt_ids]
        speed = _ratio(_total(mine, "new_tokens"), _total(mine, "seconds"))
        speeds.append(speed or 0.0)
        base_speed = _ratio(_total(base, "new_tokens"), _total(base, "seconds"))
        if speed is not None and base_speed:
            speedups.append(speed / base_speed)
    return speeds, speedups


def lossless_summary(runs: list[dict], errors: int = 0) -> dict:
    """How a strategy's runs fared in the losslessness check (`errors`: runs that raised instead of finishing)."""
    verdicts = [r.get("lossless") or {"status": "unchecked"} for r in runs]
    counts = {
        s: sum(v["status"] == s for v in verdicts)
        for s in ("reference", "exact", "tie", "valid", "failed", "differs", "unchecked")
    }
    failures = [(r, v) for r, v in zip(runs, verdicts) if v["status"] == "failed"]
    ties = [(r, v) for r, v in zip(runs, verdicts) if v["status"] == "tie"]
    differences = [(r, v) for r, v in zip(runs, verdicts) if v["status"] == "differs"]
    of = sum(v.get("of", 0) for v in verdicts)  # (only peers on their own kernels report agreement)
    agreement = sum(v.get("agreed", 0) for v in verdicts) / of if any("of" in v for v in verdicts) and of else None
    if failures:
        status = "failed"
    elif errors:
        status = "error"
    elif counts["unchecked"]:
        status = "unchecked"
    elif differences:
        status = "differs"  # a peer on its own kernels (llama.cpp): agreement reported, not required
    elif ties:
        status = "tie"
    elif counts["reference"] and not counts["exact"]:
        status = "reference"
    elif counts["valid"] and not counts["exact"]:
        status = "valid"  # a grammar peer: every output parsed and satisfied its schema
    else:
        status = "pass"
    first = lambda pairs: {"prompt_id": pairs[0][0]["prompt_id"], **pairs[0][1]} if pairs else None  # noqa: E731
    return {
        "status": status,
        **counts,
        "errors": errors,
        "first_failure": first(failures),
        "first_tie": first(ties),
        "first_difference": first(differences),
        "agreement": agreement,
    }


def aggregate(runs: list[dict], baseline: list[dict], errors: int = 0) -> dict:
    """The figures of one strategy over `runs` (any subset: a whole suite or one category)."""
    repeats = max(1, len({r["repeat"] for r in runs}))
    speeds, speedups = _by_repeat(runs, baseline)
    target_calls, new_tokens = _total(runs, "target_calls"), _total(runs, "new_tokens")
    by_position, drafted_at = _sum_lists(runs, "accepted_by_position"), _sum_lists(runs, "drafted_by_position")
    seconds, draft_seconds = _total(runs, "seconds"), _total(runs, "draft_seconds")
    peaks = [r["peak_memory_bytes"] for r in runs if r.get("peak_memory_bytes") is not None]
    return {
        "runs": len(runs),
        "prompts": len({r["prompt_id"] for r in runs}),
        "tokens_per_second": _spread(speeds),
        "speedup": _spread(speedups),
        "ttft_seconds": statistics.fmean([r["ttft_seconds"] for r in runs]) if runs else None,
        "new_tokens": new_tokens / repeats if new_tokens is not None else None,
        "target_calls": target_calls / repeats if target_calls is not None else None,
        "draft_calls": (d / repeats) if (d := _total(runs, "draft_calls")) is not None else None,
        "mean_accepted": _ratio(new_tokens, target_calls),
        "acceptance_rate": _ratio(_total(runs, "accepted"), _total(runs, "drafted")),
        "accepted_by_position": [c / repeats for c in by_position],
        "accepted_by_position_per_call": [c / target_calls for c in by_position] if target_calls else [],
        "acceptance_by_position": [c / d for c, d in zip(by_position, drafted_at) if d],
        "draft_share": _ratio(draft_seconds, seconds),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "lossless": lossless_summary(runs, errors),
    }


def _ordered(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def summarize(runs: list[dict], errors: list[dict] = ()) -> list[dict]:
    """One summary per strategy (in run order), each with a `by_category` breakdown.

    `errors` ({"strategy", "kind", "prompt_id", "category", "error"}) are runs that raised; they mark the strategy
    "error".
    """
    baseline = [r for r in runs if r["strategy"] == BASELINE and not r.get("grammar")]
    summaries = []
    for name in _ordered([r["strategy"] for r in runs] + [e["strategy"] for e in errors]):
        mine = [r for r in runs if r["strategy"] == name]
        failed = [e for e in errors if e["strategy"] == name]
        kind = next(r["kind"] for r in mine + failed)
        summary = {"strategy": name, "kind": kind, **aggregate(mine, baseline, len(failed))}
        summary["by_category"] = {
            category: aggregate(
                [r for r in mine if r["category"] == category], baseline, sum(e["category"] == category for e in failed)
            )
            for category in _ordered([r["category"] for r in mine] + [e["category"] for e in failed])
        }
        summaries.append(summary)
    return summaries


# --------------------------------------------------------------------------------------------- batched compare
def percentile(values: list[float], q: float) -> float | None:
    """The `q`-th percentile (0-100) of `values`, linearly interpolated between the closest ranks (numpy's default);
    None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latencies(runs: list[dict]) -> dict:
    """Per-request latency (`seconds`) and TTFT of a batched compare's runs: mean, p50 and p90."""
    seconds, ttfts = [r["seconds"] for r in runs], [r["ttft_seconds"] for r in runs]
    return {
        "latency_seconds": statistics.fmean(seconds) if seconds else None,
        "latency_p50_seconds": percentile(seconds, 50),
        "latency_p90_seconds": percentile(seconds, 90),
        "ttft_p50_seconds": percentile(ttfts, 50),
        "ttft_p90_seconds": percentile(ttfts, 90),
    }


def _throughputs(queues: list[dict], name: str, size: int) -> tuple[list[float], list[float]]:
    """Throughput of `name`'s queues at batch size `size`, one per repeat, and its speed-up over greedy's queue at the
    same batch size in the same repeat."""
    rate = lambda q: q["new_tokens"] / q["seconds"] if q["seconds"] > 0 else 0.0  # noqa: E731
    mine = {q["repeat"]: q for q in queues if q["strategy"] == name and q["batch_size"] == size}
    base = {q["repeat"]: q for q in queues if q["strategy"] == BASELINE and q["batch_size"] == size}
    speeds = [rate(q) for _, q in sorted(mine.items())]
    speedups = [rate(q) / rate(base[r]) for r, q in sorted(mine.items()) if r in base and rate(base[r])]
    return speeds, speedups


def summarize_batched(runs: list[dict], queues: list[dict], errors: list[dict] = ()) -> list[dict]:
    """One summary per (strategy, batch size) of a batched compare, batch sizes ascending, strategies in run order.

    `runs` are its requests (one per prompt, batch size and repeat), `queues` its `evals.batched.Queue` records,
    `errors` the requests and queues that raised (a queue's error has prompt_id None). Fields as `aggregate`'s, plus
    `batch_size` and `latencies`'; `tokens_per_second` and `speedup` are the queue's throughput. Throughput does not
    split by category: `by_category` has every other figure, with those two empty.
    """
    order = _ordered([q["strategy"] for q in queues] + [e["strategy"] for e in errors])
    pairs = {(q["strategy"], q["batch_size"]) for q in queues} | {(e["strategy"], e["batch_size"]) for e in errors}
    keys = sorted(pairs, key=lambda key: (key[1], order.index(key[0])))
    empty = {"tokens_per_second": _spread([]), "speedup": _spread([])}
    summaries = []
    for name, size in keys:
        mine = [r for r in runs if r["strategy"] == name and r["batch_size"] == size]
        failed = [e for e in errors if e["strategy"] == name and e["batch_size"] == size]
        mine_queues = [q for q in queues if q["strategy"] == name and q["batch_size"] == size]
        kind = next(x["kind"] for x in mine + failed + mine_queues)
        speeds, speedups = _throughputs(queues, name, size)
        summary = {
            "strategy": name,
            "kind": kind,
            "batch_size": size,
            **aggregate(mine, [], len(failed)),
            "tokens_per_second": _spread(speeds),
            "speedup": _spread(speedups),
            **latencies(mine),
            "draft_share": _ratio(_total(mine_queues, "draft_seconds"), _total(mine_queues, "seconds")),
        }
        summary["by_category"] = {
            category: {
                **aggregate(picked, [], sum(e["category"] == category for e in failed)),
                **empty,
                **latencies(picked),
            }
            for category in _ordered([r["category"] for r in mine] + [e["category"] for e in failed if e["category"]])
            for picked in [[r for r in mine if r["category"] == category]]
        }
        summaries.append(summary)
    return summaries
