"""Grouped-query attention without copied keys (`decoders.models.attention`) scores as transformers' sdpa does."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import decoders
from decoders.models.attention import NAME, grouped_sdpa
from tests.conftest import DEVICE, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("queries", [1, 2, 5])
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_grouped_attention_equals_transformers_sdpa(heads, kv_heads, queries, per_head_mask):
    g = torch.Generator().manual_seed(heads * 100 + queries)
    batch, keys, dim = 3, 11, 8
    query = torch.randn(batch, heads, queries, dim, generator=g)
    key, value = (torch.randn(batch, kv_heads, keys, dim, generator=g) for _ in range(2))
    allowed = torch.rand(batch, heads if per_head_mask else 1, queries, keys, generator=g) < 0.7
    allowed[..., -1] = True  # (no query sees nothing)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    ours, _ = grouped_sdpa(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (batch, queries, heads, dim)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch,switched", [("llama", True), ("gemma", True), ("gpt2", False)])
def test_wrapping_switches_grouped_models_and_their_logits_stay(arch, switched):
    model = tiny_model(arch)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    allowed = torch.ones(2, 5, 12, dtype=torch.bool).tril(7)  # 5 queries after 7 cached tokens, causal
    allowed[1, :, :2] = False  # row 1 hides two cached slots (padding, a rejected draft)
    mask = torch.zeros(2, 1, 5, 12).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min).to(DEVICE)
    positions = torch.arange(7, 12).expand(2, 5).to(DEVICE)

    def masked_call():
        with torch.inference_mode():
            cache = model(input_ids=ids[:, :7], use_cache=True).past_key_values
            return model(input_ids=ids[:, 7:], attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).logits

    before = masked_call()
    decoders.wrap(model, tiny_tokenizer())
    assert (model.config._attn_implementation == NAME) is switched
    torch.testing.assert_close(masked_call(), before, rtol=1e-5, atol=1e-5)


def test_transformers_peers_run_on_transformers_own_attention():
    from evals import batched, peers

    lm = decoders.wrap(tiny_model("llama"), tiny_tokenizer())
    draft = decoders.wrap(tiny_model("qwen2", seed=1), tiny_tokenizer())
    assert lm.model.config._attn_implementation == draft.model.config._attn_implementation == NAME
    seen = []

    class Watch:  # a streamer: what both models run on while transformers generates
        def put(self, value):
            seen.append((lm.model.config._attn_implementation, draft.model.config._attn_implementation))

        def end(self):
            pass

    ids = torch.tensor([lm.encode("hello there")], device=DEVICE)
    peers.quiet_generate(lm.model, input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                         assistant_model=draft.model, streamer=Watch(), **peers.greedy_arguments(lm))
    assert seen and set(seen) == {("sdpa", "sdpa")}
    assert batched.continuous_problem(lm, lm.encode("hi")) is None  # (it refuses any other implementation)
    assert lm.model.config._attn_implementation == draft.model.config._attn_implementation == NAME
