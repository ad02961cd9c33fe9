"""Replay a `compare` result's greedy outputs through the draft-length rules of draft-model chains: `speculative`'s
fixed k, `threshold`'s moving threshold and `auto`'s chooser (its draft-model chains against plain steps), with one
draft-model call per prompt instead of a run - to compare and tune those rules in seconds, free of timing noise.

    python -m devtools.replay_chains RESULT.json --draft zoo:qwen2.5-coder-0.5b --draft-quantize int8 \
        [--methods speculative,threshold,auto]

One call of the draft over each prompt and its greedy output records the draft's first choice and its probability at
every position given greedy's prefix. A chain drafted from position t is then that choice at t, t+1, ... for as long
as the earlier drafted tokens agree with greedy (the draft saw greedy's own prefix), so its accepted length is exact;
past its first miss the tokens are misses and their probabilities are taken from greedy's prefix (the run's would be
conditioned on the missed token), which moves only where a rule stops drafting a chain already lost. Each step is
costed with the calibrated cost curves `auto` uses: the draft's calls (the first feeding what the draft has not seen:
1 token, 2 after a fully accepted draft, none for the target's own int8 copy, which shares its cache) and one target
call of 1 + k tokens. One long call of the draft also differs from its one-token calls in rounding, so replayed
acceptance is close to, not equal to, a run's; for `self:int8` the recording runs the int8 copy on its own cache,
where a run drafts on the target's.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

import decoders
from decoders.driver import resolve_draft
from decoders.drafting import Draft
from decoders.drafting.chooser import Chooser, ChooserOptions
from decoders.drafting.cost import calibrate
from decoders.drafting.draft_model import SELF_ACCEPTANCE
from decoders.models.quantize import Int8Linear
from decoders.strategies.auto import AutoOptions, expect_draft
from decoders.strategies.speculative import ACCEPTANCE, SpeculativeOptions, default_k
from decoders.strategies.threshold import ThresholdOptions, adapt_threshold
from devtools.replay_drafts import Tally, accepted, load_prompts, print_table
from evals import methods

MISS = -1  # a drafted token past the chain's first miss: it agrees with nothing


@dataclass
class Recorded:
    """The draft's first choice and its probability at each position of greedy's output, given greedy's prefix."""

    top: list[int]  # [T]
    prob: list[float]  # [T]

    def chain(self, truth: list[int], start: int, limit: int, keep_going) -> tuple[list[int], list[float]]:
        """The draft's chain from position `start` (up to `limit` tokens, while `keep_going(probabilities so far)`):
        (tokens, the draft's probability of each)."""
        tokens, probs, agrees = [], [], True
        for position in range(start, min(start + limit, len(truth))):
            tokens.append(self.top[position] if agrees else MISS)
            probs.append(self.prob[position])
            agrees = agrees and self.top[position] == truth[position]
            if not keep_going(probs):
                break
        return tokens, probs


def record(draft: decoders.LM, ids: list[int], truth: list[int]) -> Recorded:
    """One draft call over the prompt and greedy's output; an int8 draft's layers kept on their int8 weights (a long
    call would take their float ones, which drafting never uses)."""
    layers = [m for m in draft.model.modules() if isinstance(m, Int8Linear)]
    saved = [m.float_from for m in layers]
    try:
        for m in layers:
            m.float_from = None
        with torch.no_grad():
            logits = draft.forward(ids + truth[:-1], draft.new_cache())[len(ids) - 1:]  # [T, vocab]: predicting truth
    finally:
        for m, rows in zip(layers, saved):
            m.float_from = rows
    probs = torch.softmax(logits.float(), dim=-1)
    prob, top = probs.max(dim=-1)
    return Recorded(top.tolist(), prob.tolist())


class Rule:
    """A draft-length rule: `propose` the chain for this step, `update` with how much of it was accepted."""

    def propose(self, recorded: Recorded, truth: list[int], start: int, limit: int, context: int,
                costs: tuple[float, float]) -> tuple[list[int], list[float]]:
        """The chain drafted from position `start` (context: cached tokens; costs: the seconds of a one-token draft
        call and what its first call costs beyond that)."""
        raise NotImplementedError

    def update(self, probs: list[float], accepted: int) -> None:
        pass


class Fixed(Rule):
    def __init__(self, options: SpeculativeOptions, cost, shares_cache: bool) -> None:
        self.k, self.cost, self.shares_cache = options.k, cost, shares_cache

    def propose(self, recorded, truth, start, limit, context, costs):
        if self.k is None:  # chosen as `speculative` chooses it, at the prompt's length
            self.k = default_k(self.cost, context, SELF_ACCEPTANCE if self.shares_cache else ACCEPTANCE)
        return recorded.chain(truth, start, min(self.k, limit), lambda probs: True)


class Threshold(Rule):
    def __init__(self, options: ThresholdOptions, cost, shares_cache: bool) -> None:
        self.options, self.threshold = options, options.threshold

    def propose(self, recorded, truth, start, limit, context, costs):
        self.cumulative: list[float] = []

        def keep_going(probs):
            self.cumulative.append((self.cumulative[-1] if self.cumulative else 1.0) * probs[-1])
            return self.cumulative[-1] >= self.threshold

        return recorded.chain(truth, start, min(self.options.max_draft, limit), keep_going)

    def update(self, probs, accepted):
        if probs:
            self.threshold = adapt_threshold(self.threshold, self.cumulative, accepted, self.options)


class Auto(Rule):
    """`auto` restricted to the draft model's chains: each step the chooser takes a chain or a plain step, and a
    chain runs while one more token is predicted to pay (as `auto` drafts with a draft model). Without `auto`'s
    correction of the draft model's plans by what their steps gave (`Chooser.correction`), which a run learns from its
    own timed steps."""

    def __init__(self, options: ChooserOptions, cost, shares_cache: bool, max_draft: int = AutoOptions.max_draft
                 ) -> None:
        self.chooser, self.max_draft = Chooser(cost, options), max_draft
        expect_draft(self.chooser, shares_cache)  # as `auto` starts its chooser

    def propose(self, recorded, truth, start, limit, context, costs):
        per_token, catch_up = costs
        room = min(self.max_draft, limit)
        plan = self.chooser.choose([self.chooser.candidate("draft", room, per_token_seconds=per_token,
                                                           fixed_seconds=catch_up)], context)
        if plan.proposer is None:
            return [], []
        planned, limit = (plan.k, plan.k) if plan.probe else (1, room)
        return recorded.chain(truth, start, limit, lambda probs: len(probs) < planned or
                              self.chooser.keep_drafting("draft", probs, context, catch_up))

    def update(self, probs, accepted):
        if probs:
            self.chooser.update("draft", len(probs), accepted, probs)


RULES = {"speculative": (Fixed, SpeculativeOptions), "threshold": (Threshold, ThresholdOptions),
         "auto": (Auto, ChooserOptions)}


def build(name: str, cost, shares_cache: bool = False) -> Rule:
    """A rule from a method name with @settings, e.g. `threshold@min_threshold=0.2`, `auto@decay=0.95`."""
    base, settings = methods.split(name)
    if base not in RULES:
        raise SystemExit(f"{name}: replayable rules are {', '.join(RULES)}")
    rule, options = RULES[base]
    return rule(options(**settings), cost, shares_cache)


def replay(name: str, prompts, recordings: dict[str, Recorded], cost, shares_cache: bool) -> Tally:
    """Target calls and estimated seconds (draft calls included) of rule `name` over the prompts."""
    out = Tally()
    for prompt_id, category, ids, truth in prompts:
        rule, done, calls, seconds, drafted, fed = build(name, cost, shares_cache), 0, 0, 0.0, 0, 1
        while done < len(truth):
            context, limit = len(ids) + done, len(truth) - done - 1
            per_token = cost.draft_seconds(1, context)
            catch_up = 0.0 if shares_cache else cost.draft_seconds(1, context, fed) - per_token
            tokens, probs = rule.propose(recordings[prompt_id], truth, done, limit, context, (per_token, catch_up))
            got = accepted(tokens, Draft(tokens).links, truth[done:])
            if tokens:
                seconds += cost.draft_seconds(len(tokens), context, 1 if shares_cache else fed)
                fed = 2 if got == len(tokens) else 1
            else:
                fed += 1  # the draft sat this step out
            seconds += cost.target_seconds(1 + len(tokens), context)
            calls, drafted, done = calls + 1, drafted + len(tokens), done + got + 1
            rule.update(probs, got)
        out.calls, out.seconds, out.tokens, out.drafted = (out.calls + calls, out.seconds + seconds,
                                                           out.tokens + len(truth), out.drafted + drafted)
        out.per_prompt[prompt_id] = (category, calls, seconds)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a `decodekit compare --out` JSON file with a greedy run")
    parser.add_argument("--draft", required=True, help="the draft model (a zoo name, folder, or self:int8)")
    parser.add_argument("--draft-quantize", default=None, help="quantize the draft model (int8)")
    parser.add_argument("--methods", default="speculative,threshold,auto",
                        help="comma-separated: speculative / threshold / auto (ChooserOptions) with @settings")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = result["model"]
    lm = decoders.load(model["name"], dtype=result["environment"]["dtype"])
    if args.draft_quantize is None:  # a name, or self:int8 (the target's own int8 copy)
        draft = resolve_draft(lm, args.draft)
    else:
        draft = decoders.load(args.draft, dtype=lm.dtype, device=lm.device, quantize=args.draft_quantize)
    shares_cache = draft.quantized_from is not None and draft.quantized_from() is lm  # as draft_model(state) decides
    cost = calibrate(lm, draft)
    prompts = load_prompts(result, lm)
    recordings = {prompt_id: record(draft, ids, truth) for prompt_id, _, ids, truth in prompts}
    categories = list(dict.fromkeys(c for _, c, _, _ in prompts))
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    greedy = sum(cost.target_seconds(1, len(ids) + i) for _, _, ids, truth in prompts for i in range(len(truth)))
    print(f"{model['name']} drafted by {draft.name}: {len(prompts)} prompts; target calls and estimated decode "
          f"seconds (greedy: {greedy:.1f} s)")
    print_table({name: replay(name, prompts, recordings, cost, shares_cache) for name in names}, categories)


if __name__ == "__main__":
    main()
