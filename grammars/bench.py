"""Benchmark: `guided` (and `greedy` + grammar) against outlines' own transformers generator, same schema and prompt.

    python -m grammars.bench                                   # smollm2-135m and qwen2.5-coder-1.5b, bfloat16
    python -m grammars.bench --models smollm2-135m --schemas character --repeats 3

For each model and schema: one warm-up run of every method, then `--repeats` timed runs in the same process, greedy,
the same chat-formatted prompt and the same max_new_tokens. tokens/s counts the new tokens each method produced
(outlines' through a transformers streamer) over the wall time of the call; chars/s counts output characters, which
compares methods that spell the same JSON with different numbers of tokens. "forced" is the share of guided's tokens
the grammar supplied without a model call; "valid" checks the output against the schema with jsonschema.
"""

from __future__ import annotations

import argparse
import enum
import functools
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field, constr

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Weapon(str, enum.Enum):
    sword = "sword"
    axe = "axe"
    mace = "mace"
    spear = "spear"
    bow = "bow"
    crossbow = "crossbow"


class Armor(str, enum.Enum):
    leather = "leather"
    chainmail = "chainmail"
    plate = "plate"


class Character(BaseModel):
    """The seed's example schema."""

    name: constr(max_length=10)
    age: int
    armor: Armor
    weapon: Weapon
    strength: int


class Address(BaseModel):
    street: constr(max_length=30)
    city: constr(max_length=20)
    postal_code: constr(pattern=r"^[0-9]{5}$")
    country: constr(max_length=20)


class Employee(BaseModel):
    """A larger schema: nested object, bounded numbers, enums, a short array, booleans."""

    first_name: constr(max_length=15)
    last_name: constr(max_length=15)
    age: int = Field(ge=18, le=70)
    department: str = Field(json_schema_extra={"enum": ["engineering", "sales", "marketing", "finance", "support"]})
    salary: int = Field(ge=20000, le=500000)
    remote: bool
    address: Address
    skills: list[constr(max_length=12)] = Field(max_length=3)


class Item(BaseModel):
    sku: constr(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    quantity: int = Field(ge=1, le=99)
    unit_price: float = Field(ge=0, le=10000)


class Order(BaseModel):
    """A larger schema: arrays of objects, patterns, an optional field."""

    order_id: constr(pattern=r"^ORD-[0-9]{6}$")
    customer: constr(max_length=25)
    status: str = Field(json_schema_extra={"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]})
    express_shipping: bool
    items: list[Item] = Field(min_length=1, max_length=3)
    gift_message: constr(max_length=40) | None = None


SCHEMAS = {
    # The seed's schema leaves strength unbounded; without a hint some models write "1000000..." until max tokens.
    "character": (Character, "Give me a character for a fantasy game, as JSON. Strength is a number from 1 to 100."),
    "employee": (Employee, "Describe an employee of a software company, as JSON."),
    "order": (Order, "Give me an example online shop order with two items, as JSON."),
}
MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b")


@dataclass
class Run:
    """One timed generation."""

    tokens: int
    seconds: float
    text: str
    forced: int = 0
    calls: int = 0


class _Counter:
    """A transformers streamer that only counts the tokens generated after the prompt."""

    def __init__(self) -> None:
        self.calls = 0
        self.tokens = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:  # the first put is the prompt
            self.tokens += int(value.numel())

    def end(self) -> None:
        pass


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def bench_model(name: str, schemas: list[str], max_new_tokens: int, repeats: int, dtype: str, strategies,
                draft_name: str | None = None, progress: bool = True) -> list[dict]:
    """Time every method on one model; returns one row per (schema, method)."""
    import outlines
    from outlines.types import JsonSchema

    import decoders
    import grammars

    lm = decoders.load(f"zoo:{name}", dtype=dtype)
    draft = decoders.load(f"zoo:{draft_name}", dtype=dtype) if draft_name else None
    outlines_model = outlines.from_transformers(lm.model, lm.tokenizer)
    rows = []
    for key in schemas:
        model_class, request = SCHEMAS[key]
        schema = model_class.model_json_schema()
        prompt = _chat(lm, request)
        constraint = grammars.json_schema(schema)
        generator = outlines.Generator(outlines_model, JsonSchema(json.dumps(schema), whitespace_pattern=""))

        def ours(strategy: str, limit: int) -> Run:
            options = {"draft": draft} if decoders.registry.get(strategy).needs_draft else {}
            start = time.perf_counter()
            result = decoders.generate(lm, prompt, strategy=strategy, grammar=constraint, max_new_tokens=limit,
                                       **options)
            seconds = time.perf_counter() - start
            forced = result.sources.count("grammar")
            return Run(len(result.tokens), seconds, result.text, forced, result.stats.target_calls)

        def theirs(limit: int) -> Run:
            counter = _Counter()
            start = time.perf_counter()
            text = generator(request, max_new_tokens=limit, do_sample=False, streamer=counter)
            seconds = time.perf_counter() - start
            return Run(counter.tokens, seconds, text, calls=counter.calls - 1)

        methods = {s: functools.partial(ours, s) for s in strategies}
        methods["outlines"] = theirs
        for run in methods.values():  # warm-up (indexes are built above): kernels, allocator
            run(8)
        timed: dict[str, list[Run]] = {method: [] for method in methods}
        for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every method alike
            for method, run in methods.items():
                timed[method].append(run(max_new_tokens))
        for method, runs in timed.items():
            seconds = statistics.median(r.seconds for r in runs)
            last = runs[-1]
            rows.append({
                "model": name, "schema": key, "method": method, "tokens": last.tokens, "chars": len(last.text),
                "seconds": seconds, "tokens_per_second": last.tokens / seconds,
                "chars_per_second": len(last.text) / seconds,
                "forced": last.forced / last.tokens if last.tokens else 0.0, "model_calls": last.calls,
                "valid": all(_valid(r.text, schema) for r in runs), "text": last.text,
            })
            if progress:
                row = rows[-1]
                print(f"  {name} {key} {method}: {row['tokens']} tokens in {seconds:.2f}s, forced {row['forced']:.0%}, "
                      f"valid {row['valid']}", flush=True)
    del outlines_model, lm, draft
    return rows


def _chat(lm, request: str) -> str:
    """The prompt text outlines builds for a plain-string input: the chat template with a generation prompt."""
    tokenizer = lm.tokenizer
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": request}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return request


def table(rows: list[dict]) -> str:
    """A Markdown table with guided's speed-up over outlines per (model, schema)."""
    lines = [
        "| model | schema | method | tokens | forced | model calls | tokens/s ↑ | chars/s ↑ "
        "| vs outlines (tok/s) ↑ | valid |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    base = {(r["model"], r["schema"]): r for r in rows if r["method"] == "outlines"}
    for r in rows:
        ref = base.get((r["model"], r["schema"]))
        ratio = r["tokens_per_second"] / ref["tokens_per_second"] if ref and ref["tokens_per_second"] else float("nan")
        lines.append(
            f"| {r['model']} | {r['schema']} | {r['method']} | {r['tokens']} | {r['forced']:.0%} | {r['model_calls']} "
            f"| {r['tokens_per_second']:.1f} | {r['chars_per_second']:.1f} | {ratio:.2f}x "
            f"| {'yes' if r['valid'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo names")
    parser.add_argument("--schemas", default=",".join(SCHEMAS), help=f"comma-separated, from {', '.join(SCHEMAS)}")
    parser.add_argument("--strategies", default="guided,greedy", help="decodekit strategies to time with the grammar")
    parser.add_argument("--draft", help="zoo name of a draft model, for strategies that need one")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--show", action="store_true", help="print each output")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from importlib.metadata import version

    print(f"# grammars.bench: torch {torch.__version__}, transformers {version('transformers')}, "
          f"outlines {version('outlines')}, outlines-core {version('outlines_core')}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, max_new_tokens={args.max_new_tokens}, repeats={args.repeats}\n")
    rows = []
    for model in args.models.split(","):
        rows += bench_model(model, args.schemas.split(","), args.max_new_tokens, args.repeats, args.dtype,
                            args.strategies.split(","), args.draft)
        if args.show:
            for r in rows:
                if r["model"] == model:
                    print(f"{r['schema']:>10} {r['method']:>8}: {r['text']}", flush=True)
        print(f"\n{table([r for r in rows if r['model'] == model])}\n", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
