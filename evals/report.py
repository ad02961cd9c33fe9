"""Markdown and JSON reports of compare results, and the leaderboard that merges many result files.

Tables follow lm-evaluation-harness: a header saying where and with what the numbers were measured, then Markdown
tables whose column names carry ↑ (higher is better) or ↓ (lower is better).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from evals.metrics import BASELINE

SCHEMA = "decodekit.compare/1"  # of compare's result document (evals/README.md)
LEADERBOARD_SCHEMA = "decodekit.leaderboard/1"


class ResultFileError(ValueError):
    """A file that is not a decodekit compare result."""


def fmt(value, spec: str = ".2f", scale: float = 1.0) -> str:
    """A number formatted for a table; '–' for a missing one."""
    return "–" if value is None else format(value * scale, spec)


def spread(figure: dict, spec: str = ".2f") -> str:
    """mean, with ± std when there were several repeats."""
    if figure.get("mean") is None:
        return "–"
    text = format(figure["mean"], spec)
    return f"{text} ± {format(figure['std'], spec)}" if figure.get("std") else text


def lossless_cell(summary: dict) -> str:
    """reference / ✓ exact / ✓ n tie(s) / ✓ valid / FAILED @position (prompt) / INVALID (prompt) / unchecked, or
    for a peer on its own kernels (llama.cpp) that differs, ≈ n% agree (first @position, prompt)."""
    check = summary["lossless"]
    status = check["status"]
    if status == "failed":
        first = check["first_failure"]
        if first["position"] is None:
            return f"INVALID ({first['prompt_id']})"
        return f"FAILED @{first['position']} ({first['prompt_id']})"
    if status == "differs":  # a peer on its own kernels: how much of greedy's output it reproduced
        first = check["first_difference"]
        return f"≈ {check['agreement']:.0%} agree (first @{first['position']}, {first['prompt_id']})"
    if status == "error":
        return f"ERROR ({check['errors']} run{'s' if check['errors'] > 1 else ''}, see notes)"
    if status == "tie":
        return f"✓ {check['tie']} tie{'s' if check['tie'] > 1 else ''}"
    if status == "pass" and summary["strategy"] == BASELINE and summary.get("batch_size", 1) == 1:
        return "reference"  # (its later repeats pass; greedy at a batch size above 1 is checked like any other)
    return {"pass": "✓ exact", "valid": "✓ valid"}.get(status, status)


def by_position(rates: list[float], depth: int = 5) -> str:
    return " ".join(f"{r:.2f}" for r in rates[:depth]) or "–"


# (header, getter) of the per-strategy table
COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("strategy", lambda s: s["strategy"]),
    ("lossless", lossless_cell),
    ("tok/s ↑", lambda s: spread(s["tokens_per_second"], ".1f")),
    ("speed-up ↑", lambda s: spread(s["speedup"])),
    ("TTFT ms ↓", lambda s: fmt(s["ttft_seconds"], ".0f", 1e3)),
    ("target calls ↓", lambda s: fmt(s["target_calls"], ".0f")),
    ("tokens/call ↑", lambda s: fmt(s["mean_accepted"])),
    ("acceptance ↑", lambda s: fmt(s["acceptance_rate"])),
    ("acceptance by position ↑", lambda s: by_position(s["acceptance_by_position"])),
    ("draft share ↓", lambda s: fmt(s["draft_share"], ".0%")),
    ("peak MB ↓", lambda s: fmt(s["peak_memory_bytes"], ".0f", 2**-20)),
]


def is_batched(result: dict) -> bool:
    """Whether `result` is a batched compare's (`--batch-size`: one summary per strategy and batch size)."""
    return bool(result["config"].get("batch_sizes"))


def label(summary: dict) -> str:
    """A summary's method as the leaderboard and plots name it: `speculative`, or `speculative (batch 4)`."""
    size = summary.get("batch_size")
    return summary["strategy"] if size is None else f"{summary['strategy']} (batch {size})"


# (header, getter) of a batched compare's table: one row per strategy and batch size
BATCH_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("strategy", lambda s: s["strategy"]),
    ("batch", lambda s: str(s["batch_size"])),
    ("lossless", lossless_cell),
    ("tok/s ↑", lambda s: spread(s["tokens_per_second"], ".1f")),
    ("speed-up ↑", lambda s: spread(s["speedup"])),
    ("latency p50 ms ↓", lambda s: fmt(s["latency_p50_seconds"], ".0f", 1e3)),
    ("latency p90 ms ↓", lambda s: fmt(s["latency_p90_seconds"], ".0f", 1e3)),
    ("TTFT p50 ms ↓", lambda s: fmt(s["ttft_p50_seconds"], ".0f", 1e3)),
    ("TTFT p90 ms ↓", lambda s: fmt(s["ttft_p90_seconds"], ".0f", 1e3)),
    ("tokens/call ↑", lambda s: fmt(s["mean_accepted"])),
    ("acceptance ↑", lambda s: fmt(s["acceptance_rate"])),
    ("peak MB ↓", lambda s: fmt(s["peak_memory_bytes"], ".0f", 2**-20)),
]


def batch_table(result: dict) -> tuple[list[str], list[list[str]]]:
    """A batched compare's table: tok/s is the throughput over the whole suite, speed-up over greedy at the same
    batch size; latency and TTFT per request. A method that could not run on the device gets a row saying so."""
    headers = [h for h, _ in BATCH_COLUMNS]
    rows = [[get(s) for _, get in BATCH_COLUMNS] for s in result["summary"]]
    for skipped in result.get("skipped", []):
        rows.append([skipped["strategy"], "–", "not run on this device (see notes)"] + ["–"] * (len(headers) - 3))
    return headers, rows


def throughput_table(result: dict) -> tuple[list[str], list[list[str]]] | None:
    """Throughput (tok/s over the whole suite) by strategy and batch size; None for a single batch size."""
    sizes = result["config"]["batch_sizes"]
    if len(sizes) < 2:
        return None
    cells = {(s["strategy"], s["batch_size"]): spread(s["tokens_per_second"], ".1f") for s in result["summary"]}
    names = list(dict.fromkeys(s["strategy"] for s in result["summary"]))
    return (
        ["strategy"] + [f"batch {n} ↑" for n in sizes],
        [[name] + [cells.get((name, n), "–") for n in sizes] for name in names],
    )


def _is_figure(cell: str) -> bool:
    return cell == "–" or cell.replace(".", "", 1).replace(" ± ", "", 1).replace(".", "", 1).rstrip("%").isdigit()


def make_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: figure columns (marked ↑ or ↓, or all numbers) right-aligned, text left-aligned."""
    align = [
        "---:" if "↑" in h or "↓" in h or all(_is_figure(str(row[i])) for row in rows) else ":---"
        for i, h in enumerate(headers)
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_table(result: dict) -> tuple[list[str], list[list[str]]]:
    """The per-strategy table."""
    return [h for h, _ in COLUMNS], [[get(s) for _, get in COLUMNS] for s in result["summary"]]


TIE_MARK, FAILED_MARK = "≈", "✗"
LEGEND = {
    TIE_MARK: "the output left greedy's at a numeric tie, so this speed-up divides the tokens per second of two "
    "different texts (the notes give where)",
    FAILED_MARK: "not lossless: the output differs from greedy's beyond a numeric tie",
}


def category_table(result: dict) -> tuple[list[str], list[list[str]]]:
    """Speed-up over greedy per category, marked ≈ where an output left greedy's at a numeric tie (the ratio then
    compares different texts) and ✗ where it is not lossless."""
    categories = result["config"]["categories"]
    rows = []
    for s in result["summary"]:
        row = [s["strategy"]]
        for category in categories:
            figures = s["by_category"].get(category)
            if figures is None:
                row.append("–")
                continue
            cell = spread(figures["speedup"])
            mark = {"failed": FAILED_MARK, "tie": TIE_MARK}.get(figures["lossless"]["status"])
            row.append(f"{cell} {mark}" if mark else cell)
        rows.append(row)
    return ["strategy"] + [f"{c} ↑" for c in categories], rows


def legend(rows: list[list[str]]) -> list[str]:
    """What each mark used in the category table's `rows` means, one line a mark."""
    used = {str(cell).rpartition(" ")[2] for row in rows for cell in row[1:]}
    return [f"{mark} {meaning}" for mark, meaning in LEGEND.items() if mark in used]


def draft_label(model: dict) -> str:
    """The draft as the header shows it: `zoo:qwen2.5-coder-0.5b (int8)`, `self:int8`, `none`."""
    name, scheme = model.get("draft"), model.get("draft_quantization")
    if not name:
        return "none"
    if not scheme or name.startswith("self:"):
        return name
    return f"{name.removesuffix(':' + scheme)} ({scheme})"


def subset(config: dict) -> str | None:
    """The part of the suite a --limit / --per-category run took (`first 3 of 11`, `6 of 11, first 1 per category`);
    None for the whole suite."""
    run, total = config["prompts"], config.get("suite_prompts")  # (files of older versions lack the total)
    if not (config.get("limit") or config.get("per_category")) or run == total:
        return None
    of = f" of {total}" if total else ""
    if config.get("per_category"):
        return f"{run}{of}, first {config['per_category']} per category"
    return f"first {run}{of}"


def suite_label(result: dict) -> str:
    """The suite as the leaderboard shows it: `bench`, `bench (first 3 of 11)`, `bench (partial)` ..."""
    parts = [p for p in (subset(result["config"]), "partial" if result.get("partial") else None) if p]
    return f"{result['config']['suite']} ({', '.join(parts)})" if parts else result["config"]["suite"]


def partial_line(result: dict) -> str | None:
    """What an interrupted compare measured, or None for a whole run."""
    if not result.get("partial"):
        return None
    if is_batched(result):
        rounds = len({(q["batch_size"], q["repeat"]) for q in result.get("queues", [])})
        total = len(result["config"]["batch_sizes"]) * result["config"]["repeats"]
        return (
            f"partial result: interrupted (Ctrl-C) after {rounds} of {total} rounds (every method's queue at one "
            "batch size and repeat); the round it cut short is left out"
        )
    measured = len({r["prompt_id"] for r in result["runs"]} | {e["prompt_id"] for e in result["errors"]})
    return (
        f"partial result: interrupted (Ctrl-C) after {measured} of {result['config']['prompts']} prompts; the "
        "round of runs it cut short is left out"
    )


def header_lines(result: dict) -> list[str]:
    """Where and with what the numbers were measured."""
    env, model, config, roof = result["environment"], result["model"], result["config"], result.get("roofline")
    prompts = subset(config) or f"{config['prompts']} prompts"
    lines = [line for line in [partial_line(result)] if line] + [
        f"model: {model['name']} ({model['class']}) · draft: {draft_label(model)}",
        f"device: {env['device']} — {env['device_name']} · dtype: {env['dtype']}",
        f"torch {env['torch']} · transformers {env['transformers']} · decodekit {env['decodekit']} · "
        f"{env['date']} · host {env['host']}",
        f"suite: {config['suite']} ({prompts}) · max_new_tokens: {config['max_new_tokens']} · "
        f"repeats: {config['repeats']} · processes: {config['processes']}",
    ]
    if is_batched(result):
        sizes = ", ".join(map(str, config["batch_sizes"]))
        lines.append(
            f"batched: each method decodes the suite as one queue with {sizes} requests in flight · tok/s = "
            "new tokens over the whole suite / the queue's time · latency and TTFT per request, from its "
            "admission"
        )
    if roof:
        fraction = f" · greedy reaches {roof['greedy_fraction']:.0%} of it" if roof.get("greedy_fraction") else ""
        probe = f"{roof.get('bandwidth_probe', 'copy')} probe"  # (files of older versions measured a copy)
        probe += f", {roof['bandwidth_probe_dtype']}" if roof.get("bandwidth_probe_dtype") else ""
        copy = roof.get("copy_bandwidth_bytes_per_second")
        shown, source = roof.get("demonstrated"), roof.get("bandwidth_source", "probe")
        if source != "probe":  # a real decoding step read faster than the probe: the better rate is the limit's
            probe = (
                f"{source}'s decoding step on the same weights, demonstrated here; the {probe} read "
                f"{roof['probe_bandwidth_bytes_per_second'] / 1e9:.1f}"
            )
        elif shown:
            probe += f"; {shown['by']}'s decoding step read {shown['bandwidth_bytes_per_second'] / 1e9:.1f}"
        lines.append(
            f"roofline: {roof['bytes_per_token'] / 2**20:.1f} MiB read per token / "
            f"{roof['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s read ({probe}) = "
            f"{roof['limit_tokens_per_second']:.1f} tok/s limit for batch-1 greedy{fraction}"
            + (f" · copy: {copy / 1e9:.1f} GB/s read+write" if copy else "")
        )
    return lines


def notes(result: dict) -> list[str]:
    """Skipped methods, then every divergence: failures and numeric ties, with position and logit margin."""
    out = list(result.get("notes", []))
    out += [f"{e['strategy']}{_where(e)}: raised {e['error']}" for e in result.get("errors", [])]
    out += [
        f"{s['strategy']}: its own kernels on the same weights; {s['lossless']['differs']} of {s['runs']} runs "
        f"differ from greedy, {s['lossless']['agreement']:.0%} of greedy's tokens agree before each run's first "
        "difference (agreement is reported, not required)"
        for s in result["summary"]
        if s["lossless"]["status"] == "differs"
    ]
    for run in result["runs"]:
        check = run.get("lossless") or {}
        if check.get("status") in ("failed", "tie"):
            figures = ""
            if check.get("margin") is not None:
                gaps = [f"gap {check['gap']:.3g} vs tolerance {check['tolerance']:.3g}"]
                if check.get("greedy_gap") is not None:
                    gaps.append(f"gap in greedy's scoring {check['greedy_gap']:.3g}")
                if check.get("float32_gap") is not None:
                    gaps.append(f"gap in float32 {check['float32_gap']:.3g}")
                figures = f" (top-2 margin {check['margin']:.3g}, {', '.join(gaps)})"
            where = "" if check.get("position") is None else f" at token {check['position']}"
            batch = f"batch {run['batch_size']}, " if run.get("batch_size") else ""
            out.append(
                f"{run['strategy']} on {run['prompt_id']} ({batch}repeat {run['repeat']}): "
                f"{check['status']}{where}: {check['reason']}{figures}"
            )
    return out


def _where(error: dict) -> str:
    """Where a run raised: ` on PROMPT`, or in a batched compare ` at batch N on PROMPT` / ` at batch N (repeat r)`
    for a queue that raised as a whole."""
    if error.get("batch_size") is None:
        return f" on {error['prompt_id']}"
    if error.get("prompt_id") is None:
        return f" at batch {error['batch_size']} (repeat {error['repeat']})"
    return f" at batch {error['batch_size']} on {error['prompt_id']}"


LOSSLESS = ("reference", "pass", "tie")  # the lossless check's statuses of a method that reproduces greedy


def _fastest(
    result: dict, kind: str, category: str | None = None, batch_size: int | None = None
) -> tuple[str, dict] | None:
    """The lossless method of `kind` ("decodekit" or "peer") with the best mean speed-up, over the whole suite or one
    category (in a batched compare: at `batch_size`), among those that ran on every prompt greedy ran on there; None
    when there is none."""

    def figures(s: dict) -> dict | None:
        return s if category is None else s["by_category"].get(category)

    summaries = [s for s in result["summary"] if s.get("batch_size") == batch_size]
    base = next((figures(s) for s in summaries if s["strategy"] == BASELINE), None)
    ranked = [
        (s["strategy"], f)
        for s in summaries
        if s["kind"] == kind
        and (f := figures(s))
        and base
        and f["prompts"] == base["prompts"]
        and f["lossless"]["status"] in LOSSLESS
        and f["speedup"]["mean"] is not None
    ]
    return max(ranked, key=lambda pair: pair[1]["speedup"]["mean"], default=None)


def _verdict_part(result: dict, category: str | None = None, batch_size: int | None = None) -> str | None:
    """`speculative — 1.85× greedy, 1.32× hf:assisted` for the fastest lossless strategy, or None."""
    ours, peer = _fastest(result, "decodekit", category, batch_size), _fastest(result, "peer", category, batch_size)
    if ours is None:
        return None
    name, figures = ours
    speedup = figures["speedup"]["mean"]
    parts = ["nothing beat it" if name == BASELINE else f"{speedup:.2f}× {BASELINE}"]
    if peer is not None and peer[1]["speedup"]["mean"]:
        parts.append(f"{speedup / peer[1]['speedup']['mean']:.2f}× {peer[0]}")
    return f"{name} — {', '.join(parts)}"


def verdict(result: dict) -> str | None:
    """One line: the fastest lossless strategy overall and per category, with its speed-up over greedy and over the
    fastest lossless peer (a llama.cpp peer where it reproduced greedy's tokens; speed-ups are over greedy on the same
    prompts, so their ratio compares the two). In a batched compare: at each batch size, by throughput over the whole
    suite."""
    if is_batched(result):
        parts = [
            f"batch {n}: {part}"
            for n in result["config"]["batch_sizes"]
            if (part := _verdict_part(result, batch_size=n)) is not None
        ]
        return "Fastest lossless: " + " · ".join(parts) if parts else None
    overall = _verdict_part(result)
    if overall is None:
        return None
    categories = result["config"]["categories"]
    by_category = [
        f"{c}: {part}" for c in categories if len(categories) > 1 and (part := _verdict_part(result, c)) is not None
    ]
    return " · ".join([f"Fastest lossless: {overall}", *by_category])


def choices(result: dict) -> list[str]:
    """Per run of a strategy that chooses its proposer each step (`auto`): how often it took each, and its predicted
    against its measured tokens per second; per strategy that chose a setting from the measured costs
    (`speculative`'s k), the setting."""
    lines, settings = [], {}
    for run in result["runs"]:
        extra = run.get("extra") or {}
        if "chosen_k" in extra:
            settings.setdefault(run["strategy"], set()).add(extra["chosen_k"])
        if "steps" not in extra or run["repeat"] != 0:
            continue
        steps = ", ".join(f"{name} {count}" for name, count in sorted(extra["steps"].items()))
        predicted = extra["predicted_tokens"] / extra["predicted_seconds"] if extra.get("predicted_seconds") else 0
        drafting = f" (draft: {extra['draft']})" if extra.get("draft") else ""
        batch = f" (batch {run['batch_size']})" if run.get("batch_size") else ""
        lines.append(
            f"{run['strategy']} on {run['prompt_id']}{batch}: steps by proposer: {steps}{drafting}; predicted "
            f"{predicted:.1f} tok/s, measured {run['tokens_per_second']:.1f}"
        )
    for strategy, ks in settings.items():
        lines.append(f"{strategy}: k={'/'.join(map(str, sorted(ks)))}, chosen from this device's measured call costs")
    return lines


def markdown(result: dict) -> str:
    """The whole compare report as Markdown."""
    parts = ["## decodekit compare", "", *[f"{line}  " for line in header_lines(result)], ""]
    if is_batched(result):
        return _batched_markdown(result, parts)
    parts += [make_table(*summary_table(result)), ""]
    if line := verdict(result):
        parts += [line, ""]
    parts += ["Speed-up over greedy by category:", ""]
    headers, rows = category_table(result)
    parts += [make_table(headers, rows)]
    if marks := legend(rows):
        parts += ["", *[f"{line}  " for line in marks]]
    if chosen := choices(result):
        parts += ["", "What the choosing strategies chose:", *[f"- {line}" for line in chosen]]
    if extra := notes(result):
        parts += ["", "Notes:", *[f"- {n}" for n in extra]]
    return "\n".join(parts) + "\n"


def _batched_markdown(result: dict, parts: list[str]) -> str:
    """The rest of a batched compare's report after the header `parts`."""
    parts += [make_table(*batch_table(result)), ""]
    if line := verdict(result):
        parts += [line, ""]
    if sweep := throughput_table(result):
        parts += ["Throughput (tok/s over the whole suite) by batch size:", "", make_table(*sweep), ""]
    if chosen := choices(result):
        parts += ["What the choosing strategies chose:", *[f"- {line}" for line in chosen], ""]
    if extra := notes(result):
        parts += ["Notes:", *[f"- {n}" for n in extra], ""]
    return "\n".join(parts).rstrip("\n") + "\n"


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def load_result(path: str | Path) -> dict:
    """A compare result file; anything else raises `ResultFileError` naming the file."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultFileError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ResultFileError(f"{path}: not a JSON file ({error})") from None
    if not isinstance(result, dict) or not str(result.get("schema", "")).startswith(SCHEMA.split("/")[0] + "/"):
        raise ResultFileError(f'{path}: not a decodekit compare result (no "schema": "{SCHEMA}")')
    return result


LEADERBOARD_COLUMNS = [
    "model",
    "draft",
    "device",
    "dtype",
    "strategy",
    "lossless",
    "tok/s ↑",
    "speed-up ↑",
    "tokens/call ↑",
    "acceptance ↑",
    "greedy/roofline ↑",
    "suite",
    "date",
]


def leaderboard(results: list[dict]) -> list[dict]:
    """One row per (result, strategy): best speed-up first within each result, results in the order given."""
    rows = []
    for result in results:
        env, roof = result["environment"], result.get("roofline") or {}
        ranked = sorted(result["summary"], key=lambda s: -(s["speedup"]["mean"] or 0.0))
        for s in ranked:
            rows.append(
                {
                    "model": result["model"]["name"],
                    "draft": result["model"]["draft"] or "–",
                    "device": f"{env['device']} ({env['device_name']})",
                    "dtype": env["dtype"],
                    "strategy": label(s),
                    "lossless": lossless_cell(s),
                    "tokens_per_second": s["tokens_per_second"]["mean"],
                    "speedup": s["speedup"]["mean"],
                    "speedup_std": s["speedup"]["std"],
                    "mean_accepted": s["mean_accepted"],
                    "acceptance_rate": s["acceptance_rate"],
                    "greedy_fraction": roof.get("greedy_fraction"),
                    "suite": result["config"]["suite"],
                    "suite_label": suite_label(result),
                    "date": env["date"],
                    "host": env["host"],
                }
            )
    return rows


def leaderboard_cells(row: dict) -> list[str]:
    return [
        row["model"],
        row["draft"],
        row["device"],
        row["dtype"],
        row["strategy"],
        row["lossless"],
        fmt(row["tokens_per_second"], ".1f"),
        spread({"mean": row["speedup"], "std": row["speedup_std"]}),
        fmt(row["mean_accepted"]),
        fmt(row["acceptance_rate"]),
        fmt(row["greedy_fraction"], ".0%"),
        row["suite_label"],
        row["date"],
    ]


def leaderboard_markdown(rows: list[dict]) -> str:
    return "## decodekit leaderboard\n\n" + make_table(LEADERBOARD_COLUMNS, [leaderboard_cells(r) for r in rows]) + "\n"


def leaderboard_json(rows: list[dict], sources: list[str]) -> str:
    return (
        json.dumps({"schema": LEADERBOARD_SCHEMA, "sources": sources, "rows": rows}, indent=1, ensure_ascii=False)
        + "\n"
    )
