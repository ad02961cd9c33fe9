"""Grouped-query attention that packs each key/value head's query heads into one block where transformers' `repeat_kv`
copies the keys per query head (docs/design/batching.md). `use_grouped` switches a model to it, `stock` back within."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from decoders.models.linear import plain

try:  # (without transformers' attention interfaces, models keep their own attention)
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
except ImportError:
    AttentionInterface = AttentionMaskInterface = None

NAME = "decodekit_sdpa"


def grouped_sdpa(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`sdpa_attention_forward`'s contract (query [B, H, Q, D], key and value [B, H_kv, K, D], mask [B, 1 or H, Q, K];
    returns [B, Q, H, D]); packs query heads where Q > 1 under a mask, else is transformers'."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if (
        groups == 1
        or queries == 1
        or attention_mask is None
        or dropout
        or kwargs.get("position_bias") is not None
        or attention_mask.shape[1] not in (1, heads)
        or key.shape[0] != batch
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    packed = query.reshape(batch, kv_heads, groups * queries, dim)  # query head h = kv head h // groups
    if attention_mask.shape[1] == 1:
        mask = attention_mask.repeat(1, 1, groups, 1)  # [B, 1, groups * Q, K]: row g * Q + i is query i's
    else:
        mask = attention_mask.reshape(batch, kv_heads, groups * queries, attention_mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, queries, value.shape[-1]).transpose(1, 2).contiguous(), None


if AttentionInterface is not None:
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # (transformers' own masks for the calls it masks: prefill)


def use_grouped(model) -> bool:
    """Switch `model` to `grouped_sdpa` where it runs "sdpa" with grouped key/value heads; True if it runs it now."""
    config = model.config.get_text_config(decoder=True)
    implementation = getattr(model.config, "_attn_implementation", None)
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if implementation == NAME:
        return True
    if (
        implementation != "sdpa"
        or not heads
        or not kv_heads
        or heads == kv_heads
        or AttentionInterface is None
        or not hasattr(model, "set_attn_implementation")
    ):
        return False
    model.set_attn_implementation(NAME)
    return True


@contextlib.contextmanager
def stock(*models) -> Iterator[None]:
    """Within: `models` run transformers' own "sdpa" and plain linear layers: peers as users get them."""
    switched = [m for m in models if m is not None and getattr(m.config, "_attn_implementation", None) == NAME]
    with restored(*switched), plain(*models):
        for model in switched:
            model.set_attn_implementation("sdpa")
        yield


@contextlib.contextmanager
def restored(*models) -> Iterator[None]:
    """After: each of `models` (None skipped) is back in its training mode and attention."""
    before = [(m, m.training, m.config._attn_implementation) for m in models if m is not None]
    try:
        yield
    finally:
        for model, training, implementation in before:
            if model.training != training:
                model.train(training)
            if model.config._attn_implementation != implementation:
                model.set_attn_implementation(implementation)
