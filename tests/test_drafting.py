"""Drafting strategies beyond token equality: threshold adaptation, sampling mode, cache hygiene, bad input."""

import copy

import pytest
import torch
import transformers

import decoders
from conftest import PROMPTS, VOCAB, on_device, tiny_lm, tiny_model, tiny_tokenizer
from decoders.base import drive
from decoders.driver import _prepare
from decoders.drafting.cost import CallCost, CostModel
from decoders.strategies.speculative import default_k
from decoders.strategies.threshold import ThresholdOptions, adapt_threshold
from samplers import SamplingConfig
from stats import chi_square_fits

DRAFTING = ["speculative", "threshold", "prompt_lookup"]


def test_threshold_update_rule():
    options = ThresholdOptions(threshold=0.4, step=0.1, min_threshold=0.05, max_threshold=0.95)
    cumulative = [0.9, 0.6, 0.2]
    assert adapt_threshold(0.4, cumulative, 1, options) == pytest.approx((0.4 + 0.6) / 2)  # rejected at depth 1
    assert adapt_threshold(0.4, cumulative, 0, options) == pytest.approx((0.4 + 0.9) / 2)
    assert adapt_threshold(0.4, cumulative, 3, options) == pytest.approx(0.3)  # all accepted: relax by a step
    assert adapt_threshold(0.1, cumulative, 3, options) == pytest.approx(0.05)  # clamped below
    assert adapt_threshold(0.95, [1.0, 1.0], 0, options) == pytest.approx(0.95)  # clamped above


def test_threshold_drafts_grow_on_easy_text_and_shrink_on_hard_text():
    """Easy: a confident draft that agrees with the target (the target itself, with sharpened logits).
    Hard: an unrelated, unconfident random draft."""
    base = tiny_lm("llama")
    sharp = copy.deepcopy(base.model)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(8.0)
    lm = decoders.wrap(sharp, base.tokenizer)
    easy = decoders.generate(lm, PROMPTS[2], strategy="threshold", draft=lm, max_new_tokens=120).stats
    hard = decoders.generate(lm, PROMPTS[2], strategy="threshold", draft=tiny_lm("llama", seed=99),
                             max_new_tokens=120).stats
    mean = lambda lengths: sum(lengths) / len(lengths)  # noqa: E731
    assert easy.draft_lengths[0] < max(easy.draft_lengths) == 16  # grows up to max_draft
    assert mean(hard.draft_lengths) < 2.5
    assert mean(easy.draft_lengths) > 3 * mean(hard.draft_lengths)


def test_speculative_drafts_k_tokens_per_call():
    lm = tiny_lm("qwen2")
    stats = decoders.generate(lm, PROMPTS[0], strategy="speculative", draft=lm, k=3, max_new_tokens=41).stats
    assert stats.draft_lengths == [3] * 10 + [0]  # 10 calls of 3 accepted + 1 bonus = 40, then 1 left: no draft
    assert stats.target_calls == 11 and stats.accepted_by_position == [10, 10, 10]


def test_speculative_k_defaults_to_what_the_measured_costs_favour():
    flat = lambda seconds: CallCost((1, 2), (seconds, seconds), 0.0)  # noqa: E731  a call costs this, whatever n
    # dear draft, often wrong: E(k) = 2 - 0.5 ** k tokens over 1 + 0.5 k seconds: k=1 1.0/s, k=2 0.875/s
    assert default_k(CostModel(flat(1.0), flat(0.5)), 0, 0.5) == 1
    # cheap draft, mostly right: E(k) = (1 - 0.9 ** (k + 1)) / 0.1 over 1 + 0.1 k: k=9 3.428/s, 10 3.431, 11 3.417
    assert default_k(CostModel(flat(1.0), flat(0.1)), 0, 0.9) == 10
    lm = tiny_lm("qwen2")
    chosen = decoders.generate(lm, PROMPTS[0], strategy="speculative", draft=lm, max_new_tokens=20).stats
    assert 1 <= chosen.details["chosen_k"] <= 16 and max(chosen.draft_lengths) == chosen.details["chosen_k"]
    given = decoders.generate(lm, PROMPTS[0], strategy="speculative", draft=lm, k=3, max_new_tokens=20).stats
    assert "chosen_k" not in given.details


def test_prompt_lookup_copies_from_the_prompt():
    lm = tiny_lm("gpt2")
    prompt = lm.encode(PROMPTS[3]) * 3  # a repeated context: the continuation is likely found in it
    result = decoders.generate(lm, prompt, strategy="prompt_lookup", max_new_tokens=30)
    assert "lookup" in result.sources or result.stats.drafted > 0
    assert result.tokens == decoders.generate(lm, prompt, max_new_tokens=30).tokens


def test_prompt_lookup_copies_what_followed_the_most_recent_match():
    """`lookup`: the up to k tokens after the most recent earlier occurrence of the longest matching suffix."""
    from decoders.proposers.lookup import lookup

    tokens = [7, 5, 1, 2, 3, 4, 6, 7, 5, 1, 2, 3]  # [1, 2, 3] seen before
    assert lookup(tokens, 3, 3, 1) == [4, 6, 7]
    assert lookup(tokens, 3, 2, 1) == [4, 6, 7]  # a 2-gram found, the same occurrence
    assert lookup([9, 1, 2, 8, 2], 4, 3, 1) == [8, 2]  # only the last token seen before
    assert lookup([1, 2, 3], 4, 3, 1) == []


@pytest.mark.parametrize("strategy", DRAFTING)
def test_target_cache_always_holds_the_accepted_tokens(strategy):
    """After every step the target cache holds exactly the accepted tokens but the last (which is fed next)."""
    lm = tiny_lm("mistral")  # sliding window 8: rollback across the window too
    draft = tiny_lm("mistral", seed=5) if decoders.registry.get(strategy).takes_draft else None
    state, decoder = _prepare(lm, PROMPTS[1], strategy=strategy, draft=draft, max_new_tokens=60)
    with torch.inference_mode():
        decoder.start(state)
        while not state.finished:
            decoder.step(state)
            assert len(state.cache) == len(state.tokens) - 1
            model = getattr(getattr(state.drafter, "proposer", None), "model", None)  # (a fixed plan's proposer's)
            if model is not None:  # the draft cache is always a prefix of the accepted tokens
                assert len(model.cache) <= len(state.tokens) - 1


@pytest.mark.parametrize("strategy", DRAFTING)
def test_sampling_mode_first_token_follows_the_target_distribution(strategy):
    lm = tiny_lm("llama")
    # a different distribution: recovered tokens must fix it
    draft = tiny_lm("llama", seed=99) if decoders.registry.get(strategy).takes_draft else None
    prompt = lm.encode(PROMPTS[4]) * 2
    settings = dict(temperature=1.0, top_k=12)
    with torch.inference_mode():
        target = SamplingConfig(**settings).probs(lm.forward(prompt, lm.new_cache())[-1])
    firsts = torch.tensor([
        decoders.generate(lm, prompt, strategy=strategy, draft=draft, max_new_tokens=3, seed=seed, **settings).tokens[0]
        for seed in range(1200)
    ])
    assert chi_square_fits(firsts, target)


def test_sampling_mode_is_seeded():
    lm = tiny_lm("llama")
    runs = [decoders.generate(lm, PROMPTS[0], strategy="speculative", draft=tiny_lm("llama", seed=99),
                              max_new_tokens=20, temperature=0.9, seed=s).tokens for s in (4, 4)]
    assert runs[0] == runs[1]


def test_a_draft_with_a_padded_vocabulary_works():
    """Same tokenizer, embedding matrix padded to a larger size (as Qwen's 0.5B vs 1.5B may be)."""
    lm = tiny_lm("llama")
    config = transformers.LlamaConfig(**{**lm.model.config.to_dict(), "vocab_size": VOCAB + 64})
    torch.manual_seed(3)
    padded = decoders.wrap(on_device(transformers.LlamaForCausalLM(config)), tiny_tokenizer())
    assert padded.vocab_size != lm.vocab_size
    for strategy in ("speculative", "threshold"):
        got = decoders.generate(lm, PROMPTS[1], strategy=strategy, draft=padded, max_new_tokens=30)
        assert got.tokens == decoders.generate(lm, PROMPTS[1], max_new_tokens=30).tokens
        decoders.generate(lm, PROMPTS[1], strategy=strategy, draft=padded, max_new_tokens=30, temperature=1.0, seed=1)


def test_a_draft_with_another_tokenizer_drafts_through_text_but_staged_refuses_it():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["completely different text " * 20],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    other = decoders.wrap(tiny_model("llama", seed=1), transformers.PreTrainedTokenizerFast(tokenizer_object=tok))
    lm = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[0], max_new_tokens=20).tokens
    for strategy in ("speculative", "threshold"):
        assert decoders.generate(lm, PROMPTS[0], strategy=strategy, draft=other, max_new_tokens=20).tokens == want
    with pytest.raises(ValueError, match="does not share the tokenizer.*'staged', which grows token trees"):
        decoders.generate(lm, PROMPTS[0], strategy="staged", draft=other)


@pytest.mark.parametrize(
    "strategy, options, message",
    [
        ("speculative", dict(k=0), "k .* must be a whole number >= 1"),
        ("speculative", dict(k=-2), "k .* must be a whole number >= 1"),
        ("threshold", dict(max_draft=0), "max_draft"),
        ("threshold", dict(threshold=1.5), "threshold"),
        ("prompt_lookup", dict(k=0), "k must be"),
        ("prompt_lookup", dict(min_ngram=4, max_ngram=2), "min_ngram"),
    ],
)
def test_bad_options_are_refused(strategy, options, message):
    lm = tiny_lm("llama")
    draft = lm if decoders.registry.get(strategy).takes_draft else None
    with pytest.raises(ValueError, match=message):
        decoders.generate(lm, PROMPTS[0], strategy=strategy, draft=draft, **options)


@pytest.mark.parametrize("strategy", ["speculative", "threshold"])
def test_a_missing_draft_is_refused(strategy):
    with pytest.raises(ValueError, match="needs a draft model"):
        decoders.generate(tiny_lm("llama"), PROMPTS[0], strategy=strategy)


@pytest.mark.parametrize("strategy", [s for s in DRAFTING if decoders.registry.get(s).needs_draft])
def test_sampling_with_an_int8_draft_follows_the_target_distribution(strategy):
    """The int8 copy of the target drafts what the target almost would: rejection sampling keeps q exactly."""
    lm = tiny_lm("qwen2")
    prompt = lm.encode(PROMPTS[4]) * 2
    settings = dict(temperature=1.0, top_k=12)
    with torch.inference_mode():
        target = SamplingConfig(**settings).probs(lm.forward(prompt, lm.new_cache())[-1])
    firsts = torch.tensor([
        decoders.generate(lm, prompt, strategy=strategy, draft="self:int8", max_new_tokens=3, seed=seed,
                          **settings).tokens[0]
        for seed in range(800)
    ])
    assert chi_square_fits(firsts, target)


def test_a_draft_chain_is_one_call_a_token_and_knows_the_drafts_second_choices():
    from decoders.drafting.draft_model import DraftModel

    lm, draft = tiny_lm("llama"), tiny_lm("llama", seed=5)
    state, _ = _prepare(lm, PROMPTS[1], strategy="speculative", draft=draft, max_new_tokens=20)
    model, calls = DraftModel(state), state.stats.draft_calls
    with torch.inference_mode():
        tokens, rows, cumulative = drive(model.draft_chain(8), state.forward)  # (its calls run at once)
        logits = draft.forward(state.tokens + tokens[:-1], draft.new_cache())[len(state.tokens) - 1:]  # [8, vocab]
    assert state.stats.draft_calls - calls == 8 and len(model.cache) == len(state.tokens) + 7
    assert tokens == logits.argmax(-1).tolist() and rows == [None] * 8
    probs = torch.softmax(logits.float(), -1)
    expected = torch.cumprod(probs[torch.arange(8), tokens], 0)
    assert cumulative == pytest.approx(expected.tolist(), rel=1e-4)
    assert model.runner_ups == logits.topk(2, dim=-1).indices[:, 1].tolist()  # beside each token, the second choice
    with torch.inference_mode():  # stopped by keep_going after the third token
        model = DraftModel(state)
        chain = model.draft_chain(8, keep_going=lambda p: len(model.runner_ups) < 3)
        assert drive(chain, state.forward)[0] == tokens[:3]


def test_a_sampled_draft_chain_draws_from_the_draft():
    from decoders.drafting.draft_model import DraftModel

    lm, draft = tiny_lm("llama"), tiny_lm("llama", seed=5)
    state, _ = _prepare(lm, PROMPTS[1], strategy="speculative", draft=draft, max_new_tokens=20, temperature=1.0,
                        top_k=12)
    with torch.inference_mode():
        expected = state.sampling.probs(draft.forward(state.tokens, draft.new_cache())[-1])
        firsts = []
        for _ in range(1200):
            tokens, rows, cumulative = drive(DraftModel(state).draft_chain(2), state.forward)
            assert torch.allclose(rows[0], expected, atol=1e-5) and len(tokens) == 2
            assert cumulative[0] == pytest.approx(float(expected[tokens[0]]), rel=1e-5)
            firsts.append(tokens[0])
    assert chi_square_fits(torch.tensor(firsts), expected)
