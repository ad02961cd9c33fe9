"""The HTML report: the tables, then every prompt's outputs colored by token source, each with a tokens/s sparkline."""

from __future__ import annotations

from html import escape

from evals import report

SOURCE_COLORS = {
    "target": "transparent",
    "draft": "#c8f0c8",
    "lookup": "#c8e4ff",
    "lookahead": "#f0d0f8",
    "grammar": "#fff0b0",
}
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 1em 0; } td, th { border: 1px solid #ccc; padding: 3px 8px; }
td:not(:first-child) { text-align: right; } th { background: #f4f4f4; }
.header { color: #555; } pre { white-space: pre-wrap; margin: 0.3em 0 1em; padding: 6px; background: #fafafa; }
.run { margin-left: 1em; } .meta { font-size: 12px; color: #444; } .failed { color: #b00; font-weight: bold; }
.legend span { padding: 1px 6px; margin-right: 6px; border: 1px solid #ccc; } svg { vertical-align: middle; }
"""


def table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def colored(pieces: list[str], sources: list[str]) -> str:
    """The output text, each token in a span colored by its source (runs of one source share a span)."""
    parts, current, text = [], None, ""
    for piece, source in list(zip(pieces, sources)) + [("", None)]:
        if source != current:
            if text:
                parts.append(
                    f'<span style="background:{SOURCE_COLORS.get(current, "#eee")}" '
                    f'title="{escape(current or "")}">{escape(text)}</span>'
                )
            current, text = source, ""
        text += piece
    return "".join(parts)


def sparkline(timeline: list, width: int = 160, height: int = 28) -> str:
    """An inline SVG of tokens/s over the run: one point per step, rate = tokens added / time since the last step."""
    points, last_t, last_n = [], 0.0, 0
    for t, n in timeline:
        if t > last_t:
            points.append((t, (n - last_n) / (t - last_t)))
        last_t, last_n = t, n
    if len(points) < 2:
        return ""
    end, peak = points[-1][0], max(rate for _, rate in points) or 1.0
    coords = " ".join(f"{t / end * width:.1f},{height - rate / peak * (height - 2) - 1:.1f}" for t, rate in points)
    mean = last_n / end if end else 0.0
    return (
        f'<svg width="{width}" height="{height}"><title>tokens/s per step; peak {peak:.0f}, mean {mean:.0f}'
        f'</title><polyline fill="none" stroke="#2a6" stroke-width="1.2" points="{coords}"/></svg>'
    )


def outputs(result: dict) -> str:
    """Every prompt, then each method's first-repeat output on it."""
    sections = []
    for prompt in result.get("prompts", []):
        runs = [r for r in result["runs"] if r["prompt_id"] == prompt["id"] and r["repeat"] == 0]
        if not runs:
            continue
        blocks = []
        for run in runs:
            check = run.get("lossless") or {}
            status = check.get("status", "unchecked")
            mark = (
                f'<span class="failed">FAILED @{check["position"]}</span>'
                if status == "failed"
                else f"tie @{check['position']}"
                if status == "tie"
                else escape(status)
            )
            batch = f" · batch {run['batch_size']}" if run.get("batch_size") else ""
            meta = (
                f"<b>{escape(run['strategy'])}</b>{batch} · {run['tokens_per_second']:.1f} tok/s · "
                f"{run['new_tokens']} tokens · {mark} · "
                f"{sparkline(run['timeline'])}"
            )
            blocks.append(
                f'<div class="run"><div class="meta">{meta}</div>'
                f"<pre>{colored(run['pieces'], run['sources'])}</pre></div>"
            )
        sections.append(
            f"<details open><summary><b>{escape(prompt['id'])}</b> ({escape(prompt['category'])})"
            f"</summary><pre>{escape(prompt['prompt'])}</pre>{''.join(blocks)}</details>"
        )
    return "".join(sections)


def page(title: str, body: str) -> str:
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>\n"
    )


def compare_report(result: dict) -> str:
    """The HTML page of one compare result (a batched one: its table and the throughput by batch size, then each
    request's output at every batch size)."""
    legend = "".join(f'<span style="background:{c}">{s}</span>' for s, c in SOURCE_COLORS.items())
    notes = "".join(f"<li>{escape(n)}</li>" for n in report.notes(result))
    verdict = f"<p>{escape(line)}</p>" if (line := report.verdict(result)) else ""
    if report.is_batched(result):
        sweep = report.throughput_table(result)
        tables = (
            table(*report.batch_table(result))
            + verdict
            + ("<h2>Throughput by batch size</h2>" + table(*sweep) if sweep else "")
        )
    else:
        headers, rows = report.category_table(result)
        marks = "".join(f"<div>{escape(line)}</div>" for line in report.legend(rows))
        tables = (
            table(*report.summary_table(result))
            + verdict
            + "<h2>Speed-up over greedy by category</h2>"
            + table(headers, rows)
            + marks
        )
    body = (
        "".join(f'<div class="header">{escape(line)}</div>' for line in report.header_lines(result))
        + tables
        + (f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "")
        + f'<h2>Outputs</h2><p class="legend">token sources: {legend}</p>'
        + outputs(result)
    )
    return page("decodekit compare", body)


def leaderboard_page(rows: list[dict]) -> str:
    """The HTML page of a merged leaderboard."""
    return page("decodekit leaderboard", table(report.LEADERBOARD_COLUMNS, [report.leaderboard_cells(r) for r in rows]))
