"""`Call`: one model call, as a step yields it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from decoders.models.cache import Cache
    from decoders.models.lm import LM


@dataclass
class Call:
    """One model call a step yields, the target's or a draft's (`lm`): a batch runs each model's in one forward."""

    tokens: list[int]  # [T]
    positions: list[int] | None = None  # [T] position ids; None: len(cache) + 0..T-1
    tree_mask: torch.Tensor | None = None  # [T, T] (or [T, len(cache) + T]) bool: token i sees j; None: causal
    keep: int = 0  # logits of the last `keep` positions only (0: all)
    lm: LM | None = None  # a draft model's call: that model; None: the run's target
    cache: Cache | None = None  # a draft model's call: the draft's cache (or batch row)
