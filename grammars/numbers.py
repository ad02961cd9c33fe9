"""Regexes for JSON integers and numbers within bounds (`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`).

outlines-core ignores numeric bounds, so a schema's `"minimum": 3` would still let the model write -5. These regexes
match exactly the canonical decimal spellings inside the bounds: no leading zeros, no "-0", no exponent (a subset of
valid JSON, so every match validates). They use only syntax that Python's `re` and Rust's `regex` read alike, which
lets the tests check them against Python arithmetic.
"""

from __future__ import annotations

import functools
from decimal import Decimal


def integer_range(low: int | None, high: int | None) -> str | None:
    """A regex for the integers in [low, high] (None = unbounded); None if there are none."""
    if low is not None and high is not None and low > high:
        return None
    parts = []
    if high is None or high >= 0:  # the non-negative part
        parts.append(_natural_range(max(low or 0, 0), high))
    if low is None or low < 0:  # the negative part: "-" and a magnitude in [max(1, -high), -low]
        magnitude = _natural_range(max(1, -high if high is not None else 1), None if low is None else -low)
        if magnitude is not None:
            parts.append("-" + _group(magnitude))
    return _alternatives([p for p in parts if p is not None])


def number_range(
    low: Decimal | None, high: Decimal | None, low_strict: bool = False, high_strict: bool = False
) -> str | None:
    """A regex for the decimal numbers in [low, high] (strict ends excluded; None = unbounded); None if empty."""
    if low is not None and high is not None and (low > high or (low == high and (low_strict or high_strict))):
        return None
    parts = []
    if high is None or high > 0 or (high == 0 and not high_strict):  # values >= 0
        if low is None or low < 0:
            low_part, low_part_strict = Decimal(0), False
        else:
            low_part, low_part_strict = low, low_strict
        parts.append(_magnitude_range(low_part, low_part_strict, high, high_strict))
    if low is None or low < 0:  # values < 0: "-" and a magnitude m > 0 with -high <= m <= -low
        if high is None or high >= 0:
            m_low, m_low_strict = Decimal(0), True
        else:
            m_low, m_low_strict = -high, high_strict
        magnitude = _magnitude_range(m_low, m_low_strict, None if low is None else -low, low_strict)
        if magnitude is not None:
            parts.append("-" + _group(magnitude))
    return _alternatives([p for p in parts if p is not None])


def _natural_range(low: int, high: int | None) -> str | None:
    """Non-negative integers in [low, high] without leading zeros, longest spellings first (see the module doc)."""
    return _alternatives([regex for _, regex in _natural_parts(low, high)])


def _natural_parts(low: int, high: int | None) -> list[tuple[float, str]]:
    """(digit count, regex) of the integers in [low, high], one part per digit count, longest first."""
    if high is not None and low > high:
        return []
    parts = []
    length = len(str(low))
    while high is None or length <= len(str(high)):
        start = max(low, 10 ** (length - 1) if length > 1 else 0)
        if high is None and start == 10 ** (length - 1) and length > 1:
            parts.append((float("inf"), f"[1-9][0-9]{{{length - 1},}}"))  # every longer number too
            break
        end = 10**length - 1 if high is None else min(high, 10**length - 1)
        if start <= end:
            parts.append((length, _same_length(str(start), str(end))))
        length += 1
    return sorted(parts, key=lambda part: -part[0])


def _same_length(x: str, y: str) -> str:
    """Digit strings of len(x) == len(y) between x and y (inclusive)."""
    if not x:
        return ""
    if x == y:
        return x
    if x[0] == y[0]:
        return x[0] + _same_length(x[1:], y[1:])
    rest = len(x) - 1
    if set(x[1:]) <= {"0"} and set(y[1:]) <= {"9"}:
        return _digit_class(int(x[0]), int(y[0])) + _repeat(rest)
    parts = [x[0] + _group(_same_length(x[1:], "9" * rest))]
    if int(x[0]) + 1 <= int(y[0]) - 1:
        parts.append(_digit_class(int(x[0]) + 1, int(y[0]) - 1) + _repeat(rest))
    parts.append(y[0] + _group(_same_length("0" * rest, y[1:])))
    return _alternatives(parts)


def _magnitude_range(low: Decimal, low_strict: bool, high: Decimal | None, high_strict: bool) -> str | None:
    """Non-negative decimals `I(.F)?` with low <(=) value <(=) high (high None = unbounded), longest integers first."""
    if high is not None and (low > high or (low == high and (low_strict or high_strict))):
        return None
    any_fraction = _fraction("", "", False, False, lower=False, upper=False)
    low_int, low_frac = _split(low)
    parts: list[tuple[float, str | None]] = []
    if high is None:
        parts.append((len(str(low_int)), _int_with_fraction(low_int, low_frac, low_strict, None, False)))
        parts += [(n, _group(r) + any_fraction) for n, r in _natural_parts(low_int + 1, None)]
    else:
        high_int, high_frac = _split(high)
        if low_int == high_int:
            return _int_with_fraction(low_int, low_frac, low_strict, high_frac, high_strict)
        parts.append((len(str(low_int)), _int_with_fraction(low_int, low_frac, low_strict, None, False)))
        parts += [(n, _group(r) + any_fraction) for n, r in _natural_parts(low_int + 1, high_int - 1)]
        parts.append((len(str(high_int)), _int_with_fraction(high_int, "", False, high_frac, high_strict)))
    return _alternatives([regex for _, regex in sorted(parts, key=lambda part: -part[0]) if regex is not None])


def _int_with_fraction(
    whole: int, low_frac: str, low_strict: bool, high_frac: str | None, high_strict: bool
) -> str | None:
    fraction = _fraction(low_frac, high_frac or "", low_strict, high_strict, lower=True, upper=high_frac is not None)
    return None if fraction is None else str(whole) + fraction


def _split(value: Decimal) -> tuple[int, str]:
    """(integer part, fraction digits without trailing zeros) of a non-negative decimal."""
    text = format(value, "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _fraction(x: str, y: str, x_strict: bool, y_strict: bool, lower: bool, upper: bool) -> str | None:
    """The optional `.digits` part whose value 0.G lies above 0.x (if `lower`) and below 0.y (if `upper`).

    A digit-by-digit automaton: at each position G is either still equal to x's (y's) digits - "tight" - or already
    above (below) them, after which any digit goes. No fraction at all counts as the value 0.
    """

    @functools.cache
    def rest(i: int, tight_low: bool, tight_high: bool) -> tuple[bool, str | None]:
        """(may G end at position i, regex of a non-empty continuation G[i:]) given the tightness so far."""
        if tight_low and i >= len(x) and not x_strict:
            tight_low = False  # x's remaining digits are zeros: anything is >= them
        if not tight_low and not tight_high:
            return True, "[0-9]+"
        if tight_low and i >= len(x) and not tight_high:  # strictly above x's value: some non-zero digit must follow
            return False, "0*[1-9][0-9]*"
        if tight_high and i >= len(y):  # y's remaining digits are zeros: only zeros fit, if y itself is allowed
            ok = not y_strict and not tight_low
            return ok, ("0+" if ok else None)
        lo = int(x[i]) if tight_low and i < len(x) else 0
        hi = int(y[i]) if tight_high and i < len(y) else 9
        end_ok = not tight_low and not (tight_high and y_strict and set(y[i:]) <= {"0"})
        options: dict[tuple[bool, bool], list[int]] = {}
        for digit in range(lo, hi + 1):
            key = (tight_low and digit == lo, tight_high and digit == hi)
            options.setdefault(key, []).append(digit)
        parts = []
        for (low_next, high_next), digits in options.items():
            can_end, more = rest(i + 1, low_next, high_next)
            tail = (_group(more) + "?" if can_end else _group(more)) if more else ("" if can_end else None)
            if tail is not None:
                parts.append(_digit_class(digits[0], digits[-1]) + tail)
        return end_ok, _alternatives(parts)

    can_end, digits = rest(0, lower, upper)
    if digits is None:
        return "" if can_end else None
    return f"(?:\\.{_group(digits)})" + ("?" if can_end else "")


def _digit_class(low: int, high: int) -> str:
    return str(low) if low == high else f"[{low}-{high}]"


def _repeat(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


def _group(regex: str) -> str:
    return regex if len(regex) <= 1 or (regex.startswith("(?:") and _balanced(regex[3:-1])) else f"(?:{regex})"


def _balanced(inner: str) -> bool:
    """True if `inner` never closes the group it sits in (so "(?:" + inner + ")" is one group)."""
    depth = 0
    for i, char in enumerate(inner):
        if char == "\\":
            continue
        if char == "(" and (i == 0 or inner[i - 1] != "\\"):
            depth += 1
        elif char == ")" and (i == 0 or inner[i - 1] != "\\"):
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def _alternatives(parts: list[str]) -> str | None:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"
