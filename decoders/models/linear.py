"""Linear layers whose few-row products run on the native step's kernel, reading the module's own weight, for bfloat16
CPU models the native step does not run whole (docs/design/native.md)."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Iterator

import torch
from torch import nn

ROWS = (8, 16, 32, 64, 128)  # the call sizes `_native_rows` times, in order
_crossovers: dict[tuple, int] = {}  # (out, in) -> the most rows a call runs on the native kernel, once per process


class NativeLinear(nn.Linear):
    """An `nn.Linear` (the same weight and bias) whose few-row bfloat16 CPU calls run on the native kernel."""

    def __init__(self, layer: nn.Linear, lib: ctypes.CDLL, native_rows: int | None = None) -> None:
        nn.Module.__init__(self)  # (not nn.Linear's: it would allocate a weight of its own)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.lib = lib
        self.plain = False
        self.native_rows = native_rows or _native_rows(self)  # calls of up to this many rows run natively

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        weight = self.weight
        rows = x.numel() // self.in_features if x.dim() else 0
        if (
            self.plain
            or not 0 < rows <= self.native_rows
            or x.device.type != "cpu"
            or x.dtype != torch.bfloat16
            or weight.dtype != torch.bfloat16
            or weight.device.type != "cpu"
            or not weight.is_contiguous()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):  # (no backward)
            return super().forward(x)
        return self.native(x, rows)

    def native(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        inputs = x.reshape(rows, self.in_features).contiguous()
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        self.lib.dk_linear(
            inputs.data_ptr(),
            rows,
            self.in_features,
            self.weight.data_ptr(),
            None,
            self.out_features,
            out.data_ptr(),
            1,
            1,
            torch.get_num_threads(),
        )
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "lib"}  # (a ctypes handle: unpickled, it runs plain)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, lib=None, plain=True)

    def __deepcopy__(self, memo: dict) -> nn.Linear:
        """A plain `nn.Linear` of copied parameters (a model's copy, e.g. quantized, decides for itself)."""
        import copy

        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        layer.weight, layer.bias = copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo)
        memo[id(self)] = layer
        return layer.train(self.training)


def _native_rows(layer: NativeLinear) -> int:
    """The most rows (of `ROWS`) at which the native kernel is not slower than oneDNN for this shape (4 at least)."""
    key = (layer.out_features, layer.in_features)
    if key not in _crossovers:
        _crossovers[key] = 4
        with torch.inference_mode():
            for rows in ROWS:
                x = torch.zeros(rows, layer.in_features, dtype=torch.bfloat16)
                if _seconds(lambda x=x, rows=rows: layer.native(x, rows)) > _seconds(
                    lambda x=x: nn.functional.linear(x, layer.weight)
                ):
                    break
                _crossovers[key] = rows
    return _crossovers[key]


def _seconds(call, repeats: int = 3) -> float:
    """The least seconds of `repeats` calls, after one untimed."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def available() -> bool:
    """Whether the native kernel runs bfloat16 products on this machine."""
    from decoders.models.kernel import why_not_here

    return why_not_here(torch.bfloat16) is None


def use_native(model: nn.Module) -> int:
    """Swap `model`'s bfloat16 CPU `nn.Linear` layers (without hooks) for `NativeLinear`s; returns how many."""
    places = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype == torch.bfloat16
        and not _hooked(child)
    ]
    if not places or not available():
        return 0
    from decoders.models.kernel import library

    lib = library()
    swapped = {id(child): NativeLinear(child, lib) for _, _, child in places}  # (a layer may sit in two places)
    for parent, name, child in places:
        setattr(parent, name, swapped[id(child)])
    return len(swapped)


def _hooked(layer: nn.Module) -> bool:
    """Whether `layer` has hooks (e.g. accelerate's offloading) that a swapped-in layer would not carry."""
    return bool(layer._forward_hooks or layer._forward_pre_hooks or hasattr(layer, "_hf_hook"))


@contextlib.contextmanager
def plain_layers(layers, plain: bool = True) -> Iterator[None]:
    """Within: `layers` (`NativeLinear`s) run plain (`plain`) or natively."""
    layers = list(layers)
    before = [layer.plain for layer in layers]
    for layer in layers:
        layer.plain = plain
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer.plain = was


def plain(*models) -> contextlib.AbstractContextManager:
    """Within: `models`' (None skipped) `NativeLinear`s multiply as plain `nn.Linear`s."""
    return plain_layers(
        m for model in models if model is not None for m in model.modules() if isinstance(m, NativeLinear)
    )


def native_count(model: nn.Module) -> int:
    """How many of `model`'s linear layers run on the native kernel."""
    return sum(isinstance(m, NativeLinear) and not m.plain for m in model.modules())  # (each module once)
