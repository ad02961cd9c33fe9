"""The buffers a static KV cache lives in (`models.graphs`): a `Slab` per capacity (a run's) or a `BatchSlab` per rows
and capacity (a batch's), each with its calls' CUDA graphs, kept with the LM and lent to one cache at a time."""

from __future__ import annotations

import functools
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decoders.models.capture import replayed

BUCKETS = (1, 2, 4, 8, 16, 32)  # token counts with a graph each; longer calls (a prompt) run eagerly
MIN_CAPACITY = 256  # slots of the smallest slab; each next one doubles


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values, [1, heads, capacity, head_dim], written at the owning cache's `slots`."""

    is_compileable = is_croppable = True
    is_sliding = False

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (key_states.shape[0], key_states.shape[1], self.cache.capacity)
        self.keys = key_states.new_zeros(*shape, key_states.shape[-1])
        self.values = value_states.new_zeros(*shape, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.cache.slots, key_states)
        self.values.index_copy_(2, self.cache.slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.cache.capacity, 0

    def get_seq_length(self) -> int:
        return self.cache.length

    def get_max_length(self) -> int:
        return self.cache.capacity

    get_max_cache_shape = get_max_length  # (its name before transformers 5.20)


class SlotCache(Cache):
    """The transformers `Cache` the model writes: every layer a `SlotLayer` over the same `slots` [T]."""

    def __init__(self, layers: int, capacity: int) -> None:
        self.capacity, self.length = capacity, 0
        self.slots: torch.Tensor | None = None  # [T] where the call's keys go, set before each call
        super().__init__(layers=[SlotLayer(self) for _ in range(layers)])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.capacity, 0


class Slab:
    """The static buffers of one capacity: the cache, and per bucket the captured call and its inputs."""

    def __init__(self, lm, capacity: int, capture: bool) -> None:
        self.lm, self.capacity, self.capture = lm, capacity, capture
        self.hf = SlotCache(lm.config.num_hidden_layers, capacity)
        self.graphs: dict[tuple, tuple] = {}  # (bucket, compiled, model) -> (CUDAGraph, inputs, logits)
        self.owner = None  # a weakref to the StaticKVCache it is lent to
        self.causal: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, T) -> `_padded` causal mask

    @torch.inference_mode()
    def adopt(self, other: Slab, length: int) -> None:
        """Take the first `length` slots of `other` (a smaller slab outgrown)."""
        for mine, theirs in zip(self.hf.layers, other.hf.layers):
            if theirs.is_initialized:
                mine.lazy_initialization(theirs.keys, theirs.values)
                mine.keys[:, :, :length] = theirs.keys[:, :, :length]
                mine.values[:, :, :length] = theirs.values[:, :, :length]

    def call(self, lm, ids, positions, past, tree, wide) -> torch.Tensor:
        """`lm`'s model (the slab's or its quantized copy) on `ids`, `positions` [1, T], written at slots past..past+T
        (`past` 0-d): logits [1, T, vocab]. `tree` [T, T]: query i sees new token j; `wide` [T, capacity] or None:
        query i may see cached slot j (a tree grown over several calls hides some)."""
        length = ids.shape[1]
        slot = torch.arange(self.capacity, device=ids.device)
        self.hf.slots = past + torch.arange(length, device=ids.device)
        relative = slot - past  # [capacity]: a slot's place among the new tokens, < 0 in the prefix
        new = (relative >= 0) & (relative < length)
        allowed = tree[:, relative.clamp(0, length - 1)] & new  # [T, capacity]
        cached = relative < 0 if wide is None else (relative < 0) & wide
        allowed = allowed | cached
        masks = lm.attention_masks(allowed[None], slot[None], positions)
        return lm.model(
            input_ids=ids, position_ids=positions, attention_mask=masks, use_cache=True, **{lm.cache_keyword: self.hf}
        ).logits

    def native(self, lm, ids, positions, past: int, tree, wide, keep: int) -> torch.Tensor:
        """`call` run by `lm`'s native step (a CPU): logits [keep or T, vocab]. `tree` None: causal."""
        length = ids.shape[1]
        keys, values = self.layers(lm)
        allowed = None
        if tree is not None:
            slot = torch.arange(self.capacity)
            relative = slot - past  # [capacity], as in `call`
            new = (relative >= 0) & (relative < length)
            cached = relative < 0 if wide is None else (relative < 0) & wide
            allowed = (tree[:, relative.clamp(0, length - 1)] & new) | cached  # [T, capacity]
            allowed = allowed[None]
        return lm.native.call(ids, positions, past, keys, values, allowed, keep)[0]

    def layers(self, lm) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's keys and values [1, kv_heads, capacity, head_dim], allocated for `lm`'s native step."""
        step = lm.native
        for layer in self.hf.layers:
            if not layer.is_initialized or layer.keys.dtype != step.dtype:  # (a model cast: its keys are cast too)
                empty = torch.empty(1, step.kv_heads, 0, step.head_dim, dtype=step.dtype)
                layer.lazy_initialization(empty, empty)
        return [layer.keys for layer in self.hf.layers], [layer.values for layer in self.hf.layers]

    def replay(self, lm, ids, positions, past: int, tree, wide) -> torch.Tensor:
        """`call` replayed as the graph of the smallest bucket that holds T tokens: [T, vocab]. `tree` None: causal."""
        length = ids.shape[1]
        bucket = next(b for b in BUCKETS if b >= length)
        key = bucket, lm.compile_calls, lm.model  # (the model itself, not its id: a graph keeps its weights' addresses)
        if key not in self.graphs:
            self.graphs[key] = (None, self._inputs(bucket), None)
        graph, static, _ = self.graphs[key]
        if graph is False:  # its capture failed: the caller runs it eagerly
            return None
        static["ids"][:, :length] = ids  # (padding: stale ids and positions, rows no real query sees)
        static["positions"][:, :length] = positions
        static["past"].fill_(past)
        static["tree"].copy_(self._padded(bucket, length, tree))
        if wide is not None or static.pop("wide_set", False):
            static["wide"].fill_(True)
            if wide is not None:
                static["wide"][:length] = wide
                static["wide_set"] = True
        logits = replayed(
            self.lm,
            self.graphs,
            key,
            lm,
            self.call,
            (static["ids"], static["positions"], static["past"], static["tree"], static["wide"]),
            f"calls of {bucket} tokens",
        )
        return None if logits is None else logits[0, :length]

    def _padded(self, bucket: int, length: int, tree) -> torch.Tensor:
        """`tree` [T, T] (None: causal) in a [bucket, bucket] mask whose padded rows see themselves only."""
        if tree is None:
            if (bucket, length) not in self.causal:
                causal = torch.ones(length, length, dtype=torch.bool).tril()
                self.causal[bucket, length] = self._padded(bucket, length, causal)
            return self.causal[bucket, length]
        padded = torch.eye(bucket, dtype=torch.bool, device=self.lm.device)
        padded[:length, :length] = tree
        return padded

    def _inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        device = self.lm.device
        return {
            "ids": torch.zeros(1, bucket, dtype=torch.long, device=device),
            "positions": torch.zeros(1, bucket, dtype=torch.long, device=device),
            "past": torch.zeros((), dtype=torch.long, device=device),
            "tree": torch.zeros(bucket, bucket, dtype=torch.bool, device=device),
            "wide": torch.ones(bucket, self.capacity, dtype=torch.bool, device=device),
        }


def lend(lm, capacity: int, cache, rows: int | None = None) -> Slab | BatchSlab:
    """The LM's slab of `capacity` (a `BatchSlab` of `rows` rows for a batch), lent to `cache`; a private one, never
    captured, if another live cache holds it (two runs of one model at once)."""
    slabs = lm.held.slabs if rows is None else lm.held.batch_slabs
    key = capacity if rows is None else (rows, capacity)
    make = functools.partial(Slab, lm, capacity) if rows is None else functools.partial(BatchSlab, lm, rows, capacity)
    slab = slabs.get(key)
    if slab is None:
        slab = slabs[key] = make(capture=lm.device.type == "cuda")
    elif slab.owner is not None and slab.owner() is not None:
        return make(capture=False)
    slab.owner = weakref.ref(cache)
    return slab


class BatchSlab:
    """A batch's static buffers (`models.rows.BatchCache`): keys and values of `rows` rows and `capacity` slots per
    layer, and per width the captured call."""

    def __init__(self, lm, rows: int, capacity: int, capture: bool) -> None:
        self.lm, self.rows, self.capacity, self.capture = lm, rows, capacity, capture
        self.hf = SlotCache(lm.config.num_hidden_layers, capacity)
        self.graphs: dict[tuple, tuple] = {}  # (bucket, compiled) -> (CUDAGraph, inputs, logits)
        self.owner = None  # a weakref to the BatchCache it is lent to

    def call(self, lm, ids, positions, past, allowed, keys) -> torch.Tensor:
        """The model on `ids`, `positions` [rows, W], written at slots past..past+W (`past` 0-d); `allowed` [rows, W,
        capacity]: query i may see slot j; `keys` [rows, capacity]: the slots' positions. Logits [rows, W, vocab]."""
        self.hf.slots = past + torch.arange(ids.shape[1], device=ids.device)
        masks = lm.attention_masks(allowed, keys, positions)
        return lm.model(
            input_ids=ids, position_ids=positions, attention_mask=masks, use_cache=True, **{lm.cache_keyword: self.hf}
        ).logits

    def forward(self, ids, positions, past: int, allowed, keys) -> torch.Tensor:
        """`call`, replayed as its width's CUDA graph or run by the native step: logits [rows, W, vocab], a copy."""
        lm, device, width = self.lm, self.lm.device, ids.shape[1]
        self.hf.length = past
        if lm.native is not None and lm.native.ready() and all(layer.is_initialized for layer in self.hf.layers):
            layers = self.hf.layers
            return lm.native.call(
                ids,
                positions,
                past,
                [layer.keys for layer in layers],
                [layer.values for layer in layers],
                allowed,
                width,
            )
        with torch.inference_mode():
            if self.capture and width in BUCKETS:
                key = width, lm.compile_calls
                if key not in self.graphs:
                    self.graphs[key] = (None, self._inputs(width), None)
                graph, static, _ = self.graphs[key]
                if graph is not False:
                    static["ids"].copy_(ids)
                    static["positions"].copy_(positions)
                    static["past"].fill_(past)
                    static["allowed"].copy_(allowed)
                    static["keys"].copy_(keys)
                    logits = replayed(
                        lm,
                        self.graphs,
                        key,
                        lm,
                        self.call,
                        tuple(static.values()),
                        f"batch calls of {self.rows} x {width} tokens",
                    )
                    if logits is not None:
                        return logits.clone()
            return self.call(
                lm,
                ids.to(device),
                positions.to(device),
                torch.tensor(past, device=device),
                allowed.to(device),
                keys.to(device),
            )

    def _inputs(self, width: int) -> dict[str, torch.Tensor]:
        device, rows = self.lm.device, self.rows
        return {
            "ids": torch.zeros(rows, width, dtype=torch.long, device=device),
            "positions": torch.zeros(rows, width, dtype=torch.long, device=device),
            "past": torch.zeros((), dtype=torch.long, device=device),
            "allowed": torch.zeros(rows, width, self.capacity, dtype=torch.bool, device=device),
            "keys": torch.zeros(rows, self.capacity, dtype=torch.long, device=device),
        }
