"""One model call side by side: decodekit's one-token step and prefill against llama.cpp's on the same weights.

    python -m devtools.bench_step [--models zoo:smollm2-135m,zoo:qwen2.5-coder-0.5b,zoo:qwen2.5-coder-1.5b]
        [--dtype bfloat16] [--depth 64] [--tokens 64] [--prompt 256] [--rounds 3] [--llamacpp DIR]

For each model, in rounds (so that a drift of the machine's speed reaches every column alike): decodekit's step
(`LM.forward` of one token after `--depth` tokens, `--tokens` of them, the median), the same through transformers'
calls alone (`lm.native = None`, plain linear layers: what transformers itself runs), and llama.cpp's
(`llama-bench -p 0 -n TOKENS -d DEPTH` on a GGUF of the same weights and dtype, `evals.llamacpp.step_ms`); then each
one's prefill of a `--prompt`-token prompt. Prints a Markdown table of the medians over rounds. llama.cpp comes from
`decodekit peers install llamacpp` (or `--llamacpp DIR`); without it its columns are left out. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import decoders
from evals import llamacpp, llamacpp_build


def _steps(lm: decoders.LM, depth: int, tokens: int) -> float:
    """Median seconds of a one-token call after `depth` tokens."""
    cache = lm.new_cache(depth + tokens + 1)
    with torch.inference_mode():
        token = int(lm.forward([(7 + 13 * i) % lm.vocab_size for i in range(depth)], cache, keep=1)[-1].argmax())
        times = []
        for _ in range(tokens):
            start = time.perf_counter()
            logits = lm.forward([token], cache)
            times.append(time.perf_counter() - start)
            token = int(logits[-1].argmax())
    return statistics.median(times)


def _prefill(lm: decoders.LM, length: int) -> float:
    """Seconds to score a prompt of `length` tokens (logits of the last only, as a run does)."""
    cache = lm.new_cache(length + 1)
    with torch.inference_mode():
        start = time.perf_counter()
        lm.forward([(11 + 17 * i) % lm.vocab_size for i in range(length)], cache, keep=1)
        return time.perf_counter() - start


def measure(model: str, dtype: str, depth: int, tokens: int, prompt: int, rounds: int,
            build: str | None) -> dict:
    lm = decoders.load(model, dtype=dtype)
    native = lm.native
    transformers = decoders.wrap(lm.model, lm.tokenizer, name=lm.name)  # the same weights, for transformers' calls
    transformers.native = None
    columns: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            columns.setdefault(name, []).append(value)

    for _ in range(rounds):
        if native is not None:
            add("decodekit step ms", 1e3 * _steps(lm, depth, tokens))
            add("decodekit prefill tok/s", prompt / _prefill(lm, prompt))
        add("transformers step ms", 1e3 * _steps(transformers, depth, tokens))
        add("transformers prefill tok/s", prompt / _prefill(transformers, prompt))
        if build is not False:
            step = llamacpp.step_ms(model, dtype, tokens=tokens, depth=depth, repetitions=3, llamacpp=build)
            add("llama.cpp step ms", step["ms_per_token"])
            fill = llamacpp.step_ms(model, dtype, prompt=prompt, repetitions=3, llamacpp=build)
            add("llama.cpp prefill tok/s", 1e3 / fill["ms_per_token"])
    row = {name: statistics.median(values) for name, values in columns.items()}
    row.update(model=model, dtype=dtype, native=native is not None)
    if "decodekit step ms" in row and "llama.cpp step ms" in row:
        row["step / llama.cpp"] = row["decodekit step ms"] / row["llama.cpp step ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="zoo:smollm2-135m,zoo:qwen2.5-coder-0.5b,zoo:qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--depth", type=int, default=64, help="tokens in the cache before the timed steps")
    parser.add_argument("--tokens", type=int, default=64, help="one-token steps timed per round")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of the timed prefill")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llamacpp", help="a llama.cpp build folder (default: decodekit's cache)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    build = args.llamacpp
    if why := llamacpp_build.missing(args.llamacpp):
        print(f"(llama.cpp left out: {why})")
        build = False
    rows = [measure(m, args.dtype, args.depth, args.tokens, args.prompt, args.rounds, build)
            for m in args.models.split(",")]
    names = ["decodekit step ms", "transformers step ms", "llama.cpp step ms", "step / llama.cpp",
             "decodekit prefill tok/s", "transformers prefill tok/s", "llama.cpp prefill tok/s"]
    names = [n for n in names if any(n in r for r in rows)]
    print(f"\n{args.dtype}, {torch.get_num_threads()} threads, {args.depth} tokens of context, medians of "
          f"{args.rounds} rounds\n")
    print("| model | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for r in rows:
        cells = [f"{r[n]:.2f}" if n == "step / llama.cpp" else f"{r[n]:.1f}" if n in r else "" for n in names]
        print(f"| {r['model']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
