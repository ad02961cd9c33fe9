"""decodekit inside `model.generate` (`decoders.hf.custom_generate`, and the folder `decodekit export-hub` writes).

Every registered strategy, through transformers' own `generate`, returns exactly `generate(do_sample=False)`'s tokens
(a left-padded batch: row for row, padded after each row's end as transformers pads); the streamer, stopping
criteria, EOS, sampling settings and return_dict_in_generate behave as transformers' do; what cannot be honored is
refused by name.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import LogitsProcessor, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.streamers import BaseStreamer

import decoders
import decoders.hf
import grammars
from conftest import INSTALLED, PROMPTS, tiny_model, tiny_tokenizer
from decoders.hf import custom_generate
from evals.export_hub import export_hub

STRATEGIES = [name for name in decoders.available() if not decoders.registry.get(name).needs_grammar]
NEW = 30


# transformers checks a custom_generate folder's requirements.txt (decodekit) against the installed packages
NEEDS_INSTALL = pytest.mark.skipif(not INSTALLED, reason="decodekit is not installed here (run from its source tree)")


def prompt_ids(prompt: str = PROMPTS[0]) -> torch.Tensor:
    return torch.tensor([tiny_tokenizer()(prompt)["input_ids"]])  # [1, T]


def draft_for(strategy: str, model):
    """The target itself as the assistant of strategies that need a draft (every draft token accepted)."""
    return model if decoders.registry.get(strategy).needs_draft else None


class Collect(BaseStreamer):
    """Records every put() as a list of ids, and whether end() came."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value) -> None:
        assert not self.ended
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended = True


class StopAfter(StoppingCriteria):
    """Fires once the sequence reaches `length` tokens (a user criterion, evaluated on the growing sequence)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_greedy_equals_generate(strategy, arch):
    model = tiny_model(arch)
    for prompt in PROMPTS[:2]:
        ids = prompt_ids(prompt)
        want = model.generate(ids, do_sample=False, max_new_tokens=NEW)
        got = model.generate(ids, custom_generate=custom_generate, strategy=strategy, do_sample=False,
                             assistant_model=draft_for(strategy, model), max_new_tokens=NEW)
        assert got.dtype == torch.long and got.device == ids.device
        assert torch.equal(got, want), f"{strategy} on {arch} diverged from generate on {prompt!r}"


def test_strategy_options_and_max_length(llama):
    ids = prompt_ids()
    want = llama.generate(ids, do_sample=False, max_length=ids.shape[1] + 12)
    out = llama.generate(ids, custom_generate=custom_generate, strategy="speculative", assistant_model=llama, k=2,
                         max_length=ids.shape[1] + 12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert set(out.decodekit_stats["draft_lengths"]) <= {1, 2}  # k=2 reached the strategy


def test_streamer_sees_the_prompt_then_every_returned_token(llama):
    ids, streamer = prompt_ids(), Collect()
    out = llama.generate(ids, custom_generate=custom_generate, strategy="speculative", assistant_model=llama,
                         max_new_tokens=NEW, streamer=streamer)
    assert streamer.ended and streamer.puts[0] == ids[0].tolist()
    streamed = [token for put in streamer.puts[1:] for token in put]
    assert streamed == out[0, ids.shape[1]:].tolist()
    assert len(streamer.puts) - 1 < len(streamed)  # several tokens per put: one put per accepted step
    tok = tiny_tokenizer()
    assert tok.decode(streamed) == tok.decode(out[0, ids.shape[1]:])


def test_eos_token_id_from_the_call(llama):
    ids = prompt_ids()
    greedy = llama.generate(ids, do_sample=False, max_new_tokens=NEW)[0, ids.shape[1]:].tolist()
    eos = greedy[5]  # a token greedy emits: as EOS, generation ends at its first occurrence
    want = llama.generate(ids, do_sample=False, max_new_tokens=NEW, eos_token_id=eos)
    for strategy in ("greedy", "speculative"):
        got = llama.generate(ids, custom_generate=custom_generate, strategy=strategy, eos_token_id=eos,
                             assistant_model=draft_for(strategy, llama), max_new_tokens=NEW)
        assert torch.equal(got, want) and got[0, -1] == eos


@pytest.mark.parametrize("criterion", ["max_length", "custom"])
def test_stopping_criteria_cut_a_step_token_exactly(llama, criterion):
    ids = prompt_ids()
    stop_at = ids.shape[1] + 7  # inside a step: the self-drafting speculative run accepts 6 tokens per call
    made = MaxLengthCriteria(max_length=stop_at) if criterion == "max_length" else StopAfter(stop_at)
    want = llama.generate(ids, do_sample=False, max_new_tokens=NEW, stopping_criteria=StoppingCriteriaList([made]))
    assert want.shape[1] == stop_at
    streamer = Collect()
    out = llama.generate(ids, custom_generate=custom_generate, strategy="speculative", assistant_model=llama,
                         max_new_tokens=NEW, stopping_criteria=StoppingCriteriaList([made]), streamer=streamer,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert [t for put in streamer.puts[1:] for t in put] == want[0, ids.shape[1]:].tolist()
    stats = out.decodekit_stats
    assert stats["new_tokens"] == len(stats["sources"]) == 7 and stats["finish_reason"] == "stop"


def test_return_dict_in_generate(llama):
    ids = prompt_ids()
    out = llama.generate(ids, custom_generate=custom_generate, strategy="staged", assistant_model=llama,
                         max_new_tokens=NEW, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, llama.generate(ids, do_sample=False, max_new_tokens=NEW))
    assert out["decodekit_stats"] is out.decodekit_stats and out.scores is None
    stats = out.decodekit_stats
    assert stats["strategy"] == "staged" and stats["finish_reason"] in ("eos", "length")
    assert stats["new_tokens"] == len(stats["sources"]) == out.sequences.shape[1] - ids.shape[1]
    assert {"target_calls", "drafted", "accepted", "acceptance_rate", "mean_accepted"} <= set(stats)


@pytest.mark.parametrize("strategy", ["speculative", "auto"])
def test_sampling_is_reproducible_by_seed_and_by_torch_manual_seed(llama, strategy):
    """As with transformers, `auto` included: its calls timed wildly apart (a seeded run plans by no clock)."""
    import random

    from decoders.strategies import auto

    ids, time, jitter = prompt_ids(), [0.0], random.Random(0)

    def clock() -> float:
        time[0] += jitter.choice([1e-4, 1e-2, 1.0])
        return time[0]

    decoder = auto.Auto(clock=clock) if strategy == "auto" else strategy

    def sample(**kwargs):
        return llama.generate(ids, custom_generate=custom_generate, strategy=decoder, assistant_model=llama,
                              do_sample=True, temperature=1.5, top_k=0, max_new_tokens=NEW, **kwargs)

    first = sample(seed=3)
    assert torch.equal(first, sample(seed=3))
    assert not torch.equal(first, sample(seed=4))
    torch.manual_seed(11)
    unseeded = sample()
    torch.manual_seed(11)
    assert torch.equal(unseeded, sample())


def test_top_k_1_sampling_is_greedy(llama):
    ids = prompt_ids()
    out = llama.generate(ids, custom_generate=custom_generate, strategy="threshold", assistant_model=llama,
                         do_sample=True, top_k=1, seed=0, max_new_tokens=NEW)
    assert torch.equal(out, llama.generate(ids, do_sample=False, max_new_tokens=NEW))


def test_generation_config_defaults_apply(monkeypatch):
    """do_sample=True, temperature 0.7 in the model's generation_config: sampling with them and transformers' default
    top_k=50; do_sample=False in the call overrides them."""
    model = tiny_model("llama")
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    seen = []
    prepare = decoders.hf.prepare
    monkeypatch.setattr(decoders.hf, "prepare", lambda *a, **kw: seen.append(kw) or prepare(*a, **kw))
    ids = prompt_ids()
    model.generate(ids, custom_generate=custom_generate, max_new_tokens=4, seed=1)
    assert (seen[-1]["temperature"], seen[-1]["top_k"], seen[-1]["top_p"]) == (0.7, 50, None)
    model.generate(ids, custom_generate=custom_generate, max_new_tokens=4, top_p=0.9, min_p=0.05, seed=1)
    assert (seen[-1]["top_p"], seen[-1]["min_p"]) == (0.9, 0.05)
    got = model.generate(ids, custom_generate=custom_generate, max_new_tokens=NEW, do_sample=False)
    assert seen[-1]["temperature"] == 0.0
    assert torch.equal(got, model.generate(ids, do_sample=False, max_new_tokens=NEW))


def left_padded(prompts: list[str] = PROMPTS[:3]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] and attention_mask [B, T] of `prompts`, left-padded with 0 (the tiny models' pad id)."""
    rows = [tiny_tokenizer()(p)["input_ids"] for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("strategy", ["greedy", "prompt_lookup", "speculative"])
def test_a_left_padded_batch_equals_generate_row_for_row(llama, strategy):
    """Rows that end early (at an EOS one row emits) are padded after their end, as transformers pads a batch."""
    ids, mask = left_padded()
    plain = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    eos = plain[1, ids.shape[1] + 4].item()  # a token the second row emits: it ends there, the others may go on
    want = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=eos)
    out = llama.generate(ids, attention_mask=mask, custom_generate=custom_generate, strategy=strategy,
                         assistant_model=draft_for(strategy, llama), max_new_tokens=NEW, eos_token_id=eos,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, want), f"{strategy} diverged from generate on a left-padded batch"
    assert want.shape[1] < plain.shape[1] or (want[:, ids.shape[1]:] == eos).any()
    stats = out.decodekit_stats
    assert isinstance(stats, list) and len(stats) == 3
    for row, record in zip(out.sequences, stats):
        assert record["strategy"] == strategy and record["new_tokens"] == len(record["sources"])
        new = row[ids.shape[1]:].tolist()
        assert new[: record["new_tokens"]][-1:] == [eos] or record["new_tokens"] == NEW
        assert all(t == 0 for t in new[record["new_tokens"]:])  # the pad id after the row's end


def test_a_batch_stops_each_row_by_the_stopping_criteria(llama):
    ids, mask = left_padded()
    criteria = StoppingCriteriaList([StopAfter(ids.shape[1] + 6)])  # on the padded length, as transformers counts
    want = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria)
    got = llama.generate(ids, attention_mask=mask, custom_generate=custom_generate, max_new_tokens=NEW,
                         stopping_criteria=criteria)
    assert torch.equal(got, want) and got.shape[1] == ids.shape[1] + 6


def test_one_left_padded_prompt_keeps_its_padding(llama):
    ids, mask = left_padded()
    ids, mask = (t[int(mask.sum(1).argmin())][None] for t in (ids, mask))  # the row with the most padding
    want = llama.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    got = llama.generate(ids, attention_mask=mask, custom_generate=custom_generate, max_new_tokens=NEW)
    assert bool((mask == 0).any()) and torch.equal(got, want)


def test_a_streamer_with_a_batch_is_refused(llama):
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="streamer= with a batch of 3"):
        llama.generate(ids, attention_mask=mask, custom_generate=custom_generate, max_new_tokens=4, streamer=Collect())


class AddOne(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1


@pytest.mark.parametrize("kwargs, named", [
    (dict(num_beams=2), "num_beams"),
    (dict(num_return_sequences=2, do_sample=True), "num_return_sequences"),
    (dict(repetition_penalty=1.3), "repetition_penalty"),
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
    (dict(min_new_tokens=3), "min_new_tokens"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(logits_processor=[AddOne()]), "AddOne"),
    (dict(do_sample=True, typical_p=0.5), "typical_p"),
    (dict(attention_mask=torch.tensor([[1] * 6 + [0, 0]])), "right padding"),
])
def test_unsupported_arguments_are_refused_by_name(llama, kwargs, named):
    ids = prompt_ids(PROMPTS[1])[:, :8]
    with pytest.raises(ValueError, match=named):
        llama.generate(ids, custom_generate=custom_generate, max_new_tokens=4, **kwargs)


def test_a_prefilled_cache_is_refused_and_an_empty_one_taken(llama):
    """generate passes its KV cache as a model input (`past_key_values`, from transformers 5.24 `cache`): the empty
    one it makes is taken; one that already holds a prefix is refused, as decodekit decodes from scratch."""
    from transformers import DynamicCache

    ids = prompt_ids(PROMPTS[1])[:, :8]
    want = llama.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(llama.generate(ids, custom_generate=custom_generate, max_new_tokens=4), want)
    filled = DynamicCache(config=llama.config)
    keyword = {"cache" if "cache" in inspect.signature(llama.forward).parameters else "past_key_values": filled}
    with torch.no_grad():
        llama(input_ids=ids[:, :4].to(llama.device), use_cache=True, **keyword)
    assert filled.get_seq_length() == 4
    with pytest.raises(ValueError, match="prefilled"):
        llama.generate(ids, custom_generate=custom_generate, max_new_tokens=4, **keyword)


def test_draft_needs_and_unknown_options(llama):
    ids = prompt_ids()
    with pytest.raises(ValueError, match="assistant_model="):
        llama.generate(ids, custom_generate=custom_generate, strategy="speculative", max_new_tokens=4)
    with pytest.raises(ValueError, match="takes no draft"):
        llama.generate(ids, custom_generate=custom_generate, strategy="greedy", assistant_model=llama,
                       max_new_tokens=4)
    with pytest.raises(TypeError, match="unknown option"):
        llama.generate(ids, custom_generate=custom_generate, strategy="greedy", k=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="Did you mean 'staged'"):
        llama.generate(ids, custom_generate=custom_generate, strategy="stagged", max_new_tokens=4)


def test_an_unrelated_assistant_model_stays_lossless(llama):
    ids = prompt_ids(PROMPTS[1])
    out = llama.generate(ids, custom_generate=custom_generate, strategy="threshold",
                         assistant_model=tiny_model("llama", seed=99), max_new_tokens=NEW)
    assert torch.equal(out, llama.generate(ids, do_sample=False, max_new_tokens=NEW))


@pytest.mark.parametrize("draft", ["self:int8", "lm"])
def test_decodekit_drafts_by_draft_keyword(draft):
    model = tiny_model("llama")
    model.train()  # the caller's mode comes back after the call, and its attention (decodekit switches it while it
    # decodes: `attention.use_grouped`)
    if draft == "lm":
        draft = decoders.wrap(tiny_model("llama", seed=99), tiny_tokenizer())
    ids = prompt_ids()
    out = model.generate(ids, custom_generate=custom_generate, strategy="speculative", draft=draft,
                         max_new_tokens=NEW)
    assert model.training and model.config._attn_implementation == "sdpa"
    model.eval()
    assert torch.equal(out, model.generate(ids, do_sample=False, max_new_tokens=NEW))


def test_grammar_without_tokenizer_is_refused(llama):
    with pytest.raises(ValueError, match="grammar= needs the tokenizer"):
        llama.generate(prompt_ids(), custom_generate=custom_generate, strategy="guided",
                       grammar=grammars.choice(["red", "green"]), max_new_tokens=8)


# --------------------------------------------------------------------------------------- the exported folder
@NEEDS_INSTALL
def test_exported_folder_runs_in_generate(llama, tmp_path):
    folder = export_hub(tmp_path / "dk-speculative", strategy="speculative")
    assert (folder / "custom_generate" / "generate.py").is_file()
    assert (folder / "custom_generate" / "requirements.txt").read_text().startswith("decodekit")
    ids, streamer = prompt_ids(), Collect()
    out = llama.generate(ids, custom_generate=str(folder), trust_remote_code=True, assistant_model=llama, k=3,
                         max_new_tokens=NEW, streamer=streamer, tokenizer=tiny_tokenizer(),
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, llama.generate(ids, do_sample=False, max_new_tokens=NEW))
    assert out.decodekit_stats["strategy"] == "speculative"  # the folder's default
    assert streamer.puts[0] == ids[0].tolist() and streamer.ended
    assert [t for put in streamer.puts[1:] for t in put] == out.sequences[0, ids.shape[1]:].tolist()
    other = llama.generate(ids, custom_generate=str(folder), trust_remote_code=True, strategy="prompt_lookup",
                           max_new_tokens=NEW, return_dict_in_generate=True)
    assert other.decodekit_stats["strategy"] == "prompt_lookup"


@NEEDS_INSTALL
def test_exported_folder_takes_the_tokenizer_grammar_and_stop_strings(llama, tmp_path):
    folder, tok = export_hub(tmp_path / "dk"), tiny_tokenizer()
    constraint = grammars.choice(["red", "green", "blue"])
    ids = prompt_ids(PROMPTS[1])
    out = llama.generate(ids, custom_generate=str(folder), trust_remote_code=True, tokenizer=tok,
                         strategy="guided", grammar=constraint, max_new_tokens=NEW)
    want = decoders.generate(decoders.wrap(llama, tok), ids[0].tolist(), strategy="guided", grammar=constraint,
                             max_new_tokens=NEW)
    assert out[0, ids.shape[1]:].tolist() == want.tokens
    assert tok.decode(want.tokens) in ("red", "green", "blue")
    plain = llama.generate(ids, do_sample=False, max_new_tokens=NEW)
    stop = tok.decode(plain[0, ids.shape[1] + 3: ids.shape[1] + 5])
    want = llama.generate(ids, do_sample=False, max_new_tokens=NEW, stop_strings=stop, tokenizer=tok)
    got = llama.generate(ids, custom_generate=str(folder), trust_remote_code=True, stop_strings=stop, tokenizer=tok,
                         max_new_tokens=NEW)
    assert want.shape[1] < plain.shape[1] and torch.equal(got, want)


@NEEDS_INSTALL
def test_model_saved_with_an_exported_folder_generates_with_decodekit(tmp_path):
    """A model repository holding custom_generate/: from_pretrained(trust_remote_code=True) makes its generate ours."""
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path)
    export_hub(tmp_path, strategy="prompt_lookup")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    ids = prompt_ids()
    out = model.generate(ids, max_new_tokens=NEW, return_dict_in_generate=True)  # positional inputs too
    assert out.decodekit_stats["strategy"] == "prompt_lookup"
    assert torch.equal(out.sequences, tiny_model("llama").generate(ids, do_sample=False, max_new_tokens=NEW))


def test_export_hub_refuses_an_unknown_strategy(tmp_path):
    with pytest.raises(ValueError, match="unknown strategy"):
        export_hub(tmp_path / "x", strategy="nope")
