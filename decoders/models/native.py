"""The native CPU step (docs/design/native.md): a whole call of a Llama-family decoder in one function of
`csrc/step.cpp`, reading the model's own parameters at every call, each logit the same whatever the call's rows.
`attach(lm)` is the step, or None with one notice of why (`why_not`): then calls run through transformers."""

from __future__ import annotations

import ctypes
import functools
import time
import warnings

import torch
from torch import nn

from decoders.models.held import shared
from decoders.models.kernel import DTYPES, INT8, DkCall, DkModel, library, why_not_here

PER_LAYER = 19  # pointers per layer, in csrc/step.cpp's order
MAX_HEAD_DIM = 512  # (the native attention's accumulator)

def _rmsnorm(module) -> bool:
    """A plain RMSNorm: weight * x / rms(x) (not Gemma's 1 + weight)."""
    return (type(module).__name__.endswith("RMSNorm") and "Gemma" not in type(module).__name__
            and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float))


def _linear(module, bias: bool | None = None) -> bool:
    """An `nn.Linear` (or subclass), or an int8 layer on the native kernel, with a bias as asked (None: either)."""
    native_int8 = getattr(module, "kernel", None) == "native" and hasattr(module, "weight_int8")
    return (isinstance(module, nn.Linear) or native_int8) and (bias is None or (module.bias is not None) == bias)


def _weight(module) -> tuple[dict, str]:
    """Where a linear layer's weight lives: (dict, name)."""
    return (module._buffers, "weight_int8") if hasattr(module, "weight_int8") else (module._parameters, "weight")


def _scale(module) -> tuple[dict, str]:
    """Where an int8 layer's row scales live (nowhere for a float layer)."""
    return (module._buffers, "scales") if hasattr(module, "weight_int8") else ({}, "scales")


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
                getattr(attention, "o_proj", None), bias=False):
            return "its attention is not q/k/v/o linear projections"
        if any(getattr(attention, n, None) is not None for n in ("q_norm", "k_norm")):
            return "its attention normalizes queries and keys"
        if not all(_linear(getattr(mlp, n, None), bias=False) for n in ("gate_proj", "up_proj", "down_proj")):
            return "its MLP is not gate/up/down linear projections"
        if not (_rmsnorm(getattr(layer, "input_layernorm", None))
                and _rmsnorm(getattr(layer, "post_attention_layernorm", None))):
            return "its layers' norms are not plain RMSNorms"
        if set(dict(layer.named_children())) - {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
            return f"its layers hold more modules ({', '.join(sorted(dict(layer.named_children())))})"
    return None


class NativeStep:
    """The native step for one LM: its model's dimensions, its parameters' addresses read anew at every call."""

    def __init__(self, lm, lib: ctypes.CDLL) -> None:
        # (no reference to the LM or its top model: `attach` keeps steps by model, weakly)
        self.name, self.lib, self.config, self.head = lm.name, lib, lm.config, lm.model.lm_head
        body, config = lm.model.model, lm.config
        attention = body.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = float(getattr(attention, "scaling", self.head_dim ** -0.5))
        self.eps = float(getattr(body.norm, "variance_epsilon", getattr(body.norm, "eps", 1e-6)))
        self.body = body
        # (dict, name) per parameter, so a replaced parameter is seen, in csrc/step.cpp's order: per layer 12 tensors
        # and 7 scales, then the final norm and the head
        places = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            places += [(layer.input_layernorm._parameters, "weight"), _weight(a.q_proj), (a.q_proj._parameters, "bias"),
                       _weight(a.k_proj), (a.k_proj._parameters, "bias"), _weight(a.v_proj),
                       (a.v_proj._parameters, "bias"), _weight(a.o_proj),
                       (layer.post_attention_layernorm._parameters, "weight"), _weight(m.gate_proj),
                       _weight(m.up_proj), _weight(m.down_proj), *map(_scale, linears)]
        head = lm.model.lm_head
        places += [(body.norm._parameters, "weight"), _weight(head), _scale(head)]
        self.places = places
        self.linear = [i for i in range(len(places) - 3) if i % PER_LAYER in (1, 3, 5, 7, 9, 10, 11)]
        self.linear.append(len(places) - 2)  # (the linear layers' weights)
        self.seen: list | None = None  # the parameters the last call checked, and the struct built from them
        self.struct: DkModel | None = None
        # a forward hook someone registers must see the calls: transformers' then run them
        self.hooks = [d for m in lm.model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.meters: list = []  # call meters (`evals.measure.ForwardMeter`): told each call's tokens and seconds

    def __deepcopy__(self, memo: dict) -> NativeStep:
        return self  # (a handle on the model's parameters: a module tree copied with it, e.g. by a hook, shares it)

    def _model(self) -> DkModel | None:
        """The model's struct for its parameters as they are now; None if they no longer suit the step (moved, cast,
        mixed dtypes)."""
        params = [where.get(name) for where, name in self.places]
        current = [id(p) for p in params] + [p.data_ptr() if p is not None and p.device.type == "cpu" else -1
                                             for p in params]  # (ids and addresses: ints, compared as ints)
        if current == self.seen:
            return self.struct
        self.seen, self.struct = current, None
        present = [p for p in params if p is not None]
        if any(p.device.type != "cpu" or not p.is_contiguous() for p in present):
            return None
        weights = {params[i].dtype for i in self.linear}
        dtype = params[0].dtype  # (the activations' and the cache's: the norms')
        others = {p.dtype for i, p in enumerate(params) if p is not None and i not in self.linear
                  and not self._is_scale(i)}
        if weights == {torch.int8}:  # an int8 copy: its scales bfloat16, the rest one float dtype
            scales = {params[i].dtype for i in range(len(params)) if self._is_scale(i) and params[i] is not None}
            if scales != {torch.bfloat16} or len(others) != 1:
                return None
            dtype, wtype = next(iter(others)), INT8
        elif weights == others == {dtype} and dtype in DTYPES:
            wtype = DTYPES[dtype]
        else:
            return None
        if dtype not in DTYPES:
            return None
        addresses = current[len(params):]
        pointers = (ctypes.c_void_p * (len(params) - 3))(*[max(a, 0) for a in addresses[:-3]])
        config = self.config
        self.struct = DkModel(
            layers=len(self.body.layers), hidden=config.hidden_size, heads=self.heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, intermediate=config.intermediate_size,
            vocab=self.head.out_features, dtype=DTYPES[dtype], wtype=wtype, eps=self.eps,
            scale=self.scale, final_norm=addresses[-3], lm_head=addresses[-2], lm_head_scale=max(addresses[-1], 0),
            weights=pointers)
        self.struct._pointers = pointers  # (kept alive with the struct)
        self.dtype = dtype
        return self.struct

    def _is_scale(self, i: int) -> bool:
        return i == len(self.places) - 1 or (i < len(self.places) - 3 and i % PER_LAYER >= 12)

    def ready(self) -> bool:
        """Whether the native step runs the next call: its parameters suit it and no forward hook (but decodekit's
        meters) waits to see the modules run."""
        return self._model() is not None and not self.hooked()

    def hooked(self) -> bool:
        hooks = [h for d in (*self.hooks, torch.nn.modules.module._global_forward_hooks,
                             torch.nn.modules.module._global_forward_pre_hooks) if d for h in d.values()]
        return any(not getattr(hook, "decodekit_meter", False) for hook in hooks)

    @torch.inference_mode()
    def call(self, ids: torch.Tensor, positions: torch.Tensor, past: int, keys: list[torch.Tensor],
             values: list[torch.Tensor], allowed: torch.Tensor | None = None, keep: int = 0) -> torch.Tensor:
        """Score `ids` [rows, W] at `positions` [rows, W], writing their keys and values at slots past .. past + W of
        `keys` / `values` (per layer [rows, kv_heads, capacity, head_dim]). `allowed` [rows, W, capacity] bool: the
        slots each query sees (None: causal). Returns float32 logits [rows, keep or W, vocab]."""
        model = self._model()
        if model is None:
            raise RuntimeError(f"{self.name}: its parameters no longer suit the native step")
        rows, width = ids.shape
        capacity = keys[0].shape[2]
        if past + width > capacity:
            raise ValueError(f"a call of {width} tokens after {past} slots overflows a cache of {capacity}")
        keep = keep or width
        embeddings = self.body.embed_tokens(ids).to(self.dtype).contiguous()  # [rows, W, hidden]
        cos, sin = self.body.rotary_emb(torch.empty(0), positions)  # [rows, W, head_dim] in float32
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        if allowed is not None:
            allowed = allowed.to(torch.bool).contiguous()
        for cache in (*keys, *values):
            if cache.dtype != self.dtype or not cache.is_contiguous():
                raise ValueError("the cache's layers must be contiguous and of the model's dtype")
        logits = torch.empty(rows, keep, model.vocab, dtype=torch.float32)
        layers = len(keys)
        call = DkCall(rows=rows, width=width, past=past, capacity=capacity, keep=keep,
                      threads=torch.get_num_threads(), embeddings=embeddings.data_ptr(), cos=cos.data_ptr(),
                      sin=sin.data_ptr(), allowed=allowed.data_ptr() if allowed is not None else None,
                      keys=(ctypes.c_void_p * layers)(*[t.data_ptr() for t in keys]),
                      values=(ctypes.c_void_p * layers)(*[t.data_ptr() for t in values]), logits=logits.data_ptr())
        started = time.perf_counter() if self.meters else 0.0
        self.lib.dk_forward(ctypes.byref(model), ctypes.byref(call))
        for meter in self.meters:
            meter.counted(rows * width, time.perf_counter() - started)
        return logits


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
    warnings.warn(f"the native CPU step does not run this model ({reason}); its calls run through transformers",
                  stacklevel=4)


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
