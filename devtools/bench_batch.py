"""Throughput of batched decoding against one prompt at a time and transformers' batched `generate`.

    python -m devtools.bench_batch [--strategies greedy,suffix] [--batch-sizes 1,8] [--prompts 16] [--tokens 48]
        [--draft zoo:qwen2.5-coder-0.5b [--draft-quantize int8]]

Loads Qwen2.5-Coder-1.5B in bfloat16 (the zoo's), takes the first `--prompts` of 16 prompts (the first 8 of bench +
mixed, then every second of agentic's first 16), and times `decoders.generate(lm, prompts, batch_size=B)` per
strategy and batch size (B = 1: one prompt at a time), then transformers' `generate` on left-padded batches of each B
and its continuous batching (`generate_batch`). Every strategy first runs an untimed queue of short prompts at each
batch size (as `compare` warms every method up: a strategy's first run pays one-time probes of the models). Prints
tokens per second, how many rows equal batch-1 greedy's tokens, and target calls. Run it alone: a second process on a
2-core machine spoils the timings.
`decodekit compare --batch-size` is the evaluator's version of this, with latency, TTFT and the tie analysis.
"""

from __future__ import annotations

import argparse
import time

import torch

import decoders
from evals import batched, peers, suites
from evals.cli_parser import batch_sizes
from evals.runner import WARMUP_TOKENS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="greedy,suffix")
    parser.add_argument("--batch-sizes", type=batch_sizes, default="1,8", help="as compare's --batch-size: each "
                        "size once, ascending")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--draft", help="a draft model for the strategies that take one (loaded in bfloat16)")
    parser.add_argument("--draft-quantize", choices=["int8"], help="quantize the draft model")
    parser.add_argument("--no-reference", action="store_true", help="skip the batch-1 greedy runs the rows are "
                        "compared with (they take as long as the rest at 128 tokens)")
    parser.add_argument("--no-peers", action="store_true", help="skip transformers' batched peers")
    args = parser.parse_args(argv)
    lm = decoders.load("zoo:qwen2.5-coder-1.5b", dtype="bfloat16")
    draft = decoders.load(args.draft, dtype="bfloat16", quantize=args.draft_quantize) if args.draft else None
    prompts = ([p.prompt for p in suites.load("bench") + suites.load("mixed")][:8]
               + [p.prompt for p in suites.load("agentic")][::2][:8])[: args.prompts]
    sizes = list(args.batch_sizes)
    warm = ["def f(x):", "Hello"]  # the untimed warm-up queue's prompts
    reference = [None if args.no_reference else decoders.generate(lm, p, max_new_tokens=args.tokens).tokens
                 for p in prompts]
    for strategy in args.strategies.split(","):
        options = {"strategy": strategy, "max_new_tokens": args.tokens}
        kind = decoders.registry.get(strategy)
        if draft is not None and (kind.takes_draft or kind.needs_draft):
            options["draft"] = draft
        for size in sizes:  # warm-up: the models' probes and one-time set-up are not the batch's throughput
            decoders.generate(lm, (warm * size)[:size], batch_size=size, **{**options, "max_new_tokens": WARMUP_TOKENS})
        for size in sizes:
            start = time.perf_counter()
            if size == 1:
                results = [decoders.generate(lm, p, **options) for p in prompts]
            else:
                results = decoders.generate(lm, prompts, batch_size=size, **options)
            seconds = time.perf_counter() - start
            tokens = sum(len(r.tokens) for r in results)
            same = "-" if args.no_reference else sum(r.tokens == want for r, want in zip(results, reference))
            calls = sum(r.stats.target_calls for r in results)
            print(f"{strategy} batch {size}: {tokens / seconds:.2f} tok/s, {same}/{len(prompts)} rows as batch-1 "
                  f"greedy, {calls} target calls", flush=True)
    if args.no_peers:
        return
    tokenizer, eos = lm.tokenizer, frozenset(lm.eos_token_ids)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    for size in sizes:
        tokens, start = 0, time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), size):
                batch = tokenizer(prompts[i: i + size], return_tensors="pt", padding=True)
                out = peers.quiet_generate(lm.model, **batch, max_new_tokens=args.tokens, do_sample=False,
                                           pad_token_id=pad)
                for row in out[:, batch.input_ids.shape[1]:].tolist():
                    tokens += next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        print(f"hf:batch batch {size}: {tokens / (time.perf_counter() - start):.2f} tok/s", flush=True)
    inputs = [lm.encode(p) for p in prompts]
    for size in sizes:
        start = time.perf_counter()
        try:
            outputs = batched.generate_batch(lm, inputs, size, args.tokens)
        except RuntimeError as error:
            print(f"hf:continuous batch {size}: does not run here ({error})", flush=True)
            break
        tokens = sum(len(batched.row_tokens(list(o.generated_tokens), eos, args.tokens)) for o in outputs)
        print(f"hf:continuous batch {size}: {tokens / (time.perf_counter() - start):.2f} tok/s", flush=True)


if __name__ == "__main__":
    main()
