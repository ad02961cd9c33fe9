"""Int8 linear layers: int8 weights with a scale per output row, multiplied by the fastest kernel this device runs
(evidence: docs/design/evidence.md). `decoders.models.quantize` builds an `LM`'s int8 copy of them."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from decoders.models.device import cpu_flags, synchronize
from decoders.models.kernel import INT8, library, why_not_here

# the native step's; fbgemm's dynamic quantized linear (x86); `aten._weight_int8pack_mm`; weights dequantized
KERNELS = ("native", "int8_activations", "int8_mm", "dequantize")


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and one scale per output: y = x @ (weight_int8 * scales[:, None]).T + bias."""

    scheme = "int8"

    def __init__(
        self,
        weight_int8: torch.Tensor,  # [out, in] int8
        scales: torch.Tensor,  # [out], in the dtype the kernel computes in
        bias: nn.Parameter | None,  # [out], shared with the float layer this replaces
        kernel: str,  # one of KERNELS
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown int8 kernel {kernel!r}; known: {', '.join(KERNELS)}")
        self.out_features, self.in_features = weight_int8.shape
        self.kernel = kernel
        self.packed = None  # fbgemm's prepacked weights ("int8_activations"), which then hold the only int8 copy
        self.row_by_row = False
        if kernel == "int8_activations":
            self.packed = _prepack(weight_int8, scales)
            weight_int8 = None
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.bias = bias
        self.float_from: int | None = None  # calls of at least this many rows use float_weight; None: never
        self.register_buffer("float_weight", None, persistent=False)  # [out, in] the float layer's (shared), or None

    @classmethod
    def rounded(cls, layer: nn.Linear | Conv1D, kernel: str | None = None) -> Int8Linear:
        """The int8 twin of a float `nn.Linear` or GPT-2 `Conv1D`; `kernel`: one of KERNELS, None: the first to run."""
        weight = _float_weight(layer)
        compute = torch.bfloat16 if weight.device.type == "cpu" else weight.dtype
        weight_int8, scales = quantize_rows(weight, compute)
        return cls(weight_int8, scales, layer.bias, kernel or _kernels(weight_int8, scales)[0])

    def timed(self, layer: nn.Linear | Conv1D) -> Int8Linear:
        """This layer, set to multiply by the float `layer`'s weight in calls of the rows where that is faster."""
        weight = _float_weight(layer)
        float_from = _float_from(self, weight)
        if float_from is not None:
            self.float_from, self.float_weight = float_from, weight
        return self

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight [out, in], for code that reads `.weight.shape` (e.g. the logits width)."""
        if self.weight_int8 is None:
            return torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()
        return self.weight_int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.float_from is not None and x.numel() >= self.float_from * self.in_features:
            w = self.float_weight
            rows = x.reshape(-1, self.in_features).to(w.dtype)  # 2D: a strided 3D input makes linear copy w per row
            y = nn.functional.linear(rows, w, None if self.bias is None else self.bias.to(w.dtype))
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return self.quantized(x)

    def quantized(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], with the int8 weights
        if self.kernel == "native":  # (float32 inputs stay float32, as in the native step of a float32 model's copy)
            dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
            rows = x.reshape(-1, self.in_features).to(dtype).contiguous()  # [rows, in]
            y = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
            library().dk_linear(
                rows.data_ptr(),
                rows.shape[0],
                self.in_features,
                self.weight_int8.data_ptr(),
                self.scales.data_ptr(),
                self.out_features,
                y.data_ptr(),
                int(dtype == torch.bfloat16),
                INT8,
                torch.get_num_threads(),
            )
        elif self.kernel == "int8_activations":
            rows = x.reshape(-1, self.in_features).float()
            calls, reduce = rows.split(1) if self.row_by_row else [rows], _reduce_range()
            parts = [torch.ops.quantized.linear_dynamic(r, self.packed, reduce) for r in calls]
            y = torch.cat(parts) if self.row_by_row else parts[0]  # (a cat of one copies every output)
        else:
            rows = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()  # [rows, in]
            if self.kernel == "int8_mm":
                if rows.data_ptr() % 64:  # (the CPU kernel's aligned loads; e.g. a slice of the hidden states)
                    rows = rows.clone()
                y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
            else:
                y = rows @ (self.weight.to(rows.dtype) * self.scales[:, None]).T
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"kernel={self.kernel}"
        )


@contextlib.contextmanager
def row_by_row(model: nn.Module) -> Iterator[None]:
    """Within: `model`'s "int8_activations" layers round each row of a call alone, not over the call's range, so that
    probes may compare calls of different rows."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear) and m.kernel == "int8_activations"]
    for layer in layers:
        layer.row_by_row = True
    try:
        yield
    finally:
        for layer in layers:
            layer.row_by_row = False


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q [out, in] int8, scales [out] in `dtype`) with |weight - q * scales| <= scales / 2
    for the scales stored (each rounded up to `dtype` before dividing); a million weights at a time (in cache)."""
    parts = [_quantize_rows(chunk, dtype) for chunk in weight.split(max(1, 2**20 // weight.shape[1]))]
    return torch.cat([q for q, _ in parts]), torch.cat([scales for _, scales in parts])


def _quantize_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # in float32 where it matters: the row maxima are exact in any dtype, and float32 scales promote as they divide
    scales = (weight.abs().amax(dim=1).float() / 127).clamp(min=torch.finfo(dtype).tiny)  # [out], a zero row: tiny
    stored = scales.to(dtype)
    stored = torch.where(stored.float() < scales, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)
    q = (weight / stored.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), stored  # a transposed (Conv1D) weight would leave q transposed in memory


def _float_weight(layer: nn.Linear | Conv1D) -> torch.Tensor:
    weight = layer.weight.detach()
    return weight.T if isinstance(layer, Conv1D) else weight  # [out, in]


def _kernels(weight_int8: torch.Tensor, scales: torch.Tensor) -> list[str]:
    """The KERNELS this layer's device runs, in order; on a CPU "int8_mm" only where `in` is a multiple of 16 (other
    widths crash), elsewhere where a probe does not raise."""
    kernels = []
    if weight_int8.device.type == "cpu":
        if scales.dtype == torch.bfloat16 and why_not_here(torch.bfloat16) is None:
            kernels.append("native")  # (rows widened to bfloat16 as they are read)
        if "fbgemm" in torch.backends.quantized.supported_engines:
            kernels.append("int8_activations")
        if weight_int8.shape[1] % 16 == 0:
            kernels.append("int8_mm")
        return kernels + ["dequantize"]
    probe = torch.zeros(1, weight_int8.shape[1], dtype=scales.dtype, device=scales.device)
    try:
        torch.ops.aten._weight_int8pack_mm(probe, weight_int8, scales)
        kernels.append("int8_mm")
    except (RuntimeError, NotImplementedError):
        pass
    return kernels + ["dequantize"]


def _prepack(weight_int8: torch.Tensor, scales: torch.Tensor):
    """fbgemm's prepacked weights of an int8 weight [out, in] with per-output `scales`."""
    with warnings.catch_warnings():  # (torch 2.13 deprecates the quantized tensor fbgemm is built from)
        warnings.simplefilter("ignore", UserWarning)
        zero = torch.zeros(weight_int8.shape[0], dtype=torch.long)
        quantized = torch._make_per_channel_quantized_tensor(weight_int8, scales.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(quantized, None)


def _reduce_range() -> bool:
    """Whether fbgemm must round a call's inputs to 7 bits, not 8: without VNNI its int16 pair sums can saturate."""
    return not cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"}


ROWS = (2, 4, 8, 16, 32, 64)  # the call sizes `_float_from` tries, in order
_crossovers: dict[tuple, int | None] = {}  # (device, dtype, out, in, kernel) -> float_from, measured once per process


def _float_from(layer: Int8Linear, weight: torch.Tensor) -> int | None:
    """The fewest `ROWS` at which `weight` multiplies faster than `layer`'s int8 path, or None; once per shape."""
    key = (weight.device, weight.dtype, *weight.shape, layer.kernel)
    if key not in _crossovers:
        _crossovers[key] = None
        for rows in ROWS:
            x = torch.zeros(rows, layer.in_features, dtype=weight.dtype, device=weight.device)
            as_float = _seconds(lambda: nn.functional.linear(x, weight), x.device)
            if as_float < _seconds(lambda: layer.quantized(x), x.device):
                _crossovers[key] = rows
                break
    return _crossovers[key]


def _seconds(call, device: torch.device) -> float:
    """The best of three timed calls, after one untimed."""
    times = []
    for _ in range(4):
        synchronize(device)
        start = time.perf_counter()
        with torch.no_grad():
            call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])
