"""A batch's KV caches (docs/design/batching.md): `BatchCache` for every row of a batch, `RowCache` for one."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import DynamicCache

from decoders.models.cache import KVCache, shared_length
from decoders.models.call import Call
from decoders.models.graphs import StaticKVCache
from decoders.models.slabs import BUCKETS, MIN_CAPACITY, lend

if TYPE_CHECKING:
    from decoders.models.lm import LM

PROMPTS_KEPT = 4  # the last prompts' caches a newcomer's prefill may start from
SHARED = 16  # the fewest tokens shared with a kept prompt worth copying (agentic turns share hundreds)
# a row's call feeding this many tokens more than it keeps logits for runs them alone first: padding every row by 8
# tokens costs about a call of 8 tokens alone
FEED_ALONE = 8


class RowCache:
    """One row's view of a `BatchCache`: a `Cache` whose rollback clears the row's own slots."""

    lends = False  # in a batch the target's own int8 copy drafts on a batch cache of its own

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

    def beside(self, lm: LM, length: int = 0) -> RowCache:
        """This row's cache of draft model `lm` in the same batch (empty for a new run)."""
        return self.batch.beside(lm).row(self.row)

    @property
    def hf(self):
        raise TypeError(
            "a batched run's cache is shared by its rows: its calls run in the batch's forward (the "
            "target's own int8 copy drafts on a batch cache of its own in a batch)"
        )


class BatchCache:
    """A model's keys and values for `rows` runs: per layer [rows, heads, slots, head_dim], the slots each row holds
    (`valid` [rows, slots]) and their positions (`positions` [rows, slots]); in a `BatchSlab` on a static cache."""

    def __init__(self, lm: LM, rows: int) -> None:
        self.lm, self.rows = lm, rows
        self.slab = lend(lm, MIN_CAPACITY, self, rows) if lm.static_cache_ok() else None
        self.hf = DynamicCache() if self.slab is None else self.slab.hf
        self.valid = torch.zeros(rows, 0, dtype=torch.bool)
        self.positions = torch.zeros(rows, 0, dtype=torch.long)
        self.drafts: list[BatchCache] = []  # the draft models' caches beside the target's
        # no more prompts kept than rows: their caches then hold about what the rows' prompts hold at most
        self.kept: deque[tuple[list[int], KVCache]] = deque(maxlen=min(PROMPTS_KEPT, rows))

    def beside(self, lm: LM) -> BatchCache:
        """The batch's cache of draft model `lm`, so that its rows' draft calls share a forward."""
        cache = next((c for c in self.drafts if c.lm is lm), None)
        if cache is None:
            cache = BatchCache(lm, self.rows)
            self.drafts.append(cache)
        return cache

    def clear(self, b: int) -> None:
        """Row `b` holds nothing, here and in the draft models' caches (its run ended)."""
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
        """Make room for `slots` slots (invalid for every row), layers shaped after `template`'s."""
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
        """(A static cache) a slab of `slots` slots or more, holding what the current one holds; new layers shaped
        after `like`."""
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
        """Row `b` now holds exactly `tokens` (a prompt), scored alone so that no other row's call is padded to it;
        the first SHARED or more tokens a kept prompt shares are copied, not scored."""
        tokens, prefix = list(tokens), self.lm.new_cache(len(tokens))
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
        """Append `tokens` to row `b`'s, scored alone on a copy of the row (a draft's catch-up), as `prefill`."""
        slots = self.valid[b].nonzero()[:, 0]
        row = self.lm.new_cache(len(slots) + len(tokens))
        row.fill(
            [layer.keys[b : b + 1, :, slots] for layer in self._layers()],
            [layer.values[b : b + 1, :, slots] for layer in self._layers()],
        )
        self.lm.forward(list(tokens), row, keep=1)
        self._store(b, self.slots, row, len(slots))

    def _store(self, b: int, at: int, cache: KVCache | StaticKVCache, held: int) -> None:
        """Row `b`'s slots from `at` on now hold one-row `cache`'s positions from `held` on."""
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
        """One forward serving each row's call, right-aligned in the new slots: each row's logits as `LM.forward`'s
        for that row alone."""
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
            if own.shape[1] > n:  # [n, cached + n]: a draft's tree hiding cached positions
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
