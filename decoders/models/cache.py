"""The `Cache` protocol of every KV cache, and `KVCache`, a run's cache on transformers' `DynamicCache`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class Cache(Protocol):
    """One run's keys and values of one model's calls, with rollback to the tokens a step accepted."""

    lends: bool  # whether another model's calls may write it: the target's own quantized copy, drafting on it

    def __len__(self) -> int:
        """The positions it holds."""

    def crop(self, n: int) -> None:
        """Keep the first `n` positions."""

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the positions `indices` (increasing), in that order: e.g. the prefix plus an accepted tree path."""

    def beside(self, lm, length: int) -> Cache:
        """An empty cache of this run for model `lm` (a draft), of up to `length` positions."""


def shared_length(a: Sequence, b: Sequence) -> int:
    """How many tokens `a` and `b` share at their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class KVCache:
    """The keys and values of the tokens a model has seen, for one sequence, with rollback (`crop`, `keep`)."""

    lends = True

    def __init__(self) -> None:
        # No config: full-length layers even for sliding-window models (their mask slides), so any position rolls back
        self.hf = DynamicCache()

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def _layers(self):
        for layer in self.hf.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(
                    f"cannot roll back a {type(layer).__name__} cache layer; decodekit needs models whose attention "
                    "keeps plain key/value tensors (recurrent or linear-attention layers cannot be rewound)"
                )
            if layer.is_initialized and layer.keys is not None:
                yield layer

    def crop(self, n: int) -> None:
        """Keep the first `n` positions."""
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot crop a cache of {len(self)} positions to {n}")
        if n == len(self):
            return
        for layer in self._layers():
            layer.keys = layer.keys[..., :n, :]  # [1, heads, n, head_dim]
            layer.values = layer.values[..., :n, :]

    def keep(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the positions `indices` (increasing)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        if index.numel() and (index.min() < 0 or index.max() >= len(self)):
            raise ValueError(f"keep() indices must lie in [0, {len(self)}), got {index.tolist()}")
        if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
            raise ValueError("keep() indices must be strictly increasing: positions keep their order in the sequence")
        for layer in self._layers():
            where = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, where)
            layer.values = layer.values.index_select(-2, where)

    def fill(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Hold these positions (an empty cache): per layer keys and values [1, heads, n, head_dim]."""
        for i, (k, v) in enumerate(zip(keys, values)):
            self.hf.update(k, v, i)

    def resize(self, length: int) -> None:
        """Hold `length` positions whatever their keys (a timing's context): cropped, or tiled."""
        if len(self) >= length:
            self.crop(length)
            return
        for layer in self.hf.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                reps = -(-length // layer.keys.shape[-2])
                layer.keys = layer.keys.repeat_interleave(reps, dim=-2)[..., :length, :]  # [1, heads, length, head_dim]
                layer.values = layer.values.repeat_interleave(reps, dim=-2)[..., :length, :]

    def beside(self, lm, length: int) -> KVCache:
        """An empty cache of this run for model `lm` (a draft)."""
        return lm.new_cache(length)
