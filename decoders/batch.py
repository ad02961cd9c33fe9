"""Many prompts at once: continuous batching of any strategy whose steps yield their model calls.

Each row is an ordinary run (a `Decoding`); the rows share each model's forward (docs/design/batching.md).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from decoders.base import ALONE, Budget, Chunk, Result, Steps, Verified
from decoders.decoding import Decoding
from decoders.models.call import Call
from decoders.models.lm import LM
from decoders.models.rows import BatchCache
from decoders.width import Width

Event = tuple[int, Chunk, Result | None]  # (the run's index, what its step added, its `Result` once it ended)


@dataclass
class Row:
    """A run in the batch and the step it is in."""

    run: Decoding
    steps: Steps | None = None
    pending: Call | None = None  # the call its step waits on
    record: Verified | None = None  # what its last step returned, for the width


class Lap:
    """The batch's clock for `Width.took`: seconds since the last target call ended, less those spent `aside`."""

    def __init__(self) -> None:
        self.since = time.perf_counter()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Time that is not the batch's own step: prompts admitted, draft models' calls, the caller's with a chunk."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.since += time.perf_counter() - began

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.since = now - self.since, now
        return seconds


def run(lm: LM, runs: list[Decoding], batch_size: int, with_text: bool = True) -> Iterator[Event]:
    """Decode `runs` (checked, ready) with at most `batch_size` in flight; yields each step's chunk (its text only
    `with_text`) with the run's index in `runs`, and its `Result` once the run ended."""
    for index, decoding in enumerate(runs):
        decoding.index = index
    if min(batch_size, len(runs)) == 1:
        yield from one_at_a_time(runs, with_text)
        return
    for decoding in runs:
        if not decoding.decoder.batchable():
            raise TypeError(
                f"strategy {decoding.decoder.name!r} implements `step` only and cannot run batched; implement "
                "`steps` (see decoders.base.Decoder) or decode its prompts one at a time"
            )
    try:  # rows of several lengths in one call need masks of their own
        lm.check_tree_mask()
    except TypeError as error:
        raise TypeError(f"cannot decode a batch with this model: {error}; pass batch_size=1") from None
    queue = deque(runs)
    batch = BatchCache(lm, min(batch_size, len(runs)))
    rows: list[Row | None] = [None] * batch.rows
    width = Width(lm, batch.rows)
    timed = not any(decoding.state.seeded for decoding in runs)  # seeded runs read no clock, so they repeat
    lap = Lap()
    drafters, drafted = set(), set()  # the rows that called a draft model before the last target call, and since
    while queue or any(rows):
        done: list[Event] = []  # yielded outside inference mode: the caller's code between chunks runs as it would
        with torch.inference_mode():
            with lap.aside():
                for b in range(batch.rows):
                    if rows[b] is None and queue:
                        rows[b] = admit(batch, b, queue.popleft())
            limit = width.next(batch.slots, () if queue else [b for b, row in enumerate(rows) if row is not None])
            trying = limit != width.best or not width.verified
            for b, row in enumerate(rows):
                if row is not None and row.run.error is None:  # a row whose `start` raised ends this round
                    # a second of drafting holds up every row, shared with the rows drafting beside it
                    _advance(row, None, Budget(limit, limit * batch.rows, batch.rows / len(drafters | {b}), trying))
            pending = {b: row.pending for b, row in enumerate(rows) if row is not None and row.pending is not None}
            drafting = {b: call for b, call in pending.items() if call.lm is not None}
            drafted |= drafting.keys()
            answers: dict[int, torch.Tensor] = {}
            if drafting:  # the rows waiting on the target wait for these, to verify every row's draft in one call
                with lap.aside():  # draft calls are priced in their rows' plans, not the width's
                    for cache in batch.drafts:
                        calls = {b: call for b, call in drafting.items() if call.cache.batch is cache}
                        if calls:
                            answers.update(cache.forward(calls))
                            cache.lm.synchronize()
            elif pending:
                drafters, drafted = drafted, set()
                answers = batch.forward(pending)
                for b in answers:
                    rows[b].run.state.stats.target_calls += 1
            for b, logits in answers.items():
                _advance(rows[b], logits)
            lm.synchronize()
            if pending and not drafting and timed:
                width.took(max(len(call.tokens) for call in pending.values()), lap.lap(), batch.slots)
            for b, row in enumerate(rows):
                if row is None or row.steps is not None:
                    continue
                if row.record is not None:
                    width.observe(row.record.width, row.record.fed, row.record.path, row=b)
                    row.record = None
                chunk = row.run.chunk(with_text)
                if row.run.state.finished:
                    batch.clear(b)
                    width.forget(b)
                    rows[b] = None
                done.append((row.run.index, chunk, row.run.result() if row.run.state.finished else None))
        for event in done:
            with lap.aside():
                yield event


def one_at_a_time(runs: list[Decoding], with_text: bool = True) -> Iterator[Event]:
    """`run` with one row in flight: each run alone on its own cache (a batch of one shares no call, only its costs)."""
    for decoding in runs:
        for chunk in decoding.chunks(with_text, raising=False):  # a raise ends that run; the later ones go on
            yield decoding.index, chunk, decoding.result() if decoding.state.finished else None


def admit(batch: BatchCache, b: int, decoding: Decoding) -> Row:
    """Start `decoding` in row `b`: its clock, its prompt but the last token prefilled alone, its strategy's `start`."""
    decoding.begin()
    batch.prefill(b, decoding.state.tokens[:-1])
    decoding.state.cache = batch.row(b)
    decoding.start(Budget(tokens=batch.rows))
    return Row(decoding)


def _advance(row: Row, logits: torch.Tensor | None, budget: Budget = ALONE) -> None:
    """Step `row` on until its strategy asks for a call (`row.pending`) or its step ends (`row.steps` None, what it
    returned in `row.record`). `logits`: the answer to its pending call; None to start a step under `budget`."""
    try:
        if row.steps is None:
            if logits is not None:
                raise RuntimeError("logits for a row with no step in progress")
            row.steps = row.run.steps(budget)
            row.pending = next(row.steps)
        elif logits is not None:
            row.pending = row.steps.send(logits)
    except StopIteration as done:
        row.steps = row.pending = None
        row.record = done.value
    except Exception as error:  # noqa: BLE001 - its strategy's, grammar's or drafter's: the other rows go on
        row.steps = row.pending = None
        row.run.error = error
