"""Replay `auto` without a draft model on a `compare` result's greedy outputs, timed by the target's calibrated cost
curve instead of a clock: its target calls and estimated seconds per prompt, the same on every run - to tune `auto`'s
draft-free choices (its one draft-free proposer, the suffix index's trees, against plain steps) free of the timing
noise of a 2-core machine, whose one-run figures move by 5-10% a prompt.

    python -m devtools.replay_auto RESULT.json [RESULT.json ...]

The target is a `devtools.replay.ReplayLM`: each token it scores predicts greedy's next token where the token's path
(the cached tokens, then the scored tokens it attends to) is greedy's output so far, and a token greedy's output does
not hold there where it is not. So every draft is accepted exactly as far as a run's greedy verification would accept
it (but where the run itself took another branch at a bfloat16 tie). The real `auto` runs on it through
`decoders.generate`; each call advances its clock (`Auto(clock=...)`) by its calibrated seconds, the curve `auto`
plans with, so `auto` sees exactly the costs it predicts: the replay isolates its acceptance estimates and choices
from the cost model's errors, and leaves out its own Python work (about a millisecond a step). Greedy's estimate
beside it is the prompt's call and one one-token call per further token. Without a draft model `auto` also drafts
with the target's own int8 copy where that pays; the replay leaves the copy out (`self_int8=False`): its calls would
be the model's own.

To see how `auto` fares where its calibration has gone stale, `--ratios` makes the calls cost the calibrated curve
times a ratio per knot of it (1, 2, 3, 4, 8, 16, 32 tokens: a 5-token call between those of 4 and 8) while `auto` still
plans with the cached curve and corrects it from the calls it times, and `--noise` adds a machine's noise to every call
that is not a prompt's: a log-normal factor of that spread, and one call in 50 stalled 3x (`--seed` draws it):

    python -m devtools.replay_auto RESULT.json --ratios 1,1.3,1.6,1.8,2,2,2 --noise 0.15 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import decoders
from decoders.drafting.cost import CallCost, call_cost
from decoders.strategies.auto import Auto
from devtools.replay import Prompt, ReplayLM, load_prompts, run, stale


def replay(lm: decoders.LM, prompts: list[Prompt], options: dict | None = None,
           ratios: list[float] | None = None, noise: float = 0.0, seed: int = 0, cost: CallCost | None = None,
           decoder: type[Auto] = Auto) -> list[dict]:
    """Per prompt of [(id, category, prompt ids, greedy output)]: auto's target calls, estimated seconds, steps per
    proposer, and greedy's estimated seconds. `options`: auto's (without the target's own int8 copy, whose calls
    would be the model's own); `ratios`, `noise`, `seed`: the calls' true costs (the module's docstring); `cost`: the
    curve they are costed by (default: the target's calibrated one, which `auto` plans with); `decoder`: `Auto` or a
    subclass (`devtools.ablate_auto`'s, which switch a mechanism off or plan with another curve)."""
    options = {"self_int8": False, **(options or {})}
    if not noise >= 0:
        raise ValueError(f"noise is a spread: 0 or more, got {noise}")
    lm.check_tree_mask()
    calibrated = call_cost(lm, "target")  # (cached first: auto's own calibration reads it, not timing the replay)
    cost = calibrated if cost is None else cost
    if ratios is not None:
        cost = stale(cost, ratios)
    target = ReplayLM(lm, cost, noise, seed)
    return run(target, prompts, decoder(clock=target.now, **options))  # timed by the replay's clock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="`decodekit compare --out` JSON files with a greedy run")
    parser.add_argument("--ratios", type=lambda text: [float(r) for r in text.split(",")],
                        help="calls cost the calibrated curve times these, one a knot (comma-separated)")
    parser.add_argument("--noise", type=float, default=0.0, help="log-normal spread of each call's cost (e.g. 0.15)")
    parser.add_argument("--seed", type=int, default=0, help="of the noise")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    total = {"seconds": 0.0, "greedy": 0.0, "calls": 0}
    print("| prompt | category | tokens | calls | seconds | greedy's | speed-up | steps |")
    print("|:---|:---|---:|---:|---:|---:|---:|:---|")
    for path in args.results:
        result = json.loads(path.read_text())
        lm = decoders.load(result["model"]["name"], dtype=result["environment"]["dtype"])
        for row in replay(lm, load_prompts(result, lm), ratios=args.ratios, noise=args.noise, seed=args.seed):
            for key in total:
                total[key] += row[key]
            steps = ", ".join(f"{name} {count}" for name, count in row["steps"].items())
            print(f"| {row['prompt_id']} | {row['category']} | {row['tokens']} | {row['calls']} | "
                  f"{row['seconds']:.2f} | {row['greedy']:.2f} | {row['greedy'] / row['seconds']:.2f} | {steps} |")
    print(f"| all | | | {total['calls']} | {total['seconds']:.2f} | {total['greedy']:.2f} | "
          f"{total['greedy'] / total['seconds']:.3f} | |")


if __name__ == "__main__":
    main()
