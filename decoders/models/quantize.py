"""Weight-only int8 quantization of an `LM`: a cheap copy of a model to draft for its own float original.

    draft = decoders.quantize(lm, "int8")   # a new LM; `lm` and its weights are untouched
    decoders.generate(lm, prompt, strategy="speculative", draft=draft)   # or draft="self:int8"

Every linear layer (`nn.Linear`, and transformers' `Conv1D` in GPT-2, whose weight is [in, out]), the LM head
included, becomes an `Int8Linear`: int8 weights with one symmetric scale per output channel, so each weight is off
by at most half its row's scale. Embeddings, norms and biases stay float and are shared with the original, not copied:
the copy costs the int8 weights plus one scale per output channel. A tied LM head gets its own int8 copy; the
embedding it was tied to stays as it is.

Kernel: torch's `aten._weight_int8pack_mm(x [rows, in], w [out, in] int8, scales [out])`, which wants a 2D input
contiguous in its last dimension and scales in the input's dtype. On CPU it runs in bfloat16 whatever the model's
dtype: only its bfloat16 loop is vectorized (float32 and float16 take a scalar loop, about 10x slower than a float32
matmul in a micro-timing here), and that loop reads 16 inputs at a time with aligned loads, so it needs `in` to be a
multiple of 16 and an aligned input: other widths would crash, not raise, and use the fallback. Elsewhere it runs in
the model's dtype where torch has a kernel (CUDA, MPS, XPU have one in torch 2.13), probed once per layer. The
fallback dequantizes the weight inside the matmul: correct, but slower than the float layer it replaced.

Only "int8" is offered. int4 (`_weight_int4pack_mm_for_cpu`, groups of 32) was left out: in the same micro-timing it
was not clearly faster than int8 at batch 1 (faster on one shape, slower on another), and its outputs were about 10%
off on random weights, which would cost acceptance.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from decoders.models.lm import LM

SCHEMES = ("int8",)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights and one scale per output: y = x @ (weight_int8 * scales[:, None]).T + bias."""

    scheme = "int8"

    def __init__(
        self,
        weight_int8: torch.Tensor,  # [out, in] int8
        scales: torch.Tensor,  # [out], in the dtype the kernel computes in
        bias: nn.Parameter | None,  # [out], shared with the float layer this replaces
        fused: bool,  # True: torch's int8 kernel; False: dequantize inside the matmul
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales)
        self.bias = bias
        self.fused = fused

    @classmethod
    def from_float(cls, layer: nn.Linear | Conv1D) -> Int8Linear:
        """The int8 twin of a float `nn.Linear` or GPT-2 `Conv1D`; `layer` itself is not changed."""
        weight = layer.weight.detach()
        weight = weight.T if isinstance(layer, Conv1D) else weight  # [out, in]
        compute = torch.bfloat16 if weight.device.type == "cpu" else weight.dtype
        weight_int8, scales = quantize_rows(weight, compute)
        return cls(weight_int8, scales, layer.bias, fused=_kernel_takes(weight_int8, scales))

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight [out, in], for code that reads a layer's `.weight.shape` (e.g. the logits width)."""
        return self.weight_int8

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()  # [rows, in]
        if self.fused:
            if rows.data_ptr() % 64:  # e.g. a slice of the hidden states; the CPU kernel's aligned loads need a copy
                rows = rows.clone()
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        else:
            y = rows @ (self.weight_int8.to(rows.dtype) * self.scales[:, None]).T
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q [out, in] int8, scales [out] in `dtype`) with |weight - q * scales| <= scales / 2.

    Each scale is rounded up to `dtype` before the weights are divided by it, so every quotient is within [-127, 127]
    (the clamp only guards the division's rounding) and the bound holds for the scales actually stored.
    """
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(dtype).tiny)  # [out], a zero row gets a tiny scale
    stored = scales.to(dtype)
    stored = torch.where(stored.float() < scales, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)
    q = torch.round(weight / stored.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), stored  # a transposed (Conv1D) weight would leave q transposed in memory


def _kernel_takes(weight_int8: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether torch's int8 kernel can run this layer: on CPU when `in` is a multiple of 16 (other widths crash),
    elsewhere when a probe on a zero input does not raise."""
    if weight_int8.device.type == "cpu":
        return weight_int8.shape[1] % 16 == 0
    probe = torch.zeros(1, weight_int8.shape[1], dtype=scales.dtype, device=scales.device)
    try:
        torch.ops.aten._weight_int8pack_mm(probe, weight_int8, scales)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def quantize(lm: LM, scheme: str = "int8") -> LM:
    """A new `LM` whose linear layers, the LM head included, run with weight-only int8; `lm` is left untouched.

    The copy shares `lm`'s tokenizer and every parameter that stays float (embeddings, norms, biases).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if (done := is_quantized(lm)) is not None:
        raise ValueError(f"{lm.name!r} is already quantized ({done}); quantize its float original instead")
    model = lm.model
    # Deep-copy the module tree (configs, rotary caches, ...) but map every parameter and buffer to itself: the copy
    # shares them, and the float weights of the linear layers leave the copy when their modules are replaced below.
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    replaced: dict[int, Int8Linear] = {}  # one int8 layer per float layer, should a layer sit in two places
    with torch.no_grad():
        for parent in list(twin.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, (nn.Linear, Conv1D)):
                    if id(child) not in replaced:
                        replaced[id(child)] = Int8Linear.from_float(child)
                    setattr(parent, name, replaced[id(child)])
    if not replaced:
        raise ValueError(f"{lm.name!r} has no nn.Linear or Conv1D layer to quantize")
    return LM(twin, lm.tokenizer, name=f"{lm.name}:{scheme}")


def is_quantized(lm: LM) -> str | None:
    """The scheme `lm`'s linear layers were quantized with ("int8"), or None for a float model."""
    return next((m.scheme for m in lm.model.modules() if isinstance(m, Int8Linear)), None)
