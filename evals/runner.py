"""`compare`: run strategies and peers on a suite's prompts, check them against greedy, and build one result.

Order of work: warm up every method once, then for each prompt and repeat run every method back to back
(interleaved, so drift in machine speed hits all methods alike), then check losslessness, then gather the runs of
every process (`accelerate launch` / torchrun split the prompts) and summarize on the main process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

import decoders
import grammars
from decoders import registry
from evals import lossless, metrics, peers, suites
from evals.measure import environment, roofline
from evals.timing import Run, run_decodekit

SCHEMA = "decodekit.compare/1"
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class CompareConfig:
    """What `compare` runs."""

    strategies: tuple[str, ...] = ()  # empty: every registered strategy and peer whose needs are met; greedy always
    suite: str = "default"  # a shipped suite name or a JSONL file
    max_new_tokens: int = 128  # cap for every prompt (a suite line may ask for fewer)
    repeats: int = 1  # timed runs of each (strategy, prompt); the speed-up spread is over repeats
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per strategy: {"speculative": {"k": 4}}
    warmup: bool = True  # one untimed run of every method first
    progress: bool = True  # tqdm bar on stderr
    bandwidth_megabytes: int = 256  # size of the roofline's bandwidth probe; 0 skips the roofline

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a whole number > 0, got {self.max_new_tokens!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be a whole number >= 1, got {self.repeats!r}")
        unknown = sorted(set(self.options) - {variant(n)[0] for n in self.strategies or registry.available()})
        if unknown:
            raise ValueError(f"options given for strategies that do not run: {', '.join(unknown)}")


def parse_value(raw: str) -> Any:
    """A command-line option value: JSON when it parses as JSON (4, 0.5, true, [1, 2]), else the string itself."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def variant(name: str) -> tuple[str, dict[str, Any]]:
    """Split a method name with settings, `staged@max_depth=12@min_prob=0.05`, into its strategy and options.

    Variants let one run rank several settings of a strategy side by side (`speculative@k=3,speculative@k=5`).
    """
    base, *pairs = name.split("@")
    options = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"method {name!r}: settings must look like STRATEGY@KEY=VALUE (e.g. speculative@k=3)")
        options[key] = parse_value(raw)
    if options and peers.is_peer(base):
        raise ValueError(f"method {name!r}: peers take no @settings")
    return base, options


def needs_grammar(name: str) -> bool:
    """Whether a strategy only makes sense under a grammar (runs only on prompts with a schema)."""
    base = variant(name)[0]
    if peers.is_peer(base):
        return base.startswith("outlines:")
    return registry.get(base).needs_grammar


def plan(requested: tuple[str, ...], has_draft: bool) -> tuple[list[str], list[str]]:
    """The methods to run (greedy first) and notes on what was skipped; an impossible explicit request raises."""
    explicit = bool(requested)
    wanted = list(requested) if explicit else registry.available() + list(peers.PEERS)
    names = [metrics.BASELINE] + [n for n in dict.fromkeys(wanted) if n != metrics.BASELINE]
    chosen, notes = [], []
    for name in names:
        base, settings = variant(name)
        if peers.is_peer(base):
            needs_draft = peers.get(base).needs_draft
        else:
            strategy = registry.get(base)
            strategy(**settings)  # an unknown strategy or option raises here, before any model loads
            needs_draft = strategy.needs_draft
        if peers.is_peer(name) and peers.unavailable(name):
            notes.append(f"{name}: not available ({peers.unavailable(name)})")
        elif needs_draft and not has_draft:
            if explicit:
                raise ValueError(f"strategy {name!r} needs a draft model: pass --draft MODEL (e.g. a smaller model "
                                 "with the same tokenizer)")
            notes.append(f"{name}: skipped (needs a draft model; pass --draft)")
        else:
            chosen.append(name)
    return chosen, notes


def grammar_for(schema: dict | None) -> grammars.JsonSchema | None:
    """The JSON-schema constraint of a prompt's schema, or None for a prompt without one."""
    return None if schema is None else grammars.json_schema(schema)


class Processes:
    """The processes of this run: one when started plainly, several under `accelerate launch` or torchrun."""

    def __init__(self, cpu: bool = True) -> None:
        self.state = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState

            self.state = PartialState(cpu=cpu)
        self.index = self.state.process_index if self.state else 0
        self.count = self.state.num_processes if self.state else 1
        self.is_main = self.index == 0

    @property
    def device(self) -> torch.device | None:
        """This process's device under accelerate (e.g. cuda:1), else None."""
        return self.state.device if self.state else None

    def split(self, items: list) -> list:
        """This process's contiguous share of `items` (order kept, so gathering restores the whole list)."""
        if not self.state:
            return items
        with self.state.split_between_processes(items) as share:
            return list(share)

    def gather(self, items: list) -> list:
        """Every process's items, concatenated in process order."""
        if not self.state:
            return items
        from accelerate.utils import gather_object

        return gather_object(items)


def compare(lm: decoders.LM, config: CompareConfig, draft: decoders.LM | None = None,
            processes: Processes | None = None) -> dict | None:
    """Run the comparison; returns the result (see evals/README.md) on the main process, None on the others."""
    processes = processes or Processes(cpu=lm.device.type == "cpu")
    prompts = suites.load(config.suite)
    names, notes = plan(config.strategies, draft is not None)
    constraints = {p.id: grammar_for(p.schema) for p in prompts}
    for name in [n for n in names if needs_grammar(n) and not any(constraints.values())]:
        notes.append(f"{name}: runs only on prompts with a schema under its grammar; this suite has none")
    mine = processes.split(prompts)
    tokens = {p.id: suites.render(lm, p, config.chat_template) for p in mine}
    limit = {p.id: min(config.max_new_tokens, p.max_new_tokens or config.max_new_tokens) for p in mine}
    skipped = [p for p in mine if lm.context_length and len(tokens[p.id]) + limit[p.id] > lm.context_length]
    notes += [f"prompt {p.id}: skipped ({len(tokens[p.id])} prompt tokens + {limit[p.id]} new tokens exceed the "
              f"model's context of {lm.context_length})" for p in skipped]
    mine = [p for p in mine if p not in skipped]

    def runs_for(prompt):
        return [n for n in names if not needs_grammar(n) or constraints[prompt.id] is not None]

    def run(name: str, prompt: suites.Prompt, repeat: int, max_new_tokens: int) -> Run:
        grammar = constraints[prompt.id] if needs_grammar(name) else None
        where = dict(prompt_id=prompt.id, category=prompt.category, repeat=repeat, max_new_tokens=max_new_tokens)
        if peers.is_peer(name):
            return peers.run_peer(lm, tokens[prompt.id], name, draft=draft, grammar=grammar, **where)
        base, settings = variant(name)
        options = {**config.options.get(base, {}), **settings}
        record = run_decodekit(lm, tokens[prompt.id], base, draft=draft, grammar=grammar, options=options, **where)
        record.strategy = name
        return record

    for name in names if config.warmup else []:
        first = next((p for p in mine if name in runs_for(p)), None)
        try:
            if first is not None:
                run(name, first, -1, min(WARMUP_TOKENS, limit[first.id]))
        except Exception:  # noqa: BLE001 - the timed runs record the error
            pass
    total = sum(len(runs_for(p)) for p in mine) * config.repeats
    bar = tqdm(total=total, desc=f"compare [{processes.index}]" if processes.count > 1 else "compare",
               file=sys.stderr, disable=not config.progress, dynamic_ncols=True)
    runs: list[Run] = []
    errors: list[dict] = []
    for prompt in mine:
        for repeat in range(config.repeats):
            for name in runs_for(prompt):
                bar.set_postfix_str(f"{name} · {prompt.id}", refresh=False)
                try:
                    record = run(name, prompt, repeat, limit[prompt.id])
                except Exception as error:  # noqa: BLE001 - one broken method must not lose a long run
                    errors.append({"strategy": name, "prompt_id": prompt.id, "category": prompt.category,
                                   "repeat": repeat, "error": f"{type(error).__name__}: {error}"})
                else:
                    record.rank = processes.index
                    runs.append(record)
                bar.update()
    bar.close()

    greedy_tokens = {(r.prompt_id, False): r.tokens for r in runs if r.strategy == metrics.BASELINE and r.repeat == 0}

    def reference(prompt_id: str, grammar: bool) -> list[int]:
        if (prompt_id, grammar) not in greedy_tokens:  # greedy under the prompt's grammar (or if it raised), untimed
            greedy_tokens[(prompt_id, grammar)] = decoders.generate(
                lm, tokens[prompt_id], max_new_tokens=limit[prompt_id],
                grammar=constraints[prompt_id] if grammar else None).tokens
        return greedy_tokens[(prompt_id, grammar)]

    lossless.check(lm, runs, tokens, reference, schemas={p.id: (p.schema, constraints[p.id]) for p in mine})
    gathered = processes.gather([{"runs": [r.as_dict() for r in runs], "errors": errors, "notes": notes}])
    if not processes.is_main:
        return None
    records = [r for part in gathered for r in part["runs"]]
    errors = [e for part in gathered for e in part["errors"]]
    notes = list(dict.fromkeys(n for part in gathered for n in part["notes"]))
    return build_result(lm, draft, config, prompts, names, notes, records, errors, processes.count)


def build_result(lm, draft, config: CompareConfig, prompts, names, notes, records, errors, process_count) -> dict:
    """The result document (schema in evals/README.md)."""
    summary = metrics.summarize(records, errors)
    result = {
        "schema": SCHEMA,
        "environment": environment(lm.device, lm.dtype),
        "model": {"name": lm.name, "class": type(lm.model).__name__, "draft": draft.name if draft else None},
        "config": {
            "suite": config.suite, "prompts": len(prompts),
            "categories": list(dict.fromkeys(p.category for p in prompts)),
            "max_new_tokens": config.max_new_tokens, "repeats": config.repeats, "chat_template": config.chat_template,
            "strategies": names, "options": {k: dict(v) for k, v in config.options.items()},
            "processes": process_count, "tie_tolerance": {str(k).removeprefix("torch."): v
                                                          for k, v in lossless.REL_TOLERANCE.items()},
        },
        "prompts": [dataclasses.asdict(p) for p in prompts],
        "notes": notes,
        "roofline": None,
        "summary": summary,
        "runs": records,
        "errors": errors,
    }
    if config.bandwidth_megabytes:
        line = roofline(lm.model, lm.device, config.bandwidth_megabytes)
        greedy = next((s for s in summary if s["strategy"] == metrics.BASELINE), None)
        speed = greedy["tokens_per_second"]["mean"] if greedy else None
        line["greedy_tokens_per_second"] = speed
        line["greedy_fraction"] = speed / line["limit_tokens_per_second"] if speed else None
        result["roofline"] = line
    return result
