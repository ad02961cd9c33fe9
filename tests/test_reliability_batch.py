"""Issue 69's defects at the batch's edges, each reproduced as a reviewer met it: a row whose strategy raises in
`start` or `finish`, the caller's loop body of a batch stream in inference mode, empty lists of prompts and of stop
strings, a draft model on another device, a `compile_calls` torch.compile does not take."""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict

import pytest
import torch

import decoders
from conftest import DEVICE, PROMPTS, tiny_lm, tiny_model, tiny_tokenizer
from decoders.base import Decoder
from test_batch import MAX_NEW, assert_same_row, mixed_prompts, reference


@pytest.fixture
def registered():
    """Register test strategies; unregistered after the test."""
    names = []

    def register(name, cls):
        decoders.register(name)(cls)
        names.append(name)
        return name

    yield register
    for name in names:
        decoders.unregister(name)


# ------------------------------------------------------------------------------ a row raising in start() or finish()


@dataclasses.dataclass(frozen=True)
class FragileOptions:
    bad: tuple = ()  # the prompt whose run raises
    where: str = "start"  # ... in its strategy's `start` or `finish`; "step": its step accepts no token


class Fragile(Decoder):
    """greedy, except that one prompt's `start` (where drafters are built) or `finish` raises, or its third step
    accepts no token (a strategy's bug the loop reports)."""

    Options = FragileOptions

    def _bad(self, state, where: str) -> bool:
        return self.options.where == where and tuple(state.tokens[: state.prompt_len]) == self.options.bad

    def start(self, state):
        if self._bad(state, "start"):
            raise RuntimeError("boom in start")

    def finish(self, state):
        if self._bad(state, "finish"):
            raise RuntimeError("boom in finish")

    def steps(self, state):
        logits = yield state.call()
        if not (self._bad(state, "step") and len(state.new_tokens) == 2):
            state.accept([state.choose(logits[-1])], ["target"], rows=logits[-1:])


ERRORS = {"start": "RuntimeError: boom in start", "finish": "RuntimeError: boom in finish",
          "step": "RuntimeError: strategy 'reliability_test_fragile' made a step that accepted no token"}


@pytest.mark.parametrize("batch_size", [3, 1])
@pytest.mark.parametrize("where", list(ERRORS))
def test_a_row_raising_in_start_or_finish_ends_with_an_error_and_the_others_go_on(registered, where, batch_size):
    name = registered("reliability_test_fragile", Fragile)
    lm = tiny_lm("llama")
    prompts = mixed_prompts(lm)
    bad = 2  # in the middle of the queue: rows are refilled after it
    options = dict(bad=tuple(lm.encode(prompts[bad])), where=where)
    results = decoders.generate(lm, prompts, strategy=name, batch_size=batch_size, max_new_tokens=MAX_NEW, **options)
    for i, (prompt, got) in enumerate(zip(prompts, results)):
        want = reference(lm, prompt)
        if i == bad:
            assert got.finish_reason == "error" and got.error == ERRORS[where]
            kept = {"start": 0, "step": 2, "finish": len(want.tokens)}[where]
            assert got.tokens == want.tokens[:kept]  # what it generated is kept
            assert got.text == lm.decode(got.tokens) and len(got.sources) == len(got.tokens)
        else:
            assert_same_row(got, want, i, name)
    streamed = defaultdict(list)
    for chunk in decoders.stream(lm, prompts, strategy=name, batch_size=batch_size, max_new_tokens=MAX_NEW, **options):
        streamed[chunk.index].extend(chunk.tokens)
    assert [streamed[i] for i in range(len(prompts))] == [r.tokens for r in results]


# --------------------------------------------------------------------------- a batch stream and the caller's loop


def test_the_callers_loop_body_of_a_batch_stream_runs_outside_inference_mode():
    lm = tiny_lm("llama")
    weight = torch.ones(3, requires_grad=True)
    chunks = 0
    for chunk in decoders.stream(lm, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], batch_size=2, max_new_tokens=4):
        assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
        (weight * 2).sum().backward()  # a training step between chunks
        chunks += 1
    assert chunks >= 3 and weight.grad is not None
    assert not torch.is_inference_mode_enabled()


def test_two_interleaved_batch_streams_the_first_closed_early_leave_the_thread_as_it_was():
    lm = tiny_lm("llama")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    with torch.inference_mode(False):  # (a leak stays inside this test)
        first = decoders.stream(lm, prompts, batch_size=2, max_new_tokens=6)
        second = decoders.stream(lm, prompts, batch_size=2, max_new_tokens=6)
        got = defaultdict(list)
        next(first)
        chunk = next(second)
        got[chunk.index].extend(chunk.tokens)
        assert not torch.is_inference_mode_enabled()
        first.close()
        for chunk in second:
            assert not torch.is_inference_mode_enabled()
            got[chunk.index].extend(chunk.tokens)
        assert not torch.is_inference_mode_enabled()
    assert [got[i] for i in range(3)] == [reference(lm, p, max_new_tokens=6).tokens for p in prompts]


# --------------------------------------------------------------------------------------------------- empty lists


@pytest.mark.parametrize("stop", [[], ()], ids=["list", "tuple"])
def test_an_empty_stop_list_means_no_stop_strings_for_a_list_of_prompts_too(stop):
    lm = tiny_lm("llama")
    prompts = [PROMPTS[0], PROMPTS[1]]
    alone = decoders.generate(lm, prompts[0], stop=stop, max_new_tokens=MAX_NEW)
    assert alone.tokens == reference(lm, prompts[0]).tokens
    results = decoders.generate(lm, prompts, stop=stop, batch_size=2, max_new_tokens=MAX_NEW)
    for i, (prompt, got) in enumerate(zip(prompts, results)):
        assert_same_row(got, reference(lm, prompt), i, "greedy")
    streamed = [t for c in decoders.stream(lm, prompts, stop=stop, max_new_tokens=MAX_NEW) if c.index == 1
                for t in c.tokens]
    assert streamed == results[1].tokens


@pytest.mark.parametrize("prompts", [[], ()], ids=["list", "tuple"])
def test_an_empty_list_of_prompts_decodes_nothing(prompts):
    lm = tiny_lm("llama")
    assert decoders.generate(lm, prompts, max_new_tokens=4) == []
    assert list(decoders.stream(lm, prompts, max_new_tokens=4)) == []
    # what needs no prompt is still checked, naming the argument
    with pytest.raises(ValueError, match="unknown strategy"):
        decoders.generate(lm, prompts, strategy="no_such_strategy")
    with pytest.raises(TypeError, match="unknown option"):
        decoders.generate(lm, prompts, strategy="greedy", k=3)
    with pytest.raises(ValueError, match="batch_size"):
        decoders.generate(lm, prompts, batch_size=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoders.generate(lm, prompts, max_new_tokens=0)


def test_an_empty_prompt_is_still_refused():
    lm = tiny_lm("llama")
    for prompt in ("", torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match="the prompt is empty"):
            decoders.generate(lm, prompt, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 1\b.*empty"):
        decoders.generate(lm, [PROMPTS[0], []], max_new_tokens=4)


# --------------------------------------------------------------------------------------- a draft on another device


def meta_drafts():
    """A draft built on the meta device, and one moved there after it was wrapped."""
    built = decoders.wrap(tiny_model("llama", seed=99).to("meta"), tiny_tokenizer(), name="meta-built")
    moved = decoders.wrap(copy.deepcopy(tiny_lm("llama", seed=99).model), tiny_tokenizer(), name="meta-moved")
    moved.model.to("meta")
    return {"built": built, "moved": moved}


@pytest.mark.parametrize("how", ["built", "moved"])
@pytest.mark.parametrize("strategy", ["speculative", "threshold", "staged", "auto"])
@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
def test_a_draft_on_another_device_is_refused_before_the_run_naming_both_devices(strategy, how, batch, monkeypatch):
    lm = tiny_lm("llama")
    draft = meta_drafts()[how]

    def no_call(*args, **kwargs):
        raise AssertionError("a model was called before the draft's device was checked")

    monkeypatch.setattr(decoders.LM, "forward", no_call)
    target = str(next(lm.model.parameters()).device)
    prompt = [PROMPTS[0], PROMPTS[1]] if batch else PROMPTS[0]
    with pytest.raises(ValueError, match=rf"draft.* on meta.*target.* on {target}\b") as raised:
        decoders.generate(lm, prompt, strategy=strategy, draft=draft, max_new_tokens=4)
    assert "\n" not in str(raised.value)


# ------------------------------------------------------------------------------------------------ compile_calls


@pytest.mark.parametrize("value", ["bogus-mode", "", "max_autotune", 1, None, 0.5])
def test_compile_calls_refuses_what_torch_compile_does_not_take(value):
    lm = decoders.wrap(tiny_model("llama"), tiny_tokenizer())
    with pytest.raises(ValueError, match=r"compile_calls.*True, False.*reduce-overhead") as raised:
        lm.compile_calls = value
    assert repr(value) in str(raised.value)
    assert lm.compile_calls is False  # left as it was


@pytest.mark.parametrize("value", [True, False, "default", "reduce-overhead", "max-autotune",
                                   "max-autotune-no-cudagraphs"])
def test_compile_calls_takes_true_false_and_torch_compiles_modes(value):
    lm = decoders.wrap(tiny_model("llama"), tiny_tokenizer())
    lm.compile_calls = value
    assert lm.compile_calls == value
    if DEVICE.type == "cpu":  # (no graphs on a CPU: the setting is kept for a CUDA model, the run unchanged)
        assert decoders.generate(lm, PROMPTS[0], max_new_tokens=4).tokens == reference(
            tiny_lm("llama"), PROMPTS[0], max_new_tokens=4).tokens
