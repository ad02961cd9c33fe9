"""Int8 copies of an `LM`, cheap drafts for their float original: its linear layers as `Int8Linear`s, the rest
shared; an LM's own copy (`self_draft`, "self:int8") is made once and kept with it."""

from __future__ import annotations

import copy
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from decoders.models.held import shared
from decoders.models.int8 import Int8Linear
from decoders.models.lm import LM

SCHEMES = ("int8",)


def self_draft(lm: LM, scheme: str) -> LM:
    """`lm`'s own quantized copy ("self:int8"), kept; its module shared by every LM wrapping `lm`'s module."""
    copies = lm.held.copies
    if scheme not in copies:
        made = shared(lm.model).copies
        if scheme in made:
            copies[scheme] = copy_of(lm, made[scheme], scheme)
        else:
            copies[scheme] = quantize(lm, scheme)
            made[scheme] = copies[scheme].model
    return copies[scheme]


def drop_self_draft(lm: LM, scheme: str) -> None:
    """Let go of `lm`'s quantized copy `self_draft` made, if any (freed once no run holds it)."""
    lm.held.copies.pop(scheme, None)
    shared(lm.model).copies.pop(scheme, None)


def quantize(lm: LM, scheme: str = "int8") -> LM:
    """A new `LM` whose linear layers (the head too) run with int8 weights, sharing the rest of `lm`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if (done := is_quantized(lm)) is not None:
        raise ValueError(f"{lm.name!r} is already quantized ({done}); quantize its float original instead")
    model = lm.model
    # the module tree copied, every parameter and buffer shared
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=tensors)
    places = [
        (parent, name, child)
        for parent in twin.modules()
        for name, child in parent.named_children()
        if isinstance(child, (nn.Linear, Conv1D))
    ]
    if not places:
        raise ValueError(f"{lm.name!r} has no nn.Linear or Conv1D layer to quantize")
    layers = list({id(child): child for _, _, child in places}.values())  # (a layer may sit in two places)

    def round_off(layer):
        with torch.no_grad():
            return Int8Linear.rounded(layer)

    # rounded in threads (fbgemm prepacks on one core), timed one at a time
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        rounded = list(pool.map(round_off, layers))  # (all of them before any timing: the threads would skew it)
    replaced = {id(layer): int8.timed(layer) for layer, int8 in zip(layers, rounded)}
    for parent, name, child in places:
        setattr(parent, name, replaced[id(child)])
    return copy_of(lm, twin, scheme)


def copy_of(lm: LM, module, scheme: str) -> LM:
    """`module`, a `scheme` copy of `lm`'s (made by `quantize`), as an LM known as its copy."""
    quantized = type(lm)(module, lm.tokenizer, name=f"{lm.name}:{scheme}")
    quantized.quantized_from = weakref.ref(lm)  # as a draft of its original it may share its KV cache
    return quantized


def int8_bytes(lm: LM) -> int:
    """About the bytes `quantize(lm, "int8")` adds: one a weight of each linear layer."""
    layers = {id(m): m for m in lm.model.modules() if isinstance(m, (nn.Linear, Conv1D))}
    return sum(m.weight.numel() for m in layers.values())


def is_quantized(lm: LM) -> str | None:
    """The scheme `lm`'s linear layers were quantized with ("int8"), or None for a float model."""
    return next((m.scheme for m in lm.model.modules() if isinstance(m, Int8Linear)), None)
