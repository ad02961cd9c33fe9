"""Linear layers with weights prepacked for oneDNN (bfloat16 on a CPU): the same numbers as `nn.Linear`, the model's
calls the same, what is left alone, the peers' plain layers, memory, casts and the calibration key."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PROMPTS, tiny_model, tiny_tokenizer
from torch import nn

import decoders
from decoders.drafting.cost import calibration_key
from decoders.models import lm as lm_module
from decoders.models.attention import stock
from decoders.models.cache import KVCache
from decoders.models.packed import PackedLinear, available, pack, packed_count, unpacked

pytestmark = pytest.mark.skipif(not available(), reason="this torch or CPU cannot pack bfloat16 weights for oneDNN")


@pytest.mark.parametrize("shape", [(64, 48), (40, 24), (96, 200)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_layer_gives_the_plain_layers_numbers(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(*shape, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(layer)
    assert packed.weight is layer.weight and packed.bias is layer.bias
    with torch.inference_mode():
        for x in (torch.randn(rows, shape[0], dtype=torch.bfloat16) for rows in (1, 3, 8, 33)):
            assert torch.equal(packed(x), layer(x))
        x = torch.randn(2, 5, shape[0], dtype=torch.bfloat16)  # [batch, tokens, in]
        assert packed(x).shape == (2, 5, shape[1]) and torch.equal(packed(x), layer(x))


def _bf16_lm(arch: str = "llama") -> decoders.LM:
    return decoders.wrap(tiny_model(arch, dtype=torch.bfloat16), tiny_tokenizer(), name=f"tiny-{arch}-bf16")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_a_packed_model_scores_and_decodes_as_its_plain_self(arch):
    lm = _bf16_lm(arch)
    plain = [m for m in lm.model.modules() if type(m) is nn.Linear]
    swapped = pack(lm.model, probe=False) or packed_count(lm.model)  # (LM itself may have packed them already)
    assert swapped > 0 and packed_count(lm.model) == swapped and not any(type(m) is nn.Linear
                                                                         for m in lm.model.modules())
    assert len(plain) in (0, swapped)
    tokens = lm.encode(PROMPTS[0])
    with torch.inference_mode():
        fast = lm.forward(tokens, KVCache())
        with unpacked(lm.model):
            slow = lm.forward(tokens, KVCache())
    assert torch.equal(fast, slow)
    runs = []
    for context in (unpacked(lm.model), stock(lm.model), torch.no_grad()):
        with context:
            runs.append(decoders.generate(lm, PROMPTS[1], strategy="greedy", max_new_tokens=12).tokens)
    assert runs[0] == runs[1] == runs[2]


def test_peers_run_the_plain_layers_and_get_them_back_after():
    lm = _bf16_lm()
    pack(lm.model, probe=False)
    layers = [m for m in lm.model.modules() if isinstance(m, PackedLinear)]
    assert layers
    with stock(lm.model):
        assert all(m.plain for m in layers)
    assert not any(m.plain for m in layers)


def test_float32_layers_hooked_layers_and_other_devices_are_left_alone():
    model = tiny_model("llama")  # float32
    assert pack(model, probe=False) == 0 and not any(isinstance(m, PackedLinear) for m in model.modules())
    model = tiny_model("llama", dtype=torch.bfloat16)
    hooked = model.get_output_embeddings()
    hooked.register_forward_hook(lambda *args: None)
    assert pack(model, probe=False) > 0
    assert model.get_output_embeddings() is hooked and type(hooked) is nn.Linear


def test_a_cast_drops_the_packed_copy_and_still_computes():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16).to(torch.bfloat16)
    packed = PackedLinear(layer).to(torch.float32)
    assert packed.packed is None and packed.weight.dtype == torch.float32
    x = torch.randn(3, 32)
    with torch.inference_mode():
        assert torch.equal(packed(x), nn.functional.linear(x, packed.weight, packed.bias))


def test_gradients_flow_through_the_plain_call():
    layer = nn.Linear(16, 8).to(torch.bfloat16)
    packed = PackedLinear(layer)
    packed(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_too_little_memory_for_the_copy_is_warned_of_and_nothing_packed(monkeypatch):
    model = tiny_model("llama", dtype=torch.bfloat16)
    monkeypatch.setattr(lm_module, "free_memory", lambda device: 1024)
    with pytest.warns(UserWarning, match="not packed"):
        assert pack(model, probe=False) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_the_calibration_key_tells_packed_from_plain_layers():
    plain = decoders.wrap(tiny_model("llama", dtype=torch.bfloat16), tiny_tokenizer(), name="tiny")
    for module in list(plain.model.modules()):  # undo whatever the probe decided
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                replacement = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                replacement.weight, replacement.bias = child.weight, child.bias
                setattr(module, name, replacement)
    before = calibration_key(plain, "target", (1,))
    pack(plain.model, probe=False)
    after = calibration_key(plain, "target", (1,))
    assert before["packed"] == 0 and after["packed"] > 0 and before["model"] == after["model"]


def test_a_copy_is_plain_and_its_own():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16).to(torch.bfloat16)
    packed = PackedLinear(layer)
    twin = copy.deepcopy(packed)
    assert type(twin) is nn.Linear and twin.weight is not packed.weight and torch.equal(twin.weight, packed.weight)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(twin(x), packed(x))


def test_a_packed_model_still_counts_its_bytes_and_footprint():
    from evals.measure import bytes_per_token, parameter_bytes

    model = tiny_model("llama", dtype=torch.bfloat16)
    before = parameter_bytes(model), bytes_per_token(model), model.get_memory_footprint()
    assert pack(model, probe=False) > 0
    assert (parameter_bytes(model), bytes_per_token(model), model.get_memory_footprint()) == before


def test_a_weight_changed_in_place_or_replaced_is_packed_again():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16).to(torch.bfloat16)
    packed = PackedLinear(layer)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        packed.weight.mul_(2)  # e.g. an optimizer's step
        assert torch.equal(packed(x), nn.functional.linear(x, packed.weight, packed.bias))
        packed.weight = nn.Parameter(torch.randn(16, 32, dtype=torch.bfloat16))
        assert torch.equal(packed(x), nn.functional.linear(x, packed.weight, packed.bias))


def test_a_pickled_layer_loads_plain_and_computes(tmp_path):
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(32, 16).to(torch.bfloat16))
    torch.save(packed, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert loaded.packed is None and torch.equal(loaded(x), packed(x))
