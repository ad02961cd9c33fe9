"""What decodekit keeps with a model between runs: `Held` per `LM`, `Shared` per torch module (`model.generate` wraps
the module in a new LM at every call)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from decoders.models.slabs import BatchSlab, Slab


@dataclass
class Held:
    """One LM's native step, probe verdicts, static buffers, graph memory pool and quantized copies."""

    native: Any = None  # its native step (`models.native.NativeStep`); None: transformers' calls
    tree_mask: bool | str | None = None  # `LM.check_tree_mask`'s probe: True, or what went wrong; None: not probed
    static_cache: bool | str | None = None  # `LM.static_cache_ok`'s probe, likewise
    slabs: dict[int, Slab] = field(default_factory=dict)  # capacity -> the static buffers lent to a run's cache
    batch_slabs: dict[tuple[int, int], BatchSlab] = field(default_factory=dict)  # (rows, capacity) -> a batch's
    graph_pool: Any = None  # the memory pool all its CUDA graphs share (`capture.capture`)
    copies: dict[str, Any] = field(default_factory=dict)  # scheme -> its quantized copy, an LM (`quantize.self_draft`)


@dataclass
class Shared:
    """What every LM wrapping one torch module shares."""

    copies: dict[str, Any] = field(default_factory=dict)  # scheme -> the quantized module made of it
    int8_pays: dict[str, bool] = field(default_factory=dict)  # role -> whether its int8 copy pays (`drafting.copies`)
    native: Any = None  # its `models.native.NativeStep`, or why the native step does not run it; None: not asked


_SHARED: weakref.WeakKeyDictionary[Any, Shared] = weakref.WeakKeyDictionary()


def shared(module) -> Shared:
    """What every LM wrapping torch `module` shares."""
    if module not in _SHARED:
        _SHARED[module] = Shared()
    return _SHARED[module]
