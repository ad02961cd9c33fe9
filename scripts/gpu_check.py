"""The one-command device check of issue 48, one part per call; scripts/gpu_check.sh runs them all in turn.

    python scripts/gpu_check.py PART OUTDIR [--device cuda] [--quick] [--budget SECONDS] [--tests all|quick|none]

Parts: env (versions, the GPU), curves (seconds of target and draft calls scoring 1-64 tokens, chains and trees, at
several context lengths), greedy (decodekit's and transformers' greedy tokens/s against the bandwidth limit), compiled
(transformers with a static cache + torch.compile, which captures CUDA graphs), tests (the tiny-model test suite on the
device), summary (gathers the parts' OUTDIR/PART.json into OUTDIR/summary.json). The models are the zoo's target and
draft (Qwen2.5-Coder 1.5B and 0.5B, configs in scripts/configs/) with random weights: a call's cost depends on shapes,
not weights. Every part writes its result or its error; one failing measurement never stops the others.

`to_calibration` / `save_calibration` turn a measured curve into the calibration `decoders.drafting.cost` caches, which
`auto` and the replay tools read: `python scripts/gpu_check.py calibrate OUTDIR [--role draft]`.
"""

from __future__ import annotations

import time

START = time.monotonic()  # a part's --budget counts from here, its imports and model builds included

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tokenizer_decoders

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # decodekit's packages are top-level folders of the repository

try:
    import decoders
    from decoders.drafting import cost
    DECODEKIT_ERROR = None
except Exception as error:  # noqa: BLE001 - the parts that need decodekit report it, the others run
    DECODEKIT_ERROR = f"decodekit does not import: {type(error).__name__}: {error}"

CONFIGS = Path(__file__).resolve().parent / "configs"
MODELS = {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b"}  # role -> config, as the zoo pairs them
PARTS = ("env", "curves", "greedy", "batch", "profile", "compiled", "tests")
QUICK_TESTS = ("tests/test_cache.py", "tests/test_greedy.py", "tests/test_graphs.py")
PACKAGES = ("torch", "transformers", "accelerate", "tokenizers", "numpy", "outlines", "outlines-core", "llguidance",
            "jsonschema", "pydantic", "gguf", "pytest", "pytest-xdist")  # versions env reports
# (full, quick) settings: quick is for a CPU, where a real-width call of 64 tokens takes seconds
SIZES = ((1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64), (1, 2, 4, 8))  # tokens scored in one call
CONTEXTS = ((128, 512, 2048), (16, 64))  # cached positions before the call
REPEATS = (5, 2)  # timed calls per point after an untimed one, keeping the fastest and the median
PROMPT, NEW_TOKENS = (128, 32), (128, 8)  # greedy runs: prompt length, tokens generated
BATCHES = ((4, 16), (2,))  # rows of the batch part's runs (prompts of 64 to 127 tokens, NEW_TOKENS each)
BATCH_WIDTHS = ((1, 2, 4, 8, 16), (1, 2))  # tokens per row of the batch part's timed calls
QUICK_LAYERS, QUICK_VOCAB = 2, 16384  # --quick keeps the hidden widths and cuts the depth and the vocabulary (whose
# random init takes a CPU seconds): it checks that every part runs, its timings tell nothing


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in memory (tests/conftest.py's, smaller): `wrap` needs one, the timing only
    token ids; ids past its vocabulary decode to nothing."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizer_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def fibonacci(n):\n    return n", "The quick brown fox jumps over a lazy dog."], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def build(role: str, device: str, quick: bool) -> decoders.LM:
    """The zoo model of `role` with random bfloat16 weights, made on `device` directly."""
    config = json.loads((CONFIGS / f"{MODELS[role]}.json").read_text())
    if quick:
        config.update(num_hidden_layers=QUICK_LAYERS, max_window_layers=QUICK_LAYERS, vocab_size=QUICK_VOCAB,
                      bos_token_id=QUICK_VOCAB - 1, eos_token_id=QUICK_VOCAB - 1)  # (ids inside the vocabulary)
    config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return decoders.wrap(model, tiny_tokenizer(), name=f"random:{MODELS[role]}")


def weight_bytes(model) -> int:
    """Bytes of weights one decoding step reads: every parameter once (tied ones once), but an input embedding that is
    not also the output head, of which a step reads one row."""
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(unique.values()) - (0 if tied else embedding.numel() * embedding.element_size())


def attempt(function, *args) -> dict:
    """`function(*args)`, or its error and traceback's end, so one failure leaves the other measurements standing."""
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - any failure is a result to report
        return {"error": f"{type(error).__name__}: {error}"[:2000], "traceback": traceback.format_exc()[-3000:]}


def timed(lm: decoders.LM, function) -> float:
    """Seconds `function()` takes on the device: synchronized before both clock reads (CUDA runs asynchronously)."""
    lm.synchronize()
    start = time.perf_counter()
    function()
    lm.synchronize()
    return time.perf_counter() - start


def tree(n: int, context: int) -> tuple[torch.Tensor, list[int]]:
    """A binary tree of n nodes (node i's parent (i - 1) // 2) as `LM.forward` takes it: [n, n] ancestor-or-self mask,
    positions after `context`."""
    parents = [(i - 1) // 2 for i in range(n)]
    mask, depth = torch.eye(n, dtype=torch.bool), [0] * n
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
        depth[i] = depth[parents[i]] + 1
    return mask, [context + d for d in depth]


def curve(lm: decoders.LM, quick: bool, deadline: float) -> dict:
    """Seconds of calls scoring n tokens (logits of every one: a target checking a draft) after L cached positions,
    causal chains and trees, each the fastest and the median of REPEATS timed calls; stops at `deadline`."""
    sizes, contexts, repeats = SIZES[quick], CONTEXTS[quick], REPEATS[quick]
    ids = [(7 * i + 3) % lm.vocab_size for i in range(max(16, *sizes))]
    points, stopped = [], None
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(ids[:16], cache, keep=1)  # a cache whose keys `resize` tiles to each context length
        for context in contexts:
            for n in sizes:
                for shape in ("chain", "tree") if n > 1 else ("chain",):
                    if time.monotonic() > deadline:
                        stopped = stopped or f"time budget spent before n={n}, context={context}, {shape}"
                        continue
                    mask, positions = tree(n, context) if shape == "tree" else (None, None)

                    def call():
                        cache.resize(context)  # (the cache grew by the last call's n)
                        lm.forward(ids[:n], cache, positions=positions, tree_mask=mask, keep=n)

                    call()  # untimed: a new shape's first call picks its kernels
                    times = sorted(timed(lm, call) for _ in range(repeats))
                    points.append({"n": n, "context": context, "shape": shape, "seconds": times[0],
                                   "median": times[len(times) // 2]})
    return {"model": lm.name, "layers": lm.config.num_hidden_layers, "weight_bytes": weight_bytes(lm.model),
            "cuda_graphs": lm.cuda_graphs and lm.device.type == "cuda",
            "measured": time.time(), "points": points, "stopped": stopped}


def to_calibration(curve: dict, role: str = "target") -> dict:
    """A measured curve as decodekit's calibration of that model (`CallCost.to_dict`): `cost.fit` over its chain calls
    at the sizes calibration measures in `role`, every context length measured."""
    sizes = cost.TARGET_SIZES if role == "target" else cost.DRAFT_SIZES
    points = [p for p in curve["points"] if p["shape"] == "chain" and p["n"] in sizes]
    samples = [(p["n"], p["context"], p["seconds"]) for p in points]
    fitted = cost.fit(samples, tuple(sorted({n for n, _, _ in samples})))
    # when and how noisily measured, as `cost.call_cost` records it: the median point's median over its fastest
    fitted.measured = curve.get("measured")
    fitted.noise = statistics.median(p["median"] / p["seconds"] - 1 for p in points)
    return fitted.to_dict()


def save_calibration(curve: dict, lm: decoders.LM, role: str = "target", folder: Path | None = None) -> Path:
    """Write `curve` as `lm`'s cached calibration in `role`, the file `cost.call_cost` reads (and so `auto` and the
    replay tools): keyed by `lm` as loaded here (its dtype, device, thread count), costed as the curve measured."""
    sizes = cost.planned_sizes(lm, role)  # the sizes `cost.call_cost` keys by
    key = cost.calibration_key(lm, role, sizes)
    path = cost.cache_file(key, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": cost.VERSION, "key": key, "cost": to_calibration(curve, role)}, indent=1))
    return path


def read_bandwidth(device: str, quick: bool) -> dict:
    """Bytes per second the device reads: the best of several read-only passes over a buffer far larger than any cache,
    a sum (float32) and a bfloat16 matrix-vector product, as a decoding step reads its weights."""
    elements = (1 << 30) if torch.device(device).type == "cuda" else (1 << 24)  # of float32: 4 GiB on a GPU (its
    # L2 holds 50 MB), 64 MiB on a CPU; the matrix half that, in bfloat16
    side = int(math.isqrt(elements))
    result = {}
    for name, buffer, pass_ in (
        ("sum_float32", torch.rand(elements, device=device), lambda b: b.sum()),
        ("matvec_bfloat16", torch.rand(side, side, device=device, dtype=torch.bfloat16),
         lambda b: b @ torch.ones(side, device=device, dtype=torch.bfloat16)),
    ):
        seconds = []
        for _ in range(3 if quick else 10):
            decoders.models.lm.synchronize(torch.device(device))
            start = time.perf_counter()
            pass_(buffer)
            decoders.models.lm.synchronize(torch.device(device))
            seconds.append(time.perf_counter() - start)
        result[name] = buffer.numel() * buffer.element_size() / min(seconds)
        del buffer
    result["bytes_per_second"] = max(result.values())
    return result


class StepClock:
    """A transformers streamer that reads the clock at each token `generate` emits (synchronizing first, as decodekit
    does after each step): times[0] at the prompt, times[1] at the first new token."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def put(self, value) -> None:
        decoders.models.lm.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_greedy(lm: decoders.LM, prompt: list[int], new: int, **options) -> dict:
    """transformers' greedy `generate` of exactly `new` tokens: its seconds, first-token latency, decoding tokens/s."""
    ids = torch.tensor([prompt], device=lm.device)
    clock = StepClock(lm.device)
    with torch.inference_mode():
        lm.synchronize()
        start = time.perf_counter()
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                min_new_tokens=new, pad_token_id=0, streamer=clock, **options)
        lm.synchronize()
        seconds = time.perf_counter() - start
    tokens = out[0, len(prompt):].tolist()
    return {"tokens": len(tokens), "seconds": seconds, "ttft_seconds": clock.times[1] - start,
            "decode_tokens_per_second": (len(tokens) - 1) / (clock.times[-1] - clock.times[1]), "ids": tokens}


@contextlib.contextmanager
def graphs_set(lm: decoders.LM, graphs: bool | None):
    """`LM.cuda_graphs` set to `graphs` (None: as it is) inside the block, as it was after it."""
    before = lm.cuda_graphs
    lm.cuda_graphs = before if graphs is None else graphs
    try:
        yield
    finally:
        lm.cuda_graphs = before


def decodekit_greedy(lm: decoders.LM, prompt: list[int], new: int, graphs: bool | None = None) -> dict:
    """decodekit's `greedy` strategy on the same prompt, as `hf_greedy` reports it; `graphs` sets `LM.cuda_graphs`
    for the run (None: as it is)."""
    with graphs_set(lm, graphs):
        result = decoders.generate(lm, prompt, strategy="greedy", max_new_tokens=new)
    stats = result.stats
    return {"tokens": stats.new_tokens, "seconds": stats.seconds, "ttft_seconds": stats.ttft_seconds,
            "decode_tokens_per_second": (stats.new_tokens - 1) / (stats.seconds - stats.ttft_seconds),
            "finish_reason": result.finish_reason, "ids": result.tokens}


def decodekit_graphs(lm: decoders.LM, prompt: list[int], new: int) -> dict:
    """`decodekit_greedy` with its calls replayed as CUDA graphs (a static cache eagerly off CUDA)."""
    return decodekit_greedy(lm, prompt, new, graphs=True)


def decodekit_compiled(lm: decoders.LM, prompt: list[int], new: int, mode: bool | str = True) -> dict:
    """`decodekit_graphs` with each captured call compiled first (`LM.compile_calls`: True, or torch.compile's
    `mode`)."""
    lm.compile_calls = mode
    try:
        return decodekit_greedy(lm, prompt, new, graphs=True)
    finally:
        lm.compile_calls = False


def decodekit_eager(lm: decoders.LM, prompt: list[int], new: int) -> dict:
    """`decodekit_greedy` with transformers' cache and eager calls."""
    return decodekit_greedy(lm, prompt, new, graphs=False)


def compare(lm: decoders.LM, quick: bool, runs: dict) -> dict:
    """Run each of `runs` (name -> function(lm, prompt, new)) once to warm up and once timed; their tokens/s against the
    bandwidth limit, and how many leading tokens each shares with the first run's (greedy is greedy)."""
    prompt = [(5 * i + 11) % lm.vocab_size for i in range(PROMPT[quick])]
    results = {}
    for name, run in runs.items():
        start = time.perf_counter()
        # warm-up: kernels chosen, memory pooled; graphs captured for the timed run's cache, as long
        attempt(run, lm, prompt, NEW_TOKENS[quick] if run is decodekit_graphs else 8)
        warm_up = time.perf_counter() - start
        results[name] = attempt(run, lm, prompt, NEW_TOKENS[quick])
        results[name]["warm_up_seconds"] = warm_up
    first = next((r["ids"] for r in results.values() if "ids" in r), [])
    for r in results.values():
        if "ids" in r:
            ids = r.pop("ids")
            r["same_leading_tokens"] = next((i for i, (a, b) in enumerate(zip(ids, first)) if a != b), len(ids))
    return results


def part_env(args) -> dict:
    device = torch.device(args.device)
    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "device": args.device, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory,
                    multiprocessors=properties.multi_processor_count)
    info["packages"] = {name: _version(name) for name in PACKAGES}
    info["import_decoders"] = {"error": DECODEKIT_ERROR} if DECODEKIT_ERROR else {"ok": decoders.__file__}
    for module in ("grammars", "samplers", "evals"):  # decodekit's packages beside `decoders`, with their dependencies
        info[f"import_{module}"] = attempt(lambda m: {"ok": __import__(m).__file__}, module)
    return info


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def part_curves(args) -> dict:
    """Each role's curve as its calls run by default (graphs on CUDA), then each eagerly, the time left shared evenly
    among the curves still to measure."""
    lms, result = {}, {}
    plan = [(role, graphs) for graphs in (True, False) for role in MODELS]
    for i, (role, graphs) in enumerate(plan):
        def measure():
            lm = lms.setdefault(role, build(role, args.device, args.quick))
            lm.cuda_graphs = graphs
            share = (START + args.budget - time.monotonic()) / (len(plan) - i)
            return curve(lm, args.quick, time.monotonic() + share)

        if graphs:
            result[role] = attempt(measure)
            result[role]["calibration"] = attempt(to_calibration, result[role], role)  # for `auto`'s planning
        else:
            result[role]["eager"] = attempt(measure)
    return result


def part_greedy(args) -> dict:
    result = {"bandwidth": attempt(read_bandwidth, args.device, args.quick)}
    bandwidth = result["bandwidth"].get("bytes_per_second")
    for role in MODELS:
        def measure(role):
            lm = build(role, args.device, args.quick)
            runs = compare(lm, args.quick, {"decodekit_graphs": decodekit_graphs, "decodekit_eager": decodekit_eager,
                                            "transformers_eager": hf_greedy})
            limit = bandwidth / weight_bytes(lm.model) if bandwidth else None
            for r in runs.values():
                if limit and "decode_tokens_per_second" in r:
                    r["share_of_limit"] = r["decode_tokens_per_second"] / limit
            return {"model": lm.name, "weight_bytes": weight_bytes(lm.model), "limit_tokens_per_second": limit,
                    "runs": runs}
        result[role] = attempt(measure, role)
    return result


def batch_prompts(lm: decoders.LM, rows: int, quick: bool) -> list[list[int]]:
    """`rows` prompts of different lengths (64 to 127 tokens; a quarter of that quick)."""
    longest = PROMPT[quick]
    return [[(5 * i + 7 * r + 11) % lm.vocab_size for i in range(longest // 2 + (r * 37) % (longest // 2))]
            for r in range(rows)]


def decodekit_batch(lm: decoders.LM, prompts: list[list[int]], new: int, graphs: bool) -> dict:
    """decodekit's batched `greedy` of all `prompts` at once (`LM.cuda_graphs` set to `graphs` for the run): its
    seconds, prompts included, and new tokens per second over all rows."""
    with graphs_set(lm, graphs):
        lm.synchronize()
        start = time.perf_counter()
        results = decoders.generate(lm, prompts, strategy="greedy", batch_size=len(prompts), max_new_tokens=new)
        lm.synchronize()
        seconds = time.perf_counter() - start
    tokens = sum(r.stats.new_tokens for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "ids": [r.tokens for r in results]}


def hf_batch(lm: decoders.LM, prompts: list[list[int]], new: int) -> dict:
    """transformers' greedy `generate` of the `prompts` left-padded into one batch, `new` tokens each, as
    `decodekit_batch` reports it."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=lm.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=lm.device)
    with torch.inference_mode():
        lm.synchronize()
        start = time.perf_counter()
        out = lm.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                pad_token_id=0)
        lm.synchronize()
        seconds = time.perf_counter() - start
    rows = out[:, longest:].tolist()
    return {"tokens": sum(map(len, rows)), "seconds": seconds, "tokens_per_second": sum(map(len, rows)) / seconds,
            "ids": rows}


def batch_curve(lm: decoders.LM, rows: int, quick: bool, deadline: float) -> dict:
    """Seconds of one batch call (`BatchCache.forward`) of `rows` rows, each scoring n tokens (logits of every one)
    after L cached positions of its own, the fastest and the median of REPEATS timed calls; stops at `deadline`."""
    from decoders.base import Call
    from decoders.models.rows import BatchCache

    ids = [(7 * i + 3) % lm.vocab_size for i in range(max(CONTEXTS[quick]))]
    points, stopped = [], None
    with torch.inference_mode():
        for context in CONTEXTS[quick][:2]:
            cache = BatchCache(lm, rows)
            for b in range(rows):
                cache.prefill(b, ids[:context])  # (the rows after the first copy the first's keys)
            for n in BATCH_WIDTHS[quick]:
                if time.monotonic() > deadline:
                    stopped = stopped or f"time budget spent before n={n}, context={context}"
                    continue
                calls = {b: Call(tokens=ids[:n]) for b in range(rows)}
                times = []
                for _ in range(REPEATS[quick] + 1):  # the first untimed: a new shape's kernels, or its graph
                    times.append(timed(lm, lambda: cache.forward(calls)))
                    for b in range(rows):
                        cache.row(b).crop(context)
                    cache.compact()  # (back to `context` slots)
                times = sorted(times[1:])
                points.append({"n": n, "context": context, "seconds": times[0], "median": times[len(times) // 2]})
            del cache
    return {"points": points, "stopped": stopped}


def part_batch(args) -> dict:
    """Batched greedy of the target: decodekit with its batch calls as CUDA graphs (`BatchSlab`; eagerly on a static
    cache off CUDA) and eagerly on transformers' cache, and transformers' left-padded `generate`, at each of BATCHES'
    sizes, each run after an untimed one of the same prompts (graphs captured, kernels chosen); then the cost of one
    batch call by rows, tokens per row and cached positions, graphs and eager."""
    lm = build("target", args.device, args.quick)
    runs = {"decodekit_graphs": lambda *a: decodekit_batch(*a, graphs=True),
            "decodekit_eager": lambda *a: decodekit_batch(*a, graphs=False), "transformers_eager": hf_batch}
    result: dict = {"model": lm.name}
    for rows in BATCHES[args.quick]:
        prompts, new = batch_prompts(lm, rows, args.quick), NEW_TOKENS[args.quick]
        measured = {}
        for name, run in runs.items():
            attempt(run, lm, prompts, new)
            measured[name] = attempt(run, lm, prompts, new)
        first = measured["decodekit_graphs"].get("ids")
        for r in measured.values():  # leading tokens each row shares with the graphs' run (random weights: near-ties)
            ids = r.pop("ids", None)
            if ids is not None and first is not None:
                r["same_leading_tokens"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                                            for x, y in zip(ids, first)]
        result[f"rows_{rows}"] = measured
        (args.outdir / "batch.json").write_text(json.dumps({"part": "batch", "partial": True, "result": result}))
    for graphs in (True, False):
        for i, rows in enumerate(BATCHES[args.quick]):
            left = len(BATCHES[args.quick]) * (1 + graphs) - i  # curves still to measure, this one included
            share = (START + args.budget - time.monotonic()) / left
            curves = result.setdefault("curves_" + ("graphs" if graphs else "eager"), {})
            with graphs_set(lm, graphs):
                curves[f"rows_{rows}"] = attempt(batch_curve, lm, rows, args.quick, time.monotonic() + share)
    return result


def median_seconds(lm: decoders.LM, function, repeats: int = 30) -> float:
    function()
    return statistics.median(timed(lm, function) for _ in range(repeats))


def one_token_call(lm: decoders.LM, prompt: list[int]):
    """A cache of `lm` holding `prompt`, and a function making one more one-token call on it (cropped back first)."""
    cache = lm.new_cache(2 * len(prompt))
    lm.forward(prompt, cache, keep=1)

    def call():
        cache.crop(len(prompt))
        lm.forward(prompt[:1], cache, keep=1)

    return cache, call


def replay_costs(lm: decoders.LM, prompt: list[int], new: int) -> dict:
    """With `lm`'s graphs as they are set (plain or compiled): the median seconds of a one-token call after the prompt
    (decodekit's, and its graph's replay alone), a greedy run's decoding seconds per token, and the profiler's busiest
    device kernels over a run of `new` tokens with how many kernels a token launches."""
    result: dict = {}
    with torch.inference_mode():
        cache, call = one_token_call(lm, prompt)
        result["call_seconds"] = median_seconds(lm, call)
        graphs = getattr(getattr(cache, "slab", None), "graphs", {})
        key = next((k for k in graphs if k[0] == 1 and k[1] == lm.compile_calls and graphs[k][0] is not None), None)
        if key is not None:
            result["replay_alone_seconds"] = median_seconds(lm, graphs[key][0].replay)
        del cache, call, graphs  # (a live cache keeps its slab: the runs below would get an eager one of their own)
    run = attempt(decodekit_greedy, lm, prompt, new, True)
    result["step_seconds"] = 1 / run["decode_tokens_per_second"] if "decode_tokens_per_second" in run else run
    if lm.device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            decodekit_greedy(lm, prompt, new, True)
        events = profile.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        result["kernels_per_token"] = sum(e.count for e in kernels) / new
        result["kernel_seconds_per_token"] = sum(e.self_device_time_total for e in kernels) / 1e6 / new
        table = events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
        result["kernels"] = table[:7000]
    return result


def part_profile(args) -> dict:
    """Where a greedy step of the target goes: the median seconds of one-token calls after PROMPT cached positions
    (decodekit on its static cache, as a bare graph replay, on transformers' cache; transformers' model call on its own
    cache, as `generate` makes it), of a whole step (a greedy run's decoding seconds per token), and the profiler's
    busiest operations over a few steps, eager and graph-captured."""
    lm = build("target", args.device, args.quick)
    prompt = [(5 * i + 11) % lm.vocab_size for i in range(PROMPT[args.quick])]
    result: dict = {"calls": {}, "steps": {}, "profiles": {}}
    result["graphs"] = attempt(replay_costs, lm, prompt, 16)
    with torch.inference_mode():
        lm.cuda_graphs = False
        result["calls"]["decodekit_eager"] = median_seconds(lm, one_token_call(lm, prompt)[1])
        lm.cuda_graphs = True
        hf_cache = decoders.KVCache()  # (transformers' DynamicCache, with a crop across its versions)
        lm.model(input_ids=torch.tensor([prompt], device=lm.device), **{lm.cache_keyword: hf_cache.hf})

        def hf_call():
            hf_cache.crop(len(prompt))
            lm.model(input_ids=torch.tensor([prompt[:1]], device=lm.device),
                     attention_mask=torch.ones(1, len(prompt) + 1, dtype=torch.long, device=lm.device),
                     **{lm.cache_keyword: hf_cache.hf}, logits_to_keep=1)

        result["calls"]["transformers_model"] = median_seconds(lm, hf_call)
    result["steps"]["eager"] = attempt(decodekit_greedy, lm, prompt, NEW_TOKENS[args.quick] // 2, False)
    result["steps"]["eager"].pop("ids", None)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if torch.device(args.device).type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profile:
        decodekit_greedy(lm, prompt, 8, False)
    table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    result["profiles"]["eager"] = table[:6000]
    return result


def part_compiled(args) -> dict:
    """Greedy with compiled model calls: decodekit's graph-captured calls compiled first (`LM.compile_calls`), then
    transformers' static cache with its own `torch.compile`; each its first (compiling) run and a timed one, against
    decodekit's plain graphs. Written after each run: compiling may outlast the part's time."""
    if torch.device(args.device).type != "cuda":
        return {"skipped": "graph capture (static cache + torch.compile mode 'reduce-overhead', CUDA graphs) needs a "
                           f"CUDA device; skipped on {args.device}"}
    lm = build("target", args.device, args.quick)
    prompt = [(5 * i + 11) % lm.vocab_size for i in range(PROMPT[args.quick])]  # as `compare`'s, for its tokens
    new = NEW_TOKENS[args.quick]  # the first call compiles and captures for this static cache's length: the timed
    # call must keep it, or it compiles again
    result: dict = {"model": lm.name}
    reference = attempt(decodekit_graphs, lm, prompt, new).get("ids")
    mode = args.compile_mode or True
    result["compile_mode"] = args.compile_mode or "default"
    runs = {"decodekit": lambda *a: decodekit_compiled(*a, mode=mode),
            "transformers": lambda *a: hf_greedy(*a, cache_implementation="static")}
    for name, run in runs.items():
        start = time.perf_counter()
        first = attempt(run, lm, prompt, new)
        timed_run = attempt(run, lm, prompt, new)
        ids = timed_run.pop("ids", None)
        result[name] = {"first_call_seconds": time.perf_counter() - start - timed_run.get("seconds", 0.0),
                        "first_call_error": first.get("error"), "run": timed_run,
                        "same_leading_tokens_as_graphs": None if ids is None or reference is None else
                        next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), len(ids))}
        result["dynamo_stats"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("stats",)}
        (args.outdir / "compiled.json").write_text(json.dumps({"part": "compiled", "partial": True, "result": result}))
    # where a step goes, compiled against plain graphs (the compiled graphs are captured above)
    for compiled in (mode, False):
        lm.compile_calls = compiled
        result["replays_" + ("compiled" if compiled else "graphs")] = attempt(replay_costs, lm, prompt, 16)
    lm.compile_calls = False
    return result


def part_tests(args) -> dict:
    if args.tests == "none":
        return {"skipped": "--tests none"}
    record = Path(tempfile.mkdtemp()) / "tests.jsonl"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not real_model", "-p", "no:cacheprovider",
               "-p", "pytest_record", *(QUICK_TESTS if args.tests == "quick" else ())]
    # tiny models leave a GPU mostly idle: a test process per two cores shares it where pytest-xdist is installed
    workers = min(8, (os.cpu_count() or 2) // 2) if torch.device(args.device).type == "cuda" and \
        importlib.util.find_spec("xdist") else 0
    command += ["-n", str(workers)] if workers else []
    env = dict(os.environ, DECODEKIT_TEST_DEVICE=args.device, GPU_CHECK_RECORD=str(record),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, timed_out = process.communicate(timeout=max(1.0, START + args.budget - time.monotonic()))[0], False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session: xdist's workers too
        output, timed_out = process.communicate()[0], True
    rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    collected = next((row["collected"] for row in rows if "collected" in row), None)
    rows = [row for row in rows if "outcome" in row]
    counts = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    return {"command": " ".join(command[1:]), "returncode": process.returncode, "timed_out": timed_out,
            "workers": workers, "collected": collected, "counts": counts,
            "failures": [row for row in rows if row["outcome"] in ("failed", "error")], "output_tail": output[-3000:]}


def part_summary(args) -> dict:
    """Every part's file, with the exit status the shell script saw (`--rc part=status`)."""
    statuses = {part: int(status) for part, status in (item.split("=", 1) for item in args.rc)}
    why = {-1: "not run: the check's total time was spent", 124: "killed at its time limit", 137: "killed"}
    summary = {}
    for part in PARTS:
        path, status = args.outdir / f"{part}.json", statuses.get(part)
        entry = json.loads(path.read_text()) if path.exists() else {
            "error": f"no output: {why.get(status, f'exit status {status}')} (see gpu_check.log)"}
        if status is not None:
            entry["exit_status"] = status
        summary[part] = entry
    return {"parts": summary, "headline": headline(summary)}


def headline(parts: dict) -> dict:
    """The few numbers to read first."""
    tests = parts["tests"].get("result", {})
    line = {"tests": tests.get("counts") or tests.get("skipped") or parts["tests"].get("error")}
    greedy = parts["greedy"].get("result", {})
    line["read_bytes_per_second"] = greedy.get("bandwidth", {}).get("bytes_per_second")
    for role in MODELS:
        runs = greedy.get(role, {}).get("runs", {})
        line[f"{role}_tokens_per_second"] = {n: r.get("decode_tokens_per_second") for n, r in runs.items()}
        line[f"{role}_limit_tokens_per_second"] = greedy.get(role, {}).get("limit_tokens_per_second")
    batch = parts["batch"].get("result", {})
    line["batch_tokens_per_second"] = parts["batch"].get("error") or {
        size: {name: run.get("tokens_per_second") for name, run in runs.items()}
        for size, runs in batch.items() if size.startswith("rows_")}
    compiled = parts["compiled"].get("result", {})
    limit = line["target_limit_tokens_per_second"]
    line["compiled"] = compiled.get("skipped") or parts["compiled"].get("error") or {
        name: {"decode_tokens_per_second": (tps := run.get("run", {}).get("decode_tokens_per_second")),
               "share_of_limit": tps / limit if tps and limit else None,
               "first_call_seconds": run.get("first_call_seconds"),
               "error": run.get("first_call_error") or run.get("run", {}).get("error")}
        for name, run in compiled.items() if name in ("decodekit", "transformers")}
    return line


def part_calibrate(args) -> dict:
    """Write the `--role` curve of OUTDIR/curves.json (`--eager`: its eager calls') as the calibration of the zoo
    model it stands for (or `--model`), loaded here as the replay tools load it (bfloat16, this machine's device and
    threads). Set DECODEKIT_CALIBRATION to a folder of its own: it replaces this machine's calibration there."""
    curve = json.loads((args.outdir / "curves.json").read_text())["result"][args.role]
    lm = decoders.load(args.model or f"zoo:{MODELS[args.role]}", dtype="bfloat16")
    return {"written": str(save_calibration(curve["eager"] if args.eager else curve, lm, args.role))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=(*PARTS, "summary", "calibrate"))
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer layers, tokens, sizes: a smoke run on a CPU")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds this part may measure for")
    parser.add_argument("--tests", choices=("all", "quick", "none"), default="all")
    parser.add_argument("--compile-mode", help="compiled: torch.compile's mode for decodekit's calls (default: its "
                        "default), e.g. max-autotune-no-cudagraphs")
    parser.add_argument("--rc", action="append", default=[], help="summary: PART=EXIT_STATUS")
    parser.add_argument("--role", choices=tuple(MODELS), default="target", help="calibrate: which curve")
    parser.add_argument("--model", help="calibrate: the model it stands for (default: the zoo's of that role)")
    parser.add_argument("--eager", action="store_true", help="calibrate: the curve of eager calls, not graphs'")
    args = parser.parse_args()
    args.outdir.mkdir(parents=True, exist_ok=True)
    if args.part in ("summary", "calibrate"):
        result = globals()[f"part_{args.part}"](args)
        if args.part == "summary":
            (args.outdir / "summary.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result.get("headline", result), indent=1))
        return
    start = time.perf_counter()
    entry = {"part": args.part, "device": args.device, "quick": args.quick, "budget": args.budget}
    if DECODEKIT_ERROR and args.part in ("curves", "greedy", "batch", "compiled"):
        entry["error"] = DECODEKIT_ERROR
    else:
        entry.update(attempt(lambda: {"result": globals()[f"part_{args.part}"](args)}))
    entry["seconds"] = time.perf_counter() - start
    (args.outdir / f"{args.part}.json").write_text(json.dumps(entry, indent=1))
    print(f"{args.part}: {'error: ' + entry['error'] if 'error' in entry else 'done'} in {entry['seconds']:.1f} s")


if __name__ == "__main__":
    main()
