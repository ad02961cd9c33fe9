"""`compare --batch-size N`: every method decodes the whole suite as one queue, with N requests in flight.

- decodekit strategies: continuous batching (`decoders.batch`, what `decoders.generate` runs on a list of prompts): a
  row that ends is refilled with the next prompt at once; each prompt keeps its own max_new_tokens.
- `hf:batch`: transformers `generate(do_sample=False)` on left-padded batches of N prompts, in suite order (static
  batching: a batch ends when its longest row does, and only then does the next one start).
- `hf:continuous`: transformers' continuous batching, `generate_batch` over its paged cache with N requests per
  batch, where it runs on the device (`continuous_problem` probes it once, before any run).

One queue gives a `Queue` record (its wall time and new tokens: the throughput) and one `Run` per prompt, whose
`seconds` and `ttft_seconds` are that request's latency and time to first token from its admission (decodekit: the
driver's `Stats.seconds` / `ttft_seconds` of its row; hf:batch: from the start of its batch's `generate` call;
hf:continuous: from when transformers scheduled it), and whose tokens go to the losslessness check. The transformers
peers generate up to the longest max_new_tokens of a batch (queue); each row's tokens are cut at its own limit.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import transformers
from transformers.generation.streamers import BaseStreamer

import decoders
from decoders import batch, driver
from decoders.models.attention import stock
from evals import peers, suites
from evals.timing import Run, Stopwatch, pieces

PAGE_SIZE = 256  # tokens per page of hf:continuous's paged cache (transformers' default)


@dataclass(frozen=True)
class Request:
    """One prompt of the queue: its suite line, its tokens (chat template applied) and its max_new_tokens."""

    prompt: suites.Prompt
    tokens: list[int]
    limit: int


@dataclass
class Queue:
    """The record of one queue: a method over every prompt of the suite at one batch size, in one repeat."""

    strategy: str
    kind: str  # "decodekit" or "peer"
    batch_size: int
    repeat: int
    requests: int  # prompts in the queue (those whose row raised included)
    new_tokens: int  # over the requests that finished
    seconds: float  # wall time of the queue, device synchronized (hf:continuous: see `continuous_queue`)
    forward_calls: int | None  # target model forward calls (prefills included); None: not metered
    draft_seconds: float | None  # time inside draft models' forward calls
    peak_memory_bytes: int | None
    call_seconds: float | None = None  # hf:continuous: the whole generate_batch call, manager setup included
    rank: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


@dataclass
class Done:
    """What one queue produced: its record, a `Run` per finished request, and an error record per request whose
    row raised (the other rows went on)."""

    queue: Queue
    runs: list[Run]
    errors: list[dict]


def row_tokens(generated: list[int], eos: frozenset[int], limit: int) -> list[int]:
    """A row's new tokens as every method counts them: up to and including its first EOS, at most `limit` (what
    transformers appends after a finished row - padding - and past the row's own limit is dropped)."""
    tokens = generated[:limit]
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if end is None else tokens[: end + 1]


def _run(
    lm: decoders.LM,
    request: Request,
    strategy: str,
    kind: str,
    repeat: int,
    batch_size: int,
    tokens: list[int],
    seconds: float,
    ttft: float,
    timeline: list[tuple[float, int]],
    peak: int | None,
    **counters: Any,
) -> Run:
    """The `Run` of one request of a queue (counters a method cannot report default to None)."""
    finish = "eos" if tokens and tokens[-1] in lm.eos_token_ids else "length"
    fields = dict(
        target_calls=None,
        draft_calls=None,
        drafted=None,
        accepted=None,
        accepted_by_position=[],
        drafted_by_position=[],
        draft_seconds=None,
        sources=["target"] * len(tokens),
        finish_reason=finish,
    )
    return Run(
        strategy=strategy,
        kind=kind,
        prompt_id=request.prompt.id,
        category=request.prompt.category,
        repeat=repeat,
        prompt_tokens=len(request.tokens),
        max_new_tokens=request.limit,
        new_tokens=len(tokens),
        seconds=seconds,
        ttft_seconds=ttft,
        peak_memory_bytes=peak,
        tokens=list(tokens),
        pieces=pieces(lm, tokens),
        timeline=timeline,
        batch_size=batch_size,
        **{**fields, **counters},
    )


def _error(request: Request, strategy: str, kind: str, repeat: int, batch_size: int, error: str) -> dict:
    return {
        "strategy": strategy,
        "kind": kind,
        "prompt_id": request.prompt.id,
        "category": request.prompt.category,
        "repeat": repeat,
        "batch_size": batch_size,
        "error": error,
    }


# ------------------------------------------------------------------------------------------------------- decodekit
def decodekit_queue(
    lm: decoders.LM,
    requests: list[Request],
    decoder: decoders.Decoder,
    *,
    batch_size: int,
    name: str,
    repeat: int,
    draft: decoders.LM | None = None,
) -> Done:
    """Time `decoder` over the queue, continuously batched with at most `batch_size` rows in flight: what
    `decoders.generate(lm, prompts, batch_size=...)` runs (`driver.prepare` per prompt, then `decoders.batch.run`),
    all inside the clock, with each prompt's own max_new_tokens."""
    watch = Stopwatch(lm, draft, count_target=True)
    results: dict[int, decoders.Result] = {}
    arrivals: dict[int, list[tuple[float, int]]] = {}  # per request: (seconds since the queue began, tokens so far)
    with watch:
        prepared = [
            driver.prepare(lm, r.tokens, strategy=decoder, max_new_tokens=r.limit, draft=draft) for r in requests
        ]
        for index, _, result in batch.run(lm, prepared, batch_size):
            arrivals.setdefault(index, []).append(
                (time.perf_counter() - watch.start, len(prepared[index].state.new_tokens))
            )
            if result is not None:
                results[index] = result
    runs, errors = [], []
    for index, request in enumerate(requests):
        result = results[index]
        if result.error is not None:
            errors.append(_error(request, name, "decodekit", repeat, batch_size, result.error))
            continue
        stats = result.stats
        admitted = arrivals[index][-1][0] - stats.seconds  # the driver's clock of the row began at its admission
        lengths = list(stats.draft_lengths)
        runs.append(
            _run(
                lm,
                request,
                name,
                "decodekit",
                repeat,
                batch_size,
                result.tokens,
                stats.seconds,
                stats.ttft_seconds,
                [(t - admitted, n) for t, n in arrivals[index]],
                watch.peak_bytes,
                target_calls=stats.target_calls,
                draft_calls=stats.draft_calls,
                drafted=stats.drafted,
                accepted=stats.accepted,
                accepted_by_position=list(stats.accepted_by_position),
                drafted_by_position=[sum(n > depth for n in lengths) for depth in range(max(lengths, default=0))],
                sources=list(result.sources),
                finish_reason=result.finish_reason,
                argmax_gaps=list(stats.argmax_gaps),
                extra={"driver_seconds": stats.seconds, "driver_ttft_seconds": stats.ttft_seconds, **stats.details},
            )
        )
    queue = Queue(
        name,
        "decodekit",
        batch_size,
        repeat,
        len(requests),
        sum(r.new_tokens for r in runs),
        watch.seconds,
        watch.target.calls,
        watch.draft.seconds if watch.draft_metered else None,
        watch.peak_bytes,
    )
    return Done(queue, runs, errors)


# -------------------------------------------------------------------------------------------------------- hf:batch
class _Steps(BaseStreamer):
    """A transformers streamer noting when each decoding step's tokens (one per row) arrive; the prompt's put is
    skipped."""

    def __init__(self) -> None:
        self.prompt_seen, self.times = False, []

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())  # (the tokens are on the CPU already: the step is done)
        self.prompt_seen = True

    def end(self) -> None:
        pass


def hf_batch_queue(
    lm: decoders.LM, requests: list[Request], *, batch_size: int, repeat: int, name: str = "hf:batch"
) -> Done:
    """Time transformers `generate(do_sample=False)` over the queue in left-padded batches of `batch_size` prompts,
    one batch after another (each up to its longest max_new_tokens)."""
    pad, device = peers.pad_token_id(lm), lm.device
    watch = Stopwatch(lm, count_target=True)
    rows = []  # (request, generated tokens, its batch's start, its batch's step times)
    with watch:
        for start in range(0, len(requests), batch_size):
            share = requests[start : start + batch_size]
            width = max(len(r.tokens) for r in share)
            ids = torch.full((len(share), width), pad, dtype=torch.long)  # [B, T], left-padded
            mask = torch.zeros_like(ids)
            for i, request in enumerate(share):
                ids[i, width - len(request.tokens) :] = torch.tensor(request.tokens)
                mask[i, width - len(request.tokens) :] = 1
            steps = _Steps()
            began = time.perf_counter()
            output = peers.quiet_generate(
                lm.model,
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(r.limit for r in share),
                streamer=steps,
                **peers.greedy_arguments(lm),
            )
            rows += [(r, output[i, width:].tolist(), began, steps.times) for i, r in enumerate(share)]
    runs = []
    for request, generated, began, times in rows:
        tokens = row_tokens(generated, lm.eos_token_ids, request.limit)
        marks = [(t - began, n + 1) for n, t in enumerate(times[: len(tokens)])]
        runs.append(
            _run(
                lm,
                request,
                name,
                "peer",
                repeat,
                batch_size,
                tokens,
                marks[-1][0],
                marks[0][0],
                marks,
                watch.peak_bytes,
                target_calls=len(tokens),
            )
        )  # one batched call per step of the row
    queue = Queue(
        name,
        "peer",
        batch_size,
        repeat,
        len(requests),
        sum(r.new_tokens for r in runs),
        watch.seconds,
        watch.target.calls,
        None,
        watch.peak_bytes,
    )
    return Done(queue, runs, [])


# --------------------------------------------------------------------------------------------------- hf:continuous
def generate_batch(lm: decoders.LM, inputs: list[list[int]], batch_size: int, max_new_tokens: int) -> list:
    """transformers' `generate_batch` on `inputs`, greedy, with at most `batch_size` requests per batch and a paged
    cache sized for them; returns its `GenerationOutput`s in input order. Raises RuntimeError with transformers' own
    reasons when a request fails or goes missing (generate_batch logs those instead of raising)."""
    longest = max(len(tokens) for tokens in inputs) + max_new_tokens
    settings = peers.greedy_arguments(lm)
    config = transformers.GenerationConfig(max_new_tokens=max_new_tokens, **settings)
    page = (
        "page_size"
        if "page_size" in inspect.signature(transformers.ContinuousBatchingConfig).parameters
        else "block_size"
    )  # (its name in older transformers, e.g. 5.17)
    paged = transformers.ContinuousBatchingConfig(
        **{page: PAGE_SIZE},
        max_requests_per_batch=batch_size,
        num_blocks=2 * batch_size * math.ceil(longest / PAGE_SIZE),
    )  # (not 90% of free memory: room for N requests)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity(transformers.logging.CRITICAL)  # its failures come back as our error
    try:
        # (it prints when its thread dies: stdout carries the report; it runs transformers' own attention only)
        with contextlib.redirect_stdout(sys.stderr), stock(lm.model):
            outputs = lm.model.generate_batch(
                inputs,
                generation_config=config,
                continuous_batching_config=paged,
                record_timestamps=True,
                progress_bar=False,
            )
    finally:
        transformers.logging.set_verbosity(verbosity)
    found = list(outputs.values())
    failed = sorted({o.error for o in found if o.error is not None})
    if len(found) != len(inputs) or failed:
        why = "; ".join(failed) or "its generation thread ended early"
        raise RuntimeError(
            f"transformers generate_batch finished {len(found) - len(failed)} of {len(inputs)} requests: {why}"
        )
    return found


def continuous_problem(lm: decoders.LM, prompt: list[int]) -> str | None:
    """Why transformers' `generate_batch` cannot run here (on `prompt`, two tokens), or None when it can. It needs
    an attention implementation its paged cache supports on this device; where it fails, its reason."""
    try:
        generate_batch(lm, [prompt], 1, 2)
    except Exception as error:  # noqa: BLE001 - any failure means it does not run on this model and device
        text = f"{type(error).__name__}: {error}".splitlines()[0]
        return text if len(text) <= 200 else text[:197] + "..."
    return None


def continuous_queue(
    lm: decoders.LM, requests: list[Request], *, batch_size: int, repeat: int, name: str = "hf:continuous"
) -> Done:
    """Time transformers' `generate_batch` over the queue, `batch_size` requests per batch. The queue's `seconds`
    run from the requests' submission to the last one's end by transformers' own request timestamps: the manager
    that each call sets up (its paged cache, CUDA-graph warm-up) and tears down is left out, as a server keeps one;
    `call_seconds` has the whole call."""
    watch = Stopwatch(lm)
    with watch:
        outputs = generate_batch(lm, [r.tokens for r in requests], batch_size, max(r.limit for r in requests))
    runs, last = [], 0.0
    for request, output in zip(requests, outputs):
        tokens = row_tokens(list(output.generated_tokens), lm.eos_token_ids, request.limit)
        scheduled = output.lifespan[0]
        stamps = (output.timestamps or [])[: len(tokens)] or [output.lifespan[1]]
        marks = [(t - scheduled, n + 1) for n, t in enumerate(stamps)]
        last = max(last, stamps[-1])
        runs.append(
            _run(
                lm,
                request,
                name,
                "peer",
                repeat,
                batch_size,
                tokens,
                marks[-1][0],
                marks[0][0],
                marks,
                watch.peak_bytes,
            )
        )
    first = min(o.created_time for o in outputs)
    queue = Queue(
        name,
        "peer",
        batch_size,
        repeat,
        len(requests),
        sum(r.new_tokens for r in runs),
        last - first,
        None,
        None,
        watch.peak_bytes,
        call_seconds=watch.seconds,
    )
    return Done(queue, runs, [])


PEER_QUEUES = {"hf:batch": hf_batch_queue, "hf:continuous": continuous_queue}


def peer_queue(lm: decoders.LM, requests: list[Request], peer: peers.Peer, *, batch_size: int, repeat: int) -> Done:
    """Time batched peer `peer` (one of `peers.BATCH_PEERS`) over the queue."""
    return PEER_QUEUES[peer.name](lm, requests, batch_size=batch_size, repeat=repeat, name=peer.name)
