"""Grammar-constrained generation: `guided`, `greedy` + grammar, every strategy + grammar; outputs always valid."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest

import decoders
import grammars
from tests.conftest import tiny_lm
from tests.test_grammars import CHARACTER

# Bounded schemas, so that even a random model closes every structure quickly.
SCHEMAS = {
    "character": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "armor": {"enum": ["leather", "chainmail", "plate"]},
            "weapon": {"enum": ["sword", "axe", "mace", "spear", "bow", "crossbow"]},
            "strength": {"type": "integer", "minimum": 0, "maximum": 9999},
        },
        "required": ["name", "age", "armor", "weapon", "strength"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["pos", "tags"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99},
            "tag": {"type": "string", "minLength": 1, "maxLength": 5},
            "note": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
        },
        "required": ["id"],
    },
    "numbers": {"type": "array", "items": {"type": "number", "exclusiveMinimum": -1.5, "maximum": 2.25}, "maxItems": 3},
    "objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "k": {"type": "string", "maxLength": 3},
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
}
REGEXES = [
    r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{2,8}@[a-z]{2,6}\.(com|org|net)", r"-?[0-9]{1,3}(\.[0-9]{1,2})?",
]
CHOICES = [["red", "green", "blue"], ["a", "ab", "abc"], ["héllo wörld", "hello"]]
SAMPLED = [dict(), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_k=20, seed=2)]
MAX = 120


@functools.cache
def constraint(kind: str, key) -> grammars.Constraint:
    """One constraint object per test module run, so each index is built once."""
    if kind == "schema":
        return grammars.json_schema(SCHEMAS[key])
    if kind == "regex":
        return grammars.regex(key)
    return grammars.choice(list(key))


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def check(result, kind: str, key) -> None:
    assert result.finish_reason == "eos", f"the grammar did not finish: {result.text!r}"
    if kind == "schema":
        jsonschema.validate(json.loads(result.text), SCHEMAS[key])
    elif kind == "regex":
        assert re.fullmatch(key, result.text), result.text
    else:
        assert result.text in key


CASES = ([("schema", k) for k in SCHEMAS] + [("regex", r) for r in REGEXES] + [("choice", tuple(c)) for c in CHOICES])


@pytest.mark.parametrize("kind, key", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_guided_outputs_are_always_valid(lm, kind, key):
    for prompt in ("Give me", '{"name": "'):
        for sampling in SAMPLED:
            result = decoders.generate(lm, prompt, strategy="guided", grammar=constraint(kind, key),
                                       max_new_tokens=MAX, **sampling)
            check(result, kind, key)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_greedy_with_grammar_equals_guided(arch, name):
    """greedy + grammar masks and advances; guided also fast-forwards forced tokens: same tokens, fewer calls."""
    model = tiny_lm(arch)
    grammar = constraint("schema", name)
    slow = decoders.generate(model, "Give me", strategy="greedy", grammar=grammar, max_new_tokens=MAX)
    fast = decoders.generate(model, "Give me", strategy="guided", grammar=grammar, max_new_tokens=MAX)
    assert fast.tokens == slow.tokens
    check(fast, "schema", name)
    assert "grammar" in fast.sources and set(slow.sources) == {"target"}
    assert fast.stats.target_calls == fast.sources.count("target") < slow.stats.target_calls


def test_sampling_with_grammar_equals_guided_for_the_same_seed(lm):
    """Forced tokens draw nothing from the random stream, so sampled runs agree too."""
    grammar = constraint("schema", "character")
    for seed in (1, 2, 3):
        slow = decoders.generate(lm, "Give me", strategy="greedy", grammar=grammar, temperature=1.0, seed=seed,
                                 max_new_tokens=MAX)
        fast = decoders.generate(lm, "Give me", strategy="guided", grammar=grammar, temperature=1.0, seed=seed,
                                 max_new_tokens=MAX)
        assert fast.tokens == slow.tokens


@pytest.mark.parametrize("strategy", decoders.available())
def test_every_strategy_honours_the_grammar(lm, strategy):
    """Greedy mode: any strategy with a grammar returns guided's tokens (draft strategies: forced runs are free)."""
    cls = decoders.registry.get(strategy)
    draft = tiny_lm("llama", seed=1) if cls.needs_draft else None
    for name in ("character", "objects"):
        grammar = constraint("schema", name)
        want = decoders.generate(lm, "Give me", strategy="guided", grammar=grammar, max_new_tokens=MAX)
        got = decoders.generate(lm, "Give me", strategy=strategy, grammar=grammar, draft=draft, max_new_tokens=MAX)
        check(got, "schema", name)
        assert got.tokens == want.tokens


def test_forced_tokens_are_marked_and_cost_no_call(lm):
    result = decoders.generate(lm, "Give me", strategy="guided", grammar=constraint("schema", "character"),
                               max_new_tokens=MAX)
    forced = "".join(lm.decode([t]) for t, s in zip(result.tokens, result.sources) if s == "grammar")
    for key in ('{"name":"', ',"age":', ',"armor":"', ',"weapon":"', ',"strength":'):
        assert key in forced
    assert result.stats.target_calls == result.sources.count("target")
    assert result.stats.new_tokens == len(result.tokens)


def test_stream_with_grammar(lm):
    chunks = list(decoders.stream(lm, "Give me", strategy="guided", grammar=constraint("schema", "character"),
                                  max_new_tokens=MAX))
    text = "".join(c.text for c in chunks)
    jsonschema.validate(json.loads(text), SCHEMAS["character"])
    assert chunks[0].sources[0] == "grammar"


def test_length_limit_stops_inside_the_grammar(lm):
    result = decoders.generate(lm, "Give me", strategy="guided", grammar=constraint("schema", "character"),
                               max_new_tokens=3)
    assert result.finish_reason == "length" and len(result.tokens) == 3 and result.sources == ["grammar"] * 3


def test_guided_without_grammar_is_a_clear_error(lm):
    with pytest.raises(ValueError, match="needs a grammar"):
        decoders.generate(lm, "Give me", strategy="guided")


def test_grammar_must_be_a_constraint(lm):
    with pytest.raises(TypeError, match="grammars constraint"):
        decoders.generate(lm, "Give me", grammar=r"[0-9]+")


def test_a_forbidden_token_cannot_join_the_output(lm):
    from decoders.driver import _prepare

    state, _ = _prepare(lm, "Give me", grammar=constraint("schema", "character"))
    with pytest.raises(grammars.GrammarError, match="does not allow"):
        state.accept(lm.tokenizer.encode("[", add_special_tokens=False), ["target"])
    assert state.new_tokens == []


# ---------------------------------------------------------------------------------------------------- real model

SEED_CHARACTER = CHARACTER  # the seed article's Character / Weapon / Armor example


@functools.cache
def smollm2() -> decoders.LM:
    pytest.importorskip("decoders.models.zoo")
    return decoders.load("zoo:smollm2-135m", dtype="float32")


def chat(lm: decoders.LM, request: str) -> str:
    messages = [{"role": "user", "content": request}]
    return lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.real_model
def test_character_schema_on_smollm2():
    lm = smollm2()
    grammar = grammars.json_schema(SEED_CHARACTER)
    prompt = chat(lm, "Give me a character description for a fantasy game, as JSON.")
    fast = decoders.generate(lm, prompt, strategy="guided", grammar=grammar, max_new_tokens=100)
    jsonschema.validate(json.loads(fast.text), SEED_CHARACTER)
    assert fast.finish_reason == "eos" and fast.sources.count("grammar") >= len(fast.tokens) // 3
    slow = decoders.generate(lm, prompt, strategy="greedy", grammar=grammar, max_new_tokens=100)
    assert slow.tokens == fast.tokens
    sampled = decoders.generate(lm, prompt, strategy="guided", grammar=grammar, max_new_tokens=100,
                                temperature=1.0, seed=0)
    jsonschema.validate(json.loads(sampled.text), SEED_CHARACTER)


@pytest.mark.real_model
def test_regex_on_smollm2():
    lm = smollm2()
    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    prompt = chat(lm, "On what date did the Apollo 11 mission land on the Moon? Answer as YYYY-MM-DD.")
    result = decoders.generate(lm, prompt, strategy="guided", grammar=grammars.regex(pattern), max_new_tokens=20)
    assert re.fullmatch(pattern, result.text) and result.finish_reason == "eos"
