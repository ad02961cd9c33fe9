"""One run's lifecycle, written once for every caller (`driver`, `batch`, `hf`, the evaluator): `begin`, `start`,
steps (alone `advance`, batched `steps`), `chunk`, `result`. A strategy's raise ends its own run as "error"."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from decoders.base import ALONE, Budget, Chunk, Decoder, DecodeState, Result, Steps, takes_budget


class Decoding:
    """One checked, ready run (`driver.prepare`): its `state`, its strategy, and where it stands."""

    def __init__(self, state: DecodeState, decoder: Decoder, index: int | None = None) -> None:
        """`index`: the run's prompt among several decoded at once (its chunks carry it)."""
        self.state, self.decoder, self.index = state, decoder, index
        self.error: Exception | None = None  # what ended it, where the strategy raised
        self.began = 0.0  # perf_counter at `begin`
        self.before = len(state.tokens)  # its tokens when the step in progress began
        self.text = ""  # the text its chunks carried so far
        self.budgeted = takes_budget(decoder.start), takes_budget(decoder.steps)  # (start, steps) take a `Budget`

    def begin(self) -> None:
        """Start the run's clock (before a batch prefills its prompt: a run alone counts its prompt's call)."""
        self.state.lm.synchronize()
        self.began = time.perf_counter()

    def start(self, budget: Budget = ALONE) -> None:
        """The strategy's `start`, handed `budget` where it takes one."""
        try:
            with torch.inference_mode():
                if self.budgeted[0]:
                    self.decoder.start(self.state, budget)
                else:
                    self.decoder.start(self.state)
        except Exception as error:  # noqa: BLE001 - a drafter built here may raise: it ends this run
            self.error = error

    def advance(self) -> None:
        """One step alone: the strategy's `step`, its calls run at once."""
        self.before = len(self.state.tokens)
        try:
            with torch.inference_mode():  # per step: a consumer's code between chunks runs as it would
                self.decoder.step(self.state)
        except Exception as error:  # noqa: BLE001 - the strategy's, grammar's or drafter's: this run ends
            self.error = error

    def steps(self, budget: Budget = ALONE) -> Steps:
        """One step as the generator of its calls (a batch's row), handed `budget` where it takes one."""
        self.before = len(self.state.tokens)
        if self.budgeted[1]:
            return self.decoder.steps(self.state, budget)
        return self.decoder.steps(self.state)

    def chunk(self, with_text: bool = True) -> Chunk:
        """What the step that just ended added (its text only `with_text`), the run's seconds counted to now; ends
        the run where it finished (the strategy's `finish`), raised, or added no token."""
        state = self.state
        added = state.tokens[self.before :]
        if self.error is None and state.finished:
            try:
                with torch.inference_mode():
                    self.decoder.finish(state)
            except Exception as error:  # noqa: BLE001 - its tokens stand, the run ends with the error
                self.error = error
        elif self.error is None and not added:
            self.error = RuntimeError(f"strategy {self.decoder.name!r} made a step that accepted no token")
        if self.error is not None:
            state.finish_reason = "error"
        state.lm.synchronize()
        elapsed = time.perf_counter() - self.began
        state.stats.ttft_seconds = state.stats.ttft_seconds or elapsed
        state.stats.seconds = elapsed
        piece = ""
        if with_text:
            full = state.lm.decode(state.new_tokens)
            if full.endswith("\ufffd") and not state.finished:
                full = full[:-1]  # an incomplete UTF-8 character: streamed with the next step
            piece, self.text = full[len(self.text) :], full
        self.before = len(state.tokens)
        return Chunk(added, piece, state.sources[len(state.sources) - len(added) :], self.index)

    def chunks(self, with_text: bool = True, raising: bool = True) -> Iterator[Chunk]:
        """The run alone, step by step to its end, yielding what each step adds; a raise ends it (raised again here
        where `raising`, else recorded in its result)."""
        self.begin()
        self.start()
        while not self.state.finished:
            if self.error is None:
                self.advance()
            chunk = self.chunk(with_text)
            if self.error is not None and raising:
                raise self.error
            yield chunk

    def result(self) -> Result:
        """The run's outcome (what it has so far, if it was not run to the end)."""
        state, error = self.state, self.error
        return Result(
            text=state.lm.decode(state.new_tokens),
            tokens=state.new_tokens,
            sources=state.sources,
            stats=state.stats,
            finish_reason=state.finish_reason,
            prompt_tokens=state.tokens[: state.prompt_len],
            strategy=self.decoder.name,
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
