"""Issue 45's crashes and unclear errors: a suffix store holding ids the target lacks, temperatures so small that
dividing the logits overflows, and arguments of the wrong type."""

import numpy as np
import pytest
import torch

import decoders
from conftest import PROMPTS, VOCAB, tiny_lm
from samplers import SamplingConfig


@pytest.mark.parametrize("where", [0, 4])
def test_a_store_never_drafts_ids_past_the_targets_vocabulary(where):
    """A store filled through a bigger vocabulary: its ids past the target's are cut from the drafts, the rest
    still drafted."""
    lm = tiny_lm("llama")
    prompt = lm.encode(PROMPTS[0])
    want = decoders.generate(lm, prompt, max_new_tokens=12)
    store = decoders.SuffixStore()
    store.add(prompt + want.tokens[:where] + [VOCAB, 49_151, 10**12] + want.tokens[where:])
    got = decoders.generate(lm, prompt, strategy="suffix", store=store, max_new_tokens=12)
    assert got.tokens == want.tokens
    assert got.stats.accepted >= where  # the ids before the foreign ones were drafted and kept
    decoders.generate(lm, prompt, strategy="suffix", store=store, max_new_tokens=12, temperature=1.0, seed=0)


@pytest.mark.parametrize("tokens", [[-3], [1.5], [True], ["7"], [None], [[1, 2]], torch.tensor([[1, 2]])])
def test_store_add_takes_token_ids_only(tokens):
    store = decoders.SuffixStore()
    with pytest.raises(ValueError, match=r"^SuffixStore.add's tokens\[0\] must be a whole number >= 0, got"):
        store.add(tokens)
    assert len(store) == 0
    store.add(np.array([1, 2, 3]))  # numpy's and torch's integers are token ids
    store.add([np.int64(4), 5])
    store.add(torch.tensor([6, 7]))
    assert store.sequences() == [("output", [1, 2, 3]), ("output", [4, 5]), ("output", [6, 7])]
    assert all(type(t) is int for _, tokens in store.sequences() for t in tokens)


@pytest.mark.parametrize("strategy", ["greedy", "suffix", "speculative"])
@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324])
def test_a_vanishing_temperature_samples_the_argmax(strategy, temperature):
    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[3], max_new_tokens=10)
    draft = lm if strategy == "speculative" else None
    got = decoders.generate(lm, PROMPTS[3], strategy=strategy, draft=draft, max_new_tokens=10,
                            temperature=temperature, seed=0)
    assert got.tokens == want.tokens


def test_a_vanishing_temperature_keeps_ties_and_masked_logits():
    logits = torch.tensor([[3.0, 5.0, 5.0, float("-inf"), -2.0], [-7.0, -9.0, float("-inf"), -7.5, -30.0]])
    probs = SamplingConfig(temperature=1e-40, top_k=4).probs(logits)
    assert torch.equal(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(temperature=1.0, top_p="0.5"), ValueError, r"^top_p must be a number in \(0, 1\] or None, got '0.5'$"),
    (dict(temperature=1.0, min_p="0.1"), ValueError, r"^min_p must be a number in \[0, 1\] or None, got '0.1'$"),
    (dict(prompt=None), TypeError, r"^prompt must be a string or a list of token ids, got None$"),
    (dict(prompt=7), TypeError, r"^prompt must be a string or a list of token ids, got 7$"),
    (dict(stop=123), ValueError, r"^stop= takes stop strings: a non-empty string or a list of them, got 123$"),
    (dict(stop=0), ValueError, r"^stop= takes stop strings: a non-empty string or a list of them, got 0$"),
    (dict(strategy="suffix", remember_prompts="yes"), ValueError, r"^remember_prompts must be True or False, got 'yes'$"),
])
def test_an_argument_of_the_wrong_type_gets_a_one_line_error(kwargs, error, message):
    kwargs = {"prompt": PROMPTS[0], **kwargs}
    with pytest.raises(error, match=message):
        decoders.generate(tiny_lm("llama"), kwargs.pop("prompt"), max_new_tokens=4, **kwargs)

