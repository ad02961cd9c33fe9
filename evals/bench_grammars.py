"""Benchmark: `guided` (and `greedy` + grammar) against outlines' JSON-schema logits processor, same schema and prompt.

    python -m evals.bench_grammars                             # smollm2-135m and qwen2.5-coder-1.5b, bfloat16
    python -m evals.bench_grammars --models smollm2-135m --schemas character --repeats 3

For each model and schema: one warm-up run of every method, then `--repeats` timed runs in the same process, greedy,
the same chat-formatted prompt tokens and the same max_new_tokens. Every method is timed and counted as in `compare`
(`evals.timing`: device synchronized before the clock is read, new tokens up to and including EOS); `outlines:json` is
compare's peer, outlines' logits processor in transformers `generate`. chars/s counts output characters, which
compares methods that spell the same JSON with different numbers of tokens. "forced" is the share of tokens the
grammar supplied without a model call; "valid" means every run ended and its output satisfies the schema
(`evals.lossless.validity`).
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import statistics
import sys
from importlib.metadata import version

import torch
from pydantic import BaseModel, Field, constr

import decoders
import grammars
from decoders.capabilities import check_request
from evals import lossless, peers, report, suites
from evals.cli_parser import names
from evals.methods import Method, build, check_loaded
from evals.timing import Run, run_decodekit

PEER = "outlines:json"
WARMUP_TOKENS = 8


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
COLUMNS = [
    "model",
    "schema",
    "method",
    "tokens",
    "forced",
    "model calls",
    "tokens/s ↑",
    "chars/s ↑",
    "vs outlines (tok/s) ↑",
    "valid",
]


def methods(strategies: list[str], has_draft: bool) -> list[Method]:
    """The decodekit strategies (each run under the grammar) and outlines' peer, checked before any model loads."""
    chosen = [build(name) for name in strategies] + [build(PEER)]
    if peers.unavailable(PEER):
        raise ValueError(f"{PEER} is not available: {peers.unavailable(PEER)}")
    for method in chosen:
        check_request(method.declared, has_draft=has_draft and method.takes_draft, has_grammar=True)
    return chosen


def timed(
    lm: decoders.LM,
    method: Method,
    prompt: list[int],
    constraint: grammars.JsonSchema,
    limit: int,
    draft: decoders.LM | None,
) -> Run:
    """One run of `method` under `constraint`, timed as `compare` times it."""
    where = dict(max_new_tokens=limit, grammar=constraint, draft=draft if method.takes_draft else None)
    if method.is_peer:
        return peers.run_peer(lm, prompt, method.peer, **where)
    return run_decodekit(lm, prompt, method.decoder, name=method.name, **where)


def bench_model(
    name: str,
    schemas: list[str],
    max_new_tokens: int,
    repeats: int,
    dtype: str,
    chosen: list[Method],
    draft_name: str | None = None,
    progress: bool = True,
) -> list[dict]:
    """Time every method on one model; returns one row per (schema, method)."""
    lm = decoders.load(_zoo(name), dtype=dtype)
    draft = decoders.load(_zoo(draft_name), dtype=dtype) if draft_name else None
    chosen = check_loaded(chosen, lm, draft, explicit=True, notes=[])
    rows = []
    for key in schemas:
        model_class, request = SCHEMAS[key]
        schema = model_class.model_json_schema()
        constraint = grammars.json_schema(schema)
        prompt = suites.render(lm, suites.Prompt(id=key, category="json", prompt=request, schema=schema))
        for method in chosen:  # warm-up (the index is built here, outlines' processor too): kernels, allocator
            timed(lm, method, prompt, constraint, WARMUP_TOKENS, draft)
        runs: dict[str, list[Run]] = {method.name: [] for method in chosen}
        for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every method alike
            for method in chosen:
                runs[method.name].append(timed(lm, method, prompt, constraint, max_new_tokens, draft))
        for method, timed_runs in runs.items():
            rows.append(_row(lm, name, key, method, timed_runs, schema, constraint))
            if progress:
                row = rows[-1]
                print(
                    f"  {name} {key} {method}: {row['tokens']} tokens in {row['seconds']:.2f}s, "
                    f"forced {row['forced']:.0%}, valid {row['valid']}",
                    file=sys.stderr,
                    flush=True,
                )
    del lm, draft
    gc.collect()
    return rows


def _row(
    lm: decoders.LM,
    model: str,
    schema_name: str,
    method: str,
    runs: list[Run],
    schema: dict,
    constraint: grammars.JsonSchema,
) -> dict:
    """The figures of one (schema, method): median time over the repeats, counts of the last run."""
    seconds = statistics.median(r.seconds for r in runs)
    last = runs[-1]
    text = "".join(last.pieces)
    verdicts = [lossless.validity(lm, r, schema, constraint) for r in runs]
    return {
        "model": model,
        "schema": schema_name,
        "method": method,
        "tokens": last.new_tokens,
        "chars": len(text),
        "seconds": seconds,
        "tokens_per_second": last.new_tokens / seconds if seconds else 0.0,
        "chars_per_second": len(text) / seconds if seconds else 0.0,
        "forced": last.sources.count("grammar") / last.new_tokens if last.new_tokens else 0.0,
        "model_calls": last.target_calls,
        "valid": all(v["status"] == "valid" and v["complete"] for v in verdicts),
        "text": text,
    }


def _zoo(name: str) -> str:
    return name if name.startswith("zoo:") else f"zoo:{name}"


def table(rows: list[dict]) -> str:
    """A Markdown table with each method's speed-up over outlines per (model, schema)."""
    base = {(r["model"], r["schema"]): r for r in rows if r["method"] == PEER}
    cells = []
    for r in rows:
        ref = base.get((r["model"], r["schema"]))
        ratio = r["tokens_per_second"] / ref["tokens_per_second"] if ref and ref["tokens_per_second"] else None
        cells.append(
            [
                r["model"],
                r["schema"],
                r["method"],
                r["tokens"],
                f"{r['forced']:.0%}",
                r["model_calls"],
                report.fmt(r["tokens_per_second"], ".1f"),
                report.fmt(r["chars_per_second"], ".1f"),
                report.fmt(ratio) + ("x" if ratio is not None else ""),
                "yes" if r["valid"] else "NO",
            ]
        )
    return report.make_table(COLUMNS, cells)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m evals.bench_grammars",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m evals.bench_grammars\n"
        "  python -m evals.bench_grammars --models smollm2-135m --schemas "
        "character --repeats 3\n",
    )
    parser.add_argument("--models", type=names, default=",".join(MODELS), help="comma-separated zoo names")
    parser.add_argument(
        "--schemas", type=names, default=",".join(SCHEMAS), help=f"comma-separated, from {', '.join(SCHEMAS)}"
    )
    parser.add_argument(
        "--strategies", type=names, default="guided,greedy", help="decodekit strategies to time with the grammar"
    )
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
    schemas = args.schemas
    unknown = [s for s in schemas if s not in SCHEMAS]
    if unknown:
        parser.error(f"unknown schema {unknown[0]!r}; choose from {', '.join(SCHEMAS)}")
    print(
        f"# evals.bench_grammars: torch {torch.__version__}, transformers {version('transformers')}, "
        f"outlines {version('outlines')}, outlines-core {version('outlines_core')}, {args.dtype}, "
        f"{torch.get_num_threads()} threads, max_new_tokens={args.max_new_tokens}, repeats={args.repeats}\n"
    )
    rows = []
    try:
        chosen = methods(args.strategies, has_draft=args.draft is not None)
        for model in args.models:
            mine = bench_model(model, schemas, args.max_new_tokens, args.repeats, args.dtype, chosen, args.draft)
            rows += mine
            if args.show:
                for r in mine:
                    print(f"{r['schema']:>10} {r['method']:>13}: {r['text']}", flush=True)
            print(f"\n{table(mine)}\n", flush=True)
    except (ValueError, OSError) as error:
        print(f"bench_grammars: error: {error}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
