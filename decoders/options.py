"""Validators for strategy and run options, so every frozen options dataclass checks its fields the same way."""

from __future__ import annotations

import dataclasses
import math
import numbers


def whole(name: str, value, least: int = 1, below: int | None = None) -> int:
    """`value` as an int if a whole number >= `least` (and < `below`; numpy ints count, bools not), else ValueError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < least
        or (below is not None and value >= below)
    ):
        bound = f">= {least}" if below is None else f"in [{least}, {below})"
        raise ValueError(f"{name} must be a whole number {bound}, got {value!r}")
    return int(value)


def probability(name: str, value, high_open: bool = False) -> float:
    """`value` if it is a real number in [0, 1] (or [0, 1) when `high_open`), else a ValueError naming `name`."""
    inside = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value
        and (value < 1 if high_open else value <= 1)
    )
    if not inside:
        raise ValueError(f"{name} must be a probability in [0, 1{')' if high_open else ']'}, got {value!r}")
    return float(value)


def check_whole(options, **least: int) -> None:
    """Check several whole-number fields of `options` at once: `check_whole(self, k=1, ngram=0)`."""
    for name, bound in least.items():
        whole(name, getattr(options, name), bound)


def check_flags(options) -> None:
    """Check that every field of `options` declared `bool` holds True or False (a 'yes' or 0 is a mistake: refused)."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.type in (bool, "bool") and not isinstance(value, bool):
            raise ValueError(f"{f.name} must be True or False, got {value!r}")
