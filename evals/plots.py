"""PNG plots of a compare result (matplotlib, imported only here and only when plots are asked for)."""

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
    ax.set_title(f"{result['model']['name']} · {result['environment']['device']} · {result['environment']['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def acceptance_by_position(result: dict, path: Path) -> Path:
    """Lines: the acceptance rate of the draft token at each depth, for each drafting strategy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for s in result["summary"]:
        rates = s.get("acceptance_by_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=s["strategy"])
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no strategy drafted tokens in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("accepted / drafted at this depth (↑)")
    ax.set_ylim(0, 1.05)
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(result: dict, folder: str | Path) -> list[Path]:
    """Every plot of a result into `folder` (created if needed); returns the files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return [speedup_by_category(result, folder / "speedup_by_category.png"),
            acceptance_by_position(result, folder / "acceptance_by_position.png")]
