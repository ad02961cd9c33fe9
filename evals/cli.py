"""The `decodekit` command: list, generate, compare, calibrate, leaderboard, models (also `python -m evals ...`).

Bad input (an unknown strategy or suite, a malformed suite file, a strategy that needs a missing draft, a draft of
another vocabulary ...) prints one `decodekit: error: ...` line to stderr and exits with status 2, before any run;
set DECODEKIT_DEBUG=1 to see the traceback instead. A compare whose timed runs raised writes its results, says how
many failed and exits with status 1; its output paths are checked before the first run, and Ctrl-C during its timed
runs writes the rounds measured so far, marked partial, and exits with status 130. A closed pipe (`decodekit list |
head -2`) ends the command quietly.

Commands import torch and the models only when they run: `decodekit leaderboard` and `--help` stay quick.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

from evals import report, suites
from evals.cli_parser import build_parser

ANSI = {"draft": "\033[32m", "lookup": "\033[36m", "lookahead": "\033[35m", "grammar": "\033[33m"}
RESET = "\033[0m"
EXPECTED = (ValueError, TypeError, OSError, ImportError, NotImplementedError)  # bad input: one line, status 2
CONTEXT = 512  # the context `calibrate` judges auto's int8 copies at (a prompt of some length)


class UsageError(ValueError):
    """Bad command-line input, reported as one line with exit status 2."""


def _expected(error: BaseException) -> bool:
    """Whether `error` is bad input to report in one line (a zoo error too, once the zoo is imported)."""
    zoo = sys.modules.get("decoders.models.zoo")
    return isinstance(error, EXPECTED) or (zoo is not None and isinstance(error, zoo.ZooError))


def _check_draft_arguments(args) -> None:
    if args.draft_quantize and not args.draft:
        raise UsageError("--draft-quantize quantizes the --draft model: pass --draft MODEL too")
    if args.draft_quantize and args.draft.startswith("self:"):
        raise UsageError(f"--draft {args.draft} is already the target's quantized copy; drop --draft-quantize")


def _check_device(device) -> None:
    """Refuse a --device this machine lacks in the command line's words (the library's say device='cpu')."""
    import torch

    try:
        device = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device}: not a device; use cpu, cuda, cuda:1 ...") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: this machine has no CUDA device; use --device cpu")


def _load(name: str, args, device: str | None, quantize: str | None = None):
    import decoders

    if device is not None:
        _check_device(device)
    if args.no_progress:  # transformers' and the hub's loading bars
        from transformers.utils import logging

        logging.disable_progress_bar()
    print(f"loading {name}{f' ({quantize})' if quantize else ''} ...", file=sys.stderr)
    lm = decoders.load(name, dtype=args.dtype, device=device, quantize=quantize)
    graphs = getattr(args, "cuda_graphs", "on")
    lm.cuda_graphs, lm.compile_calls = lm.device.type == "cuda" and graphs != "off", graphs == "compiled"
    return lm


def _draft(args, device: str | None):
    """--draft as `decoders.generate` and `compare` take it: "self:int8" as is (the target's int8 copy, made once by
    the callee), a model name loaded here (quantized with --draft-quantize)."""
    if args.draft.startswith("self:"):
        return args.draft
    return _load(args.draft, args, device, args.draft_quantize)


# ----------------------------------------------------------------------------------------------------------- list
def cmd_list(args) -> int:
    from decoders import registry
    from decoders.models import zoo
    from evals import llamacpp_build, peers

    print("Strategies (decoders.available()):")
    for name in registry.available():
        cls = registry.get(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"  {name:<16} {'needs --draft' if cls.needs_draft else '':<14} {doc}")
    print("\nPeers (compare --strategies ...):")
    for peer in peers.PEERS.values():
        print(f"  {peer.name:<16} {'needs --draft' if peer.needs_draft else '':<14} {peer.description}")
    for peer in peers.BATCH_PEERS.values():
        print(f"  {peer.name:<16} {'--batch-size':<14} {peer.description}")
    for peer in peers.LLAMACPP_PEERS.values():
        print(f"  {peer.name:<16} {'needs --draft' if peer.needs_draft else '':<14} {peer.description}")
    if why := llamacpp_build.missing():
        print(f"  {'llamacpp:...':<16} {'':<14} not available here: {why}")
    for prefix, why in peers.UNAVAILABLE.items():
        print(f"  {prefix + '...':<16} {'':<14} not available: {why}")
    print("\nZoo models (--model zoo:NAME):")
    for name in zoo.names():
        pulled = "pulled" if zoo.local_path(name) else "not pulled"
        print(f"  {name:<20} {pulled:<11} {zoo.ZOO[name].description}")
    print("\nPrompt suites (compare --suite NAME, or a .jsonl file):")
    for name in suites.names():
        prompts = suites.load(name)
        categories = ", ".join(dict.fromkeys(p.category for p in prompts))
        print(f"  {name:<10} {len(prompts):>3} prompts  {categories}")
    return 0


# ------------------------------------------------------------------------------------------------------- generate
def _marked(pieces: list[str], sources: list[str], color: bool, markers: bool) -> str:
    """The text with non-target tokens visible: ANSI colors (`color`), [source:...] markers (`markers`), or both."""
    out, run, current = [], "", "target"
    for piece, source in list(zip(pieces, sources)) + [("", None)]:
        if source != current:
            if run and current != "target":
                run = f"{ANSI.get(current, '')}{run}{RESET}" if color else run
                run = f"[{current}:{run}]" if markers else run
            out.append(run)
            run, current = "", source
        run += piece
    return "".join(out)


def cmd_generate(args) -> int:
    import decoders
    from decoders.capabilities import check_request
    from evals.methods import build, option_pairs
    from evals.runner import grammar_for
    from evals.timing import pieces

    method = build(args.strategy, option_pairs(args.option, scoped=False))
    if method.is_peer:
        raise UsageError(
            f"{args.strategy!r} is a peer: peers run in `decodekit compare`; generate runs decodekit "
            "strategies (decodekit list)"
        )
    check_request(method.decoder, has_draft=args.draft is not None, has_grammar=args.json_schema is not None)
    _check_draft_arguments(args)
    schema = None
    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise UsageError(f"--json-schema {args.json_schema}: cannot read a JSON schema ({error})") from None
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt_text.strip():
        raise UsageError(
            "the prompt is empty"
            + (" (nothing on stdin)" if args.prompt == "-" else "")
            + "; give some text to continue"
        )
    lm = _load(args.model, args, args.device)
    draft = _draft(args, args.device) if args.draft else None
    tokens = suites.render(lm, suites.Prompt("cli", "cli", prompt_text), chat_template=not args.no_chat_template)
    result = decoders.generate(
        lm,
        tokens,
        strategy=method.decoder,
        max_new_tokens=args.max_new_tokens,
        draft=draft,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        grammar=grammar_for(schema),
        stop=args.stop or None,
    )
    if args.json:
        record = dataclasses.asdict(result)
        record["stats"] = result.stats.as_dict()
        print(json.dumps(record, ensure_ascii=False, indent=1))
        return 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    shown = sorted(set(result.sources) & set(ANSI)) if color or args.show_sources else []
    print(_marked(pieces(lm, result.tokens), result.sources, color, args.show_sources) if shown else result.text)
    s = result.stats
    legend = " · ".join(
        f"{ANSI[k] if color else ''}{f'[{k}:...]' if args.show_sources else k}{RESET if color else ''}" for k in shown
    )
    acceptance = f" · acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted})" if s.drafted else ""
    print(
        f"{s.new_tokens} tokens · {s.tokens_per_second:.1f} tok/s · {s.target_calls} target calls · "
        f"{s.mean_accepted:.2f} tokens/call{acceptance} · finish: {result.finish_reason}"
        + (f" · sources: {legend}" if legend else ""),
        file=sys.stderr,
    )
    return 0


# -------------------------------------------------------------------------------------------------------- compare
def _check_writable(option: str, path: str, folder: bool = False) -> None:
    """Refuse an output compare could not write before any run, not after it (losing the results): open the file, or
    one in the folder, for appending, then remove whatever this made."""
    target = Path(path)
    if target.exists() and target.is_dir() != folder:
        raise UsageError(
            f"{option} {path}: is a {'file' if folder else 'folder'}; give a {'folder' if folder else 'file'} name"
        )
    made = [p for p in (target, *target.parents) if not p.exists()] if folder else []  # deepest first
    probe = target / ".decodekit-write-check" if folder else target
    existed = probe.exists()
    try:
        if folder:
            target.mkdir(parents=True, exist_ok=True)
        open(probe, "a").close()
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot write there ({error.strerror or error})") from None
    finally:
        if not existed:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # (no probe made: a file in the path)
                probe.unlink()
        for created in made:
            with contextlib.suppress(OSError):  # (another process of the run may be probing it too)
                created.rmdir()


def cmd_compare(args) -> int:
    import torch

    from evals.methods import option_pairs
    from evals.runner import BATCHED_PROCESSES, CompareConfig, Comparison, Interrupted, Processes

    _check_draft_arguments(args)
    for option, path in (("--out", args.out), ("--markdown", args.markdown), ("--html", args.html)):
        if path:
            _check_writable(option, path)
    if args.plots:
        _check_writable("--plots", args.plots, folder=True)
    config = CompareConfig(
        strategies=args.strategies or (),
        suite=args.suite,
        limit=args.limit,
        per_category=args.per_category,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        draft_quantize=args.draft_quantize,
        chat_template=not args.no_chat_template,
        options=option_pairs(args.option, scoped=True),
        warmup=not args.no_warmup,
        progress=not args.no_progress,
        bandwidth_megabytes=args.bandwidth_mb,
        batch_sizes=args.batch_size or (),
        llamacpp=args.llamacpp,
    )
    comparison = Comparison(config, has_draft=args.draft is not None)  # suite and methods: before any model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    processes = Processes(cpu=cpu)
    if config.batch_sizes and processes.count > 1:
        raise UsageError(BATCHED_PROCESSES)
    device = processes.device if processes.count > 1 and not cpu else args.device
    lm = _load(args.model, args, device)
    draft = None  # loaded as it is: the peers draft with it as a user would, the strategies with its quantized copy
    if comparison.takes_draft:
        draft = args.draft if args.draft.startswith("self:") else _load(args.draft, args, device)
    try:
        result = comparison.run(lm, draft, processes=processes)
    except Interrupted as interrupted:  # Ctrl-C: write what was measured, then end as an interrupt does
        if interrupted.result is not None:
            _write_compare(args, interrupted.result)
            print(
                'decodekit: interrupted; the report covers the prompts measured so far ("partial": true)',
                file=sys.stderr,
            )
        return processes.exit(130)
    return processes.exit(0 if result is None else _write_compare(args, result))  # (None: not the main process)


def _write_compare(args, result: dict) -> int:
    """Print and write compare's result as asked; the exit status (1 when a timed run raised)."""
    text = report.markdown(result)
    print(text)
    if args.out:
        report.write_json(result, args.out)
    if args.markdown:
        Path(args.markdown).write_text(text, encoding="utf-8")
    if args.html:
        from evals import html

        Path(args.html).write_text(html.compare_report(result), encoding="utf-8")
    if args.plots:
        from evals import plots

        plots.write_all(result, args.plots)
    written = [p for p in (args.out, args.markdown, args.html, args.plots) if p]
    if written:
        print("wrote " + ", ".join(written), file=sys.stderr)
    if failed := len(result["errors"]):
        print(
            f"decodekit: {failed} of {failed + len(result['runs'])} timed runs raised (the ERROR rows; the notes "
            "say why)",
            file=sys.stderr,
        )
        return 1
    return 0


# ------------------------------------------------------------------------------------------------------ calibrate
def cmd_calibrate(args) -> int:
    import time

    import torch

    from decoders.drafting import cost
    from decoders.drafting.copies import drafting_model
    from decoders.driver import resolve_draft

    _check_draft_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = _load(args.model, args, args.device)
    draft = resolve_draft(lm, _draft(args, args.device)) if args.draft else None
    print(
        "measuring ..." if args.refresh else "measuring (or reading this machine's cached costs) ...", file=sys.stderr
    )
    costs = cost.calibrate(lm, draft, refresh=args.refresh)
    curves = [("target", lm.name, costs.target)] + ([("draft", args.draft, costs.draft)] if draft else [])
    drafting = drafting_model(lm, draft, CONTEXT)  # what auto drafts with: an int8 copy where it pays
    if drafting is not None and drafting is not draft:
        curves.append(("auto's draft", drafting.name, cost.call_cost(drafting, "draft")))
    print(
        f"device: {cost.machine(lm.device)} · dtype: {str(lm.dtype).removeprefix('torch.')}"
        f" · threads: {torch.get_num_threads()} · torch {torch.__version__}\n"
    )
    rows = [
        [
            role,
            name,
            str(n),
            str(context),
            f"{seconds * 1e3:.2f}",
            f"{curve.fitted(n, context) * 1e3:.2f}",
            f"{curve.fitted(n, context) / curve.fitted(1, context):.2f}",
        ]
        for role, name, curve in curves
        for n, context, seconds in curve.samples
    ]
    print(report.make_table(["role", "model", "tokens", "context", "measured ms ↓", "fit ms ↓", "× 1 token ↓"], rows))

    def measured(curve) -> str:  # how old and how noisy a curve is: one measured on a busy machine misleads auto
        if curve.measured is None:
            return "measured before calibrations recorded when and how noisily (--refresh measures it again)"
        hours = (time.time() - curve.measured) / 3600
        age = f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.0f} days"
        noise = "not recorded" if curve.noise is None else f"{curve.noise:.0%}"
        return (
            f"measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(curve.measured))} ({age} ago), noise "
            f"{noise} (how much slower than its fastest a size's typical call ran; --refresh measures it again)"
        )

    for role, _, curve in curves:
        knots = ", ".join(f"{n}: {seconds * 1e3:.2f}" for n, seconds in zip(curve.sizes, curve.seconds))
        print(
            f"\n{role}: ms by tokens scored ({knots}) + {curve.per_position * 1e6:.2f} µs per cached position, "
            f"{curve.per_position_per_token * 1e6:.2f} µs more for each token scored past the first"
        )
        print(f"{role}: {measured(curve)}")
    print(
        f"\nauto drafts with: {drafting.name if drafting is not None else 'no model (guesses from the context)'}, "
        f"as measured here after {CONTEXT} tokens (the int8 copy of the draft, or without one of the target, where "
        "its calls are cheap enough)"
    )
    if args.plot:
        from evals import plots

        plots.cost_curves(curves, args.plot, title=f"{lm.name} · {lm.device} · {str(lm.dtype).removeprefix('torch.')}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------- leaderboard
def cmd_leaderboard(args) -> int:
    results = [report.load_result(path) for path in args.files]
    rows = report.leaderboard(results)
    if args.format == "json":
        text = report.leaderboard_json(rows, [str(p) for p in args.files])
    elif args.format == "html":
        from evals import html

        text = html.leaderboard_page(rows)
    else:
        text = report.leaderboard_markdown(rows)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0


# --------------------------------------------------------------------------------------------------------- models
def cmd_models(args) -> int:
    from decoders.models import zoo

    if args.action == "list":
        for name in zoo.names():
            print(f"{name:<20} {str(zoo.local_path(name) or 'not pulled'):<60} {zoo.ZOO[name].description}")
        return 0
    for name in args.names:
        print(zoo.pull(name, force=args.force, progress=True))
    return 0


# ---------------------------------------------------------------------------------------------------------- peers
def cmd_peers(args) -> int:
    from evals import llamacpp_build

    build = llamacpp_build.install(say=lambda line: print(line, file=sys.stderr), jobs=args.jobs)
    print(
        f"llama.cpp {llamacpp_build.VERSION}: {build.server}, {build.bench}; its GGUF converter: "
        f"{build.source / llamacpp_build.CONVERTER}"
    )
    return 0


# ----------------------------------------------------------------------------------------------------- export-hub
def cmd_export_hub(args) -> int:
    from evals.export_hub import export_hub

    folder = export_hub(args.directory, strategy=args.strategy)
    print(
        f"wrote {folder / 'custom_generate'}; use it as "
        f"model.generate(**inputs, custom_generate={str(folder)!r}, trust_remote_code=True)"
    )
    return 0


COMMANDS = {
    "list": cmd_list,
    "generate": cmd_generate,
    "compare": cmd_compare,
    "calibrate": cmd_calibrate,
    "leaderboard": cmd_leaderboard,
    "models": cmd_models,
    "peers": cmd_peers,
    "export-hub": cmd_export_hub,
}


def main(argv: list[str] | None = None) -> int:
    """Run the `decodekit` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # `decodekit list | head -2`: stop quietly, and point stdout at devnull so the exit-time flush cannot fail
        # again (the recipe of Python's signal module docs, "Note on SIGPIPE")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("decodekit: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if not _expected(error) or os.environ.get("DECODEKIT_DEBUG"):
            raise
        print(f"decodekit: error: {error}", file=sys.stderr)
        return 2
