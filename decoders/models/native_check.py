"""Whether the native step (`native.py`) runs a model: its structure, dtype and device (`why_not`), then a probe of
its logits against the model's own; `attach(lm)` is the step, or None with one notice of why (calls then run through
transformers)."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from decoders.models.held import shared
from decoders.models.kernel import DTYPES, library, why_not_here
from decoders.models.native import NativeStep

MAX_HEAD_DIM = 512  # (the native attention's accumulator)


def _rmsnorm(module) -> bool:
    """A plain RMSNorm: weight * x / rms(x) (not Gemma's 1 + weight)."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and "Gemma" not in type(module).__name__
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float)
    )


def _linear(module, bias: bool | None = None) -> bool:
    """An `nn.Linear` (or subclass), or an int8 layer on the native kernel, with a bias as asked (None: either)."""
    native_int8 = getattr(module, "kernel", None) == "native" and hasattr(module, "weight_int8")
    return (isinstance(module, nn.Linear) or native_int8) and (bias is None or (module.bias is not None) == bias)


def _shape_of(lm) -> str | None:
    """None if `lm`'s model has the structure the native step runs, else what differs."""
    model, config = lm.model, lm.config
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if body is None or layers is None or not len(layers):
        return f"{type(model).__name__} has no decoder layers at .model.layers"
    if not isinstance(getattr(body, "embed_tokens", None), nn.Embedding) or not _rmsnorm(getattr(body, "norm", None)):
        return "its embeddings or final norm are not an nn.Embedding and an RMSNorm"
    if getattr(body, "rotary_emb", None) is None or not _linear(getattr(model, "lm_head", None), bias=False):
        return "it has no rotary embedding module or no plain lm_head"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "embedding_multiplier", None):
        return f"its activation is {getattr(config, 'hidden_act', None)!r}, not silu"
    layer_types = set(getattr(config, "layer_types", None) or [])
    if getattr(config, "sliding_window", None) and (not layer_types or "sliding_attention" in layer_types):
        return "it has sliding-window attention"
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or mlp is None:
            return "a layer has no self_attn or mlp"
        if not all(_linear(getattr(attention, n, None)) for n in ("q_proj", "k_proj", "v_proj")) or not _linear(
            getattr(attention, "o_proj", None), bias=False
        ):
            return "its attention is not q/k/v/o linear projections"
        if any(getattr(attention, n, None) is not None for n in ("q_norm", "k_norm")):
            return "its attention normalizes queries and keys"
        if not all(_linear(getattr(mlp, n, None), bias=False) for n in ("gate_proj", "up_proj", "down_proj")):
            return "its MLP is not gate/up/down linear projections"
        if not (
            _rmsnorm(getattr(layer, "input_layernorm", None))
            and _rmsnorm(getattr(layer, "post_attention_layernorm", None))
        ):
            return "its layers' norms are not plain RMSNorms"
        if set(dict(layer.named_children())) - {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
            return f"its layers hold more modules ({', '.join(sorted(dict(layer.named_children())))})"
    return None


def why_not(lm) -> str | None:
    """None if the native step can run `lm`'s calls on this machine, else why not."""
    if lm.device.type != "cpu":
        return f"it runs on {lm.device.type}, not a CPU"
    if any(hasattr(m, "weight_int8") and m.kernel != "native" for m in lm.model.modules()):
        return "its linear layers are int8"  # (on another kernel than the native one)
    if lm.dtype not in DTYPES:
        return f"its dtype is {lm.dtype}, not float32 or bfloat16"
    shape = _shape_of(lm)
    if shape is not None:
        return shape
    heads = lm.config.num_attention_heads
    if heads % (getattr(lm.config, "num_key_value_heads", None) or 1):
        return "its query heads are not a multiple of its key/value heads"
    if (getattr(lm.config, "head_dim", None) or lm.config.hidden_size // heads) > MAX_HEAD_DIM:
        return f"its heads are wider than {MAX_HEAD_DIM}"
    return why_not_here(lm.dtype)


@functools.cache
def _notice(reason: str) -> None:
    """One warning per reason and process."""
    warnings.warn(
        f"the native CPU step does not run this model ({reason}); its calls run through transformers", stacklevel=4
    )


def attach(lm) -> NativeStep | None:
    """The native step for `lm`, if it runs here and scores a probe as the model does; else None (one notice per
    reason). Kept per torch module: `model.generate` through `decoders.hf` wraps it in a new LM per call."""
    if lm.device.type != "cpu" or lm.dtype not in DTYPES:
        return None
    verdict = shared(lm.model).native  # (its NativeStep, or why not)
    if verdict is None:
        reason = why_not(lm)
        if reason is None:
            step = NativeStep(lm, library())
            reason = _probe(lm, step)
            verdict = step if reason is None else reason
        else:
            verdict = reason
        shared(lm.model).native = verdict
    if isinstance(verdict, NativeStep):
        return verdict
    if verdict != "its linear layers are int8":  # (an int8 copy on another kernel, a draft: no notice)
        _notice(verdict)
    return None


def _probe(lm, path: NativeStep) -> str | None:
    """None if the step's logits for a short prompt match the model's own within the dtype's rounding (a model of
    another shape misses by far more), else how far off they are."""
    prompt = [(7 + 31 * i) % lm.vocab_size for i in range(16)]  # (ids: a wrapped model's tokenizer may be a stand-in)
    ids = torch.tensor([prompt])
    layers = lm.config.num_hidden_layers
    shape = (1, path.kv_heads, len(prompt), path.head_dim)
    keys = [torch.zeros(shape, dtype=lm.dtype) for _ in range(layers)]
    values = [torch.zeros(shape, dtype=lm.dtype) for _ in range(layers)]
    with torch.inference_mode():
        try:
            native = path.call(ids, torch.arange(len(prompt))[None], 0, keys, values)[0]
        except Exception as error:  # noqa: BLE001 - any failure means "not this model", reported once
            return f"its probe raised {type(error).__name__}: {error}"
        # (an int8 copy's own call of many rows would multiply by the float weights: `Int8Linear.float_from`)
        split = [(m, m.float_from) for m in lm.model.modules() if getattr(m, "float_from", None) is not None]
        for m, _ in split:
            m.float_from = None
        try:
            expected = lm.model(input_ids=ids, use_cache=False).logits[0].float()
        finally:
            for m, rows in split:
                m.float_from = rows
    error = float((native - expected).norm() / expected.norm())
    tolerance = 1e-3 if lm.dtype == torch.float32 else 5e-2
    if not error <= tolerance:
        return f"its probe's logits differ from the model's by {error:.2g} of their norm"
    return None
