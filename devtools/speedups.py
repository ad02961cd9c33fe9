"""Estimated speed-ups over greedy of the draft-free strategies, `auto` and transformers' prompt lookup, per suite, by
replay on the target's cached calibration: with a GPU's curve cached (`scripts/gpu_check.py calibrate`), what they would
give on that GPU, from greedy outputs decoded here.

    export DECODEKIT_CALIBRATION=/tmp/h100 && python scripts/gpu_check.py calibrate GPU_CHECK_OUTDIR
    python -m devtools.speedups bench.json mixed.json agentic.json [--methods suffix,prompt_lookup,hf:prompt_lookup,auto]

Each result is a `decodekit compare --out` file with a greedy run, all of one model. The replays are
`devtools.replay_drafts` (suffix, prompt_lookup, hf:prompt_lookup) and `devtools.replay_auto` (auto without a draft
model): every call costed by the calibrated curve, greedy's prompt call and one-token calls likewise; a cell is greedy's
estimated seconds over the method's. What they leave out: each strategy's own Python work per step (a millisecond or
so, which a GPU's few-millisecond steps feel more than this CPU's), and the runs' branches at bfloat16 ties.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import decoders
from decoders.drafting.cost import call_cost
from devtools import replay_auto, replay_drafts
from devtools.replay import Tally, load_prompts

METHODS = ("suffix", "prompt_lookup", "hf:prompt_lookup", "auto")


def speedups(lm: decoders.LM, results: list[dict], methods: list[str]) -> dict[str, dict[str, float]]:
    """method -> {suite: greedy's estimated seconds / the method's, "all": the same over every suite}."""
    cost = call_cost(lm, "target")
    table: dict[str, dict[str, float]] = {m: {} for m in methods}
    totals = {m: [0.0, 0.0] for m in methods}  # greedy, method
    for result in results:
        suite, prompts = result["config"]["suite"], load_prompts(result, lm)
        for method in methods:
            if method == "auto":
                tally = Tally.of(replay_auto.replay(lm, prompts, cost=cost))
            else:
                tally = replay_drafts.replay(lm, method, prompts, cost)
            table[method][suite] = tally.greedy / tally.seconds
            totals[method][0] += tally.greedy
            totals[method][1] += tally.seconds
    for method, (greedy, seconds) in totals.items():
        table[method]["all"] = greedy / seconds
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="`decodekit compare --out` files with a greedy run")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    results = [json.loads(path.read_text()) for path in args.results]
    models = {r["model"]["name"] for r in results}
    if len(models) != 1:
        raise SystemExit(f"the results must share one model, got {sorted(models)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lm = decoders.load(models.pop(), dtype=results[0]["environment"]["dtype"])
    table = speedups(lm, results, methods)
    suites = [r["config"]["suite"] for r in results] + ["all"]
    print(f"{lm.name}: estimated speed-up over greedy, calls costed by {call_cost(lm, 'target').source or 'the cached'}"
          " calibration")
    print("| method | " + " | ".join(suites) + " |")
    print("|:---|" + "---:|" * len(suites))
    for method, row in table.items():
        print(f"| {method} | " + " | ".join(f"{row[s]:.2f}" for s in suites) + " |")


if __name__ == "__main__":
    main()
