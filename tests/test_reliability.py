"""Issue 10's crashes and bad input, each reproduced as a user met it: sampling under a grammar with EOS in the
drafts, drafts with a shorter context or a narrower vocabulary than the run needs, prompts given as a batch."""

import gc
import weakref

import numpy as np
import pytest
import torch
import transformers

import decoders
import grammars
from conftest import PROMPTS, VOCAB, on_device, tiny_lm, tiny_model, tiny_tokenizer
from samplers import SamplingConfig
from stats import chi_square_fits

DRAFTING = [name for name in decoders.available() if name not in ("greedy", "guided")]


def draft_for(strategy, lm):
    """The target itself as the draft (it drafts exactly what the target will say, EOS included)."""
    return lm if decoders.registry.get(strategy).takes_draft else None


@pytest.mark.parametrize("strategy", DRAFTING)
def test_sampling_under_a_grammar_with_eos_in_the_drafts(strategy):
    """The prompt holds `answer <eos>` pairs, so lookups and a self draft propose an answer followed by EOS; the row
    after that EOS allows nothing under the grammar, and once crashed the bonus draw with NaN probabilities."""
    lm = tiny_lm("llama")
    constraint = grammars.choice([" red", " green"])
    prompt = lm.encode("Answer: red") + [0] + lm.encode("Answer: green") + [0] + lm.encode("Answer:")
    settings = dict(temperature=1.0)
    with torch.inference_mode():
        logits = lm.forward(prompt, lm.new_cache())[-1]
    allowed = constraint.matcher(lm).allowed().to(logits.device)
    first = SamplingConfig(**settings).probs(logits.masked_fill(~allowed, float("-inf")))  # the masked target
    firsts = []
    for seed in range(300):
        result = decoders.generate(lm, prompt, strategy=strategy, draft=draft_for(strategy, lm), grammar=constraint,
                                   max_new_tokens=12, seed=seed, **settings)
        assert result.text in (" red", " green") and result.finish_reason == "eos"
        firsts.append(result.tokens[0])
    assert chi_square_fits(torch.tensor(firsts), first)


@pytest.mark.parametrize("strategy", DRAFTING)
def test_greedy_under_a_grammar_with_eos_in_the_drafts(strategy):
    lm = tiny_lm("qwen2")
    constraint = grammars.regex(r" [a-z]+")
    prompt = lm.encode("Answer: red") + [0] + lm.encode("Answer:")
    want = decoders.generate(lm, prompt, strategy="guided", grammar=constraint, max_new_tokens=20)
    got = decoders.generate(lm, prompt, strategy=strategy, draft=draft_for(strategy, lm), grammar=constraint,
                            max_new_tokens=20)
    assert got.tokens == want.tokens


def short_context_draft() -> decoders.LM:
    """A GPT-2 draft with room for 24 positions, sharing the test tokenizer."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=24,
                                     eos_token_id=0, bos_token_id=0, initializer_range=0.2)
    torch.manual_seed(4)
    return decoders.wrap(on_device(transformers.GPT2LMHeadModel(config)), tiny_tokenizer(), name="gpt2-24")


@pytest.mark.parametrize("strategy", [s for s in DRAFTING if decoders.registry.get(s).needs_draft])
def test_a_draft_with_a_shorter_context_stops_drafting_and_the_run_goes_on(strategy):
    lm, draft = tiny_lm("llama"), short_context_draft()
    prompt = lm.encode(PROMPTS[0])
    assert len(prompt) + 40 > draft.context_length
    want = decoders.generate(lm, prompt, max_new_tokens=40)
    with pytest.warns(UserWarning, match="reaches its context of 24 tokens") as caught:
        got = decoders.generate(lm, prompt, strategy=strategy, draft=draft, max_new_tokens=40)
    assert got.tokens == want.tokens
    assert len([w for w in caught if "reaches its context" in str(w.message)]) == 1  # warned once
    sampled = decoders.generate(lm, prompt, strategy=strategy, draft=draft, max_new_tokens=40, temperature=1.0,
                                seed=0)
    assert len(sampled.tokens) == 40 or sampled.finish_reason == "eos"


@pytest.mark.parametrize("strategy", [s for s in DRAFTING if decoders.registry.get(s).needs_draft])
def test_a_draft_with_a_narrower_vocabulary_than_a_padded_target(strategy):
    """The target's logits (and embedding) are padded past the tokenizer; its random head does emit padded ids,
    which the draft cannot embed: those positions are fed to the draft as a stand-in, the output stays greedy's."""
    config = transformers.LlamaConfig(**{**tiny_lm("llama").model.config.to_dict(), "vocab_size": VOCAB + 256})
    torch.manual_seed(7)
    lm = decoders.wrap(on_device(transformers.LlamaForCausalLM(config)), tiny_tokenizer(), name="padded")
    draft = tiny_lm("llama")
    want = decoders.generate(lm, PROMPTS[1], max_new_tokens=40)
    assert any(t >= VOCAB for t in want.tokens), "the test needs a target that emits an id the draft lacks"
    got = decoders.generate(lm, PROMPTS[1], strategy=strategy, draft=draft, max_new_tokens=40)
    assert got.tokens == want.tokens
    decoders.generate(lm, PROMPTS[1], strategy=strategy, draft=draft, max_new_tokens=40, temperature=1.0, seed=2)


def test_prompts_as_one_sequence_in_any_container():
    lm = tiny_lm("llama")
    ids = lm.encode(PROMPTS[0])
    want = decoders.generate(lm, ids, max_new_tokens=8).tokens
    for prompt in (tuple(ids), np.array(ids), torch.tensor(ids), torch.tensor([ids]), [np.int64(t) for t in ids]):
        assert decoders.generate(lm, prompt, max_new_tokens=8).tokens == want


@pytest.mark.parametrize("batch", [
    lambda ids: torch.tensor([ids, ids]), lambda ids: np.array([ids, ids]), lambda ids: torch.tensor([[ids]]),
])
def test_a_tensor_of_several_prompts_is_refused_with_the_way_to_batch(batch):
    lm = tiny_lm("llama")
    with pytest.raises(ValueError, match="batch of prompts|nested"):
        decoders.generate(lm, batch(lm.encode(PROMPTS[0])[:4]), max_new_tokens=4)


def test_a_list_of_id_lists_is_a_batch():
    lm = tiny_lm("llama")
    ids = lm.encode(PROMPTS[0])[:4]
    results = decoders.generate(lm, [ids, ids], max_new_tokens=4)
    assert [r.tokens for r in results] == [decoders.generate(lm, ids, max_new_tokens=4).tokens] * 2


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5, True])
def test_a_temperature_that_is_not_a_finite_number_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        decoders.generate(tiny_lm("llama"), PROMPTS[0], max_new_tokens=4, temperature=temperature)


def test_a_draft_given_to_a_strategy_that_takes_none_is_refused_before_loading_it():
    lm = tiny_lm("llama")
    for draft in (lm, "no/such/model/anywhere"):  # a name is not even loaded
        with pytest.raises(ValueError, match="takes no draft model"):
            decoders.generate(lm, PROMPTS[0], strategy="prompt_lookup", draft=draft, max_new_tokens=4)


def test_the_target_keeps_no_draft_alive():
    lm = tiny_lm("llama")
    draft = decoders.wrap(tiny_model("llama", seed=11), tiny_tokenizer())
    decoders.generate(lm, PROMPTS[0], strategy="speculative", draft=draft, max_new_tokens=4)
    gone = weakref.ref(draft.model)
    del draft
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("name, message", [
    ("nosuchmodel", "no local folder, zoo name or cached hub model called 'nosuchmodel'.*zoo:smollm2-135m"),
    ("./no/such/dir", "no such local folder"),
])
def test_an_unknown_model_name_is_answered_at_once_offline(name, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=message):
        decoders.load(name)
