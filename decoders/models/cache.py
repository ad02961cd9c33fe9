from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class KVCache:
    """The keys and values of the tokens a model has seen, for one sequence, with rollback (`crop`, `keep`)."""

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
        """Keep only the positions `indices` (increasing), in that order: e.g. the prefix plus an accepted tree path."""
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
