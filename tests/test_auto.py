"""`auto` under every plan its chooser could make: whatever proposer and draft length a step picks, the output is
greedy's (the chooser's own picks depend on measured times, so the registry-wide tests see only some of them)."""

import random

import pytest

import decoders
import grammars
from conftest import PROMPTS, tiny_lm
from decoders.drafting import chooser


@pytest.fixture
def random_plans(monkeypatch):
    """Every step: a random candidate (or a plain step) and a random length, half of them probes (exact length)."""
    rng = random.Random(0)

    def choose(self, candidates, context):
        picked = rng.choice([*candidates, None])
        if picked is None:
            return chooser.Plan(None, 0, 1.0, 1.0)
        return chooser.Plan(picked.proposer, rng.randint(1, len(picked.accept)), 1.0, 1.0, probe=rng.random() < 0.5)

    monkeypatch.setattr(chooser.Chooser, "choose", choose)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt2"])
def test_any_plan_gives_greedys_tokens(arch, random_plans):
    lm = tiny_lm(arch)
    for draft in (lm, "self:int8", None):
        for prompt in PROMPTS:
            want = decoders.generate(lm, prompt, max_new_tokens=40).tokens
            got = decoders.generate(lm, prompt, strategy="auto", draft=draft, max_new_tokens=40)
            assert got.tokens == want
            assert sum(got.stats.details["steps"].values()) == got.stats.target_calls


def test_any_plan_samples_under_a_grammar_with_eos_in_the_drafts(random_plans):
    lm = tiny_lm("llama")
    constraint = grammars.choice([" red", " green"])
    prompt = lm.encode("Answer: red") + [0] + lm.encode("Answer: green") + [0] + lm.encode("Answer:")
    for seed in range(40):
        result = decoders.generate(lm, prompt, strategy="auto", draft=lm, grammar=constraint, temperature=1.0,
                                   seed=seed, max_new_tokens=12)
        assert result.text in (" red", " green")


def test_a_model_without_tree_masks_gets_the_suffix_trees_main_branch(monkeypatch):
    from conftest import tiny_model, tiny_tokenizer
    from decoders.models import lm as lm_module

    lm = lm_module.wrap(tiny_model("llama"), tiny_tokenizer())
    monkeypatch.setattr(lm_module.LM, "_tree_attention_mask", lambda self, tree, positions, past: None)
    prompt = lm.encode(PROMPTS[2]) * 2  # repeated text: the suffix index drafts
    want = decoders.generate(lm, prompt, max_new_tokens=30).tokens
    got = decoders.generate(lm, prompt, strategy="auto", max_new_tokens=30)
    assert got.tokens == want and got.stats.details["steps"].get("suffix", 0) > 0
