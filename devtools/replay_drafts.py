"""Replay a `compare` result's greedy outputs through draft-free strategies, with no model calls: the target calls each
makes and their estimated time, per category - to tune `suffix` and `prompt_lookup` options in seconds, free of the
timing noise of a 2-core machine.

    python -m devtools.replay_drafts RESULT.json \
        [--methods suffix,suffix@depth_factor=1,suffix@store=run,hf:prompt_lookup]

Each method is decodekit's own strategy, run by `decoders.generate` on a replayed target (`devtools.replay.ReplayLM`):
in greedy mode a step accepts exactly the longest path of its draft that agrees with the greedy output, so replaying
the recorded greedy tokens (`compare --out` keeps them; the result needs a `greedy` run) gives each strategy's target
calls exactly, but where the run itself took another branch at a bfloat16 tie. Each call is costed by the target's
calibrated cost curve (`decoders.drafting.cost.call_cost`, the curve `auto` uses), the prompt's call included, so the
seconds are an estimate, without the per-call overhead of the peer's own loop. On the `agentic`, `bench` and `mixed`
runs behind `SuffixOptions`' defaults, wherever a run emitted greedy's tokens the replay gave its target calls exactly
(`suffix` on 14 prompts, `prompt_lookup` on 7, `hf:prompt_lookup` on 19), and `suffix@store=run`'s on 13 of 16 (the
store then held the earlier runs' own outputs, which left greedy's at ties).

Methods: `suffix` and `prompt_lookup` with any @settings (`suffix@store=run` keeps one store across the prompts, in
the result's prompt order, as `compare` does), and `hf:prompt_lookup`: transformers' candidate rule (the first earlier
match of the last 2 or 1 tokens, its next 10 tokens; a copy of the peer's rule, `hf_lookup`) in decodekit's loop.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import decoders
from decoders.base import DecodeState
from decoders.drafting import Draft, DraftVerify
from decoders.drafting.cost import call_cost
from devtools.replay import Prompt, ReplayLM, Tally, load_prompts, print_table, run
from evals import methods

REPLAYABLE = ("suffix", "prompt_lookup")  # strategies whose drafters read only the tokens (no model)
HF_LOOKUP = dict(k=10, max_ngram=2)  # transformers' generate(prompt_lookup_num_tokens=10): max_matching_ngram_size 2


def hf_lookup(tokens: list[int], limit: int, k: int, max_ngram: int) -> list[int]:
    """transformers' `PromptLookupCandidateGenerator`: the first (leftmost) earlier match of the longest suffix of
    at most `max_ngram` tokens, and up to `k` tokens after it (not past the context's end)."""
    end = len(tokens)
    for n in range(min(max_ngram, end - 1), 0, -1):
        tail = tokens[-n:]
        for i in range(end - n + 1):
            if tokens[i:i + n] == tail and i + n < end:
                return tokens[i + n: min(i + n + k, end)][:limit]
    return []


@dataclass(frozen=True)
class HFLookupOptions:
    k: int = HF_LOOKUP["k"]
    max_ngram: int = HF_LOOKUP["max_ngram"]


class HFLookupDrafter:
    """transformers' prompt-lookup candidates (`hf_lookup`) as a drafter."""

    def __init__(self, state: DecodeState, options: HFLookupOptions) -> None:
        self.options = options

    def propose(self, state: DecodeState, limit: int) -> Draft:
        return Draft(hf_lookup(state.tokens, limit, self.options.k, self.options.max_ngram), source="lookup")

    def update(self, state: DecodeState, draft: Draft, accepted: int) -> None:
        pass


class HFPromptLookup(DraftVerify):
    """transformers' prompt lookup in decodekit's draft-then-verify loop (not registered: a replay's peer)."""

    Options = HFLookupOptions
    drafter = HFLookupDrafter


def strategy(name: str) -> decoders.Decoder:
    """The strategy of method `name` (one instance for all prompts: a `store=run` lasts across them)."""
    if name == "hf:prompt_lookup":
        return HFPromptLookup()
    if methods.split(name)[0] not in REPLAYABLE:
        raise SystemExit(f"{name}: only {', '.join(REPLAYABLE)} and hf:prompt_lookup replay without a model")
    return methods.build(name).decoder


def replay(lm: decoders.LM, name: str, prompts: list[Prompt], cost=None) -> Tally:
    """Target calls and estimated seconds of method `name` on [(id, category, prompt ids, greedy output)], its calls
    costed by `cost` (default: the target's calibrated curve)."""
    cost = call_cost(lm, "target") if cost is None else cost
    return Tally.of(run(ReplayLM(lm, cost), prompts, strategy(name)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a `decodekit compare --out` JSON file with a greedy run")
    parser.add_argument("--methods", default="suffix,suffix@store=run,prompt_lookup,hf:prompt_lookup",
                        help="comma-separated: suffix / prompt_lookup with @settings, hf:prompt_lookup")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    for name in names:
        strategy(name)  # (refused before any model loads)
    result = json.loads(args.result.read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = result["model"]
    lm = decoders.load(model["name"], dtype=result["environment"]["dtype"])
    cost = call_cost(lm, "target")
    prompts = load_prompts(result, lm)
    categories = list(dict.fromkeys(c for _, c, _, _ in prompts))
    tallies = {name: replay(lm, name, prompts, cost) for name in names}
    greedy = next(iter(tallies.values())).greedy
    print(f"{model['name']}: {len(prompts)} prompts; target calls and estimated seconds, the prompts' calls included "
          f"(greedy: {greedy:.1f} s)")
    print_table(tallies, categories)


if __name__ == "__main__":
    main()
