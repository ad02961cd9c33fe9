"""Replay a `compare` result's greedy outputs through the draft-model strategies - `speculative` (fixed k),
`threshold` (a moving threshold on the draft's confidence) and `auto` (its chooser, with the draft model's chains) -
with one draft-model call per prompt instead of a run: to compare and tune them in seconds, free of timing noise.

    python -m devtools.replay_chains RESULT.json --draft zoo:qwen2.5-coder-0.5b --draft-quantize int8 \
        [--methods speculative,threshold,auto]

One call of the draft over each prompt and its greedy output records the draft's first choice and its probability at
every position given greedy's prefix (`devtools.replay.record`). Each strategy then runs as it is, through
`decoders.generate`, its drafter and draft-then-verify loop decodekit's own, on a replayed target
(`devtools.replay.ReplayLM`: greedy's next token on greedy's path) and a replayed draft (`ReplayDraft`: at each
position its recorded choice with its recorded probability). A chain is that choice at t, t+1, ... for as long as the
drafted tokens agree with greedy (the draft saw greedy's own prefix), so its accepted length is exact; past its first
miss the probabilities are greedy's prefix's (a run's would be conditioned on the missed token), which moves only
where a rule stops drafting a chain already lost. Every call, the draft's too, advances one clock by the seconds the
calibrated cost curves (`decoders.drafting.cost.calibrate`, those `auto` plans with) predict for it; `auto` is timed
by that clock. One long call of the draft also differs from its one-token calls in rounding, so replayed acceptance is
close to, not equal to, a run's; for `self:int8` the recording runs the int8 copy on its own cache, where a run (and
the replay) drafts on the target's.

`auto` is replayed as it runs with this draft but for what the recording cannot replay: the draft's trees (which
need its other choices) are left out (`draft_trees=False`), and it drafts with the draft given, not its int8 copy
(`draft_int8=False`; pass `--draft-quantize int8` to replay the copy). It also offers the suffix index's trees, as in
a run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import decoders
from decoders.drafting.cost import CostModel, calibrate
from decoders.driver import resolve_draft
from decoders.strategies.auto import Auto
from devtools.replay import Prompt, Recorded, ReplayDraft, ReplayLM, Tally, load_prompts, print_table, record, run
from evals import methods

STRATEGIES = ("speculative", "threshold", "auto")
AUTO = {"draft_trees": False, "draft_int8": False}  # what `auto` is replayed with (the module's docstring)


def shares_cache(lm: decoders.LM, draft: decoders.LM) -> bool:
    """Whether `draft` is `lm`'s own quantized copy, which drafts on the target's cache (as `draft_model` decides)."""
    return draft.quantized_from is not None and draft.quantized_from() is lm


def replay(lm: decoders.LM, draft: decoders.LM, name: str, prompts: list[Prompt], recordings: dict[str, Recorded],
           cost: CostModel | None = None) -> Tally:
    """Target calls and estimated seconds (draft calls included) of method `name` (a strategy of `STRATEGIES` with
    @settings, e.g. `threshold@min_threshold=0.2`) over [(id, category, prompt ids, greedy output)], drafted by
    `draft` as `recordings` (per prompt id, `record`) say. `cost`: what the calls cost (default: the models'
    calibrated curves, which `auto` and `speculative` plan with)."""
    base, settings = methods.split(name)
    if base not in STRATEGIES:
        raise SystemExit(f"{name}: replayable strategies are {', '.join(STRATEGIES)}")
    calibrated = calibrate(lm, draft)  # (cached first: the strategies' own calibrations read it, not timing replays)
    cost = calibrated if cost is None else cost
    target = ReplayLM(lm, cost.target)
    drafts = ReplayDraft(draft, target, cost.draft, shares_cache(lm, draft))
    if base == "auto":
        strategy = Auto(clock=target.now, **{**AUTO, **settings})
    else:
        strategy = methods.build(name).decoder
    return Tally.of(run(target, prompts, strategy, drafts, recordings))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a `decodekit compare --out` JSON file with a greedy run")
    parser.add_argument("--draft", required=True, help="the draft model (a zoo name, folder, or self:int8)")
    parser.add_argument("--draft-quantize", default=None, help="quantize the draft model (int8)")
    parser.add_argument("--methods", default="speculative,threshold,auto",
                        help=f"comma-separated: {' / '.join(STRATEGIES)} with @settings")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    for name in names:
        if methods.split(name)[0] not in STRATEGIES:
            raise SystemExit(f"{name}: replayable strategies are {', '.join(STRATEGIES)}")
    result = json.loads(args.result.read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = result["model"]
    lm = decoders.load(model["name"], dtype=result["environment"]["dtype"])
    if args.draft_quantize is None:  # a name, or self:int8 (the target's own int8 copy)
        draft = resolve_draft(lm, args.draft)
    else:
        draft = decoders.load(args.draft, dtype=lm.dtype, device=lm.device, quantize=args.draft_quantize)
    if draft.vocab_key != lm.vocab_key:
        raise SystemExit(f"{draft.name} does not share {lm.name}'s tokenizer: the replay drafts in the target's ids")
    prompts = load_prompts(result, lm)
    recordings = {prompt_id: record(draft, ids, truth) for prompt_id, _, ids, truth in prompts}
    categories = list(dict.fromkeys(c for _, c, _, _ in prompts))
    tallies = {name: replay(lm, draft, name, prompts, recordings) for name in names}
    greedy = next(iter(tallies.values())).greedy
    print(f"{model['name']} drafted by {draft.name}: {len(prompts)} prompts; target calls and estimated seconds, the "
          f"prompts' calls included (greedy: {greedy:.1f} s)")
    print_table(tallies, categories)


if __name__ == "__main__":
    main()
