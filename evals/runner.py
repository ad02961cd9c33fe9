"""`compare`: run strategies and peers on a suite's prompts, check them against greedy, and build one result.

Order of work: before any model loads, read the suite and plan the methods (`evals.methods`: parsed, constructed and
their needs checked once); once the models are loaded, probe what each method needs of them; warm up every method
once, then for each prompt and repeat run every method back to back (interleaved, so drift in machine speed hits all
methods alike), then check losslessness, then gather the runs of every process (`accelerate launch` / torchrun split
the prompts) and summarize on the main process.

With `batch_sizes` (`--batch-size`) each method instead decodes the whole suite as one queue per batch size
(`evals.batched`): warm up every method at that size, then repeat by repeat run every method's queue back to back,
then check every request against greedy's tokens at batch 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

import decoders
import grammars
from decoders.driver import resolve_draft
from decoders.options import check_whole, whole
from evals import batched, llamacpp, llamacpp_build, lossless, metrics, peers, suites
from evals.measure import environment, roofline, with_demonstrated
from evals.methods import Method, check_loaded, plan
from evals.report import SCHEMA
from evals.timing import Run, run_decodekit

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class CompareConfig:
    """What `compare` runs."""

    strategies: tuple[str, ...] = ()  # empty: every registered strategy and peer whose needs are met; greedy always
    suite: str = "default"  # a shipped suite name or a JSONL file
    limit: int | None = None  # only the suite's first N prompts (after per_category)
    per_category: int | None = None  # only the first N prompts of each category, in file order
    draft_quantize: str | None = None  # strategies draft with this quantized copy of the draft; peers with the draft
    max_new_tokens: int = 128  # cap for every prompt (a suite line may ask for fewer)
    repeats: int = 1  # timed runs of each (strategy, prompt); the speed-up spread is over repeats
    chat_template: bool = True  # apply the tokenizer's chat template when it has one
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per strategy: {"speculative": {"k": 4}}
    warmup: bool = True  # one untimed run of every method first
    progress: bool = True  # tqdm bar on stderr
    bandwidth_megabytes: int = 256  # size of the roofline's bandwidth probe; 0 skips the roofline
    batch_sizes: tuple[int, ...] = ()  # empty: prompt by prompt; else the suite as one queue per batch size (sorted)
    llamacpp: str | None = None  # the llama.cpp build the llamacpp:* peers run (--llamacpp); None: the installed one

    def __post_init__(self) -> None:
        check_whole(self, max_new_tokens=1, repeats=1)
        object.__setattr__(self, "batch_sizes", tuple(sorted({whole("batch_size", n) for n in self.batch_sizes})))


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during compare's timed runs: `result` holds the rounds measured before it (marked "partial"), on the
    main process (None on the others)."""

    def __init__(self, result: dict | None) -> None:
        super().__init__()
        self.result = result


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

    def exit(self, code: int) -> int:
        """End a command of several processes at once with exit status `code`, skipping the interpreter's teardown
        (one process: just return `code`). Otherwise a process could abort after its work was done ("terminate
        called without an active exception", status -6): a gloo worker thread still releasing a finished
        collective's tensors needs the GIL once the interpreter is finalizing, and is killed holding a C++ frame.
        Seen in 3 of 20 two-process runs on a loaded 2-core machine (torch 2.13); `destroy_process_group` first
        does not help here, as the group outlives it once transformers has loaded a tokenizer."""
        if self.count == 1:
            return code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Comparison:
    """A compare prepared before any model loads: its suite read and its methods planned, each once.

    `has_draft`: a draft model will be given to `run` (a loaded `LM`, a model name or "self:int8").
    """

    def __init__(self, config: CompareConfig, has_draft: bool) -> None:
        self.config, self.has_draft = config, has_draft
        everything = suites.load(config.suite)
        self.suite_size = len(everything)
        self.prompts = suites.select(everything, limit=config.limit, per_category=config.per_category)
        self.methods, self.notes = plan(
            config.strategies, has_draft, config.options, batched=bool(config.batch_sizes), llamacpp_dir=config.llamacpp
        )

    @property
    def takes_draft(self) -> bool:
        """Whether any planned method uses the draft model (else there is no need to load one)."""
        return self.has_draft and any(m.takes_draft for m in self.methods)

    def run(
        self, lm: decoders.LM, draft: decoders.LM | str | None = None, processes: Processes | None = None
    ) -> dict | None:
        """Run the comparison; returns the result (see evals/README.md) on the main process, None on the others.
        Ctrl-C during the timed runs raises `Interrupted`, with the result of the rounds measured before it. The
        llama.cpp peers' servers are stopped when it returns or raises."""
        with contextlib.ExitStack() as resources:
            return self._run(lm, draft, processes, resources)

    def _run(
        self,
        lm: decoders.LM,
        draft: decoders.LM | str | None,
        processes: Processes | None,
        resources: contextlib.ExitStack,
    ) -> dict | None:
        if draft is not None and not self.has_draft:
            raise ValueError("this comparison was planned without a draft model: Comparison(config, has_draft=True)")
        if draft is None and self.takes_draft:
            raise ValueError(
                "this comparison was planned with a draft model, for "
                + ", ".join(m.name for m in self.methods if m.takes_draft)
                + "; pass draft="
            )
        config, prompts, notes = self.config, self.prompts, list(self.notes)
        processes = processes or Processes(cpu=lm.device.type == "cpu")
        if config.batch_sizes and processes.count > 1:
            raise ValueError(BATCHED_PROCESSES)
        label = draft if isinstance(draft, str) else getattr(draft, "name", None)
        draft = resolve_draft(lm, draft) if self.takes_draft else None  # "self:int8": made once, for every run
        peer_draft = draft  # the peers draft with the model as loaded, as a user would
        if draft is not None and config.draft_quantize:
            draft = decoders.quantize(draft, config.draft_quantize)
        methods = check_loaded(self.methods, lm, draft, explicit=bool(config.strategies), notes=notes)
        fresh = {m.name for m in methods if m.options.get("store") == "run"}  # suffix@store=run: a store per repeat
        notes += [
            f"{name}: one SuffixStore across the suite's prompts, in order (a new one for each repeat; the "
            "warm-up's is thrown away)"
            for name in sorted(fresh)
        ]
        decoders_for: dict[tuple[str, int], decoders.Decoder] = {}
        constraints = {p.id: grammar_for(p.schema) for p in prompts}
        for method in [m for m in methods if m.needs_grammar and not any(constraints.values())]:
            notes.append(f"{method.name}: runs only on prompts with a schema under its grammar; this suite has none")
        tokens = {p.id: suites.render(lm, p, config.chat_template) for p in prompts}
        limit = {p.id: min(config.max_new_tokens, p.max_new_tokens or config.max_new_tokens) for p in prompts}
        fits = [p for p in prompts if not lm.context_length or len(tokens[p.id]) + limit[p.id] <= lm.context_length]
        if not fits:
            raise ValueError(
                f"every prompt of suite {config.suite!r} is too long for the model's context of "
                f"{lm.context_length} tokens with {config.max_new_tokens} new tokens; lower "
                "--max-new-tokens or use shorter prompts"
            )
        notes += [
            f"prompt {p.id}: skipped ({len(tokens[p.id])} prompt tokens + {limit[p.id]} new tokens exceed the "
            f"model's context of {lm.context_length})"
            for p in prompts
            if p not in fits
        ]
        if config.batch_sizes:
            return self._run_batched(lm, label, draft, methods, notes, fits, tokens, limit, fresh)
        servers = None
        if any(m.is_peer and m.peer.engine == "llamacpp" for m in methods):  # GGUFs converted here, before any run
            context = max(len(tokens[p.id]) + limit[p.id] for p in fits) + 128  # (room for a last draft too)
            servers = resources.enter_context(
                llamacpp.Servers(
                    llamacpp_build.require(config.llamacpp),
                    lm,
                    peer_draft,
                    context=-(-context // 256) * 256,
                    say=lambda line: print(line, file=sys.stderr),
                )
            )
            methods = servers.prepare(methods, notes)
        mine = processes.split(fits)

        def runs_for(prompt: suites.Prompt) -> list[Method]:
            return [m for m in methods if not m.needs_grammar or constraints[prompt.id] is not None]

        def run(method: Method, prompt: suites.Prompt, repeat: int, max_new_tokens: int) -> Run:
            where = dict(
                prompt_id=prompt.id,
                category=prompt.category,
                repeat=repeat,
                max_new_tokens=max_new_tokens,
                grammar=constraints[prompt.id] if method.needs_grammar else None,
            )
            if method.is_peer and method.peer.engine == "llamacpp":
                return servers.run(method, tokens[prompt.id], **where)
            if method.is_peer:
                return peers.run_peer(
                    lm, tokens[prompt.id], method.peer, **where, draft=peer_draft if method.takes_draft else None
                )
            decoder = method.decoder
            if method.name in fresh:
                if (method.name, repeat) not in decoders_for:
                    decoders_for[method.name, repeat] = method.with_options(store=decoders.SuffixStore())
                decoder = decoders_for[method.name, repeat]
            return run_decodekit(
                lm, tokens[prompt.id], decoder, name=method.name, **where, draft=draft if method.takes_draft else None
            )

        for method in methods if config.warmup else []:
            first = next((p for p in mine if method in runs_for(p)), None)
            try:
                if first is not None:
                    run(method, first, -1, min(WARMUP_TOKENS, limit[first.id]))
            except Exception:  # noqa: BLE001 - the timed runs record the error
                pass
        total = sum(len(runs_for(p)) for p in mine) * config.repeats
        bar = tqdm(
            total=total,
            desc=f"compare [{processes.index}]" if processes.count > 1 else "compare",
            file=sys.stderr,
            disable=not config.progress,
            dynamic_ncols=True,
        )
        runs: list[Run] = []
        errors: list[dict] = []
        done = (0, 0)  # runs and errors of the finished rounds (every method on one prompt and repeat)
        interrupted = False
        try:
            for prompt in mine:
                for repeat in range(config.repeats):
                    for method in runs_for(prompt):
                        bar.set_postfix_str(f"{method.name} · {prompt.id}", refresh=False)
                        try:
                            record = run(method, prompt, repeat, limit[prompt.id])
                        except Exception as error:  # noqa: BLE001 - one broken method must not lose a long run
                            errors.append(
                                {
                                    "strategy": method.name,
                                    "kind": "peer" if method.is_peer else "decodekit",
                                    "prompt_id": prompt.id,
                                    "category": prompt.category,
                                    "repeat": repeat,
                                    "error": f"{type(error).__name__}: {error}",
                                }
                            )
                        else:
                            record.rank = processes.index
                            runs.append(record)
                        bar.update()
                    done = (len(runs), len(errors))
        except KeyboardInterrupt:  # keep the finished rounds, so that every method covers the same prompts
            interrupted = True
            del runs[done[0] :], errors[done[1] :]
        bar.close()
        if servers is not None:
            servers.close()  # (before the roofline's probe reads the memory bandwidth)

        reference = greedy_reference(lm, runs, tokens, limit, constraints)
        lossless.check(lm, runs, tokens, reference, schemas={p.id: (p.schema, constraints[p.id]) for p in mine})
        gathered = processes.gather(
            [{"runs": [r.as_dict() for r in runs], "errors": errors, "notes": notes, "interrupted": interrupted}]
        )
        partial = any(part["interrupted"] for part in gathered)
        result = None
        if processes.is_main:
            records = [r for part in gathered for r in part["runs"]]
            errors = [e for part in gathered for e in part["errors"]]
            notes = list(dict.fromkeys(n for part in gathered for n in part["notes"]))
            result = build_result(
                lm,
                label,
                draft,
                config,
                prompts,
                [m.name for m in methods],
                notes,
                records,
                errors,
                processes.count,
                suite_size=self.suite_size,
                partial=partial,
            )
        if partial:
            raise Interrupted(result)
        return result

    def _run_batched(
        self,
        lm: decoders.LM,
        label: str | None,
        draft: decoders.LM | None,
        methods: list[Method],
        notes: list[str],
        prompts: list[suites.Prompt],
        tokens: dict[str, list[int]],
        limit: dict[str, int],
        fresh: set[str],
    ) -> dict:
        """The batched compare (`config.batch_sizes`): per batch size, warm up every method on a short queue, then
        repeat by repeat run every method's queue back to back; check every request against greedy at batch 1."""
        config = self.config
        requests = [batched.Request(p, tokens[p.id], limit[p.id]) for p in prompts]
        skipped: list[dict] = []
        methods = ready_to_batch(methods, lm, requests[0].tokens, notes, skipped)
        fresh_decoders: dict[tuple[str, int, int], decoders.Decoder] = {}

        def queue(method: Method, size: int, repeat: int, queued: list[batched.Request]) -> batched.Done:
            if method.is_peer:
                return batched.peer_queue(lm, queued, method.peer, batch_size=size, repeat=repeat)
            decoder = method.decoder
            if method.name in fresh:  # suffix@store=run: a store for each batch size and repeat
                key = (method.name, size, repeat)
                if key not in fresh_decoders:
                    fresh_decoders[key] = method.with_options(store=decoders.SuffixStore())
                decoder = fresh_decoders[key]
            return batched.decodekit_queue(
                lm,
                queued,
                decoder,
                batch_size=size,
                name=method.name,
                repeat=repeat,
                draft=draft if method.takes_draft else None,
            )

        bar = tqdm(
            total=len(config.batch_sizes) * config.repeats * len(methods),
            desc="compare",
            file=sys.stderr,
            disable=not config.progress,
            dynamic_ncols=True,
        )
        queues: list[dict] = []
        runs: list[Run] = []
        errors: list[dict] = []
        done = (0, 0, 0)  # queues, runs and errors of the finished rounds (every method at one batch size and repeat)
        interrupted = False
        try:
            for size in config.batch_sizes:
                warmup = [dataclasses.replace(r, limit=min(WARMUP_TOKENS, r.limit)) for r in requests[:size]]
                for method in methods if config.warmup else []:
                    bar.set_postfix_str(f"warm-up {method.name} · batch {size}", refresh=False)
                    with contextlib.suppress(Exception):  # the timed runs record the error
                        queue(method, size, -1, warmup)
                for repeat in range(config.repeats):
                    for method in methods:
                        bar.set_postfix_str(f"{method.name} · batch {size}", refresh=False)
                        try:
                            finished = queue(method, size, repeat, requests)
                        except Exception as error:  # noqa: BLE001 - one broken method must not lose a long run
                            errors.append(
                                {
                                    "strategy": method.name,
                                    "kind": "peer" if method.is_peer else "decodekit",
                                    "prompt_id": None,
                                    "category": None,
                                    "repeat": repeat,
                                    "batch_size": size,
                                    "error": f"{type(error).__name__}: {error}",
                                }
                            )
                        else:
                            queues.append(finished.queue.as_dict())
                            runs += finished.runs
                            errors += finished.errors
                        bar.update()
                    done = (len(queues), len(runs), len(errors))
        except KeyboardInterrupt:  # keep the finished rounds, so that every method covers the same queues
            interrupted = True
            del queues[done[0] :], runs[done[1] :], errors[done[2] :]
        bar.close()
        lossless.check(lm, runs, tokens, greedy_reference(lm, runs, tokens, limit, {}))
        result = build_result(
            lm,
            label,
            draft,
            config,
            self.prompts,
            [m.name for m in methods],
            notes,
            [r.as_dict() for r in runs],
            errors,
            1,
            suite_size=self.suite_size,
            partial=interrupted,
            queues=queues,
            skipped=skipped,
        )
        if interrupted:
            raise Interrupted(result)
        return result


BATCHED_PROCESSES = (
    "--batch-size runs the suite as one queue in one process: start compare without accelerate launch or torchrun"
)


def ready_to_batch(
    methods: list[Method], lm: decoders.LM, prompt: list[int], notes: list[str], skipped: list[dict]
) -> list[Method]:
    """The methods of a batched compare that can run here, probed once before any run: decodekit's batch needs the
    target to take custom 4D attention masks (else this raises); `hf:continuous` needs transformers'
    `generate_batch` to run on this model and device - where it does not, it is left out with the reason in the
    notes and in `skipped`, and the report shows it as not run (named or not: the cause is the device, not the
    request)."""
    try:
        lm.check_tree_mask()
    except TypeError as error:
        raise TypeError(f"--batch-size: decodekit cannot decode a batch with this model: {error}") from None
    usable = []
    for method in methods:
        if method.is_peer and method.base == "hf:continuous":
            problem = batched.continuous_problem(lm, prompt[:16])
            if problem is not None:
                notes.append(
                    f"{method.name}: not run (transformers' generate_batch does not run on this model and "
                    f"device: {problem})"
                )
                skipped.append({"strategy": method.name, "reason": problem})
                continue
        usable.append(method)
    return usable


def greedy_reference(
    lm: decoders.LM,
    runs: list[Run],
    tokens: dict[str, list[int]],
    limit: dict[str, int],
    constraints: Mapping[str, Any],
):
    """`reference(prompt_id, grammar)` for `lossless.check`: greedy's tokens on a prompt, from its first-repeat run
    (one prompt at a time, or at batch 1 in a batched compare), else decoded untimed (under the prompt's grammar
    when `grammar`, or when greedy's run raised or did not run at batch 1)."""
    greedy_tokens = {
        (r.prompt_id, False): r.tokens
        for r in runs
        if r.strategy == metrics.BASELINE and r.repeat == 0 and r.batch_size in (None, 1)
    }

    def reference(prompt_id: str, grammar: bool) -> list[int]:
        if (prompt_id, grammar) not in greedy_tokens:
            greedy_tokens[(prompt_id, grammar)] = decoders.generate(
                lm,
                tokens[prompt_id],
                strategy=metrics.BASELINE,
                max_new_tokens=limit[prompt_id],
                grammar=constraints[prompt_id] if grammar else None,
            ).tokens
        return greedy_tokens[(prompt_id, grammar)]

    return reference


def compare(
    lm: decoders.LM, config: CompareConfig, draft: decoders.LM | str | None = None, processes: Processes | None = None
) -> dict | None:
    """Run the comparison; returns the result (see evals/README.md) on the main process, None on the others.

    `draft`: a loaded `LM`, a model name, or "self:int8" (the target's own int8 copy), for the methods that take one.
    """
    return Comparison(config, has_draft=draft is not None).run(lm, draft, processes)


def build_result(
    lm,
    draft_name,
    draft,
    config: CompareConfig,
    prompts,
    names,
    notes,
    records,
    errors,
    process_count,
    suite_size: int | None = None,
    partial: bool = False,
    queues: list[dict] | None = None,
    skipped: list[dict] | None = None,
) -> dict:
    """The result document (schema in evals/README.md); `draft_name` as given ("self:int8", a name), `draft` the
    loaded draft model (None when no method took it), `suite_size` the prompts of the whole suite, `partial` whether
    Ctrl-C ended the runs early. A batched compare (`config.batch_sizes`) adds `queues` (`evals.batched.Queue`
    records) and `skipped` (methods that could not run on the device, with why)."""
    summary = (
        metrics.summarize_batched(records, queues or [], errors)
        if config.batch_sizes
        else metrics.summarize(records, errors)
    )
    quantization = None
    if draft is not None:
        from decoders.models.quantize import is_quantized

        quantization = is_quantized(draft)
    result = {
        "schema": SCHEMA,
        "partial": partial,
        "environment": environment(lm.device, lm.dtype),
        "model": {
            "name": lm.name,
            "class": type(lm.model).__name__,
            "draft": draft_name if draft else None,
            "draft_quantization": quantization,
        },
        "config": {
            "suite": config.suite,
            "limit": config.limit,
            "per_category": config.per_category,
            "prompts": len(prompts),
            "suite_prompts": suite_size,
            "categories": list(dict.fromkeys(p.category for p in prompts)),
            "max_new_tokens": config.max_new_tokens,
            "repeats": config.repeats,
            "chat_template": config.chat_template,
            "strategies": names,
            "options": {k: dict(v) for k, v in config.options.items()},
            "processes": process_count,
            "tie_tolerance": {str(k).removeprefix("torch."): v for k, v in lossless.REL_TOLERANCE.items()},
        },
        "prompts": [dataclasses.asdict(p) for p in prompts],
        "notes": notes,
        "roofline": None,
        "summary": summary,
        "runs": records,
        "errors": errors,
    }
    if config.batch_sizes:
        result["config"]["batch_sizes"] = list(config.batch_sizes)
        result["queues"] = queues or []
        result["skipped"] = skipped or []
    if config.bandwidth_megabytes:
        line = with_demonstrated(
            roofline(lm.model, lm.device, config.bandwidth_megabytes, lm.dtype), llamacpp.demonstrated(records)
        )
        greedy = next((s for s in summary if s["strategy"] == metrics.BASELINE and s.get("batch_size", 1) == 1), None)
        speed = greedy["tokens_per_second"]["mean"] if greedy else None
        line["greedy_tokens_per_second"] = speed
        line["greedy_fraction"] = speed / line["limit_tokens_per_second"] if speed else None
        result["roofline"] = line
    return result
