"""A static KV cache, and CUDA graphs of the model calls that write it.

On a GPU a small model's call is bound by launching its kernels, not by reading its weights: a 1.5B model in eager
mode takes several times the milliseconds its weights take to read. Replaying a captured CUDA graph launches the
whole call at once. A graph replays fixed addresses and shapes, so:

- the cache is a preallocated buffer of `capacity` slots per layer, written in place at slots `past .. past + T`;
  rolling back only moves `len(cache)`, the stale slots being hidden by the attention mask and overwritten later;
- a call of T <= 32 tokens runs padded to a bucket (1, 2, 4, 8, 16, 32 tokens) whose graph takes its ids, positions,
  tree mask and `past` from static buffers; the attention mask is built inside the graph from them. Padded rows write
  slots past the call's end, which no query sees;
- buffers and graphs (a `Slab` per capacity) stay with the LM and are lent to one cache at a time: a later run reuses
  them without capturing again. A cache outgrowing its slab moves to one of twice the capacity;
- a batch (`decoders.batch.BatchCache`) keeps its rows in a `BatchSlab` per rows and capacity, lent the same way: its
  calls write every row at the same slots, padded to a bucket's width, each row's mask built by the batch.

`LM.compile_calls` also compiles each captured call with `torch.compile` first (tens of seconds of compiling for fewer,
fused kernels; a string names torch.compile's mode). A call whose capture fails runs eagerly on the same cache, with
a warning. Off the GPU the same cache runs eagerly (`LM.cuda_graphs = True` on a CPU), which the tests check.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
import weakref
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

BUCKETS = (1, 2, 4, 8, 16, 32)  # token counts with a graph each; longer calls (a prompt) run eagerly
MIN_CAPACITY = 256  # slots of the smallest slab; each next one doubles
MAX_RESERVE = 4096  # a run reserves at most this many slots: attention reads every slot of its slab, so a long
# max_new_tokens grows the cache as the run gets there instead


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
        self.slots: torch.Tensor | None = None  # set before each call: where its T keys go
        super().__init__(layers=[SlotLayer(self) for _ in range(layers)])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.capacity, 0


class Slab:
    """The static buffers of one capacity: the cache, and per bucket the captured call with its input buffers."""

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
        """`lm`'s model (the slab's or its quantized copy) on `ids` [1, T] at `positions` [1, T], written at slots
        past..past+T: logits [1, T, vocab]. `past` a 0-d tensor; `tree` [T, T] bool (query i sees new token j); `wide`
        [T, capacity] bool or None (query i may see cached slot j: a tree grown over several calls hides some)."""
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
        """`call` run by `lm`'s native step (`models.native`, a CPU): logits [keep or T, vocab]. `tree` None: causal."""
        length = ids.shape[1]
        keys, values = self.layers(lm)
        allowed = None
        if tree is not None:
            slot = torch.arange(self.capacity)
            relative = slot - past  # [capacity]: a slot's place among the new tokens, < 0 in the prefix
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
        """`call` through the graph of the smallest bucket that holds T tokens, captured on first use: [T, vocab].
        `tree` None: causal."""
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


def replayed(owner, graphs: dict, key, lm, call, args: tuple, what: str) -> torch.Tensor | None:
    """Replay `graphs[key]` (graph, inputs, logits), captured from `call(lm, *args)` on first use (`capture`): its
    logits buffer; None, with a warning the first time, if its capture failed (the caller runs the call eagerly)."""
    graph, static, logits = graphs[key]
    if graph is False:
        return None
    if graph is None:
        try:
            graph, logits = capture(owner, lm, call, args)
        except Exception as error:  # noqa: BLE001 - any failure: this call runs eagerly from now on
            warnings.warn(
                f"{lm.name}: its {what} could not be captured as a CUDA graph ({type(error).__name__}: "
                f"{error}); they run eagerly",
                stacklevel=1,
            )
            graphs[key] = (False, static, None)
            return None
        graphs[key] = (graph, static, logits)
    graph.replay()
    return logits


def capture(owner, lm, call, args: tuple):
    """A graph of `call(lm, *args)` on the static tensors `args`, which hold the caller's call, in the memory pool of
    `owner` (the LM whose buffers it writes): the warm-up calls run it for real (writing the slots its replay writes
    again), the capture runs nothing. Returns (graph, its logits buffer)."""
    device = owner.device

    # compiled, the call's many small kernels (norms, rotary, masks) fuse: fewer kernels in the graph to replay
    mode = lm.compile_calls if isinstance(lm.compile_calls, str) else None
    function = torch.compile(call, mode=mode) if lm.compile_calls else call

    def run():
        return function(lm, *args)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture: kernels picked, workspaces allocated
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph, pool, caller = torch.cuda.CUDAGraph(), graph_pool(owner), torch.cuda.current_stream(device)
    # no garbage collection inside the capture: collecting a dropped LM (a cycle with its slabs) frees its graphs'
    # memory pool, a cudaFree that invalidates the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        # thread_local: CUDA work of another thread (transformers' continuous batching runs one) cannot invalidate
        # this capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = run()
    except Exception:
        # a capture failing midway leaves the allocator recording into the pool, which every later capture of
        # this LM would refuse, the capture stream current, and the device's random generator in capture mode,
        # where any later random op outside a graph raises ("Offset increment outside graph capture")
        index = device.index if device.index is not None else torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):
            torch._C._cuda_endAllocateToPool(index, pool)
        owner.held.graph_pool = None
        torch.cuda.set_stream(caller)
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())  # (a copy of its seed and offset, not capturing)
        raise
    finally:
        if collecting:
            gc.enable()
    return graph, logits


def graph_pool(lm):
    """One memory pool for all of an LM's graphs: they never run at once, and each output is copied out."""
    if lm.held.graph_pool is None:
        lm.held.graph_pool = torch.cuda.graph_pool_handle()
    return lm.held.graph_pool


class StaticKVCache:
    """A run's `Cache` over a `Slab` of the LM, rolled back by moving its length; its calls go through `forward`."""

    lends = True

    def __init__(self, lm, reserve: int = 0) -> None:
        self.lm, self.length, self.slab = lm, 0, None
        self.reserve = min(reserve, MAX_RESERVE)  # slots its first slab holds at least

    def __len__(self) -> int:
        return self.length

    @property
    def hf(self) -> SlotCache:
        return self._slab_for(self.length).hf

    def crop(self, n: int) -> None:
        """Keep the first `n` positions."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {n}")
        self.length = n

    def keep(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the positions `indices` (increasing), in that order."""
        index = torch.as_tensor(indices, dtype=torch.long)
        if index.numel() and (index.min() < 0 or index.max() >= self.length):
            raise ValueError(f"keep() indices must lie in [0, {self.length}), got {index.tolist()}")
        if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
            raise ValueError("keep() indices must be strictly increasing: positions keep their order in the sequence")
        first = next((i for i, j in enumerate(index.tolist()) if i != j), len(index))  # the untouched prefix
        if self.slab is not None and first < len(index):
            where = index[first:].to(self.lm.device)
            with torch.inference_mode():
                for layer in self.slab.hf.layers:
                    if layer.is_initialized:  # (index_select copies first: the slots may overlap)
                        layer.keys[:, :, first : len(index)] = layer.keys.index_select(2, where)
                        layer.values[:, :, first : len(index)] = layer.values.index_select(2, where)
        self.length = len(index)

    def fill(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Hold these positions (an empty cache): per layer keys and values [1, heads, n, head_dim]."""
        n = keys[0].shape[2] if keys else 0
        slab = self._slab_for(n)
        with torch.inference_mode():
            for layer, k, v in zip(slab.hf.layers, keys, values):
                if not layer.is_initialized:
                    layer.lazy_initialization(k, v)
                layer.keys[:, :, :n], layer.values[:, :, :n] = k, v
        self.length = slab.hf.length = n

    def resize(self, length: int) -> None:
        """Hold `length` positions whatever their keys (a timing's context): the slots past the end as they are."""
        self._slab_for(length)
        self.length = length

    def beside(self, lm, length: int):
        """An empty cache of this run for model `lm` (a draft)."""
        return lm.new_cache(length)

    def forward(
        self, lm, ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None, keep: int
    ) -> torch.Tensor:
        """`LM.forward` of `lm` (this cache's LM, or its quantized copy drafting on it) on this cache: ids, positions
        [1, T]; logits [T or keep, vocab]."""
        length, past = ids.shape[1], self.length
        device = ids.device
        graphed = self.lm.device.type == "cuda" and length <= BUCKETS[-1]
        slab = self._slab_for(past + (next(b for b in BUCKETS if b >= length) if graphed else length))
        tree = wide = None  # (causal)
        if tree_mask is not None:
            tree_mask = tree_mask.to(device, torch.bool)
            tree = tree_mask[:, -length:]
            if tree_mask.shape[1] > length:  # it also hides cached positions
                wide = torch.ones(length, slab.capacity, dtype=torch.bool, device=device)
                wide[:, past + length - tree_mask.shape[1] : past] = tree_mask[:, :-length]
        with torch.inference_mode():  # (its buffers are inference tensors, whoever calls)
            logits = slab.replay(lm, ids, positions, past, tree, wide) if graphed and slab.capture else None
            if logits is not None:
                logits = logits.clone()
            elif lm.native is not None and lm.native.ready():
                logits = slab.native(lm, ids, positions, past, tree, wide, keep)
                keep = 0
            else:
                if tree is None:
                    tree = torch.ones(length, length, dtype=torch.bool, device=device).tril()
                logits = slab.call(lm, ids, positions, torch.tensor(past, device=device), tree, wide)[0]
        self.length = past + length
        slab.hf.length = self.length
        return logits[-keep:] if keep else logits

    def _slab_for(self, needed: int) -> Slab:
        """This cache's slab, moved to a larger one if it holds fewer than `needed` slots."""
        if self.slab is not None and self.slab.capacity >= needed:
            return self.slab
        capacity = MIN_CAPACITY
        while capacity < max(needed, self.reserve):
            capacity *= 2
        slab = lend(self.lm, capacity, self)
        if self.slab is not None:
            slab.adopt(self.slab, self.length)
            self.slab.owner = None
        self.slab = slab
        slab.hf.length = self.length
        return slab


def lend(lm, capacity: int, cache, rows: int | None = None) -> Slab | BatchSlab:
    """The LM's slab of `capacity` (a `BatchSlab` of `rows` rows for a batch's cache), made on first use, lent to
    `cache`; a private one, never captured, if another live cache holds it (two runs of one model at once: they stay
    exact, the second runs eagerly)."""
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
    """A batch's static buffers (`decoders.batch.BatchCache` where its LM has a static cache): keys and values of
    `rows` rows and `capacity` slots per layer, and per bucket the captured call with its input buffers. The batch
    writes every row's call at the same slots (its queries right-aligned) and builds each row's mask itself."""

    def __init__(self, lm, rows: int, capacity: int, capture: bool) -> None:
        self.lm, self.rows, self.capacity, self.capture = lm, rows, capacity, capture
        self.hf = SlotCache(lm.config.num_hidden_layers, capacity)
        self.graphs: dict[tuple, tuple] = {}  # (bucket, compiled) -> (CUDAGraph, inputs, logits)
        self.owner = None  # a weakref to the BatchCache it is lent to

    def call(self, lm, ids, positions, past, allowed, keys) -> torch.Tensor:
        """The model on `ids`, `positions` [rows, W], written at slots past..past+W (`past` a 0-d tensor); `allowed`
        [rows, W, capacity] (query i of a row may see slot j), `keys` [rows, capacity] the slots' positions: logits
        [rows, W, vocab]."""
        self.hf.slots = past + torch.arange(ids.shape[1], device=ids.device)
        masks = lm.attention_masks(allowed, keys, positions)
        return lm.model(
            input_ids=ids, position_ids=positions, attention_mask=masks, use_cache=True, **{lm.cache_keyword: self.hf}
        ).logits

    def forward(self, ids, positions, past: int, allowed, keys) -> torch.Tensor:
        """`call`, replayed as the CUDA graph of its width (a bucket, captured on first use) where the slab captures,
        run by the LM's native step on a CPU: logits [rows, W, vocab], the caller's to keep."""
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
