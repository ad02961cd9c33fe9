"""The native CPU step (docs/design/native.md): a whole call of a Llama-family decoder in one function of
`csrc/step.cpp`, reading the model's own parameters at every call, each logit the same whatever the call's rows.
`native_check.attach(lm)` is the step, or None where a model does not fit it."""

from __future__ import annotations

import ctypes
import time

import torch

from decoders.models.kernel import DTYPES, INT8, DkCall, DkModel

PER_LAYER = 19  # pointers per layer, in csrc/step.cpp's order


def _weight(module) -> tuple[dict, str]:
    """Where a linear layer's weight lives: (dict, name)."""
    return (module._buffers, "weight_int8") if hasattr(module, "weight_int8") else (module._parameters, "weight")


def _scale(module) -> tuple[dict, str]:
    """Where an int8 layer's row scales live (nowhere for a float layer)."""
    return (module._buffers, "scales") if hasattr(module, "weight_int8") else ({}, "scales")


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
        self.scale = float(getattr(attention, "scaling", self.head_dim**-0.5))
        self.eps = float(getattr(body.norm, "variance_epsilon", getattr(body.norm, "eps", 1e-6)))
        self.body = body
        # (dict, name) per parameter, so a replaced parameter is seen, in csrc/step.cpp's order: per layer 12 tensors
        # and 7 scales, then the final norm and the head
        places = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            places += [
                (layer.input_layernorm._parameters, "weight"),
                _weight(a.q_proj),
                (a.q_proj._parameters, "bias"),
                _weight(a.k_proj),
                (a.k_proj._parameters, "bias"),
                _weight(a.v_proj),
                (a.v_proj._parameters, "bias"),
                _weight(a.o_proj),
                (layer.post_attention_layernorm._parameters, "weight"),
                _weight(m.gate_proj),
                _weight(m.up_proj),
                _weight(m.down_proj),
                *map(_scale, linears),
            ]
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
        current = [id(p) for p in params] + [
            p.data_ptr() if p is not None and p.device.type == "cpu" else -1 for p in params
        ]  # (ids and addresses: ints, compared as ints)
        if current == self.seen:
            return self.struct
        self.seen, self.struct = current, None
        present = [p for p in params if p is not None]
        if any(p.device.type != "cpu" or not p.is_contiguous() for p in present):
            return None
        weights = {params[i].dtype for i in self.linear}
        dtype = params[0].dtype  # (the activations' and the cache's: the norms')
        others = {
            p.dtype for i, p in enumerate(params) if p is not None and i not in self.linear and not self._is_scale(i)
        }
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
        addresses = current[len(params) :]
        pointers = (ctypes.c_void_p * (len(params) - 3))(*[max(a, 0) for a in addresses[:-3]])
        config = self.config
        self.struct = DkModel(
            layers=len(self.body.layers),
            hidden=config.hidden_size,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate=config.intermediate_size,
            vocab=self.head.out_features,
            dtype=DTYPES[dtype],
            wtype=wtype,
            eps=self.eps,
            scale=self.scale,
            final_norm=addresses[-3],
            lm_head=addresses[-2],
            lm_head_scale=max(addresses[-1], 0),
            weights=pointers,
        )
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
        hooks = [
            h
            for d in (
                *self.hooks,
                torch.nn.modules.module._global_forward_hooks,
                torch.nn.modules.module._global_forward_pre_hooks,
            )
            if d
            for h in d.values()
        ]
        return any(not getattr(hook, "decodekit_meter", False) for hook in hooks)

    @torch.inference_mode()
    def call(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        past: int,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        allowed: torch.Tensor | None = None,
        keep: int = 0,
    ) -> torch.Tensor:
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
        call = DkCall(
            rows=rows,
            width=width,
            past=past,
            capacity=capacity,
            keep=keep,
            threads=torch.get_num_threads(),
            embeddings=embeddings.data_ptr(),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            allowed=allowed.data_ptr() if allowed is not None else None,
            keys=(ctypes.c_void_p * layers)(*[t.data_ptr() for t in keys]),
            values=(ctypes.c_void_p * layers)(*[t.data_ptr() for t in values]),
            logits=logits.data_ptr(),
        )
        started = time.perf_counter() if self.meters else 0.0
        self.lib.dk_forward(ctypes.byref(model), ctypes.byref(call))
        for meter in self.meters:
            meter.counted(rows * width, time.perf_counter() - started)
        return logits
