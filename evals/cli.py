"""The `decodekit` command: list, generate, compare, leaderboard, models pull (also `python -m evals ...`).

Bad input (an unknown strategy or suite, a malformed suite file, a strategy that needs a missing draft ...) prints one
`decodekit: error: ...` line to stderr and exits with status 2; set DECODEKIT_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import decoders
from decoders import registry
from evals import peers, report, suites
from evals.cli_parser import build_parser
from evals.runner import parse_value

ANSI = {"draft": "\033[32m", "lookup": "\033[36m", "lookahead": "\033[35m", "grammar": "\033[33m"}
RESET = "\033[0m"


class UsageError(ValueError):
    """Bad command-line input, reported as one line with exit status 2."""


def _zoo():
    try:
        from decoders.models import zoo
    except ImportError:
        return None
    return zoo


def _options(pairs: list[str], scoped: bool) -> dict:
    """KEY=VALUE pairs (values parsed as JSON when they are JSON); scoped: STRATEGY.KEY=VALUE, grouped by strategy."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"option {pair!r} must look like {'STRATEGY.KEY' if scoped else 'KEY'}=VALUE")
        value = parse_value(raw)
        if scoped:
            strategy, dot, name = key.partition(".")
            if not dot or not name:
                raise UsageError(f"option {pair!r} must name its strategy: STRATEGY.KEY=VALUE (e.g. speculative.k=4)")
            out.setdefault(strategy, {})[name] = value
        else:
            out[key] = value
    return out


def _load(name: str, dtype: str, device: str | None) -> decoders.LM:
    print(f"loading {name} ...", file=sys.stderr)
    return decoders.load(name, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------- list
def cmd_list(args) -> int:
    print("Strategies (decoders.available()):")
    for name in registry.available():
        cls = registry.get(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"  {name:<16} {'needs --draft' if cls.needs_draft else '':<14} {doc}")
    print("\nPeers (compare --strategies ...):")
    for peer in peers.PEERS.values():
        print(f"  {peer.name:<16} {'needs --draft' if peer.needs_draft else '':<14} {peer.description}")
    for prefix, why in peers.UNAVAILABLE.items():
        print(f"  {prefix + '...':<16} {'':<14} not available: {why}")
    zoo = _zoo()
    print("\nZoo models (--model zoo:NAME):")
    if zoo is None:
        print("  (the model zoo is not available in this version)")
    else:
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
def _marked(pieces: list[str], sources: list[str], color: bool) -> str:
    """The text with non-target tokens visible: ANSI colors, or [source:...] markers when not a terminal."""
    out, run, current = [], "", "target"
    for piece, source in list(zip(pieces, sources)) + [("", None)]:
        if source != current:
            if run:
                if current == "target":
                    out.append(run)
                else:
                    out.append(f"{ANSI.get(current, '')}{run}{RESET}" if color else f"[{current}:{run}]")
            run, current = "", source
        run += piece
    return "".join(out)


def cmd_generate(args) -> int:
    from evals.runner import grammar_for, needs_grammar

    cls = registry.get(args.strategy)
    if cls.needs_draft and not args.draft:
        raise UsageError(f"strategy {args.strategy!r} needs a draft model: pass --draft MODEL")
    if needs_grammar(args.strategy) and not args.json_schema:
        raise UsageError(f"strategy {args.strategy!r} decodes under a grammar: pass --json-schema FILE")
    options = _options(args.option, scoped=False)
    schema = None
    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise UsageError(f"--json-schema {args.json_schema}: cannot read a JSON schema ({error})") from None
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    lm = _load(args.model, args.dtype, args.device)
    draft = _load(args.draft, args.dtype, args.device) if args.draft else None
    grammar = grammar_for(schema)
    tokens = suites.render(lm, suites.Prompt("cli", "cli", prompt_text), chat_template=not args.no_chat_template)
    result = decoders.generate(
        lm, tokens, strategy=args.strategy, max_new_tokens=args.max_new_tokens, draft=draft,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, grammar=grammar,
        stop=args.stop or None, **options,
    )
    if args.json:
        record = dataclasses.asdict(result)
        record["stats"] = result.stats.as_dict()
        print(json.dumps(record, ensure_ascii=False, indent=1))
        return 0
    from evals.timing import pieces

    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(_marked(pieces(lm, result.tokens), result.sources, color))
    s = result.stats
    shown = sorted(set(result.sources) & set(ANSI))
    legend = " · ".join(f"{ANSI[k]}{k}{RESET}" if color else f"[{k}:...]" for k in shown)
    acceptance = f" · acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted})" if s.drafted else ""
    print(f"{s.new_tokens} tokens · {s.tokens_per_second:.1f} tok/s · {s.target_calls} target calls · "
          f"{s.mean_accepted:.2f} tokens/call{acceptance} · finish: {result.finish_reason}"
          + (f" · sources: {legend}" if legend else ""), file=sys.stderr)
    return 0


# -------------------------------------------------------------------------------------------------------- compare
def cmd_compare(args) -> int:
    import torch

    from evals.runner import CompareConfig, Processes, compare, plan

    strategies = tuple(s.strip() for s in (args.strategies or "").split(",") if s.strip())
    config = CompareConfig(
        strategies=strategies, suite=args.suite, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
        chat_template=not args.no_chat_template, options=_options(args.option, scoped=True),
        warmup=not args.no_warmup, progress=not args.no_progress, bandwidth_megabytes=args.bandwidth_mb,
    )
    suites.load(config.suite)  # fail fast, before loading any model
    plan(config.strategies, has_draft=bool(args.draft))
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = args.device == "cpu" or not torch.cuda.is_available()
    processes = Processes(cpu=cpu)
    device = processes.device if processes.count > 1 and not cpu else args.device
    lm = _load(args.model, args.dtype, device)
    draft = _load(args.draft, args.dtype, device) if args.draft else None
    result = compare(lm, config, draft=draft, processes=processes)
    if result is None:  # not the main process: it wrote nothing
        return 0
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
    zoo = _zoo()
    if zoo is None:
        raise UsageError("the model zoo (decoders.models.zoo) is not available in this version of decodekit")
    if args.action == "list":
        for name in zoo.names():
            print(f"{name:<20} {str(zoo.local_path(name) or 'not pulled'):<60} {zoo.ZOO[name].description}")
        return 0
    for name in args.names:
        print(zoo.pull(name, force=args.force, progress=True))
    return 0


COMMANDS = {"list": cmd_list, "generate": cmd_generate, "compare": cmd_compare, "leaderboard": cmd_leaderboard,
            "models": cmd_models}


def main(argv: list[str] | None = None) -> int:
    """Run the `decodekit` command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    zoo = _zoo()
    expected = (ValueError, TypeError, OSError, ImportError, NotImplementedError) + ((zoo.ZooError,) if zoo else ())
    try:
        return COMMANDS[args.command](args)
    except expected as error:
        if os.environ.get("DECODEKIT_DEBUG"):
            raise
        print(f"decodekit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("decodekit: interrupted", file=sys.stderr)
        return 130
