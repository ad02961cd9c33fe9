"""`Lru`: the thread-safe, size-bounded cache of compiled indexes, compiled grammars and allowed masks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class Lru(Generic[Value]):
    """Keeps the `size` most recently used values. A value is built outside the lock, so a slow build (compiling an
    index) does not block other threads; two threads that miss together both build, and the later one is kept."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._values: OrderedDict[Hashable, Value] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Value], valid: Callable[[Value], bool] | None = None) -> Value:
        """The value kept for `key`, else `build()` (then kept); a kept value that is not `valid` is built again."""
        with self._lock:
            value = self._values.get(key)
            if value is not None and (valid is None or valid(value)):
                self._values.move_to_end(key)
                return value
        value = build()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.size:
                self._values.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every value."""
        with self._lock:
            self._values.clear()
