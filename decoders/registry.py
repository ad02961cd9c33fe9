"""The strategy registry. Plugins may also register through the `decodekit.strategies` entry-point group, loaded the
first time the registry is read."""

from __future__ import annotations

import difflib
import warnings
from importlib.metadata import entry_points

_STRATEGIES: dict[str, type] = {}
_entry_points_loaded = False


def register(name: str):
    """Class decorator: make a `Decoder` subclass available under `name`. A taken name raises."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a strategy name must be a Python identifier-like string, got {name!r}")

    def decorate(cls):
        from decoders.base import Decoder

        if not (isinstance(cls, type) and issubclass(cls, Decoder)):
            raise TypeError(f"@register({name!r}) decorates subclasses of decoders.Decoder, got {cls!r}")
        taken = _STRATEGIES.get(name)
        if taken is not None and taken is not cls:
            raise ValueError(f"strategy name {name!r} is already taken by {taken.__module__}.{taken.__qualname__}")
        cls.name = name
        _STRATEGIES[name] = cls
        return cls

    return decorate


def unregister(name: str) -> None:
    """Remove a strategy (for tests and notebooks that redefine one)."""
    _STRATEGIES.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in entry_points(group="decodekit.strategies"):
        try:
            point.load()  # importing the module runs its @register
        except Exception as error:  # noqa: BLE001 - a broken plugin must not take the built-in strategies down
            warnings.warn(
                f"decodekit: could not load strategy plugin {point.name!r} ({point.value}): {error}", stacklevel=1
            )


def available() -> list[str]:
    """Sorted names of every registered strategy."""
    _load_entry_points()
    return sorted(_STRATEGIES)


def get(name: str) -> type:
    """The strategy class registered under `name`; an unknown name raises with the known names and the nearest."""
    _load_entry_points()
    if name in _STRATEGIES:
        return _STRATEGIES[name]
    known = sorted(_STRATEGIES)
    nearest = difflib.get_close_matches(str(name), known, n=1, cutoff=0.5)
    hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
    raise ValueError(f"unknown strategy {name!r}.{hint} Known strategies: {', '.join(known)}")
