"""Turning target logits into a next-token distribution: temperature, top-k, top-p, min-p, and seeded sampling.

The same `SamplingConfig.probs` is applied to the target and to any draft distribution, so every strategy samples
from exactly one well-defined target distribution.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How a next token is chosen; `temperature == 0` means greedy (argmax)."""

    temperature: float = 0.0  # 0 = greedy; > 0 divides the logits before the softmax
    top_k: int | None = None  # keep the k most probable tokens
    top_p: float | None = None  # keep the smallest set of tokens whose probability reaches top_p
    min_p: float | None = None  # keep tokens whose probability is at least min_p times the most probable one

    def __post_init__(self):
        if not _real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be a whole number >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1] or None, got {self.top_p!r}")
        if self.min_p is not None and not (_real(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be a number in [0, 1] or None, got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax, not sampled."""
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The filtered, renormalized distribution for sampling mode.  logits: [..., vocab] -> probs: [..., vocab]."""
        if self.greedy:
            raise ValueError("probs() is for sampling mode; greedy mode takes the argmax of the logits")
        if self.temperature >= TINY:
            logits = logits.float() / self.temperature
        else:  # dividing would overflow float32: divide each logit's distance to its row's max, in float64 (which
            # holds any temperature), so the max goes to 0 and the rest to -inf: the same softmax, without inf - inf.
            # Both sides scaled by 2^600 first: a GPU flushes a subnormal divisor (below 2.2e-308) to zero, 0 / 0 = NaN
            scale = 2.0**600
            distance = (logits.double() - logits.amax(dim=-1, keepdim=True)) * scale
            logits = (distance / (self.temperature * scale)).float()
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]  # [..., 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more probable tokens
            drop_sorted = mass_before >= self.top_p  # never drops the most probable token
            probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        if self.min_p is not None and self.min_p > 0.0:
            floor = self.min_p * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)


TINY = 1e-30  # below this temperature, logits / temperature may overflow float32 (its max is 3.4e38)


def _real(value) -> bool:
    """A finite real number (numpy's count; bools do not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def sample(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from a single position's logits [vocab]: argmax in greedy mode, else a seeded draw."""
    if config.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(config.probs(logits), 1, generator=generator))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` (or from fresh entropy when None)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
