"""Sampling: filters on hand-built logits, seeded reproducibility, and the sampled distribution itself."""

import pytest
import torch

import decoders
import grammars
from conftest import PROMPTS, tiny_lm
from stats import chi_square_fits
from samplers import SamplingConfig, make_generator, sample

LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def test_temperature_one_is_softmax():
    torch.testing.assert_close(SamplingConfig(temperature=1.0).probs(LOGITS), torch.softmax(LOGITS, -1))


def test_top_k_top_p_min_p_filters():
    top_k = SamplingConfig(temperature=1.0, top_k=2).probs(LOGITS)
    torch.testing.assert_close(top_k, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]))
    top_p = SamplingConfig(temperature=1.0, top_p=0.8).probs(LOGITS)  # 0.5 + 0.25 < 0.8 -> needs the 0.15 too
    torch.testing.assert_close(top_p, torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9)
    min_p = SamplingConfig(temperature=1.0, min_p=0.2).probs(LOGITS)  # floor 0.1
    torch.testing.assert_close(min_p, torch.tensor([0.5, 0.25, 0.15, 0, 0]) / 0.9)
    assert SamplingConfig(temperature=1.0, top_p=0.01).probs(LOGITS)[0] == 1.0  # the top token always survives


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(temperature=1, top_k=0), dict(temperature=1, top_p=0),
               dict(temperature=1, top_p=1.5), dict(temperature=1, min_p=-0.1)]
)
def test_invalid_settings_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_seeded_sampling_is_reproducible():
    lm = tiny_lm("llama")
    runs = [decoders.generate(lm, PROMPTS[0], max_new_tokens=16, temperature=1.0, seed=s).tokens for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("strategy", decoders.available())
def test_every_strategy_draws_the_same_sample_from_the_same_seed(strategy):
    """What each drafts follows from the tokens alone (and `auto`'s, seeded, from its cached calibration, not from the
    call times it measures), so the seeded random numbers are spent the same way on every run."""
    lm, cls = tiny_lm("llama"), decoders.registry.get(strategy)
    draft = tiny_lm("llama", 1) if cls.takes_draft else None
    grammar = grammars.regex(r"[a-z ]+") if getattr(cls, "needs_grammar", False) else None
    runs = [decoders.generate(lm, PROMPTS[0] * 2, strategy=strategy, draft=draft, grammar=grammar, max_new_tokens=24,
                              temperature=1.0, seed=s).tokens for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_one_equals_greedy(arch):
    lm = tiny_lm(arch)
    greedy = decoders.generate(lm, PROMPTS[1], max_new_tokens=16).tokens
    assert decoders.generate(lm, PROMPTS[1], max_new_tokens=16, temperature=0.7, top_k=1, seed=3).tokens == greedy


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)])
def test_sampled_first_token_matches_the_filtered_softmax(settings):
    """A chi-square test of 4000 seeded draws against softmax(logits / T) after filtering - and a wrong T fails it."""
    lm = tiny_lm("qwen2")
    ids = lm.encode(PROMPTS[2])
    with torch.inference_mode():
        logits = lm.forward(ids, lm.new_cache())[-1]
    config = SamplingConfig(**settings)
    target = config.probs(logits)
    generator = make_generator(0, logits.device)
    draws = torch.tensor([sample(logits, config, generator) for _ in range(4000)])
    assert chi_square_fits(draws, target)
    assert not chi_square_fits(draws, SamplingConfig(**{**settings, "temperature": 1.5}).probs(logits))
    # and the generate() path draws its first token from the same distribution
    firsts = [decoders.generate(lm, ids, max_new_tokens=1, seed=s, **settings).tokens[0] for s in range(100)]
    assert all(target[t] > 0 for t in firsts)
