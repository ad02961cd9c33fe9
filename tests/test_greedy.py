"""`greedy` is the reference: it must return exactly what transformers' own greedy `generate` returns."""

import pytest
import torch

import decoders
from conftest import PROMPTS, tiny_lm


def hf_greedy(lm, ids, max_new_tokens, eos=None):
    """transformers' greedy generate, new tokens only."""
    out = lm.model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos if eos is not None else lm.model.generation_config.eos_token_id, pad_token_id=0,
    )
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_equals_transformers_generate(arch, prompt):
    lm = tiny_lm(arch)
    ids = lm.encode(prompt)
    result = decoders.generate(lm, ids, strategy="greedy", max_new_tokens=24)
    assert result.tokens == hf_greedy(lm, ids, 24)
    assert result.sources == ["target"] * len(result.tokens)
    assert result.stats.target_calls == len(result.tokens)


def test_greedy_stops_at_eos_like_transformers(arch):
    """Make a token that greedy emits mid-way the EOS: both must stop right after it, EOS included."""
    lm = tiny_lm(arch)
    ids = lm.encode(PROMPTS[1])
    free = decoders.generate(lm, ids, max_new_tokens=24).tokens
    eos = free[10]
    first = free.index(eos)
    saved = lm.eos_token_ids
    lm.eos_token_ids = frozenset([eos])
    try:
        result = decoders.generate(lm, ids, max_new_tokens=24)
    finally:
        lm.eos_token_ids = saved
    assert result.finish_reason == "eos"
    assert result.tokens == free[: first + 1]
    assert result.tokens == hf_greedy(lm, ids, 24, eos=eos)


def test_text_prompt_and_text_result_agree_with_tokens():
    lm = tiny_lm("llama")
    result = decoders.generate(lm, PROMPTS[0], max_new_tokens=12)
    assert result.prompt_tokens == lm.encode(PROMPTS[0])
    assert result.text == lm.decode(result.tokens)
    assert result.finish_reason == "length" and len(result.tokens) == 12


def test_stats_fields():
    lm = tiny_lm("qwen2")
    stats = decoders.generate(lm, PROMPTS[2], max_new_tokens=10).stats
    fields = stats.as_dict()
    for name in ("new_tokens", "target_calls", "draft_calls", "drafted", "accepted", "acceptance_rate",
                 "mean_accepted", "accepted_by_position", "seconds", "ttft_seconds", "tokens_per_second"):
        assert name in fields
    assert stats.new_tokens == 10 and stats.target_calls == 10 and stats.mean_accepted == 1.0
    assert 0 < stats.ttft_seconds <= stats.seconds and stats.tokens_per_second > 0
