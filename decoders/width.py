"""`Width`: how many tokens each row of a batch may score in the batch's target calls (docs/design/batching.md).

Every row's call is padded to the widest, so the batch picks one width for all: the one of most expected tokens per
second, from what each width gained or would have (a draft's accepted nodes among its first ones, counted at every
verified step) over the seconds a step of the batch takes there: the target's calibrated cost of rows x width tokens,
corrected by what the batch's steps at that width (or the nearest one run) took. The gains start from auto's prior
and fade as the chooser's evidence does (`drafting.chooser`: `ChooserOptions`, `expected_tokens`, `Decayed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from decoders.drafting.chooser import ChooserOptions, Decayed, expected_tokens
from decoders.drafting.cost import CallCost, calibrate

if TYPE_CHECKING:
    from decoders.models.lm import LM

WIDTHS = (1, 2, 3, 5, 9, 17)  # target call widths a batch weighs: a plain step, then 1, 2, 4, 8, 16 drafted tokens
EXPLORE = 8  # calls before the batch tries another width than its best; the gap doubles while the best holds

Gains = dict[int, Decayed]  # width -> the tokens a row's step gained (or would have) at that width, decayed


class Width:
    """The batch's width, chosen before each target call (`next`) from the rows' verified steps (`observe`) and the
    seconds the batch's steps took (`took`). While prompts wait, a row's tokens gained free its slot for the next one
    sooner, so the rows' gains count together; in the last wave the batch ends with its slowest row, so a width is
    worth what it gains the row that gains least."""

    def __init__(self, lm: LM, rows: int, cost: CallCost | None = None, options: ChooserOptions | None = None) -> None:
        """`cost`: the target's call cost (default: `calibrate`d on first use, once a step is verified); `options`:
        the prior and decay of the gains (auto's: each drafted level accepted with prior_mean, as prior_strength
        steps)."""
        self.lm, self.rows, self.cost = lm, rows, cost
        self.options = options or ChooserOptions()
        self.gains = self.prior()
        self.rows_seen: dict[int, Gains] = {}  # row -> its own gains
        self.timed = {w: Decayed(decay=self.options.decay) for w in WIDTHS}  # seconds taken / the cost predicted
        self.calls, self.verified, self.last = 0, False, WIDTHS[0]  # (last: the width handed out last)
        self.best, self.gap, self.due, self.explored = 0, EXPLORE, EXPLORE, 0  # the best width, since when explored
        self.heard: set[int] = set()  # widths whose gains rows report from narrower calls (auto's guesses)

    def prior(self) -> Gains:
        o = self.options
        return {
            w: Decayed(o.prior_strength * expected_tokens((o.prior_mean,) * (w - 1)), o.prior_strength, o.decay)
            for w in WIDTHS
        }

    def observe(self, width: int, fed: int, path: list[int], row: int = 0) -> None:
        """Row `row`'s verified step whose call scored `fed` tokens, then a draft of at most `width` - `fed` nodes, of
        which `path` were accepted (0: no limit)."""
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
        """A step of the batch whose target call was `width` tokens wide took `seconds`: the call and every row's own
        work; not the draft models' calls (the rows that draft price them) nor the prompts admitted meanwhile."""
        if self.cost is None:
            return  # (no prediction yet to correct: the first steps, at the starting width)
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
        prompt waiting, the rows still running."""
        if not self.verified:  # plain steps until a row reports one (a drafting strategy reports its first): a first
            return WIDTHS[0]  # call drafting 4 tokens a row cost 3 plain ones at 16 rows
        if self.cost is None:
            self.cost = calibrate(self.lm).target  # (measured once per machine and model, then cached)
        seen = [self.rows_seen[b] for b in last_wave if b in self.rows_seen] or [self.gains]
        best = max(WIDTHS, key=lambda w: min(gains[w].mean for gains in seen) / self.seconds(w, context))
        if best != self.best:  # a new best: the others are tried soon again
            self.best, self.gap, self.due = best, EXPLORE, self.calls + EXPLORE
        self.calls, self.last = self.calls + 1, best
        if self.calls < self.due:
            return best
        # the width above the best and a plain step in turn: what a wider call gains and what a step without drafts
        # takes (the price to beat) are learnt only by running them
        self.gap, self.explored = 2 * self.gap, self.explored + 1
        self.due = self.calls + self.gap
        trial = WIDTHS[min(WIDTHS.index(best) + 1, len(WIDTHS) - 1)] if self.explored % 2 or best == 1 else WIDTHS[0]
        # a width the rows report at narrower calls needs no try: its gain is heard at every step
        self.last = best if trial in self.heard else trial
        return self.last
