"""Drafting time of the suffix index at 1k, 10k and 100k stored tokens (no model): is it far below a target call?

    python -m devtools.bench_suffix_index [--sizes 1000,10000,100000] [--drafts 300]

Three texts: uniform random ids (every match short, the trie mostly leaves), Python source of the standard library cut
into words (natural repetition, like code outputs) and a period-40 loop (every suffix repeats: the most nodes and the
slowest appends). The store holds the text in 400-token sequences; each draft continues a 64-token context taken from
the same kind of text (half from stored text, so long matches happen), with the run's own index holding a 1k-token
prompt, through `propose` with the default `SuffixOptions`. Prints build time per token, memory per token
(tracemalloc), and ms per draft: cold (right after building: each node sorts its children on first use, as the nodes
an `add` touched do after every add) and warm (the same contexts again).
"""

from __future__ import annotations

import argparse
import gc
import random
import re
import statistics
import time
import tracemalloc
from pathlib import Path

from decoders.drafting.suffix_index import SuffixIndex, SuffixOptions
from decoders.drafting.suffix_store import SuffixStore, propose


def source_words(count: int) -> list[int]:
    """`count` word ids from the standard library's Python files (words, punctuation and newlines)."""
    ids: dict[str, int] = {}
    out: list[int] = []
    for path in sorted(Path(re.__file__).parent.parent.glob("*.py")):
        for word in re.findall(r"\w+|[^\w\s]|\n", path.read_text(errors="replace")):
            out.append(ids.setdefault(word, len(ids)))
        if len(out) >= count:
            return out[:count]
    return out


def text(kind: str, count: int, rng: random.Random) -> list[int]:
    if kind == "random":
        return [rng.randrange(32_000) for _ in range(count)]
    if kind == "loop":
        period = [rng.randrange(32_000) for _ in range(40)]
        return (period * (count // 40 + 1))[:count]
    return source_words(count)


def build(stored: list[int]) -> SuffixStore:
    store = SuffixStore(max_tokens=len(stored))
    for start in range(0, len(stored), 400):
        store.add(stored[start: start + 400])
    return store


def bench(kind: str, size: int, drafts: int) -> str:
    rng = random.Random(0)
    words = text(kind, size + 1_000 + 64 * drafts, rng)
    stored, prompt, fresh = words[:size], words[size: size + 1_000], words[size + 1_000:]
    tracemalloc.start()
    held = build(stored)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del held
    began = time.perf_counter()
    store = build(stored)
    seconds = time.perf_counter() - began
    gc.collect()  # the full collection the new objects have due: ~2 ms per 1k tokens held, once per 25% growth
    local = SuffixIndex()
    local.extend("run", prompt)
    options, contexts = SuffixOptions(), []
    for i in range(drafts):
        source = stored if i % 2 else fresh
        at = rng.randrange(64, len(source) - 1)
        contexts.append(prompt + source[at - 64: at])
    timings = []
    for _ in ("cold", "warm"):  # cold: each node's children sorted on first use, as after every add
        times, sizes = [], []
        for context in contexts:
            began = time.perf_counter()
            tree = propose(local, store, context, 64, options)
            times.append(time.perf_counter() - began)
            sizes.append(len(tree.tokens))
        timings.append(sorted(times))
    cold, warm = timings
    return (f"| {kind:6} | {size:>7,} | {1e6 * seconds / size:5.1f} | {memory / size:4.0f} | "
            f"{1e3 * statistics.mean(cold):6.3f} | {1e3 * cold[int(0.99 * (len(cold) - 1))]:6.3f} | "
            f"{1e3 * statistics.mean(warm):6.3f} | {statistics.mean(sizes):4.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="stored tokens, comma separated")
    parser.add_argument("--drafts", type=int, default=300, help="drafts timed per row")
    args = parser.parse_args()
    print("| text   |  stored | build µs/token ↓ | bytes/token ↓ | cold ms/draft ↓ | cold p99 ms ↓ "
          "| warm ms/draft ↓ | nodes drafted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in ("random", "source", "loop"):
        for size in map(int, args.sizes.split(",")):
            print(bench(kind, size, args.drafts), flush=True)


if __name__ == "__main__":
    main()
