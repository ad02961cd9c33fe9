"""Replay `auto` without a draft model on a `compare` result's greedy outputs, timed by the target's calibrated cost
curve instead of a clock: its target calls and estimated seconds per prompt, the same on every run - to tune `auto`'s
draft-free choices (suffix index, prompt lookup, lookahead, their merged trees) free of the timing noise of a 2-core
machine, whose one-run figures move by 5-10% a prompt.

    python -m devtools.replay_auto RESULT.json [RESULT.json ...]

The target is a `ReplayLM`: each token it scores predicts greedy's next token where the token's path (the cached
tokens, then the scored tokens it attends to) is greedy's output so far, and a token greedy's output does not hold
there where it is not. So every draft is accepted exactly as far as a run's greedy verification would accept it (but
where the run itself took another branch at a bfloat16 tie), and lookahead's Jacobi window, whose tokens are off
greedy's path, never sees the future: its guesses come out worse than a run's. Each call advances `auto`'s clock
(`Auto(clock=...)`) by its calibrated seconds, the curve `auto` plans with, so `auto` sees exactly the
costs it predicts: the replay isolates its acceptance estimates and choices from the cost model's errors, and leaves
out its own Python work (about a millisecond a step). Greedy's estimate beside it is the prompt's call and one
one-token call per further token.

To see how `auto` fares where its calibration has gone stale, `--ratios` makes the calls cost the calibrated curve
times a ratio per knot of it (1, 2, 3, 4, 8, 16, 32 tokens: a 5-token call between those of 4 and 8) while `auto` still
plans with the cached curve and corrects it from the calls it times, and `--noise` adds a machine's noise to every call
that is not a prompt's: a log-normal factor of that spread, and one call in 50 stalled 3x (`--seed` draws it):

    python -m devtools.replay_auto RESULT.json --ratios 1,1.3,1.6,1.8,2,2,2 --noise 0.15 --seed 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from pathlib import Path

import torch

import decoders
from decoders.drafting.cost import TARGET_SIZES, CallCost, call_cost
from decoders.models.cache import KVCache
from decoders.strategies.auto import Auto
from devtools.replay_drafts import load_prompts


class ReplayLM(decoders.LM):
    """An LM whose calls replay `truth` (prompt + greedy output) and cost `cost`'s predicted seconds on its clock
    (`now`). Its cache holds the token ids it has seen as keys, so it crops and keeps paths as a model's does."""

    STALLS, STALL = 0.02, 3.0  # with noise (`noisy`), the share of calls stalled and how much longer they take

    def __init__(self, lm: decoders.LM, cost: CallCost, noise: float = 0.0, seed: int = 0) -> None:
        super().__init__(lm.model, lm.tokenizer, lm.name)
        self.cost, self.truth, self.seconds = cost, [], 0.0
        self.noise, self.random = noise, random.Random(seed)
        self._tree_mask_ok = True  # (probed on the model itself: `replay`)

    def noisy(self, length: int) -> float:
        """A call's factor of noise: a log-normal one of spread `noise`, STALL in a share STALLS of the calls, none for
        a prompt's call (longer than calibration measures: one such call's luck would outweigh the steps')."""
        if not self.noise or length > TARGET_SIZES[-1]:
            return 1.0
        stalled = self.random.random() < self.STALLS
        return math.exp(self.random.gauss(0.0, self.noise)) * (self.STALL if stalled else 1.0)

    def now(self) -> float:
        """The replay's clock: the calibrated seconds of the calls made so far."""
        return self.seconds

    def forward(self, tokens, cache: KVCache, positions=None, tree_mask=None, keep: int = 0) -> torch.Tensor:
        tokens = [int(t) for t in tokens]
        past, length = len(cache), len(tokens)
        layer = cache.hf.layers[0] if cache.hf.layers else None
        cached = [] if layer is None or layer.keys is None else layer.keys[0, 0, :, 0].long().tolist()  # [past]
        ids = torch.tensor(tokens, dtype=torch.float32).reshape(1, 1, length, 1)
        cache.hf.update(ids, ids.clone(), 0)
        if tree_mask is None:
            seen = torch.ones(length, length, dtype=torch.bool).tril()  # [T, T]
        else:
            seen = tree_mask[:, -length:].bool()  # (the cache is seen whole: a mask over it too is a draft model's)
        on_path = cached == self.truth[:past]
        rows = range(length - keep, length) if keep else range(length)
        logits = torch.zeros(len(rows), self.vocab_size)
        for row, i in enumerate(rows):
            path = [tokens[j] for j in range(length) if seen[i, j]]
            at = past + len(path)  # the position this token predicts
            right = self.truth[at] if at < len(self.truth) else 0
            agrees = on_path and path == self.truth[past: at]
            logits[row, right if agrees else (right + 1) % self.vocab_size] = 1.0
        self.seconds += self.cost.predict(length, past) * self.noisy(length)
        return logits


def stale(cost: CallCost, ratios: list[float]) -> CallCost:
    """`cost`'s curve with each knot's seconds times its ratio (one a knot), the context terms times the first's."""
    if len(ratios) != len(cost.sizes) or not all(r > 0 for r in ratios):
        raise ValueError(f"give one positive ratio per knot of the calibration ({len(cost.sizes)}: sizes "
                         f"{list(cost.sizes)}), got {ratios}")
    return CallCost(cost.sizes, tuple(s * r for s, r in zip(cost.seconds, ratios)), cost.per_position * ratios[0],
                    cost.per_position_per_token * ratios[0])


def replay(lm: decoders.LM, prompts: list[tuple[str, str, list[int], list[int]]], options: dict | None = None,
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
    strategy = decoder(clock=target.now, **options)  # timed by the replay's clock
    rows = []
    for prompt_id, category, ids, truth in prompts:
        target.truth, start = list(ids) + list(truth), target.seconds
        result = decoders.generate(target, list(ids), strategy=strategy, max_new_tokens=len(truth))
        if result.tokens != list(truth):
            raise AssertionError(f"{prompt_id}: the replay left greedy's output (a bug in the replay or in auto)")
        greedy = cost.predict(len(ids), 0) + sum(cost.predict(1, len(ids) + i) for i in range(1, len(truth)))
        rows.append({"prompt_id": prompt_id, "category": category, "tokens": len(truth),
                     "calls": result.stats.target_calls, "seconds": target.seconds - start, "greedy": greedy,
                     "steps": result.stats.details["steps"]})
    return rows


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
