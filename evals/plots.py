"""PNG plots of a compare result and of measured call costs (matplotlib, imported only here and only when plots are
asked for)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plots needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _title(result: dict) -> str:
    """A compare result's plot title: model, device, dtype."""
    return f"{result['model']['name']} · {result['environment']['device']} · {result['environment']['dtype']}"


def _save(plt, fig, path: str | Path) -> None:
    """Lay `fig` out, write it to `path` (PNG, 120 dpi) and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def speedup_by_category(result: dict, path: Path) -> Path:
    """Grouped bars: speed-up over greedy per category, one bar per strategy."""
    plt = _pyplot()
    categories = result["config"]["categories"]
    summaries = result["summary"]
    width = 0.8 / max(1, len(summaries))
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(categories)), 4))
    for i, s in enumerate(summaries):
        values = [(s["by_category"].get(c) or {}).get("speedup", {}).get("mean") or 0.0 for c in categories]
        errors = [(s["by_category"].get(c) or {}).get("speedup", {}).get("std") or 0.0 for c in categories]
        xs = [j + (i - (len(summaries) - 1) / 2) * width for j in range(len(categories))]
        ax.bar(xs, values, width, yerr=errors, label=s["strategy"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("speed-up over greedy (↑)")
    ax.set_title(_title(result))
    ax.legend(fontsize=8)
    _save(plt, fig, path)
    return path


def acceptance_by_position(result: dict, path: Path) -> Path:
    """Lines: the acceptance rate of the draft token at each depth, for each drafting strategy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for s in result["summary"]:
        rates = s.get("acceptance_by_position") or []
        if rates:
            label = s["strategy"] if s.get("batch_size") is None else f"{s['strategy']} (batch {s['batch_size']})"
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no strategy drafted tokens in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("accepted / drafted at this depth (↑)")
    ax.set_ylim(0, 1.05)
    if drawn:
        ax.legend(fontsize=8)
    _save(plt, fig, path)
    return path


def throughput_by_batch_size(result: dict, path: Path) -> Path:
    """Lines: a batched compare's throughput (new tokens per second over the whole suite) against the batch size, one
    line per strategy and peer, with the spread over repeats as error bars."""
    plt = _pyplot()
    sizes = result["config"]["batch_sizes"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(s["strategy"] for s in result["summary"]):
        points = [
            (s["batch_size"], s["tokens_per_second"]["mean"], s["tokens_per_second"]["std"] or 0.0)
            for s in result["summary"]
            if s["strategy"] == name and s["tokens_per_second"]["mean"] is not None
        ]
        if points:
            xs, ys, errors = zip(*points)
            ax.errorbar(
                xs,
                ys,
                yerr=errors,
                marker="o",
                capsize=3,
                label=name,
                linestyle="--" if name.startswith("hf:") else "-",
            )
    if len(sizes) > 1 and max(sizes) >= 4 * min(sizes):
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("batch size (requests in flight)")
    ax.set_ylabel("new tokens / s over the whole suite (↑)")
    ax.set_ylim(bottom=0)
    ax.set_title(_title(result))
    ax.legend(fontsize=8)
    _save(plt, fig, path)
    return path


def write_all(result: dict, folder: str | Path) -> list[Path]:
    """Every plot of a result into `folder` (created if needed); returns the files. A batched compare's are the
    throughput by batch size and the acceptance by position (a line per strategy and batch size)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if result["config"].get("batch_sizes"):
        return [
            throughput_by_batch_size(result, folder / "throughput_by_batch_size.png"),
            acceptance_by_position(result, folder / "acceptance_by_position.png"),
        ]
    return [
        speedup_by_category(result, folder / "speedup_by_category.png"),
        acceptance_by_position(result, folder / "acceptance_by_position.png"),
    ]


def cost_curves(curves: list[tuple[str, str, object]], path: str | Path, title: str = "") -> Path:
    """One panel per (role, model name, `decoders.drafting.cost.CallCost`): the fitted milliseconds of a call by tokens
    scored, a line per measured context length, and the measured calls as dots."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (role, name, curve) in zip(axes[0], curves):
        tokens = list(range(1, 2 * max(curve.sizes) + 1))
        for context in sorted({c for _, c, _ in curve.samples}):
            line = ax.plot(tokens, [curve.fitted(n, context) * 1e3 for n in tokens], label=f"fit, context {context}")
            measured = [(n, s * 1e3) for n, c, s in curve.samples if c == context]
            ax.plot(*zip(*measured), "o", color=line[0].get_color(), label=f"measured, context {context}")
        ax.set_xlabel("tokens scored in one call")
        ax.set_ylabel("ms per call (↓)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{role}: {name}", fontsize=9)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    _save(plt, fig, path)
    return Path(path)
