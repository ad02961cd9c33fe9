"""Benchmark: decodekit `greedy` vs transformers `generate(do_sample=False)`, tokens/s and the roofline.

    python -m evals.bench_greedy [--models zoo:smollm2-135m,zoo:qwen2.5-coder-1.5b] [--dtype bfloat16]
                                 [--max-new-tokens 128] [--suite default] [--repeats 3]

One process, same prompts, warm-up first, the two methods interleaved prompt by prompt: this is `compare` with the
strategies greedy and hf:greedy, so both are timed and counted exactly as in every compare table. The ratio is
greedy tok/s / hf:greedy tok/s (> 1: decodekit is faster); the roofline is parameter bytes / measured bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

import decoders
from evals import report
from evals.cli_parser import names
from evals.metrics import BASELINE
from evals.runner import CompareConfig, compare

COLUMNS = [
    "model",
    "dtype",
    "MiB/token",
    "greedy tok/s ↑",
    "hf:greedy tok/s ↑",
    "ratio ↑",
    "roofline tok/s",
    "greedy/roofline ↑",
    "hf/roofline ↑",
    "lossless",
]


def bench(model: str, dtype: str, config: CompareConfig, device: str | None = None) -> dict:
    """The compare result of greedy vs hf:greedy on one model."""
    lm = decoders.load(model, dtype=dtype, device=device)
    try:
        return compare(lm, config)
    finally:
        del lm
        gc.collect()


def row(result: dict) -> list[str]:
    """One table row of a bench result."""
    summary = {s["strategy"]: s for s in result["summary"]}
    ours, theirs = summary[BASELINE]["tokens_per_second"], summary["hf:greedy"]["tokens_per_second"]
    roof = result["roofline"] or {}
    limit = roof.get("limit_tokens_per_second")
    ratio = ours["mean"] / theirs["mean"] if theirs["mean"] else None
    return [
        result["model"]["name"],
        result["environment"]["dtype"],
        report.fmt(roof.get("bytes_per_token"), ".0f", 2**-20),
        report.spread(ours, ".1f"),
        report.spread(theirs, ".1f"),
        report.fmt(ratio),
        report.fmt(limit, ".1f"),
        report.fmt(ours["mean"] / limit if limit else None, ".0%"),
        report.fmt(theirs["mean"] / limit if limit else None, ".0%"),
        report.lossless_cell(summary["hf:greedy"]),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m evals.bench_greedy",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m evals.bench_greedy\n"
        "  python -m evals.bench_greedy --models zoo:smollm2-135m --repeats 1 "
        "--max-new-tokens 64\n",
    )
    parser.add_argument(
        "--models", type=names, default="zoo:smollm2-135m,zoo:qwen2.5-coder-1.5b", help="comma-separated"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--suite", default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", metavar="FILE", help="write every model's compare result as one JSON list")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = CompareConfig(
        strategies=(BASELINE, "hf:greedy"),
        suite=args.suite,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        progress=not args.no_progress,
    )
    results = []
    try:
        for model in args.models:
            print(f"benchmarking {model} ...", file=sys.stderr)
            results.append(bench(model, args.dtype, config, args.device))
    except (ValueError, OSError, RuntimeError) as error:
        print(f"bench_greedy: error: {error}", file=sys.stderr)
        return 2
    env = results[0]["environment"]
    print(
        f"decodekit greedy vs transformers generate(do_sample=False) · {env['device']} — {env['device_name']} · "
        f"torch {env['torch']} · transformers {env['transformers']} · suite {args.suite} · "
        f"max_new_tokens {args.max_new_tokens} · repeats {args.repeats}\n"
    )
    print(report.make_table(COLUMNS, [row(r) for r in results]))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
