"""Linear layers whose weights oneDNN holds prepacked, on a CPU in bfloat16.

A bfloat16 `nn.Linear` on a CPU multiplies by its weight in the plain [out, in] layout; oneDNN's matmul then works
from that layout on every call. The same weight reordered once into oneDNN's own blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what `torch.compile` does to frozen CPU weights) gives the same products
from the same numbers, faster: on a 2-core AVX-512 EPYC, Qwen2.5-Coder-1.5B's one-token call took 130 ms where it took
264 ms (docs/benchmarks.md). The price is a second copy of those weights in memory.

`pack` swaps a model's bfloat16 `nn.Linear` layers for `PackedLinear` (the same parameters, plus the packed copy)
where a probe times them faster and memory holds the copy; `unpacked` runs the plain ones within (the peers, as
users get them).
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Iterator

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """An `nn.Linear` (the same weight and bias parameters) that multiplies by a copy of its weight in oneDNN's
    layout. Moved or cast, it drops the copy and runs as a plain `nn.Linear` from then on."""

    def __init__(self, layer: nn.Linear) -> None:
        nn.Module.__init__(self)  # (not nn.Linear's: it would allocate a weight of its own)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        # the packed weight and the (address, version) of the weight it was packed from; attributes, not buffers: code
        # that walks a model's buffers (e.g. to count bytes) cannot read a packed tensor's storage
        self.packed: torch.Tensor | None = None
        self.packed_from: tuple[int, int] | None = None
        self.repack()
        self.plain = False  # (`unpacked`: the plain layer's call)

    def repack(self) -> None:
        """Pack the weight as it is now (a weight changed in place, e.g. trained, is packed again at its next call)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self.packed_from = (self.weight.data_ptr(), self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if (self.plain or self.packed is None or x.dtype != self.packed.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):  # (no backward)
            return super().forward(x)
        if self.packed_from != (self.weight.data_ptr(), self.weight._version):
            self.repack()
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "packed": None}  # (pickled, e.g. by torch.save: plain, as a cast one)

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        """A plain `nn.Linear` of copied parameters (a model's copy, e.g. cast to float32 or quantized, packs anew)."""
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        layer.weight, layer.bias = copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo)
        memo[id(self)] = layer
        return layer.train(self.training)

    def _apply(self, fn, recurse: bool = True):
        self.packed = None  # (a moved or cast weight: the copy no longer is it)
        return super()._apply(fn, recurse)


def available() -> bool:
    """Whether this torch can pack a bfloat16 weight for oneDNN on this CPU."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(model: nn.Module, probe: bool = True) -> int:
    """Swap `model`'s bfloat16 CPU `nn.Linear` layers (without hooks) for `PackedLinear`s, if memory holds their copy
    and (`probe`) a one-row call through all of them runs faster packed; returns how many were swapped."""
    places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if type(child) is nn.Linear and child.weight.device.type == "cpu"
              and child.weight.dtype == torch.bfloat16 and not _hooked(child)]
    if not places or not available():
        return 0
    layers = list({id(child): child for _, _, child in places}.values())  # (a layer may sit in two places)
    size = sum(layer.weight.nbytes for layer in layers)
    from decoders.models.lm import free_memory

    free = free_memory(torch.device("cpu"))
    if free is not None and 2 * size > free:
        warnings.warn(f"the linear layers' weights ({size / 2**30:.1f} GiB) are not packed for oneDNN: a copy would "
                      f"leave too little of the {free / 2**30:.1f} GiB free (calls run about half as fast)",
                      stacklevel=3)
        return 0
    packed = {id(layer): PackedLinear(layer) for layer in layers}
    if probe and _seconds(packed.values(), plain=False) >= _seconds(packed.values(), plain=True):
        return 0
    for parent, name, child in places:
        setattr(parent, name, packed[id(child)])
    return len(packed)


def _hooked(layer: nn.Module) -> bool:
    """Whether `layer` has hooks (e.g. accelerate's offloading) that a swapped-in layer would not carry."""
    return bool(layer._forward_hooks or layer._forward_pre_hooks or hasattr(layer, "_hf_hook"))


def _seconds(layers, plain: bool, repeats: int = 3) -> float:
    """The least seconds of `repeats` one-row calls through every layer, each in turn (plain or packed); all the
    weights together, not one: one layer's weight may fit in the CPU's cache, and the model's do not."""
    inputs = [torch.zeros(1, layer.in_features, dtype=layer.weight.dtype) for layer in layers]
    best = float("inf")
    with torch.inference_mode(), unpacked_layers(layers, plain):
        for _ in range(repeats):
            start = time.perf_counter()
            for layer, x in zip(layers, inputs):
                layer(x)
            best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def unpacked_layers(layers, plain: bool = True) -> Iterator[None]:
    """Within: `layers` (`PackedLinear`s) run plain (`plain`) or packed."""
    layers = list(layers)
    before = [layer.plain for layer in layers]
    for layer in layers:
        layer.plain = plain
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer.plain = was


def unpacked(*models) -> contextlib.AbstractContextManager:
    """Within: each of `models`' (None skipped) `PackedLinear`s multiplies by its plain weight."""
    return unpacked_layers(m for model in models if model is not None for m in model.modules()
                           if isinstance(m, PackedLinear))


def packed_count(model: nn.Module) -> int:
    """How many of `model`'s linear layers multiply by a packed weight."""
    return sum(isinstance(m, PackedLinear) and m.packed is not None for m in model.modules())  # (each module once)
