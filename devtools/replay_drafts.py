"""Replay a `compare` result's greedy outputs through draft-free drafters, with no model calls: the target calls each
would make and their estimated time, per category - to tune `suffix` and `prompt_lookup` options in seconds, free of
the timing noise of a 2-core machine.

    python -m devtools.replay_drafts RESULT.json \
        [--methods suffix,suffix@depth_factor=1,suffix@store=run,hf:prompt_lookup]

In greedy mode the tokens a step accepts are exactly the longest path of its draft that agrees with the greedy output,
so replaying the recorded greedy tokens (`compare --out` keeps them; the result needs a `greedy` run) gives each
drafter's target calls exactly, but where the run itself took another branch at a bfloat16 tie. Each call is costed
by the target's calibrated cost curve (`decoders.drafting.cost.call_cost`, the curve `auto` uses: the time of a call
of 1 + draft-size tokens at that context length), so the seconds are an estimate, without prefill and without the
per-call overhead of the peer's own loop. On the `agentic`, `bench` and `mixed` runs behind `SuffixOptions`'
defaults, wherever a run emitted greedy's tokens the replay gave its target calls exactly (`suffix` on 14 prompts,
`prompt_lookup` on 7, `hf:prompt_lookup` on 19), and `suffix@store=run`'s on 13 of 16 (the store then held the earlier
runs' own outputs, which left greedy's at ties).

Methods: `suffix` and `prompt_lookup` with any @settings (`suffix@store=run` keeps one store across the prompts, in
the result's prompt order, as `compare` does), and `hf:prompt_lookup`, replayed with transformers' own candidate rule
(the first earlier match of the last 2 or 1 tokens, its next 10 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import decoders
from decoders.drafting import Draft
from decoders.drafting.cost import call_cost
from evals import methods, suites

REPLAYABLE = ("suffix", "prompt_lookup")  # strategies whose drafters read only the tokens (no model)
HF_LOOKUP = dict(k=10, max_ngram=2)  # transformers' generate(prompt_lookup_num_tokens=10): max_matching_ngram_size 2


@dataclass
class Tokens:
    """What a model-free drafter reads of a `DecodeState`."""

    tokens: list[int]
    prompt_len: int
    lm: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(vocab_size=None))  # no vocabulary bound:
    # the replayed ids are the target's own

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class Tally:
    calls: int = 0
    seconds: float = 0.0
    tokens: int = 0
    drafted: int = 0
    per_prompt: dict = field(default_factory=dict)


def accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Length of the longest path of the draft tree that agrees with `truth`."""
    depth = {-1: 0}  # node -> length of the agreeing path ending there
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        d = depth.get(parent)
        if d is not None and d < len(truth) and truth[d] == token:
            depth[node] = d + 1
    return max(depth.values())


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


def replay(name: str, prompts: list[tuple[str, str, list[int], list[int]]], cost) -> Tally:
    """Target calls and estimated seconds of method `name` on [(id, category, prompt ids, greedy output)]."""
    out = Tally()
    decoder = None if name == "hf:prompt_lookup" else methods.build(name).decoder
    for prompt_id, category, ids, truth in prompts:
        state = Tokens(list(ids), len(ids))
        drafter = decoder.drafter(state, decoder.options) if decoder is not None else None
        calls, seconds, drafted = 0, 0.0, 0
        while len(state.tokens) - len(ids) < len(truth):
            done = len(state.tokens) - len(ids)
            limit = len(truth) - done - 1  # room for the target's own token, as DraftVerify leaves it
            if drafter is None:
                draft = Draft(hf_lookup(state.tokens, limit, **HF_LOOKUP), source="lookup")
            else:
                draft = drafter.propose(state, limit)
            got = accepted(draft.tokens, draft.links, truth[done:])
            calls, drafted = calls + 1, drafted + len(draft.tokens)
            seconds += cost.predict(1 + len(draft.tokens), len(state.tokens))
            state.tokens.extend(truth[done: done + got + 1])
            if drafter is not None:
                drafter.update(state, draft, got)
        if drafter is not None and hasattr(drafter, "finish"):
            drafter.finish(state)
        out.calls, out.seconds, out.tokens, out.drafted = (out.calls + calls, out.seconds + seconds,
                                                           out.tokens + len(truth), out.drafted + drafted)
        out.per_prompt[prompt_id] = (category, calls, seconds)
    return out


def load_prompts(result: dict, lm: decoders.LM) -> list[tuple[str, str, list[int], list[int]]]:
    """[(id, category, prompt ids, greedy output)] of a result, in its prompt order (repeat 0, no grammar)."""
    greedy = {r["prompt_id"]: r["tokens"] for r in result["runs"]
              if r["strategy"] == "greedy" and str(r["repeat"]) == "0" and r.get("tokens")}
    chat = result["config"].get("chat_template", True)
    out = []
    for p in result["prompts"]:
        if p["id"] in greedy and not p.get("schema"):
            ids = suites.render(lm, suites.Prompt(id=p["id"], category=p["category"], prompt=p["prompt"]), chat)
            out.append((p["id"], p["category"], ids, greedy[p["id"]]))
    if not out:
        raise SystemExit("the result holds no greedy run with its tokens: run compare with greedy and --out")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a `decodekit compare --out` JSON file with a greedy run")
    parser.add_argument("--methods", default="suffix,suffix@store=run,prompt_lookup,hf:prompt_lookup",
                        help="comma-separated: suffix / prompt_lookup with @settings, hf:prompt_lookup")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    for name in names:
        if name != "hf:prompt_lookup" and methods.split(name)[0] not in REPLAYABLE:
            raise SystemExit(f"{name}: only {', '.join(REPLAYABLE)} and hf:prompt_lookup replay without a model")
    result = json.loads(args.result.read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = result["model"]
    lm = decoders.load(model["name"], dtype=result["environment"]["dtype"])
    cost = call_cost(lm, "target")
    prompts = load_prompts(result, lm)
    categories = list(dict.fromkeys(c for _, c, _, _ in prompts))
    tallies = {name: replay(name, prompts, cost) for name in names}
    print(f"{model['name']}: {len(prompts)} prompts; target calls and estimated decode seconds")
    print_table(tallies, categories)


def print_table(tallies: dict[str, Tally], categories: list[str]) -> None:
    """A markdown table: per method its target calls, estimated seconds, tokens per call, and both per category."""
    print("| method | calls | seconds | tokens/call | " + " | ".join(categories) + " |")
    print("|:---|---:|---:|---:|" + "---:|" * len(categories))
    for name, t in tallies.items():
        by = {c: [0, 0.0] for c in categories}
        for category, calls, seconds in t.per_prompt.values():
            by[category][0] += calls
            by[category][1] += seconds
        cells = " | ".join(f"{by[c][0]} / {by[c][1]:.1f} s" for c in categories)
        print(f"| {name} | {t.calls} | {t.seconds:.1f} | {t.tokens / t.calls:.2f} | {cells} |")


if __name__ == "__main__":
    main()
