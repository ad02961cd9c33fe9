"""Ablate `auto`'s draft-free mechanisms: replay it without a draft model (`devtools.replay_auto`) on `compare` results'
greedy outputs with one mechanism switched off at a time, in several cost regimes, and print what each is worth in
estimated seconds (issue 46 keeps a mechanism only where switching it off costs at least 3%).

    python -m devtools.ablate_auto RESULT.json [RESULT.json ...] [--regimes here,flat,dear] [--mechanisms all]
        [--noise 0.15 --seeds 3] [--out ablation.json]

The results must share one model (and dtype); each result's `config.suite` is a column of its own beside their union.
A cell reads "seconds with the mechanism off / with everything on (ratio)"; a ratio of at least 1.03 (bold) says the
mechanism earns its place there. With `--noise`, each cell is the mean over seeds 1..N, with the range of the seeds'
own ratios.

Regimes: the curve the replay costs every call by, which `auto` also plans with (so the replay measures its choices,
not its cost model's errors), and greedy's estimate too:
- `here`: the target's calibrated curve on this machine (`call_cost`, cached per model, dtype, CPU and threads);
- `flat`: its one-token seconds t1 times 1, 1, 1, 1, 1.02, 1.05, 1.1 at 1, 2, 3, 4, 8, 16, 32 tokens (a GPU's shape);
- `dear`: t1 times 1, 1.7, 2.4, 3, 5.5, 11, 22 (a CPU computing bfloat16 in float);
- `stale` (not by default): calls cost the `here` curve times 1, 1.3, 1.6, 1.8, 2, 2, 2 while `auto` plans with `here`
  and corrects it online, the case `online_correction` is for.
Both keep the calibrated context terms.

The mechanisms (`MECHANISMS`), each switched off by a subclass of `AutoDrafter` passed to the replay as the drafter
of an `Auto` subclass (`variant`), so the replay runs auto's own proposers and chooser with one thing changed: a
proposer switched off by name (`AutoDrafter.off`, the ones that read it falling with it), one swapped in auto's list
(`AutoDrafter.kinds`), or a setting of one:
- `online_correction`: the costs corrected by the run's call times (off: its `Clock` is untimed, as in a seeded run:
  the calibrated curve alone, steps judged by their planned seconds);
- `match_curves`: the suffix index's guesses estimated on one calibration curve per length of their match (off: a
  `SuffixProposer` whose `curve` gives one name for every length);
- `suffix_trees`: the suffix index's trees (off: its main branch alone, `AutoDrafter.suffix_trees`);
- `lookahead`, `merged`: those proposers (off: `AutoDrafter.off`).

What the replay cannot judge: without noise every call costs what auto predicts, so `online_correction` has nothing to
correct there (but in `stale`), and its row (and the float rounding of the replay's clock, which can flip a tie
between plans) shows the noise floor: 0.2-0.3% on a suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from tqdm.auto import tqdm

import decoders
from decoders.drafting.cost import TARGET_SIZES, CallCost, call_cost
from decoders.proposers.suffix import SuffixProposer
from decoders.strategies.auto import PROPOSERS, Auto, AutoDrafter
from devtools.replay import load_prompts, stale
from devtools.replay_auto import replay

SHAPES = {"flat": (1, 1, 1, 1, 1.02, 1.05, 1.1), "dear": (1, 1.7, 2.4, 3.0, 5.5, 11, 22)}  # t(n) / t(1) at TARGET_SIZES
STALE = dict(zip(TARGET_SIZES, (1, 1.3, 1.6, 1.8, 2, 2, 2)))  # the `stale` regime's true costs over the calibrated
# ones, per knot
KEEP = 1.03  # off / on: a mechanism whose switching off costs this much earns its place (issue 46)
Prompts = list[tuple[str, str, list[int], list[int]]]  # (id, category, prompt ids, greedy output)


def fresh(curve: CallCost) -> CallCost:
    """`curve`'s calibrated fit, without the online corrections a run adds to it."""
    return CallCost(curve.sizes, curve.seconds, curve.per_position, curve.per_position_per_token)


def described(curve: CallCost) -> dict:
    """`curve`'s fit, for the report."""
    return {"sizes": list(curve.sizes), "seconds": list(curve.seconds), "per_position": curve.per_position,
            "per_position_per_token": curve.per_position_per_token}


def regime(name: str, here: CallCost) -> tuple[CallCost, CallCost]:
    """(the curve `auto` plans with, the one the calls cost) of regime `name`, from the calibrated curve `here`."""
    if name == "here":
        return here, here
    if name == "stale":
        return here, stale(here, [STALE[n] for n in here.sizes])
    if name not in SHAPES:
        raise ValueError(f"unknown regime {name!r}: here, flat, dear, stale")
    t1 = here.seconds[0]
    curve = CallCost(TARGET_SIZES, tuple(t1 * r for r in SHAPES[name]), here.per_position, here.per_position_per_token)
    return curve, curve


class Planned(AutoDrafter):
    """`auto`'s drafter, planning with the regime's curve (`planning`, fresh each run) where one is set."""

    planning: CallCost | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.planning is not None:
            self.cost.target = fresh(self.planning)  # (the chooser holds this CostModel too)


class Untimed(Planned):
    """`online_correction`: plans by the calibrated curve alone, uncorrected by the calls' times, and judges its steps
    by their planned seconds (as a seeded run does: `Clock(timed=False)`); its calls still advance the replay's
    clock, which the replay's seconds are read from."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock.timed = False  # (the one Clock its proposers share)


class OneCurve(SuffixProposer):
    """The suffix index's trees with every guess on one calibration curve, whatever the length of its match."""

    def curve(self, match: int) -> str:
        return "suffix"


class OneCurveDrafter(Planned):
    """`match_curves`: the suffix index's guesses estimated on one calibration curve, not one per match length."""

    kinds = tuple(OneCurve if kind is SuffixProposer else kind for kind in PROPOSERS)


class MainBranch(Planned):
    """`suffix_trees`: the suffix index drafts its main branch alone, never a tree."""

    suffix_trees = False


class NoLookahead(Planned):
    """`lookahead`: no lookahead guesses, alone or merged (which reads them), and no window rides. The replay
    undervalues it: its window's tokens are off greedy's path, so their predictions never see the future."""

    off = ("lookahead",)


class NoMerged(Planned):
    """`merged`: the suffix index's and lookahead's guesses never checked in one tree."""

    off = ("merged",)


MECHANISMS: dict[str, type[Planned]] = {"online_correction": Untimed, "match_curves": OneCurveDrafter,
                                         "lookahead": NoLookahead, "merged": NoMerged,
                                        "suffix_trees": MainBranch}


def variant(mechanism: str | None, planning: CallCost | None = None) -> type[Auto]:
    """`Auto` with `mechanism` switched off (None: none), planning with `planning` (None: the calibrated curve)."""
    base = MECHANISMS[mechanism] if mechanism else Planned
    drafter = type(f"{base.__name__}Drafter", (base,), {"planning": planning})
    return type(f"Auto_{mechanism or 'full'}", (Auto,), {"drafter": drafter})


def ticking(prompts: Prompts, bar: tqdm) -> Iterator:
    """`prompts`, the bar ticking as each is done."""
    for prompt in prompts:
        yield prompt
        bar.update()


def ablate(lm: decoders.LM, suites: dict[str, Prompts], regimes: Iterable[str] = ("here", "flat", "dear"),
           mechanisms: Iterable[str] = tuple(MECHANISMS), noise: float = 0.0, seeds: int = 1,
           here: CallCost | None = None, progress: bool = True) -> dict:
    """Replay `auto` on every suite's prompts with everything on and with each mechanism off, in each regime: per
    regime, its curves, greedy's and each run's estimated seconds and target calls per suite and in all ("all"),
    per seed (1..`seeds` with `noise`, else one run), and their means ("seconds", "calls"). `here`: the calibrated
    curve (default: the target's, `call_cost`)."""
    regimes, mechanisms = list(regimes), list(mechanisms)
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown:
        raise ValueError(f"unknown mechanisms {unknown}: {', '.join(MECHANISMS)}")
    here = call_cost(lm, "target") if here is None else here
    seeds_run = list(range(1, seeds + 1)) if noise else [0]
    prompts = [(suite, p) for suite, ps in suites.items() for p in ps]
    names = ["all", *suites] if len(suites) > 1 else ["all"]
    bar = tqdm(total=len(regimes) * (1 + len(mechanisms)) * len(seeds_run) * len(prompts), unit="prompt",
               disable=not progress, desc="ablating auto")
    out = {"model": lm.name, "suites": {s: len(ps) for s, ps in suites.items()}, "noise": noise, "seeds": seeds_run,
           "regimes": {}}
    curves = {name: regime(name, here) for name in regimes}
    for name, (planning, truth) in curves.items():
        entry = out["regimes"][name] = {"plans_with": described(planning), "costed_by": described(truth), "runs": {}}
        for mechanism in [None, *mechanisms]:
            decoder, per_seed = variant(mechanism, planning), []
            for seed in seeds_run:
                rows = replay(lm, ticking([p for _, p in prompts], bar), noise=noise, seed=seed, cost=truth,
                              decoder=decoder)
                per_seed.append(tally(rows, [suite for suite, _ in prompts], names, "seconds", "calls"))
                if seed == seeds_run[0]:
                    steps = sum((Counter(row["steps"]) for row in rows), Counter())  # what auto chose
                    if mechanism is None:
                        entry["greedy"] = tally([{**row, "calls": row["tokens"]} for row in rows],
                                                [suite for suite, _ in prompts], names, "greedy", "calls")
            run = entry["runs"][mechanism or "full"] = {
                suite: {"seconds": statistics.fmean(s[suite]["seconds"] for s in per_seed),
                        "calls": statistics.fmean(s[suite]["calls"] for s in per_seed),
                        "per_seed": [s[suite]["seconds"] for s in per_seed]} for suite in names}
            run["all"]["steps"] = dict(steps)
    bar.close()
    return out


def tally(rows: list[dict], suites: list[str], names: list[str], seconds: str, calls: str) -> dict:
    """Per suite in `names` ("all": every row): the rows' sums of `seconds` and `calls`, as "seconds" and "calls"."""
    out = {name: {"seconds": 0.0, "calls": 0} for name in names}
    for row, suite in zip(rows, suites):
        for name in {"all", suite} & set(names):
            out[name]["seconds"] += row[seconds]
            out[name]["calls"] += row[calls]
    return out


def cell(off: dict, on: dict) -> str:
    """"off / on (ratio)", the ratio bold where the mechanism earns its place; with seeds, their ratios' range."""
    ratio = off["seconds"] / on["seconds"]
    text = f"**{ratio:.3f}**" if ratio >= KEEP else f"{ratio:.3f}"
    if len(on["per_seed"]) > 1:
        ratios = [a / b for a, b in zip(off["per_seed"], on["per_seed"])]
        text += f"; {min(ratios):.3f}-{max(ratios):.3f}"
    return f"{off['seconds']:.2f} / {on['seconds']:.2f} ({text})"


def table(report: dict, columns: list[tuple[str, str]], head: list[str]) -> list[str]:
    """Markdown rows: the `columns` ((regime, suite) each, headed `head`) of full auto, greedy and each mechanism
    off."""
    lines = ["| mechanism off | " + " | ".join(head) + " |", "|:---|" + "---:|" * len(columns)]
    first = report["regimes"][columns[0][0]]
    for label, get in (("auto, all on", lambda r, s: report["regimes"][r]["runs"]["full"][s]),
                       ("greedy", lambda r, s: report["regimes"][r]["greedy"][s])):
        lines.append(f"| *{label}* | " + " | ".join(f"{get(r, s)['seconds']:.2f} s, {get(r, s)['calls']:.0f} calls"
                                                    for r, s in columns) + " |")
    for mechanism in first["runs"]:
        if mechanism != "full":
            runs = [report["regimes"][r]["runs"] for r, _ in columns]
            lines.append(f"| {mechanism} | " + " | ".join(cell(run[mechanism][s], run["full"][s])
                                                        for run, (_, s) in zip(runs, columns)) + " |")
    return lines


def markdown(report: dict) -> str:
    """The report as Markdown: the union of the suites per regime, then each regime per suite where there are
    several."""
    regimes = list(report["regimes"])
    suites = ", ".join(f"{s} ({n})" for s, n in report["suites"].items())
    noise = f", noise {report['noise']} over seeds {report['seeds']}" if report["noise"] else ""
    lines = [f"{report['model']}: {suites} prompts{noise}; estimated seconds with the mechanism off / all on "
             f"(their ratio). The regimes' curves, t(1) and t(n) / t(1):", ""]
    for r, entry in report["regimes"].items():
        curves = [("", entry["costed_by"])] if entry["plans_with"] == entry["costed_by"] else [
            (" (plans with)", entry["plans_with"]), (" (costed by)", entry["costed_by"])]
        for what, curve in curves:
            t1 = curve["seconds"][0]
            shape = ", ".join(f"{n}: {t / t1:.2f}" for n, t in zip(curve["sizes"], curve["seconds"]))
            lines.append(f"- {r}{what}: t(1) {t1 * 1000:.1f} ms; {shape}; {curve['per_position'] * 1e6:.0f} + "
                         f"{curve['per_position_per_token'] * 1e6:.0f} x (n - 1) us a cached position")
    lines.append("")
    lines += table(report, [(r, "all") for r in regimes], regimes)
    if len(report["suites"]) > 1:
        for r in regimes:
            lines += ["", f"{r}, per suite:", ""]
            suites = ["all", *report["suites"]]
            lines += table(report, [(r, s) for s in suites], suites)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="`decodekit compare --out` JSON files with a greedy run")
    parser.add_argument("--regimes", default="here,flat,dear", help="comma-separated: here, flat, dear, stale")
    parser.add_argument("--mechanisms", default="all", help=f"all, or comma-separated of: {', '.join(MECHANISMS)}")
    parser.add_argument("--noise", type=float, default=0.0, help="log-normal spread of each call's cost (e.g. 0.15)")
    parser.add_argument("--seeds", type=int, default=3, help="with --noise: seeds 1..N, their mean")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mechanisms = list(MECHANISMS) if args.mechanisms == "all" else [m.strip() for m in args.mechanisms.split(",")]
    results = [json.loads(path.read_text()) for path in args.results]
    models = {(r["model"]["name"], r["environment"]["dtype"]) for r in results}
    if len(models) > 1:
        raise SystemExit(f"the results hold several models ({sorted(models)}): ablate one model at a time")
    (name, dtype), = models
    lm = decoders.load(name, dtype=dtype)
    suites: dict[str, Prompts] = {}
    for path, result in zip(args.results, results):
        suites.setdefault(result["config"].get("suite") or path.stem, []).extend(load_prompts(result, lm))
    report = ablate(lm, suites, [r.strip() for r in args.regimes.split(",")], mechanisms, args.noise, args.seeds)
    report["results"] = [str(path) for path in args.results]
    print(markdown(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
