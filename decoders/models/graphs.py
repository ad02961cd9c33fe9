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
- a batch (`models.rows.BatchCache`) keeps its rows in a `BatchSlab` per rows and capacity, lent the same way: its
  calls write every row at the same slots, padded to a bucket's width, each row's mask built by the batch.

`LM.compile_calls` also compiles each captured call with `torch.compile` first (tens of seconds of compiling for fewer,
fused kernels; a string names torch.compile's mode). A call whose capture fails runs eagerly on the same cache, with
a warning. Off the GPU the same cache runs eagerly (`LM.cuda_graphs = True` on a CPU), which the tests check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoders.models.slabs import BUCKETS, MIN_CAPACITY, Slab, SlotCache, lend

MAX_RESERVE = 4096  # a run reserves at most this many slots: attention reads every slot of its slab, so a long
# max_new_tokens grows the cache as the run gets there instead


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
