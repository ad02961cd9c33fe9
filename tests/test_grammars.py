"""grammars/: constraints, the byte vocabulary, numeric ranges, matcher state (advance / rollback / forced / masks)."""

from __future__ import annotations

import itertools
import random
import re
import types
from decimal import Decimal

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import grammars
from grammars.numbers import integer_range, number_range
from grammars.vocabulary import token_bytes
from tests.conftest import tiny_lm, tiny_tokenizer

CHARACTER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
        "armor": {"enum": ["leather", "chainmail", "plate"]},
        "weapon": {"enum": ["sword", "axe", "mace", "spear", "bow", "crossbow"]},
        "strength": {"type": "integer"},
    },
    "required": ["name", "age", "armor", "weapon", "strength"],
}


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture(scope="module")
def character(lm):
    constraint = grammars.json_schema(CHARACTER)
    constraint.matcher(lm)  # builds and caches the index once for the module
    return constraint


def text_of(lm, tokens) -> str:
    return lm.tokenizer.decode(tokens)


# ---------------------------------------------------------------------------------------------------- vocabulary


def test_token_bytes_rebuild_any_text():
    tokenizer = tiny_tokenizer()
    table = token_bytes(tokenizer).table
    for text in ['{"name": "clerame"}', "héllo wörld ✓ 3.14", "def f(x):\n    return x"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode()
    assert table[tokenizer.eos_token_id] is None  # special tokens are never grammar text
    assert all(len(token_bytes(tokenizer).single) == 256 for _ in range(1))  # every byte has a one-byte token


def test_token_bytes_cached_per_tokenizer():
    assert token_bytes(tiny_tokenizer()) is token_bytes(tiny_tokenizer())


# ---------------------------------------------------------------------------------------------------- numeric ranges


def test_integer_range_matches_exactly():
    rng = random.Random(0)
    for _ in range(200):
        low = rng.choice([None, rng.randint(-300, 300), rng.randint(-100000, 100000)])
        high = rng.choice([None, rng.randint(-300, 300), rng.randint(-100000, 100000)])
        pattern = integer_range(low, high)
        if pattern is None:
            assert low > high
            continue
        compiled = re.compile(pattern)
        values = [*range(-1100, 1100, 7), *(rng.randint(-10**6, 10**6) for _ in range(50)), low or 0, high or 0]
        for value in values:
            inside = (low is None or value >= low) and (high is None or value <= high)
            assert bool(compiled.fullmatch(str(value))) == inside, (low, high, value, pattern)
        assert not any(compiled.fullmatch(bad) for bad in ("-0", "01", "1.0", ""))


def test_number_range_matches_exactly():
    candidates = [f"{sign}{whole}{frac}" for sign in ("", "-") for whole in range(13)
                  for frac in ("", ".0", ".5", ".05", ".25", ".125", ".999", ".001", ".75", ".7500", ".3")]
    bounds = [None, Decimal("0"), Decimal("0.5"), Decimal("1"), Decimal("2.25"), Decimal("-1"), Decimal("-0.5"),
              Decimal("10"), Decimal("0.125"), Decimal("0.3")]
    for low, high, low_strict, high_strict in itertools.product(bounds, bounds, (False, True), (False, True)):
        if (low is None and low_strict) or (high is None and high_strict):
            continue
        pattern = number_range(low, high, low_strict, high_strict)
        if pattern is None:
            assert low > high or (low == high and (low_strict or high_strict))
            continue
        compiled = re.compile(pattern)
        for text in candidates:
            value = Decimal(text)
            inside = (low is None or (value > low if low_strict else value >= low)) and (
                high is None or (value < high if high_strict else value <= high))
            inside = inside and not (text.startswith("-") and value == 0)  # "-0" is never generated
            assert bool(compiled.fullmatch(text)) == inside, (low, high, low_strict, high_strict, text, pattern)


# ---------------------------------------------------------------------------------------------------- constraints


def test_constraints_are_small_frozen_values():
    a, b = grammars.regex(r"[0-9]{3}"), grammars.regex(r"[0-9]{3}")
    assert a == b and hash(a) == hash(b)
    with pytest.raises(Exception):
        a.regex = "x"
    assert grammars.choice(["red", "green"]).pattern == "(red|green)"
    assert grammars.choice(["a.b", "(c)"]).pattern == r"(a\.b|\(c\))"


def test_json_schema_accepts_pydantic_dict_and_string():
    import json

    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    from_class = grammars.json_schema(Point)
    from_dict = grammars.json_schema(Point.model_json_schema())
    from_text = grammars.json_schema(json.dumps(Point.model_json_schema()))
    assert from_class.pattern == from_dict.pattern == from_text.pattern
    assert from_class.pattern.startswith(r'\{"x":')  # properties keep the schema's order


def test_schema_bounds_become_ranges():
    pattern = grammars.json_schema({"type": "integer", "minimum": 3, "maximum": 250}).pattern
    assert re.fullmatch(pattern, "250") and re.fullmatch(pattern, "3")
    assert not re.fullmatch(pattern, "251") and not re.fullmatch(pattern, "-5") and not re.fullmatch(pattern, "2")


@pytest.mark.parametrize(
    "schema, words",
    [
        ("{", ["not valid JSON"]),
        ({"type": "foo"}, ["foo"]),
        ({"type": "string", "format": "hostname"}, ["hostname"]),
        ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}},
         ["multipleOf", "#/properties/n"]),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ["uniqueItems"]),
        ({"not": {"type": "string"}}, ["not"]),
        ({"type": "integer", "minimum": 5, "maximum": 1}, ["bounds"]),
        ({"type": "string", "pattern": "[a-"}, ["regex"]),
        (42, ["pydantic model class, a dict or a JSON string"]),
    ],
)
def test_bad_schemas_raise_clear_errors(schema, words):
    with pytest.raises(grammars.GrammarError) as error:
        grammars.json_schema(schema)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("pattern, word", [("[", "invalid"), ("a(", "invalid"), (r"\bx", "word boundaries")])
def test_bad_regexes_raise_clear_errors(pattern, word):
    with pytest.raises(grammars.GrammarError, match=word):
        grammars.regex(pattern)


def test_bad_choices_raise():
    for options in ([], "abc", [1, 2], None):
        with pytest.raises(grammars.GrammarError):
            grammars.choice(options)


def test_vocabulary_that_cannot_spell_the_grammar():
    backend = Tokenizer(models.WordLevel({"<eos>": 0, "a": 1, "b": 2}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    small = types.SimpleNamespace(tokenizer=tokenizer, vocab_size=3, eos_token_ids=frozenset({0}))
    assert grammars.regex("ab+").matcher(small).allowed().tolist() == [False, True, False]
    with pytest.raises(grammars.GrammarError, match="cannot be generated with this tokenizer's vocabulary"):
        grammars.regex("ac").matcher(small)


# ---------------------------------------------------------------------------------------------------- matcher


def test_allowed_mask_covers_the_logits_width(lm, character):
    matcher = character.matcher(lm)
    mask = matcher.allowed()
    assert mask.dtype == torch.bool and mask.shape == (lm.vocab_size,)
    assert lm.vocab_size > len(lm.tokenizer) and not mask[len(lm.tokenizer):].any()


def test_eos_allowed_exactly_when_finished(lm):
    matcher = grammars.choice(["a", "ab"]).matcher(lm)
    eos = next(iter(lm.eos_token_ids))
    assert not matcher.allowed()[eos] and not matcher.is_finished()
    matcher.advance(lm.tokenizer.encode("a", add_special_tokens=False))
    assert matcher.allowed()[eos] and matcher.is_finished() and not matcher.is_complete()
    matcher.advance(lm.tokenizer.encode("b", add_special_tokens=False))
    assert matcher.is_complete() and not hasattr(matcher, "done")  # one name per question
    assert matcher.allowed().nonzero().flatten().tolist() == sorted(lm.eos_token_ids)
    matcher.advance([eos])
    assert not matcher.allowed().any()


def test_advance_rollback_round_trip(lm, character):
    matcher = character.matcher(lm)
    rng = random.Random(0)
    walked, masks = [], [matcher.allowed().clone()]
    for _ in range(60):  # a random walk through allowed tokens
        if matcher.is_complete():
            break
        allowed = matcher.allowed().nonzero().flatten().tolist()
        token = rng.choice([t for t in allowed if t not in lm.eos_token_ids] or allowed)
        matcher.advance([token])
        walked.append(token)
        masks.append(matcher.allowed().clone())
    assert len(walked) > 10
    for back in range(1, len(walked) + 1):
        matcher.rollback(1)
        assert torch.equal(matcher.allowed(), masks[-1 - back])
    assert matcher.tokens == [] and matcher.text == ""
    matcher.advance(walked)
    assert torch.equal(matcher.allowed(), masks[-1])
    matcher.rollback(len(walked))
    assert torch.equal(matcher.allowed(), masks[0])
    with pytest.raises(ValueError):
        matcher.rollback(1)


def test_forced_runs_spell_the_fixed_keys(lm, character):
    matcher = character.matcher(lm)
    first = matcher.forced()
    assert text_of(lm, first) == '{"name":"'
    assert matcher.tokens == []  # forced() does not move the matcher
    matcher.advance(first)
    matcher.advance(lm.tokenizer.encode('Bob"', add_special_tokens=False))
    assert text_of(lm, matcher.forced()) == ',"age":'
    matcher.advance(matcher.forced() + lm.tokenizer.encode("7,", add_special_tokens=False))
    assert text_of(lm, matcher.forced()) == '"armor":"'
    matcher.advance(matcher.forced() + lm.tokenizer.encode("p", add_special_tokens=False))
    assert text_of(lm, matcher.forced()) == 'late","weapon":"'  # only "plate" starts with p


def test_forced_tokens_are_the_tokenizers_own_spelling(lm, character):
    forced = character.matcher(lm).forced()
    assert forced == lm.tokenizer.encode('{"name":"', add_special_tokens=False)
    spelled_any_way = grammars.json_schema(CHARACTER, canonical=False).matcher(lm)
    assert spelled_any_way.forced() == []  # "{", '{"', ... are all allowed: nothing is forced without canonical


def test_disallowed_token_raises_and_does_not_move(lm, character):
    matcher = character.matcher(lm)
    good = matcher.forced()
    bad = lm.tokenizer.encode("\n", add_special_tokens=False)  # a raw newline is not allowed in a JSON string
    with pytest.raises(grammars.GrammarError, match=r"does not allow token .* after '\{\"name\":\"'"):
        matcher.advance(good + bad)
    assert matcher.tokens == []
    eos = next(iter(lm.eos_token_ids))
    with pytest.raises(grammars.GrammarError, match="EOS before the grammar can finish"):
        matcher.advance([eos])


def test_masks_along(lm, character):
    matcher = character.matcher(lm)
    tokens = lm.tokenizer.encode('{"name":"Al","age":3', add_special_tokens=False)
    n, masks = matcher.masks_along(tokens)
    assert n == len(tokens) and masks.shape == (n + 1, lm.vocab_size)
    assert matcher.tokens == []  # not moved
    walker = character.matcher(lm)
    for i, token in enumerate(tokens):
        assert torch.equal(masks[i], walker.allowed()) and masks[i][token]
        walker.advance([token])
    assert torch.equal(masks[n], walker.allowed())
    bad = tokens[:4] + lm.tokenizer.encode("}", add_special_tokens=False) + tokens[4:]
    n_bad, masks_bad = matcher.masks_along(bad)
    assert n_bad == 4 and masks_bad.shape == (5, lm.vocab_size)
    assert not masks_bad[4][bad[4]]


def test_fork_is_independent(lm, character):
    matcher = character.matcher(lm)
    matcher.advance(matcher.forced())
    twin = matcher.fork()
    twin.advance(lm.tokenizer.encode("x", add_special_tokens=False))
    assert len(twin.tokens) == len(matcher.tokens) + 1
    twin.rollback(len(twin.tokens))
    assert len(matcher.tokens) > 0


def test_matchers_follow_the_protocol(lm, character):
    """Both matchers are `GrammarMatcher`s, and every method of the protocol documents its parameters."""
    for matcher in (character.matcher(lm), grammars.cfg('start: "a" "b"+').matcher(lm)):
        assert isinstance(matcher, grammars.GrammarMatcher)
    for name in ("allowed", "forced", "advance", "rollback", "masks_along", "fork", "is_finished", "is_complete"):
        doc = getattr(grammars.GrammarMatcher, name).__doc__
        assert doc, name
        if name in ("advance", "rollback", "masks_along"):
            assert "Args:" in doc, name
    assert not isinstance(object(), grammars.GrammarMatcher)


def test_index_built_once_per_tokenizer_and_constraint(lm, character):
    assert character.matcher(lm).index is character.matcher(lm).index
    assert grammars.json_schema(CHARACTER).matcher(lm).index is character.matcher(lm).index  # equal constraint


def test_matches_can_go_on_past_a_complete_match(lm):
    """outlines-core alone drops `1(\\.5)?`'s ".5" after "1" and `a|ab`'s "b" after "a"; the end mark keeps them."""
    number = grammars.regex(r"[0-9]+(\.[0-9]+)?").matcher(lm)
    number.advance(lm.tokenizer.encode("12", add_special_tokens=False))
    dot = lm.tokenizer.encode(".", add_special_tokens=False)
    assert number.is_finished() and number.allowed()[dot[0]]
    number.advance(dot)
    assert not number.is_finished()
    prefix = grammars.choice(["a", "ab"]).matcher(lm)
    prefix.advance(lm.tokenizer.encode("a", add_special_tokens=False))
    assert prefix.allowed()[lm.tokenizer.encode("b", add_special_tokens=False)[0]]


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-1.5b", "gemma3-270m"])
def test_token_bytes_of_real_tokenizers(name):
    """Byte-level BPE (SmolLM2, Qwen2.5) and SentencePiece-style byte fallback (Gemma 3)."""
    zoo = pytest.importorskip("decoders.models.zoo")
    folder = zoo.local_path(name)
    if folder is None:
        pytest.skip(f"zoo:{name} is not pulled (decodekit models pull {name})")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    table = token_bytes(tokenizer).table
    for text in ['{"name":"clerame","age":7}', " héllo wörld ✓ 3.14 日本語", "\tdef f(x):\n    return x"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode(), [tokenizer.convert_ids_to_tokens(ids)]
    assert all(table[i] is None for i in tokenizer.all_special_ids if i < len(table))
