"""What the replay tools share: a `compare` result's greedy outputs (`load_prompts`), a replayed target (`ReplayLM`)
and draft model (`ReplayDraft`) whose calls cost calibrated seconds on one clock, and `run`, which drives a real
strategy through `decoders.generate` on them.

A replay runs decodekit's own code - its drafters, proposers, chooser and draft-then-verify loop - and replaces only
the models: the target's logits are greedy's next token where the scored token's path is greedy's output (so every
draft is accepted exactly as far as a run's greedy verification would accept it), a draft model's are its recorded
first choice and probability at each position, and every call advances the clock by the seconds the calibrated cost
curve (`decoders.drafting.cost`) predicts for it: no timing noise, unless asked for.
"""

from __future__ import annotations

import math
import random
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

import decoders
from decoders.drafting.cost import TARGET_SIZES, CallCost
from decoders.models.cache import KVCache
from decoders.models.held import Held
from evals import suites

Prompt = tuple[str, str, list[int], list[int]]  # (id, category, prompt ids, greedy output)


def load_prompts(result: dict, lm: decoders.LM) -> list[Prompt]:
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


def stale(cost: CallCost, ratios: list[float]) -> CallCost:
    """`cost`'s curve with each knot's seconds times its ratio (one a knot), the context terms times the first's."""
    if len(ratios) != len(cost.sizes) or not all(r > 0 for r in ratios):
        raise ValueError(f"give one positive ratio per knot of the calibration ({len(cost.sizes)}: sizes "
                         f"{list(cost.sizes)}), got {ratios}")
    return CallCost(cost.sizes, tuple(s * r for s, r in zip(cost.seconds, ratios)), cost.per_position * ratios[0],
                    cost.per_position_per_token * ratios[0])


def take_over(replayed: decoders.LM, lm: decoders.LM) -> None:
    """Make `replayed` `lm` in all but its calls: same model, name, dtype and device, so the same calibration
    (`decoders.drafting.cost.calibration_key`): a replay never measures a replayed model."""
    replayed.__dict__.update({k: v for k, v in vars(lm).items() if k != "held"})
    replayed.held = Held()  # (its own probe verdicts, buffers and copies: nothing of the model's)
    replayed.cuda_graphs = False  # (its cache holds token ids, not a model's keys)
    replayed.native = None


class ReplayLM(decoders.LM):
    """A target whose calls replay `truth` (prompt + greedy output) and cost `cost`'s predicted seconds on its clock
    (`now`). Its cache holds the token ids it has seen as keys, so it crops and keeps paths as a model's does."""

    STALLS, STALL = 0.02, 3.0  # with noise (`noisy`), the share of calls stalled and how much longer they take

    def __init__(self, lm: decoders.LM, cost: CallCost, noise: float = 0.0, seed: int = 0) -> None:
        take_over(self, lm)
        self.cost, self.truth, self.seconds = cost, [], 0.0
        self.noise, self.random = noise, random.Random(seed)
        self.held.tree_mask = True  # (it scores trees whatever the model; the tools check the model's own)

    def noisy(self, length: int) -> float:
        """A call's factor of noise: a log-normal one of spread `noise`, STALL in a share STALLS of the calls, none for
        a prompt's call (longer than calibration measures: one such call's luck would outweigh the steps')."""
        if not self.noise or length > TARGET_SIZES[-1]:
            return 1.0
        stalled = self.random.random() < self.STALLS
        return math.exp(self.random.gauss(0.0, self.noise)) * (self.STALL if stalled else 1.0)

    def now(self) -> float:
        """The replay's clock: the calibrated seconds of the calls made so far (a draft's too)."""
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
            self.score(logits[row], at, on_path and path == self.truth[past: at])
        self.charge(length, past)
        return logits

    def score(self, row: torch.Tensor, at: int, agrees: bool) -> None:
        """Fill `row`, the logits predicting position `at`: greedy's token there where the path `agrees` with
        greedy's output, another token where not."""
        right = self.truth[at] if at < len(self.truth) else 0
        row[right if agrees else (right + 1) % self.vocab_size] = 1.0

    def charge(self, length: int, past: int) -> None:
        """Advance the clock by a call of `length` tokens after `past` cached ones."""
        self.seconds += self.cost.predict(length, past) * self.noisy(length)


@dataclass
class Recorded:
    """A draft model's first choice and its probability at each position of greedy's output, given greedy's
    prefix (`record`)."""

    start: int  # the prompt's length: top[0] predicts the output's first token
    top: list[int]  # [T]
    prob: list[float]  # [T]


def record(draft: decoders.LM, ids: list[int], truth: list[int]) -> Recorded:
    """One call of `draft` over the prompt and greedy's output; an int8 draft's layers kept on their int8 weights (a
    long call would take their float ones, which drafting never uses)."""
    from decoders.models.int8 import Int8Linear

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
    prob, top = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    return Recorded(len(ids), top.tolist(), prob.tolist())


class ReplayDraft(ReplayLM):
    """A draft model whose calls give, at each position, its `recorded` first choice with its recorded probability
    (the rest spread evenly), whatever the path drafted: exact on greedy's path, and past a chain's first miss the
    probabilities greedy's prefix gave (a run's would be conditioned on the missed token). Its calls cost `cost`
    (the draft's curve) on the target's clock. The target's own quantized copy (`self:int8`) shares the target's
    cache as in a run (`SharedCacheDraft`)."""

    def __init__(self, draft: decoders.LM, target: ReplayLM, cost: CallCost, shares_cache: bool = False) -> None:
        take_over(self, draft)
        self.target, self.cost, self.recorded = target, cost, Recorded(0, [], [])
        self.held.tree_mask = False  # (its trees would need more than its first choices)
        self.quantized_from = weakref.ref(target) if shares_cache else None

    @property
    def truth(self) -> list[int]:
        return self.target.truth

    def score(self, row: torch.Tensor, at: int, agrees: bool) -> None:
        j = at - self.recorded.start
        if not 0 <= j < len(self.recorded.top):
            return  # (past greedy's output: even, nothing to draft)
        top, prob = self.recorded.top[j], min(self.recorded.prob[j], 1.0)
        row.fill_(math.log(max((1.0 - prob) / max(self.vocab_size - 1, 1), 1e-38)))
        row[top] = math.log(max(prob, 1e-38))

    def charge(self, length: int, past: int) -> None:
        self.target.seconds += self.cost.predict(length, past) * self.target.noisy(length)


def greedy_seconds(cost: CallCost, ids: list[int], truth: list[int]) -> float:
    """Greedy's estimated seconds: the prompt's call, then one one-token call per further token."""
    return cost.predict(len(ids), 0) + sum(cost.predict(1, len(ids) + i) for i in range(1, len(truth)))


def run(target: ReplayLM, prompts: Iterable[Prompt], strategy: decoders.Decoder, draft: ReplayDraft | None = None,
        recordings: dict[str, Recorded] | None = None) -> list[dict]:
    """`strategy` (one instance: a store it holds lasts across the prompts, in order, as `compare` keeps it) on each
    prompt through `decoders.generate` with the replayed models: per prompt its target and draft calls, drafted
    tokens, estimated seconds, greedy's, and what `auto` chose. Raises where a run leaves greedy's output."""
    rows = []
    for prompt_id, category, ids, truth in prompts:
        target.truth, start = list(ids) + list(truth), target.seconds
        if draft is not None:
            draft.recorded = recordings[prompt_id]
        result = decoders.generate(target, list(ids), strategy=strategy, draft=draft, max_new_tokens=len(truth))
        if result.tokens != list(truth):
            raise AssertionError(f"{prompt_id}: the replay left greedy's output (a bug in the replay or in the "
                                 f"strategy)")
        stats = result.stats
        rows.append({"prompt_id": prompt_id, "category": category, "tokens": len(truth),
                     "calls": stats.target_calls, "draft_calls": stats.draft_calls, "drafted": stats.drafted,
                     "seconds": target.seconds - start, "greedy": greedy_seconds(target.cost, ids, truth),
                     "steps": dict(stats.details.get("steps", {})) if isinstance(stats.details, dict) else {}})
    return rows


@dataclass
class Tally:
    """A method's rows (`run`) summed, and per prompt (category, calls, seconds)."""

    calls: int = 0
    seconds: float = 0.0
    tokens: int = 0
    drafted: int = 0
    greedy: float = 0.0  # greedy's estimated seconds
    steps: Counter = field(default_factory=Counter)  # what `auto` chose: steps per proposer ("none": plain steps)
    per_prompt: dict = field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[dict]) -> Tally:
        out = cls()
        for row in rows:
            out.calls += row["calls"]
            out.seconds += row["seconds"]
            out.tokens += row["tokens"]
            out.drafted += row["drafted"]
            out.greedy += row["greedy"]
            out.steps.update(row["steps"])
            out.per_prompt[row["prompt_id"]] = (row["category"], row["calls"], row["seconds"])
        return out


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
