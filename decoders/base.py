"""What every strategy shares: `Decoder`, the per-run `DecodeState`, and what a batch hands a step and a run returns.
A strategy is stateless apart from its frozen options: everything a run changes lives in its `DecodeState`."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from decoders.models.cache import Cache
from decoders.models.call import Call
from decoders.models.lm import LM
from samplers import SamplingConfig, sample

if TYPE_CHECKING:
    from grammars import GrammarMatcher

SLACK = 64  # positions past the run's last token that a call checking a draft may write (`expected_length`)


@dataclass(frozen=True)
class Budget:
    """What a batch hands a row's step: how wide its target call may be, and what that call and drafting cost there."""

    width: int = 0  # the most tokens the step's target call may score; 0: no limit
    tokens: int = 0  # tokens the batch's shared target call scores in all its rows (its cost); 0: alone
    stall: float = 1.0  # rows a second of this row's drafting holds up, per row drafting beside it
    trying: bool = False  # the width is a try or a guess, not the batch's best: rent no draft model on it

    @property
    def batched(self) -> bool:
        return self.tokens > 1


ALONE = Budget()


@dataclass(frozen=True)
class Verified:
    """What a drafting step tells the batch's `Width`: what it would have gained at narrower widths."""

    width: int  # the most tokens its target call could score (0: no limit)
    fed: int  # tokens the call scored before the draft
    path: list[int]  # the draft nodes accepted


# a step: yields each model call, is sent its logits [keep or T, vocab], returns a drafting step's `Verified` or None
Steps = Generator[Call, torch.Tensor, Verified | None]


def takes_budget(method: Callable) -> bool:
    """Whether a strategy's `start` or `steps` takes a `budget` (a batch's `Budget`; alone: `ALONE`)."""
    return "budget" in inspect.signature(method).parameters


def drive(steps: Generator[Call, torch.Tensor, Any], forward: Callable[[Call], torch.Tensor]) -> Any:
    """Run a generator of calls (a step, a draft chain) to its end, answering each by `forward`; returns its value."""
    try:
        call = next(steps)
        while True:
            call = steps.send(forward(call))
    except StopIteration as done:
        return done.value


@dataclass(frozen=True)
class NoOptions:
    """A strategy without options."""


class Decoder:
    """Base class of a decoding strategy. Subclasses set `Options` (a frozen dataclass) and implement `step`."""

    name: ClassVar[str] = ""  # set by @register
    Options: ClassVar[type] = NoOptions
    # what the strategy needs, checked before the clock starts (`decoders.capabilities`)
    needs_draft: ClassVar[bool] = False
    takes_draft: ClassVar[bool] = False  # a draft model is used when given (always True when needs_draft)
    needs_grammar: ClassVar[bool] = False
    needs_tree_mask: ClassVar[bool] = False  # the target scores token trees in one call (custom 4D attention masks)
    draft_needs_tree_mask: ClassVar[bool] = False  # the draft model grows token trees in one call

    def __init__(self, **options: Any) -> None:
        names = [f.name for f in dataclasses.fields(self.Options)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            valid = ", ".join(names) or "none"
            raise TypeError(f"strategy {self.name!r} got unknown option(s) {', '.join(unknown)}; its options: {valid}")
        self.options = self.Options(**options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options})"

    def start(self, state: DecodeState) -> None:
        """Set up per-run helpers (a drafter, in `state.drafter`) before the first step; may take `budget` too."""

    def step(self, state: DecodeState) -> None:
        """Append at least one token to the run with `state.accept`."""
        drive(self.steps(state), state.forward)

    def steps(self, state: DecodeState) -> Steps:
        """`step` as a generator that yields its `Call`s and is sent their logits (a batch's rows share a forward); one
        whose drafts a batch's width limits takes `budget` and returns a `Verified` (`DraftVerify`)."""
        raise NotImplementedError(f"strategy {self.name!r} implements neither step nor steps")

    @classmethod
    def batchable(cls) -> bool:
        """Whether its steps can be batched with other runs'."""
        return cls.steps is not Decoder.steps

    def finish(self, state: DecodeState) -> None:
        """Called once after the run's last step (e.g. to remember its output)."""


@dataclass
class Stats:
    """Counters of one run. The words (drafted, accepted, bonus ...) are defined in `samplers.verify`."""

    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: times the draft token at depth i was accepted
    draft_lengths: list[int] = field(default_factory=list)  # drafted tokens at each verification, in order
    seconds: float = 0.0
    ttft_seconds: float = 0.0  # until the first new token
    details: dict[str, Any] = field(default_factory=dict)  # a strategy's own record (auto: what it chose)
    # greedy mode, per new token: the best logit minus the token's (grammar-masked), None if forced (lossless check)
    argmax_gaps: list[float | None] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """New tokens per target call, the bonus or recovered token included."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        """Every counter and derived rate, JSON-ready."""
        derived = {k: getattr(self, k) for k in ("acceptance_rate", "mean_accepted", "tokens_per_second")}
        return {**dataclasses.asdict(self), **derived}

    def count_accepted(self, drafted: int, accepted: int, levels: int) -> None:
        """One verification: `drafted` tokens proposed, `accepted` kept (a prefix, a tree's path), `levels` deep."""
        self.drafted += drafted
        self.accepted += accepted
        self.draft_lengths.append(drafted)
        self.accepted_by_position.extend([0] * (levels - len(self.accepted_by_position)))
        for depth in range(accepted):
            self.accepted_by_position[depth] += 1


@dataclass
class DecodeState:
    """Everything that changes during one run, handed to the strategy at every step."""

    lm: LM
    tokens: list[int]  # prompt + new tokens so far
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingConfig
    generator: torch.Generator | None  # seeded; None in greedy mode
    draft: LM | None = None
    seeded: bool = False  # sampling from a seed the caller gave (`auto` then plans by no clock: `AutoDrafter.timed`)
    stop: tuple[str, ...] = ()
    grammar: GrammarMatcher | None = None  # advanced with accepted tokens only
    cache: Cache = field(init=False)  # target cache; holds tokens[:len(cache)]
    sources: list[str] = field(default_factory=list)  # one per new token
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None  # "eos", "stop" or "length" once finished
    drafter: Any = None  # a drafting strategy's per-run `Drafter` (its draft cache, adaptive settings)

    def __post_init__(self) -> None:
        self.cache = self.lm.new_cache(self.expected_length)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def expected_length(self) -> int:
        """The positions a cache of this run may hold: every token it may add, and a draft checked past the end."""
        return len(self.tokens) + self.remaining + SLACK

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (len(self.tokens) - self.prompt_len)

    def uncached(self) -> list[int]:
        """The tokens the target has not seen yet (at least the last accepted one)."""
        return self.tokens[len(self.cache) :]

    def call(self, extra: Sequence[int] = ()) -> Call:
        """The target call on the uncached tokens plus `extra`; its logits row i scores what follows extra[:i]."""
        return Call(self.uncached() + list(extra), keep=len(extra) + 1)

    def forward(self, call: Call) -> torch.Tensor:
        """Run `call` alone: on this run's target cache, or a draft model's call on the draft's cache."""
        if call.lm is not None:  # counted in `DraftModel.forward`
            return call.lm.forward(
                call.tokens, call.cache, positions=call.positions, tree_mask=call.tree_mask, keep=call.keep
            )
        self.stats.target_calls += 1
        return self.lm.forward(call.tokens, self.cache, call.positions, call.tree_mask, call.keep)

    def score(self, extra: Sequence[int] = ()) -> torch.Tensor:
        return self.forward(self.call(extra))

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one position's target logits [vocab] under the grammar's mask and the sampling settings.
        A forced token takes no draw: the random stream is the same whether or not a strategy skipped its call."""
        if self.grammar is not None:
            forced = self.grammar.forced()
            if forced:
                return forced[0]
            logits = logits.masked_fill(~self.grammar.allowed().to(logits.device), float("-inf"))
        return sample(logits, self.sampling, self.generator)

    def accept(self, tokens: Sequence[int], sources: Sequence[str], rows: torch.Tensor | None = None) -> int:
        """Append new tokens until EOS, a stop string or max_new_tokens ends the run; returns how many were added.
        `rows` [len(tokens), vocab]: the target logits each was chosen from (None: grammar-forced). Each token advances
        the grammar (a forbidden one raises `grammars.GrammarError`); a complete grammar ends the run as "eos"."""
        added = 0
        for token, source in zip(tokens, sources, strict=True):
            if self.finished:
                break
            if rows is not None and self.sampling.greedy:
                row = rows[added].float()
                if self.grammar is not None:
                    row = row.masked_fill(~self.grammar.allowed().to(row.device), float("-inf"))
                self.stats.argmax_gaps.append(float(row.max() - row[token]))
            elif self.sampling.greedy:
                self.stats.argmax_gaps.append(None)
            if self.grammar is not None:
                self.grammar.advance([token])
            self.tokens.append(int(token))
            self.sources.append(source)
            added += 1
            if token in self.lm.eos_token_ids or (self.grammar is not None and self.grammar.is_complete()):
                self.finish_reason = "eos"
            elif self.stop and any(s in self.lm.decode(self.new_tokens) for s in self.stop):
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        self.stats.new_tokens += added
        return added


@dataclass
class Chunk:
    """Tokens accepted in one step, as streamed."""

    tokens: list[int]
    text: str  # the text these tokens add
    sources: list[str]
    index: int | None = None  # the prompt's index, when several are decoded at once


@dataclass
class Result:
    """The outcome of one `decoders.generate` call."""

    text: str  # the new text only
    tokens: list[int]  # the new tokens only (an ending EOS included)
    sources: list[str]  # one per new token: "target", "draft", "lookup", "lookahead" or "grammar"
    stats: Stats
    finish_reason: str  # "eos", "stop", "length", or "error" (then see `error`)
    prompt_tokens: list[int]
    strategy: str
    error: str | None = None
