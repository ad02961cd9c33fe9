"""Linear layers on the native kernel (bfloat16 on a CPU, for models the native step does not run whole): oneDNN's
numbers up to rounding, each row's outputs whatever the call's other rows, the module's weights as they are at every
call (no copy to go stale), what is left alone, the peers' plain layers, casts, copies and the calibration key."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PROMPTS, tiny_model, tiny_tokenizer
from torch import nn

import decoders
from decoders.drafting.cost import calibration_key
from decoders.models.attention import stock
from decoders.models.linear import NativeLinear, available, native_count, plain, use_native
from decoders.models.kernel import library

pytestmark = pytest.mark.skipif(not available(), reason="no native kernel for bfloat16 on this machine")


def native(layer: nn.Linear, rows: int = 64) -> NativeLinear:
    return NativeLinear(layer, library(), native_rows=rows)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to bfloat16's rounding of the output (the kernels sum in other orders)."""
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2 * float(b.abs().max()), rtol=0)


@pytest.mark.parametrize("shape", [(64, 48), (40, 24), (96, 200)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_native_layer_gives_the_plain_layers_numbers_and_each_row_its_own(shape, bias):
    torch.manual_seed(0)
    layer = nn.Linear(*shape, bias=bias).to(torch.bfloat16)
    fast = native(layer)
    assert fast.weight is layer.weight and fast.bias is layer.bias
    with torch.inference_mode():
        x = torch.randn(33, shape[0], dtype=torch.bfloat16)
        whole = fast(x)
        close(whole, layer(x))
        for rows in (1, 3, 8):
            assert torch.equal(torch.cat([fast(part) for part in x.split(rows)]), whole)
        x = torch.randn(2, 5, shape[0], dtype=torch.bfloat16)  # [batch, tokens, in]
        assert fast(x).shape == (2, 5, shape[1])


def _bf16_lm(arch: str) -> decoders.LM:
    return decoders.wrap(tiny_model(arch, dtype=torch.bfloat16), tiny_tokenizer(), name=f"tiny-{arch}-bf16")


@pytest.mark.parametrize("arch", ["gpt_neox", "phi3"])
def test_a_model_the_native_step_does_not_run_gets_native_layers_and_decodes_as_its_plain_self(arch):
    lm = _bf16_lm(arch)
    assert lm.native is None and native_count(lm.model) > 0
    assert not any(type(m) is nn.Linear for m in lm.model.modules())
    runs = []
    for context in (torch.no_grad(), plain(lm.model), stock(lm.model)):
        with context:
            runs.append(decoders.generate(lm, PROMPTS[1], strategy="greedy", max_new_tokens=12).tokens)
    assert len(runs[0]) == 12  # (bfloat16: the plain layers round apart, so their tokens may part at a tie)


def test_peers_run_the_plain_layers_and_get_them_back_after():
    lm = _bf16_lm("gpt_neox")
    layers = [m for m in lm.model.modules() if isinstance(m, NativeLinear)]
    assert layers
    with stock(lm.model):
        assert all(m.plain for m in layers)
    assert not any(m.plain for m in layers)


def test_float32_layers_and_hooked_layers_are_left_alone():
    model = tiny_model("gpt_neox")  # float32
    assert use_native(model) == 0 and not any(isinstance(m, NativeLinear) for m in model.modules())
    model = tiny_model("gpt_neox", dtype=torch.bfloat16)
    hooked = model.get_output_embeddings()
    hooked.register_forward_hook(lambda *args: None)
    assert use_native(model) > 0
    assert model.get_output_embeddings() is hooked and type(hooked) is nn.Linear


def test_a_cast_layer_computes_as_a_plain_one():
    torch.manual_seed(0)
    fast = native(nn.Linear(32, 16).to(torch.bfloat16)).to(torch.float32)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        assert torch.equal(fast(x), nn.functional.linear(x, fast.weight, fast.bias))


def test_a_moved_layer_computes_where_it_now_is():
    torch.manual_seed(0)
    fast = native(nn.Linear(32, 16).to(torch.bfloat16)).to("meta")
    out = fast(torch.randn(3, 32, dtype=torch.bfloat16, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 16)


def test_gradients_flow_through_the_plain_call():
    layer = nn.Linear(16, 8).to(torch.bfloat16)
    native(layer)(torch.randn(2, 16, dtype=torch.bfloat16)).float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_every_weight_edit_is_what_the_next_call_reads():
    """No copy of the weight: writes through `.data` (a LoRA merge), `copy_` under no_grad, `load_state_dict`, a
    replaced parameter: the next call multiplies by what the module holds."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16).to(torch.bfloat16)
    fast = native(layer)
    x = torch.randn(2, 32, dtype=torch.bfloat16)

    def check():
        with torch.inference_mode():
            close(fast(x), nn.functional.linear(x, fast.weight, fast.bias))

    check()
    fast.weight.data.add_(1.0)
    check()
    with torch.no_grad():
        fast.weight.copy_(torch.randn(16, 32, dtype=torch.bfloat16))
    check()
    fast.load_state_dict({"weight": torch.randn(16, 32, dtype=torch.bfloat16), "bias": torch.zeros(16,
                                                                                                  dtype=torch.bfloat16)})
    check()
    fast.weight = nn.Parameter(torch.randn(16, 32, dtype=torch.bfloat16))
    check()


def test_the_calibration_key_tells_native_layers_and_steps_from_plain_ones():
    lm = _bf16_lm("gpt_neox")
    with plain(lm.model):
        before = calibration_key(lm, "target", (1,))
    after = calibration_key(lm, "target", (1,))
    assert before["native_layers"] == 0 and after["native_layers"] > 0 and before["model"] == after["model"]
    covered = decoders.wrap(tiny_model("llama", dtype=torch.bfloat16), tiny_tokenizer(), name="tiny")
    assert calibration_key(covered, "target", (1,))["native"] and not after["native"]


def test_a_copy_is_plain_and_its_own():
    torch.manual_seed(0)
    fast = native(nn.Linear(32, 16).to(torch.bfloat16))
    twin = copy.deepcopy(fast)
    assert type(twin) is nn.Linear and twin.weight is not fast.weight and torch.equal(twin.weight, fast.weight)


def test_a_native_model_still_counts_its_bytes_and_footprint():
    from evals.measure import bytes_per_token, parameter_bytes

    model = tiny_model("gpt_neox", dtype=torch.bfloat16)
    before = parameter_bytes(model), bytes_per_token(model), model.get_memory_footprint()
    assert use_native(model) > 0
    assert (parameter_bytes(model), bytes_per_token(model), model.get_memory_footprint()) == before


def test_a_pickled_layer_loads_plain_and_computes(tmp_path):
    torch.manual_seed(0)
    fast = native(nn.Linear(32, 16).to(torch.bfloat16))
    torch.save(fast, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert loaded.plain and torch.equal(loaded(x), nn.functional.linear(x, fast.weight, fast.bias))
