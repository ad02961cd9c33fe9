"""Many prompts at once: continuous batching of any strategy whose steps yield their model calls.

Each row of the batch is an ordinary run (its own `DecodeState`: tokens, grammar, random stream, drafter); what the
rows share is each model's forward. Every round, each row steps until its strategy asks for a call (`Decoder.steps`
yields a `Call`: the target's, or its draft model's), the calls of all rows to one model go through one forward
(`BatchCache.forward`: one row of the batch per run, the queries right-aligned, a 4D mask hiding every other row's
slots, padding and what each row's own call must not see), and each row is sent its own logits and steps on. While
any row drafts, the rows waiting for the target wait: so the target's call verifies every row's draft at once. A draft
model's calls run on a `BatchCache` of its own beside the target's (`BatchCache.beside`). A row whose run ends is
refilled with the next prompt at once; the newcomer's prompt is prefilled in a call of its own, so the other rows wait
one prefill, not a whole run, and from what it shares with a recent prompt's beginning (`BatchCache.kept`).

Rows advance by different numbers of tokens; the cache keeps, per row, which slots hold its tokens (`valid`) and
their positions, so rejected drafts and finished rows are just slots no mask shows, gathered away when the slots grow
past twice what the rows hold (`compact`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import DynamicCache

from decoders.base import Call, Chunk, Decoder, DecodeState, Result
from decoders.drafting.chooser import ChooserOptions
from decoders.drafting.cost import CallCost, calibrate
from decoders.drafting.tree import shared_length
from decoders.driver import Decoding
from decoders.models.cache import KVCache
from decoders.models.graphs import BUCKETS, MIN_CAPACITY, StaticKVCache, lend
from decoders.models.lm import LM

PROMPTS_KEPT = 4  # the last prompts' caches a newcomer's prefill starts from where it shares their beginning
SHARED = 16  # the fewest tokens shared with a kept prompt worth copying (agentic turns share hundreds)
FEED_ALONE = 8  # a row's call feeding this many tokens more than it keeps logits for runs them alone first: padding
# 8 rows to 8 more tokens costs about a call of 8 tokens alone (1.5B, this CPU: 8 x 4 tokens 511 ms, 8 x 1 337 ms)


class RowCache:
    """One row's view of a `BatchCache`, with `KVCache`'s rollback (`crop`, `keep`) over the row's own slots."""

    def __init__(self, batch: BatchCache, row: int) -> None:
        self.batch, self.row = batch, row

    def __len__(self) -> int:
        return int(self.batch.valid[self.row].sum())

    def slots(self) -> torch.Tensor:
        """[len] the batch slots holding this row's tokens, in order."""
        return self.batch.valid[self.row].nonzero()[:, 0]

    def crop(self, n: int) -> None:
        """Keep the first `n` positions."""
        slots = self.slots()
        if not 0 <= n <= len(slots):
            raise ValueError(f"cannot crop a cache of {len(slots)} positions to {n}")
        self.batch.valid[self.row, slots[n:]] = False

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the positions `indices` (increasing)."""
        slots = self.slots()
        kept = torch.zeros_like(self.batch.valid[self.row])
        kept[slots[torch.as_tensor(list(indices), dtype=torch.long)]] = True
        self.batch.valid[self.row] = kept

    def beside(self, lm: LM) -> RowCache:
        """This row's cache of another model (a draft model) in the same batch: an empty one for a new run."""
        return self.batch.beside(lm).row(self.row)

    @property
    def hf(self):
        raise TypeError(
            "a batched run's cache is shared by its rows: its calls run in the batch's forward (the "
            "target's own int8 copy drafts on a batch cache of its own in a batch)"
        )


class BatchCache:
    """A model's keys and values for `rows` runs: per layer [rows, heads, slots, head_dim], with which slots hold
    each row's tokens (`valid` [rows, slots]) and their positions (`positions` [rows, slots]). Where the LM has a
    static cache (`LM.static_cache_ok`: CUDA graphs), the layers are a `BatchSlab`'s buffers of `capacity` >= slots,
    and calls of up to 32 tokens run padded to a bucket's width as its graph."""

    def __init__(self, lm: LM, rows: int) -> None:
        self.lm, self.rows = lm, rows
        self.slab = lend(lm, MIN_CAPACITY, self, rows) if lm.static_cache_ok() else None
        self.hf = DynamicCache() if self.slab is None else self.slab.hf
        self.valid = torch.zeros(rows, 0, dtype=torch.bool)
        self.positions = torch.zeros(rows, 0, dtype=torch.long)
        self.drafts: list[BatchCache] = []  # the draft models' caches beside the target's, one per draft model
        self.kept: deque[tuple[list[int], KVCache]] = deque(maxlen=min(PROMPTS_KEPT, rows))  # the last prompts
        # prefilled (no more than the rows: their caches hold at most about what the rows' prompts hold)

    def beside(self, lm: LM) -> BatchCache:
        """The batch's cache of draft model `lm` (made on first use), so that its rows' draft calls share a forward."""
        cache = next((c for c in self.drafts if c.lm is lm), None)
        if cache is None:
            cache = BatchCache(lm, self.rows)
            self.drafts.append(cache)
        return cache

    def clear(self, b: int) -> None:
        """Row `b` holds nothing, in this cache and in the draft models' beside it (its run ended)."""
        for cache in (self, *self.drafts):
            cache.valid[b] = False

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def row(self, b: int) -> RowCache:
        return RowCache(self, b)

    def _layers(self):
        return [layer for layer in self.hf.layers if getattr(layer, "keys", None) is not None]

    def _grow(self, slots: int, template: KVCache) -> None:
        """Make room for `slots` slots (invalid for every row), shaping the layers after `template`'s."""
        extra = slots - self.slots
        if extra <= 0:
            return
        layers = self._layers()
        if self.slab is not None:
            self._reserve(slots, template.hf.layers)
        else:
            if not layers:  # the first prompt: shape the batch's layers after its cache
                for i, layer in enumerate(template.hf.layers):
                    shape = (self.rows, layer.keys.shape[1], 0, layer.keys.shape[-1])
                    empty = layer.keys.new_zeros(shape), layer.values.new_zeros(shape[:3] + (layer.values.shape[-1],))
                    self.hf.update(*empty, i)
                layers = self._layers()
            for layer in layers:
                pad = lambda t: t.new_zeros(t.shape[0], t.shape[1], extra, t.shape[3])  # noqa: E731
                layer.keys, layer.values = (
                    torch.cat([layer.keys, pad(layer.keys)], 2),
                    torch.cat([layer.values, pad(layer.values)], 2),
                )
        self.valid = torch.cat([self.valid, torch.zeros(self.rows, extra, dtype=torch.bool)], 1)
        self.positions = torch.cat([self.positions, torch.zeros(self.rows, extra, dtype=torch.long)], 1)

    def _reserve(self, slots: int, like=None) -> None:
        """(A static cache) a slab of `slots` slots or more, holding what the current one holds; its layers, if new,
        shaped after `like` (layers of one row, or of the current slab)."""
        if self.slab.capacity >= slots and self._layers():
            return
        capacity = self.slab.capacity
        while capacity < slots:
            capacity *= 2
        slab = self.slab if capacity == self.slab.capacity else lend(self.lm, capacity, self, self.rows)
        for layer, model in zip(slab.hf.layers, like or self._layers()):
            if not layer.is_initialized:
                shape = (self.rows, model.keys.shape[1], 0)
                layer.lazy_initialization(
                    model.keys.new_empty(*shape, model.keys.shape[-1]),
                    model.values.new_empty(*shape, model.values.shape[-1]),
                )
        if slab is not self.slab:
            for mine, theirs in zip(slab.hf.layers, self._layers()):
                mine.keys[:, :, : self.slots] = theirs.keys[:, :, : self.slots]
                mine.values[:, :, : self.slots] = theirs.values[:, :, : self.slots]
            self.slab.owner = None
            self.slab, self.hf = slab, slab.hf

    def prefill(self, b: int, tokens: Sequence[int]) -> None:
        """Row `b` now holds exactly `tokens` (a prompt), in its first slots: scored in a call of their own, so that no
        other row's call is padded to a prompt's length. Where they begin with SHARED or more of a kept prompt's
        tokens, those positions are copied from its cache and only the rest is scored."""
        tokens, prefix = list(tokens), self.lm.new_cache(len(tokens))  # (a run's own cache, copied from below)
        shared, source = max(
            ((shared_length(tokens, seen), cache) for seen, cache in self.kept),
            default=(0, None),
            key=lambda pair: pair[0],
        )
        if shared >= SHARED:
            prefix.fill(
                [layer.keys[:, :, :shared] for layer in source.hf.layers],
                [layer.values[:, :, :shared] for layer in source.hf.layers],
            )
        else:
            shared = 0
        if len(tokens) > shared:
            self.lm.forward(tokens[shared:], prefix, keep=1)
        if len(tokens) >= SHARED:
            self.kept.append((tokens, prefix))
        self.valid[b] = False
        self._store(b, 0, prefix, 0)

    def feed(self, b: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to row `b`'s, scored in a call of their own on a copy of the row (a draft's catch-up after
        steps it did not draft), so that no other row's call is padded to their length."""
        slots = self.valid[b].nonzero()[:, 0]
        row = self.lm.new_cache(len(slots) + len(tokens))
        row.fill(
            [layer.keys[b : b + 1, :, slots] for layer in self._layers()],
            [layer.values[b : b + 1, :, slots] for layer in self._layers()],
        )
        self.lm.forward(list(tokens), row, keep=1)
        self._store(b, self.slots, row, len(slots))

    def _store(self, b: int, at: int, cache: KVCache | StaticKVCache, held: int) -> None:
        """Row `b`'s slots from `at` on now hold `cache`'s positions from `held` on (a one-row cache run alone)."""
        end = len(cache)
        n = end - held
        if n <= 0:
            return
        self._grow(at + n, cache)
        with torch.inference_mode():  # (a slab's buffers are inference tensors, whoever calls)
            for layer, source in zip(self._layers(), cache.hf.layers):
                layer.keys[b, :, at : at + n] = source.keys[0, :, held:end]
                layer.values[b, :, at : at + n] = source.values[0, :, held:end]
        self.valid[b, at : at + n] = True
        self.positions[b, at : at + n] = torch.arange(held, held + n)

    def compact(self) -> None:
        """Gather each row's slots to the front and drop the rest (rejected drafts, finished rows, padding)."""
        counts = self.valid.sum(1)
        width = int(counts.max()) if self.rows else 0
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # valid slots first
        for layer in self._layers():
            index = order.to(layer.keys.device)[:, None, :, None]
            keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
            if self.slab is None:
                layer.keys, layer.values = keys, values
            else:  # (a slab's buffers stay where its graphs read them)
                layer.keys[:, :, :width], layer.values[:, :, :width] = keys, values
        self.positions = self.positions.gather(1, order)
        self.valid = torch.arange(width)[None, :] < counts[:, None]

    def forward(self, calls: dict[int, Call]) -> dict[int, torch.Tensor]:
        """One forward serving each row's call (rows without one only pad); returns each row's logits as `LM.forward`
        would for that row alone. Its new slots hold the rows' call tokens, right-aligned."""
        lm, device, calls = self.lm, self.lm.device, dict(calls)
        for b, call in list(calls.items()):
            head = len(call.tokens) - (call.keep or len(call.tokens))
            if call.positions is not None or call.tree_mask is not None or head <= 0:
                continue
            if not self.valid[b].any():
                self.prefill(b, call.tokens[:head])  # a draft's first call, on its row's prompt (as `admit` does)
            elif head >= FEED_ALONE:
                self.feed(b, call.tokens[:head])
            else:
                continue
            calls[b] = replace(call, tokens=call.tokens[head:])
        if self.slots > 64 and self.slots > 2 * int(self.valid.sum(1).max()):
            self.compact()
        past, width = self.slots, max(len(call.tokens) for call in calls.values())
        if self.slab is not None:
            bucket = next((b for b in BUCKETS if b >= width), width)
            self._reserve(past + bucket)
            if self.slab.capture:
                width = bucket  # (a graph's width: the rows padded further left)
        total = past + width if self.slab is None else self.slab.capacity  # keys a query may see, padding included
        ids = torch.zeros(self.rows, width, dtype=torch.long)
        positions = torch.zeros(self.rows, width, dtype=torch.long)
        allowed = torch.zeros(self.rows, width, total, dtype=torch.bool)
        allowed[:, torch.arange(width), past + torch.arange(width)] = True  # padding sees itself (no empty softmax)
        for b, call in calls.items():
            n, cached = len(call.tokens), int(self.valid[b].sum())
            pad = width - n
            ids[b, pad:] = torch.as_tensor(call.tokens)
            positions[b, pad:] = (
                torch.as_tensor(call.positions) if call.positions is not None else torch.arange(cached, cached + n)
            )
            own = torch.ones(n, n, dtype=torch.bool).tril() if call.tree_mask is None else call.tree_mask.bool()
            if own.shape[1] > n:  # [n, cached + n]: which of the row's cached positions each sees (a draft's tree)
                allowed[b, pad:, self.valid[b].nonzero()[:, 0]] = own[:, :cached]
            else:
                allowed[b, pad:, :past] = self.valid[b]
            allowed[b, pad:, past + pad : past + width] = own[:, own.shape[1] - n :]
        key_positions = torch.cat([self.positions, positions], 1)  # [rows, past + width]
        if self.slab is not None:
            keys = torch.zeros(self.rows, total, dtype=torch.long)
            keys[:, : past + width] = key_positions
            out, keep = self.slab.forward(ids, positions, past, allowed, keys), width
        else:
            mask = lm.attention_masks(allowed, key_positions, positions)
            keep = max(call.keep or len(call.tokens) for call in calls.values())
            out = lm.model(
                input_ids=ids.to(device),
                position_ids=positions.to(device),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=keep,
                **{lm.cache_keyword: self.hf},
            ).logits
        self.valid = torch.cat([self.valid, torch.zeros(self.rows, width, dtype=torch.bool)], 1)
        self.positions = key_positions
        logits = {}
        for b, call in calls.items():
            n = len(call.tokens)
            self.valid[b, past + width - n :] = True
            want = call.keep or n
            logits[b] = out[b, keep - want :].float()  # [want, vocab], as `LM.forward`'s
        return logits


WIDTHS = (1, 2, 3, 5, 9, 17)  # target call widths a batch weighs: a plain step, then 1, 2, 4, 8, 16 drafted tokens
EXPLORE = 8  # calls before the batch tries another width than its best; the gap doubles while the best holds
DECAY = 0.99  # per row's step, older evidence fades


class Width:
    """How many tokens each row may score in the batch's target calls. Every row's call is padded to the widest, so
    the batch picks one width for all: the one of most expected tokens per second, from what each width gained or
    would have (a draft's accepted nodes among its first ones, counted on every verified step) over the seconds a
    step of the batch takes at that width: the target's measured cost of a call scoring rows x width tokens
    (`calibrate`), corrected by what the batch's steps at that width (or the nearest width run) took. While prompts
    wait, a row's tokens gained free its slot for the next one sooner, so the rows' gains count together; in the
    last wave the batch ends with its slowest row, so a width is worth what it gains the row that gains least."""

    def __init__(self, lm: LM, rows: int, cost: CallCost | None = None) -> None:
        """`cost`: the target's call cost (default: `calibrate`d on first use, once a step is verified)."""
        self.lm, self.rows, self.cost = lm, rows, cost
        prior = ChooserOptions()  # (auto's prior: each drafted level accepted with prior_mean, as prior_strength steps)
        self.steps = dict.fromkeys(WIDTHS, prior.prior_strength)  # decayed steps counted
        self.gained = {w: prior.prior_strength * sum(prior.prior_mean**i for i in range(w)) for w in WIDTHS}
        # (decayed tokens a row's step gained at each width)
        self.prior = dict(self.steps), dict(self.gained)
        self.rows_seen: dict[int, tuple[dict[int, float], dict[int, float]]] = {}  # row -> its own steps, gained
        self.timed = dict.fromkeys(WIDTHS, 0.0)  # decayed batch steps timed at each width
        self.ratio = dict.fromkeys(WIDTHS, 0.0)  # their decayed sum of seconds taken / the cost predicted
        self.calls, self.verified, self.last = 0, False, WIDTHS[0]  # (last: the width handed out last)
        self.best, self.gap, self.due, self.explored = 0, EXPLORE, EXPLORE, 0  # the best width, since when explored
        self.heard: set[int] = set()  # widths whose gains rows report from narrower calls (auto's guesses)

    def observe(self, width: int, fed: int, path: list[int], row: int = 0) -> None:
        """Row `row`'s verified step whose call scored `fed` tokens, then a draft of at most `width` - `fed` nodes, of
        which `path` were accepted (0: no limit)."""
        self.verified = True
        if width > self.last:
            self.heard.add(width)
        own = self.rows_seen.setdefault(row, (dict(self.prior[0]), dict(self.prior[1])))
        for w in WIDTHS:
            if width and w > width:
                break
            kept = next((i for i, node in enumerate(path) if node >= w - fed), len(path))  # nodes within width w
            for steps, gained in ((self.steps, self.gained), own):
                gained[w] = DECAY * gained[w] + 1 + kept
                steps[w] = DECAY * steps[w] + 1

    def forget(self, row: int) -> None:
        """Row `row`'s run ended: its gains say nothing of the next prompt's."""
        self.rows_seen.pop(row, None)

    def took(self, width: int, seconds: float, context: int) -> None:
        """A step of the batch whose target call was `width` tokens wide took `seconds`: the call and every row's own
        work; not the draft models' calls (the rows that draft price them) nor the prompts admitted meanwhile."""
        if self.cost is None:
            return  # (no prediction yet to correct: the first steps, at the starting width)
        w = next((w for w in WIDTHS if w >= width), WIDTHS[-1])
        self.timed[w] = DECAY * self.timed[w] + 1
        self.ratio[w] = DECAY * self.ratio[w] + seconds / self.cost.predict(self.rows * width, context)

    def seconds(self, width: int, context: int) -> float:
        """The expected seconds of a step of the batch at `width`."""
        seen = [w for w in WIDTHS if self.timed[w] > 0]
        near = min(seen, key=lambda w: abs(WIDTHS.index(w) - WIDTHS.index(width))) if seen else None
        correction = self.ratio[near] / self.timed[near] if near else 1.0
        return correction * self.cost.predict(self.rows * width, context)

    def next(self, context: int, last_wave: Sequence[int] = ()) -> int:
        """The width of the batch's next target call, its rows holding up to `context` slots; `last_wave`: with no
        prompt waiting, the rows still running."""
        if not self.verified:  # plain steps until a row reports one (a drafting strategy reports its first): a first
            return WIDTHS[0]  # call drafting 4 tokens a row cost 3 plain ones at 16 rows
        if self.cost is None:
            self.cost = calibrate(self.lm).target  # (measured once per machine and model, then cached)
        seen = [self.rows_seen[b] for b in last_wave if b in self.rows_seen] or [(self.steps, self.gained)]
        best = max(WIDTHS, key=lambda w: min(gained[w] / steps[w] for steps, gained in seen) / self.seconds(w, context))
        if best != self.best:  # a new best: the others are tried soon again
            self.best, self.gap, self.due = best, EXPLORE, self.calls + EXPLORE
        self.calls, self.last = self.calls + 1, best
        if self.calls < self.due:
            return best
        # the width above the best and a plain step in turn: what a wider call gains and what a step without drafts
        # takes (the price to beat) are learnt only by running them; each try dearer when a draft model must catch up
        self.gap, self.explored = 2 * self.gap, self.explored + 1
        self.due = self.calls + self.gap
        trial = WIDTHS[min(WIDTHS.index(best) + 1, len(WIDTHS) - 1)] if self.explored % 2 or best == 1 else WIDTHS[0]
        # a width the rows report at narrower calls needs no try: its gain is heard at every step, its seconds priced
        # by the nearest width run (at 16 rows a 2-token call costs 1.5 plain ones, and a try gains the batch nothing)
        self.last = best if trial in self.heard else trial
        return self.last


@dataclass
class Row:
    """A run in the batch: its index in the caller's prompts, state, strategy and the step in progress."""

    index: int
    state: DecodeState
    decoder: Decoder
    began: float
    steps: Iterator | None = None
    pending: Call | None = None
    before: int = 0  # len(state.tokens) when its step began
    error: Exception | None = None  # what its own step raised
    text: str = ""  # the text streamed so far


def run(
    lm: LM, runs: list[tuple[DecodeState, Decoder]], batch_size: int, with_text: bool = True
) -> Iterator[tuple[int, Chunk, Result | None]]:
    """Decode `runs` (checked, ready states and their strategies) with at most `batch_size` in flight; yields (the
    run's index, the chunk a step added (its text only `with_text`), its `Result` once finished) as rows step."""
    if min(batch_size, len(runs)) == 1:
        yield from one_at_a_time(runs, with_text)
        return
    for _, decoder in runs:
        if not decoder.batchable():
            raise TypeError(
                f"strategy {decoder.name!r} implements `step` only and cannot run batched; implement "
                "`steps` (see decoders.base.Decoder) or decode its prompts one at a time"
            )
    try:  # (rows of several lengths in one call need masks of their own)
        lm.check_tree_mask()
    except TypeError as error:
        raise TypeError(f"cannot decode a batch with this model: {error}; pass batch_size=1") from None
    queue = deque(enumerate(runs))
    batch = BatchCache(lm, min(batch_size, len(runs)))
    rows: list[Row | None] = [None] * batch.rows
    width = Width(lm, batch.rows)
    timed = not any(state.seeded for state, _ in runs)  # (seeded: widths from the calibration alone, so runs repeat)
    since = time.perf_counter()  # the last target call's end, less the prompts admitted, draft calls and chunks since
    drafters, drafted = set(), set()  # the rows that called a draft model before the last target call, and since
    while queue or any(rows):
        done = []  # the round's (index, chunk, result): yielded outside inference mode, so the caller's code between
        # chunks runs as it would (grad on), and a stream closed early leaves no mode behind
        with torch.inference_mode():
            admitting = time.perf_counter()
            for b in range(batch.rows):
                if rows[b] is None and queue:
                    rows[b] = admit(batch, b, *queue.popleft())
            since += time.perf_counter() - admitting
            limit = width.next(batch.slots, () if queue else [b for b, row in enumerate(rows) if row is not None])
            for b, row in enumerate(rows):
                if row is None or row.error is not None:  # (its `start` raised: it ends this round)
                    continue
                row.state.width, row.state.batch_tokens = limit, limit * batch.rows
                # a second of drafting holds up every row, shared with the rows drafting beside it
                row.state.stall = batch.rows / len(drafters | {b})
                row.state.trying = limit != width.best or not width.verified
                _advance(row, None)
            pending = {b: row.pending for b, row in enumerate(rows) if row is not None and row.pending is not None}
            drafting = {b: call for b, call in pending.items() if call.lm is not None}
            served = drafting or pending  # target calls wait for the rows still drafting, to verify all in one call
            drafted |= drafting.keys()
            if served and not drafting:  # the round's target call
                drafters, drafted = drafted, set()
            answers: dict[int, torch.Tensor] = {}
            for cache in (batch, *batch.drafts):  # one forward per model: the target's, each draft model's
                calls = {
                    b: call for b, call in served.items() if (batch if call.lm is None else call.cache.batch) is cache
                }
                if calls:
                    began = time.perf_counter()
                    answers.update(cache.forward(calls))
                    if cache is not batch:  # a draft model's call: priced in its rows' plans (`stall`), not the width's
                        cache.lm.synchronize()
                        since += time.perf_counter() - began
            for b, logits in answers.items():
                rows[b].state.stats.target_calls += rows[b].pending.lm is None
                _advance(rows[b], logits)
            lm.synchronize()
            target = [len(call.tokens) for call in served.values() if call.lm is None]
            if target and timed:
                now = time.perf_counter()
                width.took(max(target), now - since, batch.slots)
                since = now
            for b, row in enumerate(rows):
                if row is not None and row.steps is None:  # its step is done
                    state = row.state
                    if state.verified is not None:
                        width.observe(*state.verified, row=b)
                        state.verified = None
                    added = state.tokens[row.before :]
                    if not added and not state.finished and row.error is None:
                        row.error = RuntimeError(f"strategy {row.decoder.name!r} made a step that accepted no token")
                    elapsed = time.perf_counter() - row.began
                    state.stats.ttft_seconds = state.stats.ttft_seconds or elapsed
                    state.stats.seconds = elapsed
                    piece = ""
                    if with_text:
                        full = state.lm.decode(state.new_tokens)
                        if full.endswith("\ufffd") and not state.finished and row.error is None:
                            full = full[:-1]  # an incomplete UTF-8 character: streamed with the next step
                        piece, row.text = full[len(row.text) :], full
                    chunk = Chunk(added, piece, state.sources[len(state.sources) - len(added) :], row.index)
                    if row.error is not None:
                        state.finish_reason = "error"
                    if state.finished:
                        if row.error is None:
                            try:
                                row.decoder.finish(state)
                            except Exception as error:  # noqa: BLE001  (as a step's: its tokens kept, the others go on)
                                row.error, state.finish_reason = error, "error"
                        batch.clear(b)
                        width.forget(b)
                        rows[b] = None
                    done.append(
                        (row.index, chunk, Decoding(state, row.decoder).result(row.error) if state.finished else None)
                    )
        for item in done:
            paused = time.perf_counter()  # (the caller's time with the chunk is not the batch's)
            yield item
            since += time.perf_counter() - paused


def one_at_a_time(
    runs: list[tuple[DecodeState, Decoder]], with_text: bool = True
) -> Iterator[tuple[int, Chunk, Result | None]]:
    """`run` with one row in flight: each run alone on its own cache, as `decoders.generate` runs one prompt (a batch
    of one shares no call: its masks, slots and widths would only cost)."""
    for index, (state, decoder) in enumerate(runs):
        run, error = Decoding(state, decoder), None
        chunks = run.chunks(with_text)
        streamed, text = len(state.tokens), ""  # what its chunks held so far
        while not state.finished:
            try:
                chunk = next(chunks)
            except Exception as raised:  # noqa: BLE001  (as a batch's row: the later runs go on)
                error, state.finish_reason = raised, "error"
                added = state.tokens[streamed:]  # accepted before the raise (a `finish` that raised: its last step)
                piece = state.lm.decode(state.new_tokens)[len(text) :] if with_text else ""
                chunk = Chunk(added, piece, state.sources[len(state.sources) - len(added) :])
            streamed, text = len(state.tokens), text + chunk.text
            yield index, replace(chunk, index=index), run.result(error) if state.finished else None


def admit(batch: BatchCache, b: int, index: int, run: tuple[DecodeState, Decoder]) -> Row:
    """Start run `index` in row `b`: its prompt but the last token prefilled alone, then its strategy's `start`. Its
    clock starts before the prefill, as a run alone counts its prompt's call."""
    state, decoder = run
    began = time.perf_counter()
    batch.prefill(b, state.tokens[:-1])
    state.cache, state.batch_tokens = batch.row(b), batch.rows  # (its strategy starts knowing it is in a batch)
    row = Row(index, state, decoder, began, before=len(state.tokens))  # (a row whose `start` raised added nothing)
    try:
        decoder.start(state)
    except Exception as error:  # noqa: BLE001  (where drafters are built: as a step's, the row ends with it)
        row.error = error
    return row


def _advance(row: Row, logits: torch.Tensor | None) -> None:
    """Step `row` on until its strategy asks for a call (`row.pending`) or its step ends (`row.steps` None).
    `logits`: the answer to its pending call; None to start a step."""
    try:
        if row.steps is None:
            if logits is not None:
                raise RuntimeError("logits for a row with no step in progress")
            row.before, row.steps = len(row.state.tokens), row.decoder.steps(row.state)
            row.pending = next(row.steps)
        elif logits is not None:
            row.pending = row.steps.send(logits)
    except StopIteration:
        row.steps = row.pending = None
    except Exception as error:  # noqa: BLE001  (its strategy's, grammar's or drafter's: the other rows go on)
        row.steps = row.pending = None
        row.error = error
