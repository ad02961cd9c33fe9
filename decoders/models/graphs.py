"""A static KV cache, and CUDA graphs of the calls that write it (a small model's eager GPU call is bound by kernel
launches). A graph replays fixed addresses and shapes: the cache is a preallocated `Slab` written in place, rolled back
by moving its length (stale slots masked, then overwritten), and a call runs padded to a bucket (padded rows write
slots no query sees). Off the GPU the same cache runs eagerly, as the tests do."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decoders.models.slabs import BUCKETS, MIN_CAPACITY, Slab, SlotCache, lend

# the most slots a run reserves: attention reads every slot of its slab, so a long run grows its cache as it goes
MAX_RESERVE = 4096


class StaticKVCache:
    """A run's `Cache` over a `Slab` of the LM, rolled back by moving its length."""

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
        """`LM.forward` of `lm` (this cache's LM, or its quantized copy drafting on it): ids, positions [1, T];
        logits [T or keep, vocab]."""
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
