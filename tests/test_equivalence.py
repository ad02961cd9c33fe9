"""Every registered strategy, in greedy mode, returns exactly the tokens of KV-cached `greedy` (float32).

Parametrized over `decoders.available()`, so a new strategy is tested the day it is registered. Strategies that take
a draft run four times: with the target itself as the draft (everything accepted) and with an unrelated random model of
the same tokenizer (almost nothing accepted) - the two extremes - and with the int8 copies of both ("self:int8").
"""

import copy

import pytest
import torch

import decoders
from conftest import ARCHITECTURES, PROMPTS, tiny_lm

STRATEGIES = [name for name in decoders.available() if name != "greedy"]
SELF, RANDOM, SELF_INT8, RANDOM_INT8 = "self", "random", "self:int8", "random:int8"


def run(strategy, lm, prompt, draft_kind, **kwargs):
    cls = decoders.registry.get(strategy)
    if getattr(cls, "needs_grammar", False):
        pytest.skip(f"{strategy} is tested with grammars in its own tests")
    draft = None
    if cls.takes_draft:
        draft = {SELF: lm, RANDOM: tiny_lm("llama", seed=99), SELF_INT8: SELF_INT8,
                 RANDOM_INT8: decoders.quantize(tiny_lm("llama", seed=99))}[draft_kind]
    elif draft_kind != SELF:
        pytest.skip(f"{strategy} takes no draft model")
    return decoders.generate(lm, prompt, strategy=strategy, draft=draft, **kwargs)


def assert_draft_fully_accepted(strategy, stats):
    """With the target as its own draft every chain token is accepted. A tree also holds the draft's second choices,
    which the target never takes, so there: every call that drafted accepted at least its first token."""
    if getattr(decoders.registry.get(strategy), "needs_tree_mask", False):
        assert stats.accepted >= sum(1 for drafted in stats.draft_lengths if drafted)
    else:
        assert stats.acceptance_rate == 1.0


@pytest.mark.parametrize("draft_kind", [SELF, RANDOM, SELF_INT8, RANDOM_INT8])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_mode_equals_greedy(strategy, arch, draft_kind):
    lm = tiny_lm(arch)
    for prompt in PROMPTS:
        want = decoders.generate(lm, prompt, strategy="greedy", max_new_tokens=40)
        got = run(strategy, lm, prompt, draft_kind, max_new_tokens=40)
        assert got.tokens == want.tokens, f"{strategy} diverged on {prompt!r}"
        assert len(got.sources) == len(got.tokens)
        stats = got.stats
        assert stats.new_tokens == len(got.tokens)
        assert stats.accepted == sum(s != "target" for s in got.sources)
        # one target token per call, except a last call whose accepted draft already ended in EOS
        assert stats.target_calls - sum(s == "target" for s in got.sources) in (0, 1)
        if draft_kind == SELF and decoders.registry.get(strategy).needs_draft:
            assert_draft_fully_accepted(strategy, stats)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_self_draft_accepts_everything_and_saves_calls(strategy):
    """A confident model (sharpened logits) drafting for itself: every drafted chain token is accepted, and
    strategies that size their drafts by the draft's confidence draft long enough to save calls."""
    cls = decoders.registry.get(strategy)
    if not cls.needs_draft:
        pytest.skip("only a draft model equal to the target accepts everything")
    base = tiny_lm("llama")
    sharp = copy.deepcopy(base.model)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(8.0)
    lm = decoders.wrap(sharp, base.tokenizer)
    options = {"k": 5} if strategy == "speculative" else {}  # (its measured default for a draft as dear as its
    # target, this one, is 1: the length `default_k` favours when drafting hardly pays)
    result = decoders.generate(lm, PROMPTS[0], strategy=strategy, draft=lm, max_new_tokens=40, **options)
    assert result.tokens == decoders.generate(lm, PROMPTS[0], max_new_tokens=40).tokens
    assert_draft_fully_accepted(strategy, result.stats)
    assert result.stats.target_calls < len(result.tokens) / 2
