"""A held-out suite from Spec-Bench's `question.jsonl` (github.com/hemingkx/Spec-Bench, `data/spec_bench/`): public
prompts `auto` was not tuned on, for `decodekit compare --suite`. Of each task category, the prompts at `--positions`
(file order, from 0); of MT-Bench's categories (its first 80 questions), the `--mt-bench` ones, as category "mt_bench".

    python -m devtools.heldout question.jsonl > heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from evals import suites

TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")


def held_out(prompts: list[suites.Prompt], positions: tuple[int, ...] = (2, 3),
             mt_bench: tuple[tuple[str, int], ...] = (("writing", 2), ("extraction", 2))) -> list[suites.Prompt]:
    """The prompts at `positions` of each of TASKS, then each (category, position) of `mt_bench` as "mt_bench"."""
    by_category: dict[str, list[suites.Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    wanted = [(category, i) for category in TASKS for i in positions] + list(mt_bench)
    missing = [f"{category}[{i}]" for category, i in wanted if len(by_category.get(category, ())) <= i]
    if missing:
        raise SystemExit(f"the file has no prompt {', '.join(missing)}: is it Spec-Bench's question.jsonl?")
    return [replace(by_category[c][i], category=c if c in TASKS else "mt_bench") for c, i in wanted]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m devtools.heldout", description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", help="Spec-Bench's data/spec_bench/question.jsonl")
    parser.add_argument("--positions", default="2,3", help="positions taken in each task category (default 2,3)")
    parser.add_argument("--mt-bench", default="writing:2,extraction:2",
                        help="MT-Bench's CATEGORY:POSITION taken (default writing:2,extraction:2)")
    args = parser.parse_args(argv)
    try:
        positions = tuple(int(i) for i in args.positions.split(","))
        mt_bench = tuple((c, int(i)) for c, i in (item.split(":") for item in args.mt_bench.split(",")))
        if min(positions) < 0 or any(i < 0 for _, i in mt_bench):  # (a negative one would count from the end)
            raise ValueError
    except ValueError:
        parser.error("--positions takes whole numbers from 0 (2,3), --mt-bench CATEGORY:POSITION pairs (writing:2)")
    for prompt in held_out(suites.load(args.questions), positions, mt_bench):
        print(json.dumps({"id": f"specbench-{prompt.id}", "category": prompt.category, "prompt": prompt.prompt}))


if __name__ == "__main__":
    main()
