"""Weight-only int8 quantization: the layer against a float reference, the copy as a lossless draft on every tiny
architecture, the original untouched, sharing, tied heads and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from conftest import ARCHITECTURES, PROMPTS, tiny_lm, tiny_model, tiny_tokenizer
from torch import nn
from transformers.pytorch_utils import Conv1D

import decoders
from decoders.base import drive
from decoders.models import int8 as int8_module
from decoders.models.int8 import Int8Linear, _kernels, quantize_rows
from decoders.models.quantize import is_quantized, quantize, self_draft


def _float_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, Conv1D))]


def _error_bound(x: torch.Tensor, layer: Int8Linear, y: torch.Tensor) -> torch.Tensor:
    """Per output: sum_i |x_i| * scale / 2 from the int8 weights, plus the rounding of the kernel's output dtype."""
    from_weights = x.abs().sum(-1, keepdim=True) * layer.scales.float() / 2  # [rows, out]
    from_output = y.abs() * torch.finfo(layer.scales.dtype).eps
    return from_weights + from_output + 1e-6


def test_quantize_rows_error_is_at_most_half_a_scale():
    weight = torch.tensor([[1.0, -0.5, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0], [-7.0, 1e-3, 2.5, 6.9]])
    for dtype in (torch.float32, torch.bfloat16):
        q, scales = quantize_rows(weight, dtype)
        assert q.dtype == torch.int8 and scales.dtype == dtype and q.abs().max() <= 127
        error = (q.float() * scales.float()[:, None] - weight).abs()
        assert (error <= scales.float()[:, None] / 2).all()
        assert (q[1] == 0).all()  # a zero row stays zero


@pytest.mark.parametrize("in_features", [48, 40])  # torch's int8_mm takes multiples of 16 on a CPU; 40 does not
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_layer_matches_float_reference_within_the_scale_bound(kind, bias, in_features):
    torch.manual_seed(0)
    out_features = 24
    weight = torch.randn(out_features, in_features) * torch.linspace(0.1, 3.0, out_features)[:, None]  # [out, in]
    if kind == "linear":
        layer = nn.Linear(in_features, out_features, bias=bias)
        layer.weight.data.copy_(weight)
    else:  # GPT-2's Conv1D keeps its weight as [in, out]
        layer = Conv1D(out_features, in_features)
        layer.weight.data.copy_(weight.T)
        if not bias:
            layer.bias = None
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(out_features))
    q, scales = quantize_rows(weight, torch.bfloat16)
    kernels = _kernels(q, scales)
    assert ("int8_mm" in kernels) == (in_features % 16 == 0) and kernels[-1] == "dequantize"
    assert Int8Linear.rounded(layer).kernel == kernels[0]
    x = torch.randint(-8, 9, (1, 5, in_features)) / 4  # [1, T, in], exact in bfloat16
    reference = x @ weight.T  # [1, T, out]
    for kernel in kernels:
        int8 = Int8Linear.rounded(layer, kernel)  # (not `timed`: the int8 path at every call size)
        with torch.no_grad():
            y = int8(x)
        assert y.shape == (1, 5, out_features) and y.dtype == x.dtype
        if layer.bias is not None:
            y = y - layer.bias
        dequantized = q.float() * scales.float()[:, None]  # [out, in]
        bound = _error_bound(x, int8, y)
        if kernel == "dequantize":  # each dequantized weight also rounded to the kernel's dtype
            bound = bound + x.abs() @ dequantized.abs().T * torch.finfo(scales.dtype).eps
        if kernel == "int8_activations":  # each input also rounded to 8 bits (7 without VNNI) over the call's range
            step = (x.max().clamp(min=0) - x.min().clamp(max=0)) / (127 if int8_module._reduce_range() else 255)
            bound = bound + (dequantized.abs().sum(1) + in_features * scales.float()) * step * 0.51
        assert ((y - reference).abs() <= bound).all(), kernel


def test_weights_that_are_multiples_of_their_scale_come_back_exactly():
    weight = torch.tensor([[127.0, -3.0, 0.0, 5.0], [1.0, 2.0, -127.0, 64.0]]) / 64  # scales are exactly 1/64
    layer = nn.Linear(4, 2, bias=False)
    layer.weight.data.copy_(weight)
    int8 = Int8Linear.rounded(layer, "dequantize")  # (the inputs as they are: "int8_activations" rounds them)
    x = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    assert torch.equal(int8.scales.float(), torch.full((2,), 1 / 64))
    assert torch.equal(int8(x), x @ weight.T)
    assert int8(x[0]).shape == (2,)  # no leading dimensions


def test_int8_layer_takes_an_unaligned_bfloat16_input():
    torch.manual_seed(0)
    layer = nn.Linear(64, 8).to(torch.bfloat16)
    int8 = Int8Linear.rounded(layer, "int8_mm")
    x = torch.randn(3 * 64 + 1, dtype=torch.bfloat16)[1:].reshape(1, 3, 64)  # starts 2 bytes into its storage
    assert x.data_ptr() % 64 and torch.equal(int8(x), int8(x.clone()))


def test_long_calls_run_on_the_shared_float_weight_from_the_measured_size(monkeypatch):
    from decoders.models import int8 as module

    torch.manual_seed(0)
    layer = nn.Linear(64, 8)
    monkeypatch.setattr(module, "_crossovers", {})
    monkeypatch.setattr(module, "_seconds", lambda call, device: 1.0)  # float never faster
    int8 = Int8Linear.rounded(layer).timed(layer)
    assert int8.float_from is None and int8.float_weight is None  # never faster: not kept

    timings = iter([2.0, 1.0, 2.0, 1.0, 0.5, 1.0])  # (float, int8) at 2, 4, 8 rows: faster from 8
    monkeypatch.setattr(module, "_crossovers", {})
    monkeypatch.setattr(module, "_seconds", lambda call, device: next(timings))
    int8 = Int8Linear.rounded(layer).timed(layer)
    assert int8.float_from == 8 and int8.float_weight.data_ptr() == layer.weight.data_ptr()  # shared, not copied
    x = torch.randn(1, 8, 64)
    with torch.no_grad():
        assert torch.equal(int8(x), layer(x))  # 8 rows: the float layer's own result
        assert not torch.equal(int8(x[:, :7]), layer(x[:, :7]))  # 7 rows: the int8 weights
    layer = nn.Linear(64, 8)
    assert Int8Linear.rounded(layer).timed(layer).float_from == 8  # measured once per shape


def test_a_self_draft_drafts_on_the_targets_cache_and_leaves_it_as_it_found_it(monkeypatch):
    from decoders.driver import _prepare
    from decoders.drafting import draft_model
    from decoders.drafting.draft_model import DraftModel, SharedCacheDraft

    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[1])
    state, _ = _prepare(lm, prompt, strategy="speculative", draft="self:int8", max_new_tokens=20)
    assert isinstance(draft_model(state), SharedCacheDraft)
    other = dataclasses.replace(state, draft=quantize(tiny_lm("qwen2")))  # another model's copy: its own cache
    assert type(draft_model(other)) is DraftModel
    with torch.inference_mode():
        lm.forward(prompt[:-1], state.cache)
        n = len(state.cache)  # (a static cache's slots past its length are scratch that drafts may write)
        keys = [layer.keys[:, :, :n].clone() for layer in state.cache.hf.layers]
        model = draft_model(state)
        fed = []
        original = model.lm.forward
        monkeypatch.setattr(model.lm, "forward",  # (the copy is kept on the target: put back after the test)
                            lambda tokens, cache, **kw: fed.append(list(tokens)) or original(tokens, cache, **kw))
        tokens, _, _ = drive(model.draft_chain(4), state.forward)
    assert fed == [prompt[-1:], *([t] for t in tokens[:-1])]  # no prefill: only the uncached token, then its drafts
    assert len(tokens) == 4 and len(state.cache) == len(prompt) - 1
    assert all(torch.equal(k, layer.keys[:, :, :n]) for k, layer in zip(keys, state.cache.hf.layers))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_int8_copy_as_draft_is_lossless(arch):
    lm = tiny_lm(arch)
    draft = quantize(lm)
    assert not _float_layers(draft.model)  # every linear layer, the LM head included
    for prompt in PROMPTS[:2]:
        greedy = decoders.generate(lm, prompt, strategy="greedy", max_new_tokens=30)
        speculative = decoders.generate(lm, prompt, strategy="speculative", draft=draft, max_new_tokens=30)
        assert speculative.tokens == greedy.tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_int8_logits_are_close_to_the_original(arch, dtype):
    lm = decoders.wrap(tiny_model(arch, dtype=dtype), tiny_tokenizer(), name=f"tiny-{arch}")
    draft = quantize(lm)
    assert draft.dtype == dtype and draft.vocab_size == lm.vocab_size
    tokens = lm.encode(PROMPTS[1])
    with torch.inference_mode():
        expected = lm.forward(tokens, lm.new_cache()).float()  # [T, vocab]
        logits = draft.forward(tokens, draft.new_cache()).float()
    assert logits.shape == expected.shape
    assert nn.functional.cosine_similarity(logits, expected, dim=-1).min() > 0.99


def test_original_is_untouched_and_untouched_parameters_are_shared():
    lm = decoders.wrap(tiny_model("llama"), tiny_tokenizer(), name="tiny-llama")
    before = {name: t.clone() for name, t in lm.model.state_dict().items()}
    layers = _float_layers(lm.model)
    draft = quantize(lm)
    after = lm.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert _float_layers(lm.model) == layers and is_quantized(lm) is None
    assert draft.tokenizer is lm.tokenizer and draft.name == "tiny-llama:int8" and is_quantized(draft) == "int8"
    assert draft.model.get_input_embeddings().weight is lm.model.get_input_embeddings().weight
    assert draft.model.model.norm.weight is lm.model.model.norm.weight
    assert draft.model.model.layers[0].input_layernorm.weight is lm.model.model.layers[0].input_layernorm.weight
    # What the copy adds: the int8 weights (as buffers, or prepacked by fbgemm) and their scales, nothing else.
    original = {t.data_ptr() for t in (*lm.model.parameters(), *lm.model.buffers())}
    added = [t for t in (*draft.model.parameters(), *draft.model.buffers()) if t.data_ptr() not in original]
    int8_layers = [m for m in draft.model.modules() if isinstance(m, Int8Linear)]
    packed = [m for m in int8_layers if m.weight_int8 is None]
    assert all(m.kernel == "int8_activations" and m.packed is not None for m in packed)
    assert len(int8_layers) == len(layers) and len(added) == 2 * len(int8_layers) - len(packed)
    linear_bytes = sum(m.weight.numel() for m in layers)  # int8: one byte a weight
    assert sum(m.weight.numel() for m in int8_layers) == linear_bytes
    scale_bytes = sum(m.scales.numel() * m.scales.element_size() for m in int8_layers)  # one a row
    stored = linear_bytes - sum(m.weight.numel() for m in packed)
    assert sum(t.numel() * t.element_size() for t in added) == stored + scale_bytes
    assert scale_bytes < 0.1 * linear_bytes


def test_tied_head_gets_its_own_int8_copy():
    config = transformers.LlamaConfig(**ARCHITECTURES["llama"][2], initializer_range=0.2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    lm = decoders.wrap(model, tiny_tokenizer())
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding
    before = embedding.clone()
    draft = quantize(lm)
    head = draft.model.get_output_embeddings()
    assert isinstance(head, Int8Linear) and head.weight.shape == embedding.shape
    assert draft.model.get_input_embeddings().weight is embedding and torch.equal(embedding, before)
    assert model.get_output_embeddings().weight is embedding  # the original stays tied
    tokens = lm.encode(PROMPTS[0])
    with torch.inference_mode():
        expected, logits = lm.forward(tokens, lm.new_cache()), draft.forward(tokens, draft.new_cache())
    assert nn.functional.cosine_similarity(logits, expected, dim=-1).min() > 0.99


def test_bad_scheme_and_quantizing_twice_raise():
    lm = tiny_lm("llama")
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'; known: int8"):
        quantize(lm, "int3")
    draft = self_draft(lm, "int8")
    assert self_draft(lm, "int8") is draft and is_quantized(draft) == "int8"
    with pytest.raises(ValueError, match="already quantized"):
        quantize(draft)


def test_lms_wrapping_one_module_share_its_self_draft_for_as_long_as_the_module_lives(monkeypatch):
    """transformers' `model.generate` wraps the module in a new LM on each call: its int8 copy is made once, each
    wrapper gets its own LM around it (a draft of that wrapper, sharing its cache), and it goes with the module."""
    import gc
    import weakref

    from conftest import tiny_model, tiny_tokenizer
    from decoders.models import held, quantize as quantizing

    made, quantize_lm = [], quantizing.quantize
    monkeypatch.setattr(quantizing, "quantize", lambda lm, scheme: made.append(lm) or quantize_lm(lm, scheme))
    module, tokenizer = tiny_model("llama"), tiny_tokenizer()
    first, second = decoders.wrap(module, tokenizer), decoders.wrap(module, tokenizer)
    copy_first, copy_second = self_draft(first, "int8"), self_draft(second, "int8")
    assert len(made) == 1 and copy_first.model is copy_second.model and copy_second.quantized_from() is second
    prompt = first.encode(PROMPTS[0])
    want = decoders.generate(second, prompt, max_new_tokens=12).tokens
    got = decoders.generate(second, prompt, strategy="speculative", draft="self:int8", max_new_tokens=12)
    assert got.tokens == want and got.stats.accepted > 0 and len(made) == 1
    alive = weakref.ref(module)
    assert alive() in held._SHARED
    del first, second, copy_first, copy_second, module, got, made[:]
    gc.collect()
    assert alive() is None  # the copy kept nothing of the module alive: no model outlives its last user


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm in this torch")
def test_int8_activations_round_over_the_calls_range_except_row_by_row():
    from decoders.models.int8 import row_by_row

    torch.manual_seed(0)
    layer = nn.Linear(64, 32, bias=False)
    int8 = Int8Linear.rounded(layer, "int8_activations")
    x = torch.randn(3, 64)
    x[2] *= 50  # a row of wide range: every row of its call is rounded in coarser steps
    q, scales = quantize_rows(layer.weight.detach(), torch.bfloat16)
    exact = x[:1] @ (q.float() * scales.float()[:, None]).T  # the int8 weights, the input as it is
    with torch.no_grad():
        alone, beside = int8(x[:1]), int8(x)[:1]
        assert not torch.equal(alone, beside)
        assert (beside - exact).abs().max() > (alone - exact).abs().max()
        with row_by_row(nn.Sequential(int8)):
            assert torch.equal(int8(x)[:1], alone) and torch.equal(int8(x)[2:], int8(x[2:]))
    assert not int8.row_by_row
    with torch.no_grad():
        assert torch.equal(int8(x)[:1], beside)
