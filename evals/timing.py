"""One timed generation call, measured the same way for decodekit strategies and for peers.

Every method is timed from just before its call (what `decoders.generate` runs, or `model.generate` for peers) to its
end, with the device synchronized at both ends and a mark after every step; new tokens are counted up to and
including an ending EOS, never more than max_new_tokens. A `Run` is the record of one such call.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import decoders
from decoders import driver
from evals.measure import ForwardMeter, PeakMemory, synchronize


@dataclass
class Run:
    """The record of one timed (strategy, prompt, repeat) call. Counters a method cannot report are None."""

    strategy: str
    kind: str  # "decodekit" or "peer"
    prompt_id: str
    category: str
    repeat: int
    prompt_tokens: int
    max_new_tokens: int
    new_tokens: int  # up to and including an ending EOS
    seconds: float  # wall time of the call, device synchronized
    ttft_seconds: float  # until the first new token was available
    target_calls: int | None
    draft_calls: int | None
    drafted: int | None
    accepted: int | None
    accepted_by_position: list[int]  # [i]: times the draft token at depth i was accepted
    drafted_by_position: list[int]  # [i]: verifications that drafted a token at depth i (empty: unknown)
    draft_seconds: float | None  # time inside the draft model's forward calls
    peak_memory_bytes: int | None
    finish_reason: str  # "eos" or "length" ("stop" never: compare passes no stop strings)
    tokens: list[int]
    sources: list[str]  # one per token: "target", "draft", "lookup", "lookahead", "grammar"
    pieces: list[str]  # the text each token adds (for colored reports)
    timeline: list[tuple[float, int]]  # (seconds since the call began, new tokens so far) after every step
    grammar: bool = False  # ran under the prompt's JSON-schema constraint
    rank: int = 0  # the process that ran it (accelerate launch)
    lossless: dict[str, Any] | None = None  # filled by evals.lossless.check
    argmax_gaps: list[float | None] = field(default_factory=list)  # decoders.Stats.argmax_gaps (greedy mode)
    extra: dict[str, Any] = field(default_factory=dict)
    # a batched compare's requests in flight (`evals.batched`): `seconds` and `ttft_seconds` are then the request's
    # latency and time to first token from its admission; None (and left out of `as_dict`) for a one-prompt run
    batch_size: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """JSON-ready, with the derived rates."""
        record = asdict(self)
        record["tokens_per_second"] = self.tokens_per_second
        record["mean_accepted"] = self.new_tokens / self.target_calls if self.target_calls else None
        record["acceptance_rate"] = self.accepted / self.drafted if self.drafted else None
        record["draft_share"] = self.draft_seconds / self.seconds if self.draft_seconds and self.seconds else None
        if self.batch_size is None:
            del record["batch_size"]
        return record


class Stopwatch:
    """Brackets one call: peak memory reset, draft forwards metered, device synced, clock read; `mark` per step."""

    def __init__(self, lm: decoders.LM, draft: decoders.LM | None = None, count_target: bool = False) -> None:
        self.device = lm.device
        self.peak = PeakMemory(lm.device)
        self.target = ForwardMeter(lm.model if count_target else None, lm.device)
        # the draft's calls, and those of the int8 copies kept with the draft and the target (`self_draft`), which
        # `auto` may draft with instead; a draft that is the target itself (a test setup) cannot be told apart by
        # hooks: not metered
        drafts = {
            id(m.model): m
            for m in ([draft] if draft is not None else [])
            + [copy for model in (lm, draft) if model is not None for copy in model.held.copies.values()]
        }
        drafts.pop(id(lm.model), None)
        self.draft = ForwardMeter(
            [m.model for m in drafts.values()], lm.device, natives=[m.native for m in drafts.values()]
        )
        self.draft_metered = bool(drafts)
        self.marks: list[tuple[float, int]] = []
        self.start = self.seconds = 0.0
        self.peak_bytes = 0

    def __enter__(self) -> Stopwatch:
        self.peak.reset()
        self.target.__enter__()
        self.draft.__enter__()
        synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def mark(self, new_tokens: int) -> None:
        """Note that `new_tokens` tokens exist now."""
        synchronize(self.device)
        self.marks.append((time.perf_counter() - self.start, new_tokens))

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.start
        self.draft.__exit__()
        self.target.__exit__()
        self.peak_bytes = self.peak.read()

    @property
    def ttft(self) -> float:
        return next((t for t, n in self.marks if n > 0), self.seconds)


def pieces(lm: decoders.LM, tokens: list[int]) -> list[str]:
    """The text each new token adds (a token that ends inside a UTF-8 character adds nothing until it completes)."""
    out, before = [], ""
    for i in range(1, len(tokens) + 1):
        text = lm.decode(tokens[:i])
        if text.endswith("\ufffd") and i < len(tokens):
            out.append("")
            continue
        out.append(text[len(before) :])
        before = text
    return out


def run_decodekit(
    lm: decoders.LM,
    prompt: list[int],
    decoder: decoders.Decoder,
    *,
    max_new_tokens: int,
    name: str | None = None,
    draft: decoders.LM | None = None,
    grammar: Any = None,
    prompt_id: str = "",
    category: str = "",
    repeat: int = 0,
) -> Run:
    """Time one run of the strategy `decoder`, recorded as `name` (default: its registered name).

    The run is `decoders.generate` unrolled (`decoders.driver.prepare`, then its steps), all inside the clock, so the
    stopwatch marks every step while the run's state keeps its counters.
    """
    watch = Stopwatch(lm, draft)
    with watch:
        run = driver.prepare(lm, prompt, strategy=decoder, max_new_tokens=max_new_tokens, draft=draft, grammar=grammar)
        for _ in run.chunks(with_text=False):
            watch.mark(len(run.state.new_tokens))
    state, decoder = run.state, run.decoder
    stats, tokens = state.stats, state.new_tokens
    lengths = list(stats.draft_lengths)  # drafted tokens per verification
    return Run(
        strategy=name or decoder.name,
        kind="decodekit",
        prompt_id=prompt_id,
        category=category,
        repeat=repeat,
        prompt_tokens=len(prompt),
        max_new_tokens=max_new_tokens,
        new_tokens=len(tokens),
        seconds=watch.seconds,
        ttft_seconds=watch.ttft,
        target_calls=stats.target_calls,
        draft_calls=stats.draft_calls,
        drafted=stats.drafted,
        accepted=stats.accepted,
        accepted_by_position=list(stats.accepted_by_position),
        drafted_by_position=[sum(n > depth for n in lengths) for depth in range(max(lengths, default=0))],
        draft_seconds=watch.draft.seconds if stats.draft_calls and watch.draft.calls else None,  # (None: a draft the
        # watch could not meter, e.g. an int8 copy `auto` made in this very run)
        peak_memory_bytes=watch.peak_bytes,
        finish_reason=state.finish_reason,
        tokens=list(tokens),
        sources=list(state.sources),
        pieces=pieces(lm, tokens),
        timeline=watch.marks,
        grammar=grammar is not None,
        argmax_gaps=list(stats.argmax_gaps),
        extra={"driver_seconds": stats.seconds, "driver_ttft_seconds": stats.ttft_seconds, **stats.details},
    )
