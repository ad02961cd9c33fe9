"""`Width`: how many tokens each row of a batch may score in the batch's target calls (docs/design/batching.md).

Every row's call is padded to the widest, so the batch picks one width for all: the one of most expected tokens per
second."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from decoders.drafting.chooser import ChooserOptions, Decayed, expected_tokens
from decoders.drafting.cost import CallCost, calibrate

if TYPE_CHECKING:
    from decoders.models.lm import LM

WIDTHS = (1, 2, 3, 5, 9, 17)  # a plain step, then 1, 2, 4, 8, 16 drafted tokens
EXPLORE = 8  # calls before the batch tries another width than its best; the gap doubles while the best holds

Gains = dict[int, Decayed]  # width -> tokens a row's step gained (or would have) at that width


class Width:
    """The batch's width, chosen before each target call (`next`) from its rows' verified steps and its clock."""

    def __init__(self, lm: LM, rows: int, cost: CallCost | None = None, options: ChooserOptions | None = None) -> None:
        """`cost` defaults to calibrating the target once a step is verified; `options`: the gains' prior and decay."""
        self.lm, self.rows, self.cost = lm, rows, cost
        self.options = options or ChooserOptions()
        self.gains = self.prior()
        self.rows_seen: dict[int, Gains] = {}  # row -> its own gains
        self.timed = {w: Decayed(decay=self.options.decay) for w in WIDTHS}  # seconds taken / the cost predicted
        self.calls, self.verified, self.last = 0, False, WIDTHS[0]  # last: the width handed out last
        self.best, self.gap, self.due, self.explored = 0, EXPLORE, EXPLORE, 0  # due: the call of the next try
        self.heard: set[int] = set()  # widths whose gains rows report from narrower calls (auto's guesses)

    def prior(self) -> Gains:
        o = self.options
        return {
            w: Decayed(o.prior_strength * expected_tokens((o.prior_mean,) * (w - 1)), o.prior_strength, o.decay)
            for w in WIDTHS
        }

    def observe(self, width: int, fed: int, path: list[int], row: int = 0) -> None:
        """Row `row`'s verified step: its call scored `fed` tokens, then a draft of at most `width` - `fed` nodes
        (`width` 0: no limit), of which `path` were accepted."""
        self.verified = True
        if width > self.last:
            self.heard.add(width)
        own = self.rows_seen.setdefault(row, self.prior())
        for w in WIDTHS:
            if width and w > width:
                break
            kept = next((i for i, node in enumerate(path) if node >= w - fed), len(path))  # nodes within width w
            for gains in (self.gains, own):
                gains[w].add(1 + kept)

    def forget(self, row: int) -> None:
        """Row `row`'s run ended: its gains say nothing of the next prompt's."""
        self.rows_seen.pop(row, None)

    def took(self, width: int, seconds: float, context: int) -> None:
        """A step of the batch at `width` took `seconds`: its target call and the rows' own work, not the draft models'
        calls (the rows that draft price them) nor prompts admitted."""
        if self.cost is None:
            return  # no prediction to correct yet
        w = next((w for w in WIDTHS if w >= width), WIDTHS[-1])
        self.timed[w].add(seconds / self.cost.predict(self.rows * width, context))

    def seconds(self, width: int, context: int) -> float:
        """The expected seconds of a step of the batch at `width`."""
        seen = [w for w in WIDTHS if self.timed[w].weight > 0]
        near = min(seen, key=lambda w: abs(WIDTHS.index(w) - WIDTHS.index(width))) if seen else None
        correction = self.timed[near].mean if near else 1.0
        return correction * self.cost.predict(self.rows * width, context)

    def next(self, context: int, last_wave: Sequence[int] = ()) -> int:
        """The width of the batch's next target call, its rows holding up to `context` slots; `last_wave`: with no
        prompt waiting, the rows still running (the batch ends with its slowest: a width is worth its least gain)."""
        # plain steps until a row reports a verified step (a drafting strategy reports its first): wide calls are dear
        if not self.verified:
            return WIDTHS[0]
        if self.cost is None:
            self.cost = calibrate(self.lm).target  # measured once per machine and model, then cached
        seen = [self.rows_seen[b] for b in last_wave if b in self.rows_seen] or [self.gains]
        best = max(WIDTHS, key=lambda w: min(gains[w].mean for gains in seen) / self.seconds(w, context))
        if best != self.best:  # a new best: the others are tried soon again
            self.best, self.gap, self.due = best, EXPLORE, self.calls + EXPLORE
        self.calls, self.last = self.calls + 1, best
        if self.calls < self.due:
            return best
        # the width above the best and a plain step in turn: what they gain and cost is learnt only by running them
        self.gap, self.explored = 2 * self.gap, self.explored + 1
        self.due = self.calls + self.gap
        trial = WIDTHS[min(WIDTHS.index(best) + 1, len(WIDTHS) - 1)] if self.explored % 2 or best == 1 else WIDTHS[0]
        # a width the rows report at narrower calls needs no try: its gain is heard at every step
        self.last = best if trial in self.heard else trial
        return self.last
