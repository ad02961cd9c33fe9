"""Many prompts at once (`decoders.batch`): each row of a batched run is exactly its prompt's own run.

Greedy mode, float32: every registered strategy (with a draft where it needs or takes one, as in test_equivalence)
returns, row for row, the tokens of batch-1 `greedy`, with prompts of different lengths (text and token ids, one of a
single token), rows that end at different steps (per-row stop strings, an EOS-prone model), refills (more prompts
than rows) and a row under a grammar beside rows without. Also: stop strings, seeds, `stream`, sampling (a chi-square
of each row's first token, seeded rows equal their own seeded runs), bad input refused before any run, a row whose own
step raises, a long queue whose cache stays bounded, the batch-1 path left as it was, and draft models drafting for
all rows in one forward (chains, trees, auto's, the target's int8 copy, a draft of another tokenizer).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
from collections import defaultdict

import pytest
import torch

import decoders
import grammars
from conftest import ARCHITECTURES, PROMPTS, tiny_lm, tiny_tokenizer
from decoders import batch
from decoders.base import Decoder, Result
from decoders.models.rows import FEED_ALONE, SHARED, BatchCache
from decoders.width import EXPLORE, WIDTHS
from decoders.drafting import chooser
from decoders.drafting.cost import CallCost, CostModel
from decoders.models.graphs import MIN_CAPACITY
from decoders.models.quantize import self_draft
from decoders.strategies import auto
from samplers import SamplingConfig
from stats import chi_square_fits

STRATEGIES = decoders.available()
NONE, SELF, RANDOM, SELF_INT8, RANDOM_INT8 = "none", "self", "random", "self:int8", "random:int8"
EOS_PRONE = "llama-eos"  # a pseudo-architecture: tiny llama whose EOS logit shadows a common token
FULL_ARCHS = ("llama", "mistral", "gemma3")  # plain, sliding window, mixed full and sliding layers
MAX_NEW = 16
# a prompt longer than mistral's and gemma3's sliding window (8), of rare bytes: many tokens
LONG_PROMPT = "Zebras & quartz: 42 mixed-case WORDS, odd punctuation!? and digits 0123456789 ~~"

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                      "maximum": 99}},
    "required": ["name", "age"],
}


@functools.cache
def constraint(name: str):
    """One constraint object per name for the whole module (each index is built once)."""
    return {"schema": lambda: grammars.json_schema(SCHEMA), "regex": lambda: grammars.regex(r"[0-9]{3}-[0-9]{4}"),
            "choice": lambda: grammars.choice(["red", "green", "blue"])}[name]()


@functools.cache
def eos_prone_lm() -> decoders.LM:
    """Tiny llama whose EOS row of the output head is 1.5x that of the token greedy emits 4th after PROMPTS[0]: that
    prompt ends by EOS within 4 tokens, other prompts wherever they would have emitted that token (or never)."""
    base = tiny_lm("llama")
    token = decoders.generate(base, PROMPTS[0], max_new_tokens=4).tokens[3]
    model = copy.deepcopy(base.model)
    with torch.no_grad():
        model.lm_head.weight[0] = model.lm_head.weight[token] * 1.5
    return decoders.wrap(model, tiny_tokenizer(), name="tiny-llama-eos-prone")


def target(arch: str) -> decoders.LM:
    return eos_prone_lm() if arch == EOS_PRONE else tiny_lm(arch)


@functools.cache
def random_int8() -> decoders.LM:
    return decoders.quantize(tiny_lm("llama", seed=99))


def draft_of(kind: str, lm: decoders.LM):
    return {NONE: None, SELF: lm, RANDOM: tiny_lm("llama", seed=99), SELF_INT8: SELF_INT8,
            RANDOM_INT8: random_int8()}[kind]


def mixed_prompts(lm: decoders.LM) -> list:
    """Six prompts of different lengths: text and token ids, one a single token, one longer than a sliding window."""
    return [PROMPTS[3], lm.encode(PROMPTS[1])[:1], PROMPTS[0], LONG_PROMPT, lm.encode(PROMPTS[4]), PROMPTS[2]]


def key(prompt):
    return prompt if isinstance(prompt, str) else tuple(prompt)


@functools.cache
def _reference(lm, prompt, stop, grammar, max_new_tokens, sampling=()) -> Result:
    return decoders.generate(lm, prompt if isinstance(prompt, str) else list(prompt), strategy="greedy",
                             stop=None if stop is None else list(stop),
                             grammar=None if grammar is None else constraint(grammar),
                             max_new_tokens=max_new_tokens, **dict(sampling))


def reference(lm, prompt, stop=None, grammar=None, max_new_tokens=MAX_NEW, **sampling) -> Result:
    """Batch-1 `greedy` on one prompt (cached: the same references serve every strategy)."""
    return _reference(lm, key(prompt), None if stop is None else tuple(stop), grammar, max_new_tokens,
                      tuple(sorted(sampling.items())))


def assert_same_row(got: Result, want: Result, index: int, strategy: str) -> None:
    where = f"row {index} ({strategy})"
    assert isinstance(got, Result), where
    assert got.error is None, f"{where} raised: {got.error}"
    assert got.tokens == want.tokens, f"{where} diverged from its batch-1 greedy run"
    assert got.finish_reason == want.finish_reason, where
    assert got.text == want.text, where
    assert got.prompt_tokens == want.prompt_tokens, where
    assert got.strategy == strategy, where
    assert len(got.sources) == len(got.tokens) == got.stats.new_tokens, where


# ------------------------------------------------------------------------------------------------- exactness matrix


def draft_kinds(strategy: str, arch: str) -> list[str]:
    cls = decoders.registry.get(strategy)
    if cls.needs_draft:
        if arch == "llama":
            return [RANDOM, SELF, SELF_INT8, RANDOM_INT8]
        return [SELF] if arch == EOS_PRONE else [RANDOM]  # (self: drafts that end in EOS, accepted)
    if cls.takes_draft:
        return [NONE, RANDOM]
    return [NONE]


DRAFTING = next(s for s in STRATEGIES if decoders.registry.get(s).needs_draft)  # a drafting one, for `stream`
# every strategy on every architecture (tiny models are cheap): every draft kind on FULL_ARCHS, one elsewhere
CASES = [(s, a, k) for a in (*FULL_ARCHS, EOS_PRONE) for s in STRATEGIES for k in draft_kinds(s, a)]
CASES += [(s, a, draft_kinds(s, a)[0]) for a in sorted(ARCHITECTURES) if a not in FULL_ARCHS for s in STRATEGIES]


def row_settings(lm, prompts, strategy: str) -> tuple[list, list]:
    """Per-row grammars and stop strings: one row under a grammar beside rows without (every row under one of three
    grammars for a strategy that needs one); stop strings taken from the rows' own greedy text at different depths,
    so that rows end at different steps."""
    if decoders.registry.get(strategy).needs_grammar:
        names = [("schema", "regex", "choice")[i % 3] for i in range(len(prompts))]
    else:
        names = [None, "schema"] + [None] * (len(prompts) - 2)
    stops = []
    for i, (prompt, grammar) in enumerate(zip(prompts, names)):
        text = reference(lm, prompt, grammar=grammar).text
        depth = 1 + 2 * i
        stop = text[depth: depth + 2]
        stops.append([stop] if i % 2 == 0 and len(stop) == 2 else None)
    return names, stops


@pytest.mark.parametrize("strategy, arch, draft_kind", CASES, ids=[f"{s}-{a}-{k}" for s, a, k in CASES])
def test_each_row_equals_its_batch1_greedy_run(strategy, arch, draft_kind):
    lm = target(arch)
    prompts = mixed_prompts(lm)
    names, stops = row_settings(lm, prompts, strategy)
    batch_size = 2 if arch in FULL_ARCHS else 3  # refills: 6 prompts through 2 or 3 rows
    results = decoders.generate(lm, prompts, strategy=strategy, draft=draft_of(draft_kind, lm), batch_size=batch_size,
                                grammar=[None if n is None else constraint(n) for n in names], stop=stops,
                                max_new_tokens=MAX_NEW)
    assert isinstance(results, list) and len(results) == len(prompts)
    wants = [reference(lm, p, stop=s, grammar=g) for p, s, g in zip(prompts, stops, names)]
    for i, (got, want) in enumerate(zip(results, wants)):
        assert_same_row(got, want, i, strategy)
        if names[i] is None:
            assert got.stats.accepted == sum(s != "target" for s in got.sources)
        if strategy == "greedy" and names[i] is None:
            assert got.stats.target_calls == len(got.tokens)
    # the case exercises what it claims: rows end at different steps, some by a stop string (EOS on the EOS-prone model)
    assert len({len(w.tokens) for w in wants}) > 2
    assert any(w.finish_reason == "stop" for w in wants)
    if arch == EOS_PRONE and not decoders.registry.get(strategy).needs_grammar:
        assert any(w.finish_reason == "eos" and n is None for w, n in zip(wants, names))
        assert any(w.finish_reason != "eos" for w in wants)


# ---------------------------------------------------------------------------------------------- stop strings, stream


@pytest.mark.parametrize("stop", ["e", ["e", "o"], ("t", " ")], ids=["string", "list-of-strings", "tuple"])
def test_stop_strings_for_all_rows(stop):
    """A string, or a list of strings (even one as long as the prompts: its items are strings, not per-row lists),
    applies to every row."""
    lm = tiny_lm("llama")
    prompts = [PROMPTS[0], PROMPTS[1]]
    results = decoders.generate(lm, prompts, stop=stop, max_new_tokens=MAX_NEW, batch_size=2)
    wants = [decoders.generate(lm, p, stop=stop, max_new_tokens=MAX_NEW) for p in prompts]
    for i, (got, want) in enumerate(zip(results, wants)):
        assert_same_row(got, want, i, "greedy")
    assert any(w.finish_reason == "stop" for w in wants)


def test_stop_strings_per_row():
    lm = tiny_lm("llama")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    texts = [reference(lm, p).text for p in prompts]
    stops = [None, [texts[1][2:4]], (texts[2][5:7], "\x00never")]
    results = decoders.generate(lm, prompts, stop=stops, max_new_tokens=MAX_NEW, batch_size=2)
    for i, (prompt, stop, got) in enumerate(zip(prompts, stops, results)):
        want = decoders.generate(lm, prompt, stop=stop, max_new_tokens=MAX_NEW)
        assert_same_row(got, want, i, "greedy")
    assert [r.finish_reason for r in results] == ["length", "stop", "stop"]


def test_stop_mixing_none_and_strings_is_refused():
    """[None, "x"] is neither one list for all nor one list per row."""
    lm = tiny_lm("llama")
    with pytest.raises(ValueError, match="stop"):
        decoders.generate(lm, [PROMPTS[0], PROMPTS[1]], stop=[None, "x"], max_new_tokens=4)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, seed=3)], ids=["greedy", "sampled"])
def test_stream_chunks_cover_every_prompt_and_concatenate_to_its_result(sampling):
    lm = tiny_lm("llama")
    prompts = mixed_prompts(lm)[:5]
    texts = [reference(lm, p).text for p in prompts]
    kwargs = dict(strategy=DRAFTING, draft=tiny_lm("llama", seed=99), max_new_tokens=12, batch_size=2,
                  stop=[None, None, [texts[2][3:5]], None, None], **sampling)
    chunks = list(decoders.stream(lm, prompts, **kwargs))
    results = decoders.generate(lm, prompts, **kwargs)
    by_index = defaultdict(list)
    for chunk in chunks:
        by_index[chunk.index].append(chunk)
    assert sorted(by_index) == list(range(len(prompts)))
    for i, result in enumerate(results):
        assert [t for c in by_index[i] for t in c.tokens] == result.tokens, f"row {i}"
        assert [s for c in by_index[i] for s in c.sources] == result.sources, f"row {i}"
        assert "".join(c.text for c in by_index[i]) == result.text, f"row {i}"
        assert all(c.tokens for c in by_index[i][:-1]), f"row {i}: an empty chunk before its last"
    order = [c.index for c in chunks]
    assert any(a > b for a, b in zip(order, order[1:])), "rows' chunks should interleave, not come prompt by prompt"
    if not sampling:
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            assert result.tokens == reference(lm, prompt, stop=kwargs["stop"][i], max_new_tokens=12).tokens


# ---------------------------------------------------------------------------------------------------------- sampling


def sampled_cases():
    cases = []
    for strategy in STRATEGIES:
        cls = decoders.registry.get(strategy)
        cases.append((strategy, RANDOM if cls.needs_draft else NONE))
    return cases


@pytest.mark.parametrize("seed", [11, [5, 9, 3]], ids=["int", "list"])
@pytest.mark.parametrize("strategy, draft_kind", sampled_cases(), ids=[f"{s}-{k}" for s, k in sampled_cases()])
def test_seeded_batches_repeat_for_every_strategy(strategy, draft_kind, seed):
    """seed=s seeds row i with s + i; a list gives each row its own: the same seeds, prompts and batch size repeat
    every row exactly. (A row may differ from its run alone: the batch's width limits its drafts, and what is drafted
    decides how the random numbers are spent; a strategy that drafts nothing spends them alike.)"""
    lm = tiny_lm("llama")
    cls = decoders.registry.get(strategy)
    prompts = [PROMPTS[0], lm.encode(PROMPTS[2]), PROMPTS[1]]
    names = ["regex", "schema", "choice"] if cls.needs_grammar else [None, "regex", None]
    settings = dict(temperature=1.0, max_new_tokens=12, strategy=strategy, draft=draft_of(draft_kind, lm))
    grammars = lambda: [None if n is None else constraint(n) for n in names]  # noqa: E731  (a matcher per run)
    results = decoders.generate(lm, prompts, seed=seed, batch_size=2, grammar=grammars(), **settings)
    again = decoders.generate(lm, prompts, seed=seed, batch_size=2, grammar=grammars(), **settings)
    seeds = [seed + i for i in range(3)] if isinstance(seed, int) else seed
    for i, (prompt, name, s) in enumerate(zip(prompts, names, seeds)):
        assert_same_row(again[i], results[i], i, strategy)
        if strategy == "greedy":
            want = decoders.generate(lm, prompt, seed=s, grammar=None if name is None else constraint(name), **settings)
            assert_same_row(results[i], want, i, strategy)


def test_seeded_batches_repeat_exactly():
    lm = tiny_lm("llama")
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    run = lambda seed: [r.tokens for r in decoders.generate(lm, prompts, temperature=1.0, seed=seed,  # noqa: E731
                                                            max_new_tokens=12, batch_size=2)]
    first = run(7)
    assert run(7) == first
    assert run(8) != first
    assert run([7, 8, 9]) == first  # the int seed's rows: 7, 8, 9
    unseeded = decoders.generate(lm, prompts, temperature=1.0, seed=[None, 8, None], max_new_tokens=12)
    assert unseeded[1].tokens == first[1]


def test_each_row_samples_its_own_prompts_distribution():
    """A chi-square test of each row's first sampled token, over many seeded batched runs that alternate two prompts
    of different lengths, against that prompt's exact filtered target distribution (and not the other prompt's)."""
    lm = tiny_lm("qwen2")
    settings = dict(temperature=0.8, top_k=40)
    config = SamplingConfig(**settings)
    ids = {"a": lm.encode(PROMPTS[2]), "b": lm.encode(PROMPTS[0])}
    with torch.inference_mode():
        probs = {k: config.probs(lm.forward(v, lm.new_cache())[-1]) for k, v in ids.items()}
    rows = [ids["a"], ids["b"]] * 20
    draws = defaultdict(list)
    for run in range(20):
        results = decoders.generate(lm, rows, max_new_tokens=1, seed=run * len(rows), batch_size=8, **settings)
        for i, result in enumerate(results):
            draws["ab"[i % 2]].append(result.tokens[0])
    for mine, other in (("a", "b"), ("b", "a")):
        tokens = torch.tensor(draws[mine])
        assert chi_square_fits(tokens, probs[mine]), f"prompt {mine}'s rows do not follow its distribution"
        assert not chi_square_fits(tokens, probs[other])


# --------------------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def no_run(monkeypatch):
    """Fail if a batch starts running."""
    def refuse(*args, **kwargs):
        raise AssertionError("a batch ran before its input was checked")

    monkeypatch.setattr(decoders.batch, "run", refuse)


@pytest.mark.parametrize("bad, message", [
    ("", "empty"),
    ([], "empty"),
    (list(range(1, 300)), "context"),  # alone longer than the model's 256
    (list(range(1, 250)), "context"),  # fits, but not with max_new_tokens
    ([5, 10**6], "token ids"),
], ids=["empty-text", "empty-ids", "over-context", "over-context-with-new-tokens", "bad-id"])
@pytest.mark.parametrize("call", ["generate", "stream"])
def test_a_bad_prompt_is_refused_before_any_run_naming_its_index(no_run, bad, message, call):
    lm = tiny_lm("llama")
    with pytest.raises(ValueError, match=rf"prompt 2\b.*{message}"):
        out = getattr(decoders, call)(lm, [PROMPTS[0], lm.encode(PROMPTS[1]), bad, PROMPTS[2]], max_new_tokens=10)
        list(out) if call == "stream" else None


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(strategy="no_such_strategy"), ValueError, "unknown strategy"),
    (dict(batch_size=0), ValueError, "batch_size"),
    (dict(batch_size=-2), ValueError, "batch_size"),
    (dict(batch_size=2.5), ValueError, "batch_size"),
    (dict(batch_size=True), ValueError, "batch_size"),
    (dict(seed=[1, 2], temperature=1.0), ValueError, r"seed= has 2 entries for 3 prompts"),
    (dict(seed=[1, 2, 3, 4], temperature=1.0), ValueError, r"seed= has 4 entries for 3 prompts"),
    (dict(seed=[1, -2, 3], temperature=1.0), ValueError, r"prompt 1\b.*seed"),
    (dict(grammar=[None, None]), ValueError, r"grammar= has 2 entries for 3 prompts"),
    (dict(stop=[None, ["x"]]), ValueError, r"stop= has 2 entries for 3 prompts"),
    (dict(strategy="speculative"), ValueError, "needs a draft"),
], ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__)
def test_bad_batch_arguments_are_refused_before_any_run(no_run, kwargs, error, message):
    lm = tiny_lm("llama")
    with pytest.raises(error, match=message):
        decoders.generate(lm, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], max_new_tokens=4, **kwargs)


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


def test_a_strategy_with_step_only_is_refused_in_a_batch_but_runs_one_at_a_time(registered, monkeypatch):
    class StepOnly(Decoder):
        def step(self, state):
            logits = state.score()
            state.accept([state.choose(logits[-1])], ["target"], rows=logits[-1:])

    name = registered("batch_test_step_only", StepOnly)
    lm = tiny_lm("llama")
    assert not StepOnly.batchable()
    # one prompt: the batch-1 path runs it as before
    assert decoders.generate(lm, PROMPTS[0], strategy=name, max_new_tokens=6).tokens == reference(
        lm, PROMPTS[0], max_new_tokens=6).tokens

    def admit(*args, **kwargs):
        raise AssertionError("a row was admitted before the strategy was checked")

    monkeypatch.setattr(decoders.batch, "admit", admit)
    with pytest.raises(TypeError, match=rf"{name}.*`step` only.*`steps`"):
        decoders.generate(lm, [PROMPTS[0], PROMPTS[1]], strategy=name, max_new_tokens=6)
    # one row in flight: each prompt runs alone (no row admitted to a batch), as it would by itself
    results = decoders.generate(lm, [PROMPTS[0], PROMPTS[1]], strategy=name, batch_size=1, max_new_tokens=6)
    assert [r.tokens for r in results] == [reference(lm, p, max_new_tokens=6).tokens for p in PROMPTS[:2]]


def test_a_model_without_masks_of_its_own_is_refused_a_batch_but_runs_one_at_a_time(monkeypatch):
    def no_masks(self):
        raise TypeError(f"{type(self.model).__name__} takes no 4D attention mask")

    monkeypatch.setattr(decoders.LM, "check_tree_mask", no_masks)
    lm = tiny_lm("llama")
    with pytest.raises(TypeError, match="cannot decode a batch with this model: LlamaForCausalLM takes no 4D.*"
                                        "batch_size=1"):
        decoders.generate(lm, [PROMPTS[0], PROMPTS[1]], max_new_tokens=6)
    results = decoders.generate(lm, [PROMPTS[0], PROMPTS[1]], batch_size=1, max_new_tokens=6)
    assert [r.tokens for r in results] == [reference(lm, p, max_new_tokens=6).tokens for p in PROMPTS[:2]]


# ------------------------------------------------------------------------------------------ a row whose step raises


@dataclasses.dataclass(frozen=True)
class FlakyOptions:
    bad: tuple = ()  # the prompt whose run raises
    at: int = 2  # ... at the step that would add its token number `at`
    after_call: bool = False  # ... after its target call was answered (else before asking one)


class Flaky(Decoder):
    """greedy, except that one prompt's run raises."""

    Options = FlakyOptions

    def steps(self, state):
        o = self.options
        bad = tuple(state.tokens[: state.prompt_len]) == o.bad and len(state.new_tokens) >= o.at
        if bad and not o.after_call:
            raise RuntimeError("boom before the call")
        logits = yield state.call()
        if bad:
            raise RuntimeError("boom after the call")
        state.accept([state.choose(logits[-1])], ["target"], rows=logits[-1:])


@pytest.mark.parametrize("batch_size", [2, 1])
@pytest.mark.parametrize("at, after_call", [(0, False), (3, False), (3, True)])
def test_a_row_whose_step_raises_ends_with_an_error_and_the_others_go_on(registered, at, after_call, batch_size):
    name = registered("batch_test_flaky", Flaky)
    lm = tiny_lm("llama")
    prompts = mixed_prompts(lm)
    bad = 2  # in the middle of the queue: rows are refilled after it
    options = dict(bad=tuple(lm.encode(prompts[bad]) if isinstance(prompts[bad], str) else prompts[bad]), at=at,
                   after_call=after_call)
    results = decoders.generate(lm, prompts, strategy=name, batch_size=batch_size, max_new_tokens=MAX_NEW, **options)
    for i, (prompt, got) in enumerate(zip(prompts, results)):
        want = reference(lm, prompt)
        if i == bad:
            assert got.finish_reason == "error"
            assert got.error is not None and got.error.startswith("RuntimeError: boom")
            assert ("after" in got.error) == after_call
            assert got.tokens == want.tokens[:at]
        else:
            assert_same_row(got, want, i, name)
    streamed = [c for c in decoders.stream(lm, prompts, strategy=name, batch_size=batch_size,
                                           max_new_tokens=MAX_NEW, **options) if c.index == bad]
    assert [t for c in streamed for t in c.tokens] == results[bad].tokens


# ----------------------------------------------------------------------------------------------------------- memory


MEMORY_CASES = [("greedy", NONE, 200, 8, 6), ("lookahead", NONE, 80, 4, 12), ("staged", RANDOM, 80, 4, 12),
                (DRAFTING, SELF, 80, 4, 12)]


@pytest.mark.parametrize("strategy, draft_kind, count, batch_size, new", MEMORY_CASES,
                         ids=[c[0] for c in MEMORY_CASES])
def test_a_long_queue_keeps_the_cache_bounded(monkeypatch, strategy, draft_kind, count, batch_size, new):
    """A long queue of short prompts (200 through 8 rows for greedy; trees, windows and rejected drafts for the
    others): the cache's slots stay within twice what a row holds (or the compaction threshold, 64) plus one call,
    where without compaction they would grow by each forward's width; every row exact."""
    lm = tiny_lm("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, lm.vocab_size) for _ in range(rng.randint(1, 10))] for _ in range(count)]
    seen = []
    forward = BatchCache.forward

    def recording(self, calls):
        width = max(len(call.tokens) for call in calls.values())
        held = int(self.valid.sum(1).max())  # the most slots one row holds
        out = forward(self, calls)
        layers = self._layers()
        capacity = self.slots if self.slab is None else self.slab.capacity  # (a static cache's layers: its slab's)
        seen.append(dict(slots=self.slots, width=width, held=held, rows={layer.keys.shape[0] for layer in layers},
                         capacity=capacity,
                         layer_slots={t.shape[2] for layer in layers for t in (layer.keys, layer.values)},
                         positions=tuple(self.positions.shape), valid=tuple(self.valid.shape)))
        return out

    monkeypatch.setattr(BatchCache, "forward", recording)
    results = decoders.generate(lm, prompts, strategy=strategy, draft=draft_of(draft_kind, lm), batch_size=batch_size,
                                max_new_tokens=new)
    monkeypatch.undo()
    grown = sum(s["width"] for s in seen)  # the slots an uncompacted cache would end with
    bound = max(64, 2 * max(s["held"] for s in seen)) + max(s["width"] for s in seen)
    assert grown > 2 * bound  # the queue is long enough for an unbounded cache to pass the bound
    for s in seen:
        assert s["rows"] == {batch_size} and s["layer_slots"] == {s["capacity"]} and s["capacity"] >= s["slots"]
        assert s["positions"] == s["valid"] == (batch_size, s["slots"])
    assert max(s["slots"] for s in seen) <= bound
    assert max(s["capacity"] for s in seen) <= max(MIN_CAPACITY, 2 * bound)  # a slab doubles only as slots grow
    assert max(s["held"] for s in seen) <= 10 + new + 16  # (a row holds its prompt, its tokens and at most a call)
    for i, (prompt, got) in enumerate(zip(prompts, results)):
        assert_same_row(got, reference(lm, prompt, max_new_tokens=new), i, strategy)


# ---------------------------------------------------------------------------------------------------- batch-1 path


def test_one_prompt_still_returns_one_result():
    lm = tiny_lm("llama")
    ids = lm.encode(PROMPTS[0])
    single = decoders.generate(lm, PROMPTS[0], max_new_tokens=8)
    assert isinstance(single, Result) and single.finish_reason == "length" and single.error is None
    for prompt in (ids, tuple(ids), torch.tensor(ids)):
        got = decoders.generate(lm, prompt, max_new_tokens=8)
        assert isinstance(got, Result) and got.tokens == single.tokens
    chunks = list(decoders.stream(lm, PROMPTS[0], max_new_tokens=8))
    assert all(c.index is None for c in chunks)
    assert "".join(c.text for c in chunks) == single.text
    assert [t for c in chunks for t in c.tokens] == single.tokens
    # a list of one prompt is a batch of one: a list of one Result, the same tokens
    for batch in ([PROMPTS[0]], (PROMPTS[0],), [ids]):
        got = decoders.generate(lm, batch, max_new_tokens=8)
        assert isinstance(got, list) and len(got) == 1 and got[0].tokens == single.tokens
    assert decoders.generate(lm, [], max_new_tokens=8) == []  # a list of no prompts


# ------------------------------------------------------------------------------------------------------ draft calls


def taking(proposer: str) -> type:
    """auto's chooser, taking `proposer`'s offer (4 levels at least) wherever it is made."""
    from decoders.drafting import chooser

    class Taking(chooser.Chooser):
        def choose(self, offers, context, remaining=None):
            offer = next((o for o in offers if o.proposer == proposer), None)
            if offer is None:
                return chooser.Plan(None, 0, 1.0, 1.0)
            return chooser.Plan(proposer, min(4, len(offer.accept)), 1.0, 1.0, probe=True)

    return Taking


def translating_draft() -> decoders.LM:
    from test_translate import draft_lm

    return draft_lm("metaspace", "llama")


DRAFT_CASES = {  # strategy, its options, the draft model
    "speculative": ("speculative", dict(k=3), lambda lm: tiny_lm("llama", seed=99)),
    "threshold": ("threshold", {}, lambda lm: tiny_lm("llama", seed=99)),
    "staged": ("staged", dict(min_prob=0.0, expand_prob=0.0, budget=6), lambda lm: tiny_lm("llama", seed=99)),
    "auto-chain": ("auto", dict(chooser=taking("draft"), draft_int8=False), lambda lm: tiny_lm("llama", seed=99)),
    "auto-tree": ("auto", dict(chooser=taking("tree"), draft_int8=False), lambda lm: tiny_lm("llama", seed=99)),
    "self-int8": ("speculative", dict(k=3), lambda lm: self_draft(lm, "int8")),  # (in a batch: on a cache of its own)
    "translated": ("speculative", dict(k=3), lambda lm: translating_draft()),
}


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_the_draft_model_drafts_for_all_rows_in_one_forward(monkeypatch, case):
    """Every row's draft calls go through the draft model's own batch cache, one forward serving all rows drafting in
    that round: the rows' draft calls (each counted once) take a few forwards of several rows each, not one forward a
    call; the target's forwards wait for every row's draft, so each serves every row still running; each row still
    its batch-1 greedy run's tokens; and a prompt alone never goes through a batch cache."""
    strategy, options, make_draft = DRAFT_CASES[case]
    lm = tiny_lm("llama")
    draft = make_draft(lm)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]]
    seen = []  # (the model, the rows served) per forward
    forward = BatchCache.forward

    def recording(self, calls):
        seen.append((self.lm, len(calls)))
        return forward(self, calls)

    monkeypatch.setattr(BatchCache, "forward", recording)
    strategy = decoders.registry.get(strategy)(**options)
    results = decoders.generate(lm, prompts, strategy=strategy, draft=draft, batch_size=4, max_new_tokens=MAX_NEW)
    for i, (prompt, got) in enumerate(zip(prompts, results)):
        assert_same_row(got, reference(lm, prompt), i, strategy.name)
    rows = [n for model, n in seen if model is draft]
    calls = sum(r.stats.draft_calls for r in results)
    assert calls >= 2 * len(prompts) and sum(rows) == calls  # each row's draft call served once, in a batch forward
    assert max(rows) == len(prompts) and len(rows) <= calls / 2
    verified = [n for model, n in seen if model is lm]  # no target forward while a row drafts: each serves every row
    assert len(verified) == max(r.stats.target_calls for r in results), verified
    seen.clear()
    alone = decoders.generate(lm, prompts[0], strategy=strategy, draft=draft, max_new_tokens=MAX_NEW)
    assert alone.tokens == results[0].tokens and alone.stats.draft_calls > 0 and not seen


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("strategy", ["greedy", "speculative"])
def test_a_prompt_sharing_a_kept_prompts_beginning_scores_only_the_rest(arch, strategy, monkeypatch):
    """Prompts beginning alike (agentic turns): a newcomer's prefill copies what it shares with a kept prompt and
    scores only the rest, its draft model's too; each row still equals its batch-1 greedy run."""
    lm = tiny_lm(arch)
    draft = tiny_lm(arch, seed=99) if strategy == "speculative" else None
    base = lm.encode(LONG_PROMPT * 2)
    prompts = [base + lm.encode(tail)[-3:] for tail in (" one", " two", "3 three")] + [lm.encode(PROMPTS[1])]
    assert len(base) > SHARED
    prefills, inside = defaultdict(list), []  # model -> [tokens a prefill held, tokens it scored]; its prefill running
    prefill = BatchCache.prefill

    def prefilling(self, b, tokens):
        inside.append(self.lm)
        prefills[self.lm].append([len(tokens), 0])
        prefill(self, b, tokens)
        inside.pop()

    def scoring(model, forward, tokens, *args, **kwargs):
        if inside and inside[-1] is model:
            prefills[model][-1][1] += len(tokens)
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(BatchCache, "prefill", prefilling)
    for model in filter(None, (lm, draft)):
        monkeypatch.setattr(model, "forward", functools.partial(scoring, model, model.forward))
    monkeypatch.setattr(batch.Width, "seconds", lambda self, width, context: 1.0)  # (every row drafts)
    chosen = decoders.registry.get(strategy)(**({"k": 3} if draft else {}))  # (a measured k may be 0: no draft call)
    results = decoders.generate(lm, prompts, strategy=chosen, draft=draft, batch_size=2, max_new_tokens=MAX_NEW)
    for i, (prompt, got) in enumerate(zip(prompts, results)):
        assert_same_row(got, reference(lm, prompt), i, strategy)
    for model in filter(None, (lm, draft)):  # (a draft prefills at its first call: the prompt and tokens since)
        (first, alone), *shared, (last, unrelated) = prefills[model]
        assert len(shared) == 2 and alone == first and unrelated == last, (model, prefills[model])
        assert all(scored <= held - len(base) for held, scored in shared), (model, prefills[model])


# ------------------------------------------------------------------------------------------------------ the width


def test_width_counts_what_each_narrower_call_would_have_gained():
    """A step verified at width 5 (one token fed, four drafted, the first three accepted) would have gained 1, 2, 3, 4
    tokens at widths 1, 2, 3, 5; it says nothing of wider calls."""
    width = batch.Width(tiny_lm("llama"), rows=4, cost=CallCost((1, 64), (1.0, 1.0)))
    prior = {w: gains.total for w, gains in width.gains.items()}
    width.observe(5, 1, [0, 1, 2])
    gained = {w: round(width.gains[w].total - width.options.decay * prior[w], 6) for w in WIDTHS}
    assert gained == {1: 1, 2: 2, 3: 3, 5: 4, 9: round(0.01 * prior[9], 6), 17: round(0.01 * prior[17], 6)}


@pytest.mark.parametrize("slope, want", [(0.0, 17), (1.0, 1)])
def test_width_weighs_the_tokens_against_the_call_of_rows_x_width_tokens(slope, want):
    """Every draft accepted in full: with a flat call cost the widest width pays; when each token costs as much as
    the call (x rows), none does. After `EXPLORE` calls it tries another width, the next wider (or the widest), then,
    after twice as many, a plain step (or, where that is the best, the next wider again)."""
    width = batch.Width(tiny_lm("llama"), rows=4, cost=CallCost((1, 1000), (1.0, 1.0 + 1999 * slope)))
    for _ in range(30):
        width.observe(0, 1, list(range(16)))
    picks = [width.next(context=10) for _ in range(3 * EXPLORE)]
    wider = WIDTHS[min(WIDTHS.index(want) + 1, len(WIDTHS) - 1)]
    then = 1 if want != 1 else wider
    assert picks == [want] * (EXPLORE - 1) + [wider] + [want] * (2 * EXPLORE - 1) + [then]


@pytest.mark.parametrize("reported", [1, 2])
def test_a_width_the_rows_report_at_narrower_calls_is_never_tried(reported):
    """Each token as dear as the call, so a plain step is best. Before any report the batch runs plain steps. Rows
    that report only what their calls ran (width 1) get width 2 tried after `EXPLORE` calls; rows that report at
    each 1-token call what a 2-token one would have gained (auto's guesses) need no try, and get none."""
    width = batch.Width(tiny_lm("llama"), rows=4, cost=CallCost((1, 1000), (1.0, 2000.0)))
    picks = []
    for _ in range(4 * EXPLORE):
        picks.append(width.next(context=10))
        width.observe(reported, 1, [])
    tried = [i for i, pick in enumerate(picks) if pick != 1]  # (pick 0 before any report, then 1 + EXPLORE calls)
    assert tried == ([] if reported == 2 else [EXPLORE, 3 * EXPLORE]) and picks[0] == 1


def test_a_batch_limits_every_rows_call_to_its_width(monkeypatch):
    """Each row's target call scores at most the batch's width, and the rows still equal their batch-1 greedy runs."""
    lm = tiny_lm("llama")
    prompts = [PROMPTS[0] * 3, PROMPTS[1] * 3, PROMPTS[2] * 3]
    want = [decoders.generate(lm, p, max_new_tokens=24).tokens for p in prompts]
    monkeypatch.setattr(batch.Width, "next", lambda self, context, last_wave=(): 3)
    widest = []
    forward = batch.BatchCache.forward

    def recording(self, calls):
        widest.append(max(len(call.tokens) for call in calls.values() if call.lm is None) if self.lm is lm else 0)
        return forward(self, calls)

    monkeypatch.setattr(batch.BatchCache, "forward", recording)
    got = decoders.generate(lm, prompts, strategy="suffix", max_new_tokens=24, batch_size=3)
    assert [r.tokens for r in got] == want
    assert max(widest[1:]) == 3  # (the first call feeds each prompt's last token: one a row)
    assert sum(r.stats.accepted for r in got) > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_a_long_catch_up_is_fed_alone_and_scores_as_alone(arch, monkeypatch):
    """A row's call feeding FEED_ALONE or more tokens before those it keeps logits for (a draft catching up) runs
    them in a call of its own: the other row's call is not padded to them, and both rows' logits are those of their
    runs alone."""
    lm = tiny_lm(arch)
    first, second = lm.encode(PROMPTS[0]), lm.encode(PROMPTS[1])
    catch_up = lm.encode(PROMPTS[2] * 3)[: FEED_ALONE + 2]
    cache = BatchCache(lm, 2)
    cache.prefill(0, first[:-1])
    cache.prefill(1, second[:-1])
    widths = []
    if lm.native is not None:  # (its calls run no module)
        native = lm.native.call
        monkeypatch.setattr(lm.native, "call", lambda ids, *a, **k: widths.append(ids.shape) or native(ids, *a, **k))
    else:
        model = lm.model.forward
        monkeypatch.setattr(lm.model, "forward", lambda *a, **k: widths.append(k["input_ids"].shape) or model(*a, **k))
    calls = {0: decoders.base.Call(first[-1:] + catch_up, keep=2), 1: decoders.base.Call(second[-1:], keep=1)}
    got = cache.forward(calls)
    assert widths[-1] == (2, 2)  # the batch's call: two rows, the first's two kept tokens
    for tokens, logits in ((first + catch_up, got[0]), (second, got[1])):
        alone = lm.forward(tokens, lm.new_cache(), keep=len(logits))
        torch.testing.assert_close(logits, alone, rtol=1e-4, atol=1e-4)


def test_a_bfloat16_models_logits_come_back_in_float32_alone_and_in_a_batch():
    """Argmax over a vocabulary in bfloat16 took 4x a conversion and a float32 argmax on a CPU, so `LM.forward` and a
    batch's calls hand back float32 logits: the model's own bfloat16 ones, converted exactly."""
    model = copy.deepcopy(tiny_lm("llama").model).to(torch.bfloat16)
    lm = decoders.wrap(model, tiny_tokenizer(), name="tiny-llama-bf16")
    lm.native = None  # (transformers' calls; the native step's logits are float32 sums from the start)
    first, second = lm.encode(PROMPTS[0]), lm.encode(PROMPTS[1])
    own = model(input_ids=torch.tensor([first])).logits[0]  # [T, vocab] bfloat16
    alone = lm.forward(first, decoders.models.cache.KVCache())
    assert own.dtype == torch.bfloat16 and alone.dtype == torch.float32 and torch.equal(alone, own.float())
    cache = BatchCache(lm, 2)
    cache.prefill(0, first[:-1])
    cache.prefill(1, second[:-1])
    got = cache.forward({0: decoders.base.Call(first[-1:]), 1: decoders.base.Call(second[-1:])})
    assert all(logits.dtype == torch.float32 for logits in got.values())
    # (a batch's bfloat16 call rounds differently: within a few bfloat16 steps of the largest logit; AVX2 CPUs'
    # kernels round a batch further from the single call than AVX-512's, 0.047 here at 5.4)
    ulp = 2**-8 * float(own.abs().max())
    torch.testing.assert_close(got[0], own[-1:].float(), rtol=0, atol=4 * ulp)


def test_width_follows_what_the_batchs_steps_took_over_the_predicted_cost():
    """The calibrated cost is flat, so every draft accepted makes 17 the widest and best; once steps at 17 are seen
    to take 20x their prediction and steps at 1 as predicted, a width never run is priced by the nearest run one's
    correction: 9 by 17's, 2 and 3 by 1's, so 3 pays best (and 2, once 3 is seen to be slow too)."""
    width = batch.Width(tiny_lm("llama"), rows=4, cost=CallCost((1, 1000), (1.0, 1.0)))
    for _ in range(30):
        width.observe(0, 1, list(range(16)))
    assert width.next(context=10) == 17
    for _ in range(10):
        width.took(17, 20.0, context=10)
        width.took(1, 1.0, context=10)
    assert width.seconds(9, context=10) == pytest.approx(20.0) and width.seconds(2, context=10) == pytest.approx(1.0)
    assert width.next(context=10) == 3
    for _ in range(10):
        width.took(3, 20.0, context=10)
    assert width.next(context=10) == 2


def test_a_draft_models_calls_are_not_charged_to_the_batchs_width(monkeypatch):
    """The seconds a width's step took (`Width.took`) leave out the draft model's calls: the rows that draft price
    them in their own plans (`stall`), and counted twice they made drafting widths look dear and the batch fall back
    to plain steps. Each draft forward here takes 100 s of a fake clock, the rest nothing."""
    clock, tooks = [0.0], []
    monkeypatch.setattr(batch.time, "perf_counter", lambda: clock[0])

    def forward(self, calls, original=BatchCache.forward):
        if self.lm is not lm:
            clock[0] += 100.0
        return original(self, calls)

    class Recorded(Fixed):
        def took(self, width, seconds, context):
            tooks.append(seconds)

    monkeypatch.setattr(BatchCache, "forward", forward)
    monkeypatch.setattr(batch, "Width", Recorded)
    lm, draft = tiny_lm("llama"), tiny_lm("llama", seed=1)
    results = decoders.generate(lm, [lm.encode(p) for p in PROMPTS[:3]], strategy="speculative", draft=draft, k=2,
                                batch_size=3, max_new_tokens=12)
    assert sum(r.stats.draft_calls for r in results) > 0 and tooks and max(tooks) < 100.0


def test_in_the_last_wave_a_width_is_worth_what_it_gains_the_slowest_row():
    """While prompts wait, the rows' gains count together: one row accepting every draft makes 17 the best width.
    With none waiting the batch ends with its slowest row, and a row that gains nothing from drafts holds it at 1
    (a wider call would only slow it), until its run ends and is forgotten."""
    width = batch.Width(tiny_lm("llama"), rows=2, cost=CallCost((1, 1001), (1.0, 11.0)))  # 0.01 s a token
    for _ in range(100):  # (the prior's hope of drafts fades)
        width.observe(0, 1, list(range(16)), row=0)
        width.observe(0, 1, [], row=1)
    assert width.next(context=10) == 17
    assert width.next(context=10, last_wave=[0, 1]) == 1
    width.forget(1)
    assert width.next(context=10, last_wave=[0]) == 17


def test_auto_in_a_batch_makes_no_int8_copy_unless_asked(monkeypatch):
    """Where the target's int8 copy pays (here: said to), a run alone drafts with it; a batch's rows do not, unless
    asked (`self_int8=True`), and give the same tokens either way."""
    from decoders.drafting import copies

    lm = tiny_lm("llama", seed=47)  # (a model of its own: the verdict and the copy stay with it)
    monkeypatch.setattr(copies, "pays", lambda *_: True)
    prompts = [PROMPTS[0], PROMPTS[1]]
    alone = decoders.generate(lm, prompts[0], strategy="auto", max_new_tokens=8)
    plain = decoders.generate(lm, prompts, strategy="auto", max_new_tokens=8)
    asked = decoders.generate(lm, prompts, strategy="auto", self_int8=True, max_new_tokens=8)
    assert alone.stats.details["draft"] == f"{lm.name}:int8"
    assert all("draft" not in r.stats.details for r in plain)
    assert all(r.stats.details["draft"] == f"{lm.name}:int8" for r in asked)
    assert [r.tokens for r in plain] == [r.tokens for r in asked] == [alone.tokens, plain[1].tokens]


def priced(draft_seconds: float, prompt: float = 1.0):
    """Auto's chooser factory: the target's calls cost 1 s whatever they score, the draft's `draft_seconds`, up to
    `prompt` times that for 64 tokens (its catching up on a prompt); held there (the tiny models' calls take ms)."""

    def make(cost: CostModel) -> chooser.Chooser:
        cost.target = CallCost((1, 64), (1.0, 1.0))
        cost.draft = CallCost((1, 64), (draft_seconds, prompt * draft_seconds))
        cost.observe = lambda *args, **kwargs: None
        return chooser.Chooser(cost)

    return make


class Fixed(batch.Width):
    """Every target call 3 tokens wide; `best_width`: the width it calls the batch's best, `was_verified`: whether
    it says a step was verified."""

    best_width, was_verified = 3, True

    def next(self, context, last_wave=()):
        self.best, self.verified = self.best_width, self.was_verified
        return 3


@pytest.mark.parametrize("width", ["tried", "unverified", "best"])
def test_auto_rents_no_draft_model_on_a_width_the_batch_only_tries(width, monkeypatch):
    """A try at a width the batch's best does not run (`Width.next`'s exploration), or the first width before any
    step is verified, prefills no row's draft model: every row would stall on it for a width the batch may not run
    again. At its best width, auto probes the draft (one that costs little beside the target's calls)."""
    monkeypatch.setattr(Fixed, "best_width", 1 if width == "tried" else 3)
    monkeypatch.setattr(Fixed, "was_verified", width != "unverified")
    monkeypatch.setattr(batch, "Width", Fixed)
    lm, draft = tiny_lm("llama"), tiny_lm("llama", seed=1)
    prompts = [lm.encode(p) for p in PROMPTS[:3]]
    results = decoders.generate(lm, prompts, strategy=auto.Auto(chooser=priced(0.01, 8)), draft=draft, batch_size=3,
                                max_new_tokens=40)
    for prompt, result in zip(prompts, results):
        assert result.tokens == decoders.generate(lm, prompt, max_new_tokens=40).tokens
    drafted = sum(r.stats.draft_calls for r in results)
    assert drafted > 0 if width == "best" else drafted == 0


@pytest.mark.parametrize("rows", [1, 3])
def test_auto_weighs_a_rows_drafting_by_the_rows_it_holds_up(rows, monkeypatch):
    """A draft call costing half a target call pays alone (a chain of k costs (k / 2 + 1) / (k + 1) of a step per
    token, every guess right); in a batch of three where no other row drafts, each second of it holds up three rows,
    and a chain would cost more than plain steps: auto never rents it there (`DecodeState.stall`)."""
    monkeypatch.setattr(batch, "Width", Fixed)
    lm, draft = tiny_lm("llama"), tiny_lm("llama", seed=1)
    prompts = [lm.encode(p) for p in PROMPTS[:rows]]
    options = dict(strategy=auto.Auto(chooser=priced(0.5)), draft=draft, max_new_tokens=40)
    results = (decoders.generate(lm, prompts, batch_size=rows, **options) if rows > 1
               else [decoders.generate(lm, prompts[0], **options)])
    drafted = sum(r.stats.draft_calls for r in results)
    assert drafted > 0 if rows == 1 else drafted == 0


class Plain(batch.Width):
    """Every target call 1 token wide (no room to draft), the batch's best; records what each row's step reported."""

    def next(self, context, last_wave=()):
        self.best, self.verified = 1, True
        return 1

    def observe(self, width, fed, path, row=0):
        self.reports.append((width, fed, list(path)))
        super().observe(width, fed, path, row)


def test_at_a_batchs_plain_steps_auto_reports_what_one_token_more_would_have_gained(monkeypatch):
    """A width's gain is learnt by running it; at steps whose width leaves no room to draft, auto reports the step as
    one token wider, its draft the suffix index's guess, accepted where the target's token is that guess. The tokens
    stay the batch-1 greedy ones; a run whose text repeats (the prompt's own words, a tiny model's loops) guesses
    right at some steps."""
    reports = []
    monkeypatch.setattr(Plain, "reports", reports, raising=False)
    monkeypatch.setattr(batch, "Width", Plain)
    lm = tiny_lm("llama")
    prompts = ["the cat sat on the mat and the cat sat on the mat and the cat", PROMPTS[0], PROMPTS[1]]
    results = decoders.generate(lm, prompts, strategy="auto", batch_size=3, max_new_tokens=24)
    for prompt, result in zip(prompts, results):
        assert result.tokens == decoders.generate(lm, prompt, max_new_tokens=24).tokens
        assert result.stats.drafted == 0  # (nothing drafted: every call 1 token wide)
    # every step reports one token wider but each row's last (no token comes after it to have drafted)
    assert [r for r in reports if r[0] != r[1] + 1] == [(1, 1, [])] * len(prompts) < reports
    assert any(path == [0] for _, _, path in reports)
