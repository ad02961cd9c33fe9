"""JSON-schema composition: `allOf`, `oneOf`, `anyOf` / `enum` / `const` beside other keywords, empty lists.

Each schema outlines-core alone would misread is either enforced exactly (every text its regex matches validates,
checked on hand-picked texts and on guided outputs) or refused with a `GrammarError` that names the keyword.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Literal, Union

import jsonschema
import pytest
from pydantic import BaseModel, Field, conint

import decoders
import grammars
from tests.conftest import tiny_lm


class Cat(BaseModel):
    pet: Literal["cat"]
    lives: conint(ge=1, le=9)


class Dog(BaseModel):
    pet: Literal["dog"]
    good: bool


class Owner(BaseModel):
    """pydantic writes a discriminated union as `oneOf` of `$ref`s whose `pet` consts differ."""

    animal: Union[Cat, Dog] = Field(discriminator="pet")


SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 4}

# name -> (schema, texts its grammar must allow, texts it must refuse); every schema is bounded, so that even a random
# model closes it quickly.
EXACT = {
    "allOf objects": (
        {"allOf": [
            {"type": "object", "properties": {"a": SMALL_INT}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]},
        ]},
        ['{"a":3,"b":"x"}'],
        ['{"a":3}{"b":"x"}', '{"a":3}', '{"b":"x"}'],
    ),
    "allOf refines a property": (
        {"type": "object", "properties": {"s": SHORT}, "required": ["s"],
         "allOf": [{"properties": {"s": {"type": "string", "minLength": 2}}}]},
        ['{"s":"ab"}', '{"s":"abcd"}'],
        ['{"s":"a"}', '{"s":"abcde"}'],
    ),
    "allOf with a $ref": (
        {"$defs": {"Base": {"type": "object", "properties": {"id": SMALL_INT}, "required": ["id"]}},
         "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}]},
        ['{"id":1,"ok":true}'],
        ['{"id":1}', '{"ok":true}', '{"id":1}{"ok":true}'],
    ),
    "allOf closed by one part": (
        {"allOf": [{"type": "object", "properties": {"a": SMALL_INT}, "additionalProperties": False},
                   {"properties": {"b": SHORT}}]},
        ['{"a":1}', "{}"],
        ['{"a":1,"b":"x"}', '{"b":"x"}'],
    ),
    "oneOf of different types": (
        {"oneOf": [SMALL_INT, SHORT, {"type": "null"}]},
        ["7", '"ab"', "null"],
        ["10", "true", '"abcde"'],
    ),
    "oneOf with a discriminator": (
        Owner.model_json_schema(),
        ['{"animal":{"pet":"cat","lives":3}}', '{"animal":{"pet":"dog","good":false}}'],
        ['{"animal":{"pet":"cat","good":false}}', '{"animal":{"pet":"dog","lives":3}}'],
    ),
    "oneOf with keywords beside it": (
        {"type": "object", "properties": {"n": SMALL_INT}, "required": ["n"],
         "oneOf": [{"properties": {"n": {"const": 0}}}, {"properties": {"n": {"enum": [8, 9, 10]}}}]},
        ['{"n":0}', '{"n":9}'],
        ['{"n":5}', '{"n":10}'],
    ),
    "anyOf with keywords beside it": (
        {"type": "string", "anyOf": [{"pattern": "^a{1,3}$"}, {"pattern": "^b{1,3}$"}, {"type": "null"}]},
        ['"a"', '"bbb"'],
        ['"aaaa"', '"ab"', "null"],
    ),
    "enum with keywords beside it": (
        {"type": "string", "enum": ["red", 1, None, "blue"]},
        ['"red"', '"blue"'],
        ["1", "null"],
    ),
    "const with an enum beside it": (
        {"const": "x", "enum": ["x", "y"]},
        ['"x"'],
        ['"y"'],
    ),
    "$ref with keywords beside it": (
        {"$defs": {"P": {"type": "object", "properties": {"x": SMALL_INT}}},
         "$ref": "#/$defs/P", "required": ["x"]},
        ['{"x":4}'],
        ["{}"],
    ),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_grammar_allows_exactly_the_valid_texts(name):
    schema, good, bad = EXACT[name]
    pattern = grammars.json_schema(schema).pattern
    for text in good:
        jsonschema.validate(json.loads(text), schema)  # the test's own premise
        assert re.fullmatch(pattern, text), (name, text)
    for text in bad:
        assert not re.fullmatch(pattern, text), (name, text)


@functools.cache
def constraint(name: str) -> grammars.JsonSchema:
    return grammars.json_schema(EXACT[name][0])


@pytest.mark.parametrize("name", sorted(EXACT))
def test_guided_outputs_validate(name):
    """Every output that ends with EOS validates against its schema (outlines-core alone concatenates allOf parts)."""
    lm = tiny_lm("llama")
    for prompt in ("Give me", '{"a": '):
        for sampling in (dict(), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)):
            result = decoders.generate(lm, prompt, strategy="guided", grammar=constraint(name), max_new_tokens=80,
                                       **sampling)
            assert result.finish_reason == "eos", f"{name}: the grammar did not finish: {result.text!r}"
            jsonschema.validate(json.loads(result.text), EXACT[name][0])


@pytest.mark.parametrize("keyword", ["enum", "anyOf", "oneOf"])
def test_empty_lists_have_no_value(keyword):
    with pytest.raises(grammars.GrammarError, match=f"no value can satisfy '{keyword}': \\[\\] at #"):
        grammars.json_schema({keyword: []})
    nested = {"type": "object", "properties": {"a": {keyword: []}}, "required": ["a"]}
    with pytest.raises(grammars.GrammarError, match=f"no value can satisfy '{keyword}'.* at #/properties/a"):
        grammars.json_schema(nested)


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"allOf": []}, ["'allOf' must be a non-empty list"]),
        ({"allOf": [{"type": "integer"}, {"type": "string"}]}, ["no value can satisfy 'allOf'", "do not meet"]),
        ({"allOf": [{"enum": [1, 2]}, {"enum": [3]}]}, ["no value can satisfy 'allOf'", "share no value"]),
        ({"allOf": [{"type": "object", "properties": {"a": SMALL_INT}, "additionalProperties": False},
                    {"properties": {"b": SHORT}, "required": ["b"]}]}, ["no value can satisfy 'allOf'", "'b'"]),
        ({"allOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]},
         ["'allOf'", "'pattern'"]),
        ({"allOf": [{"properties": {"a": {"type": "string", "format": "date"}}},
                    {"properties": {"a": {"type": "string", "format": "email"}}}]},
         ["'allOf'", "'format'", "#/properties/a"]),
        ({"type": "string", "enum": [1, 2]}, ["no value can satisfy 'enum'"]),
        ({"type": "integer", "anyOf": [{"type": "string"}, {"type": "null"}]}, ["no value can satisfy 'anyOf'"]),
        ({"anyOf": [SMALL_INT], "oneOf": [SHORT]}, ["'anyOf' and 'oneOf'"]),
        ({"type": "string", "maxLength": 5, "pattern": "^[a-z]+$"}, ["'pattern' together with 'maxLength'"]),
        ({"type": "string", "pattern": "^[0-9-]+$", "format": "date"}, ["'format' together with 'pattern'"]),
    ],
)
def test_unenforceable_combinations_raise(schema, words):
    with pytest.raises(grammars.GrammarError) as error:
        grammars.json_schema(schema)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize(
    "branches",
    [
        [{"type": "integer"}, {"type": "number"}],  # 1 is both
        [SHORT, {"type": "string", "minLength": 2}],  # "ab" is both
        [{"type": "object", "properties": {"a": SMALL_INT}}, {"type": "object", "properties": {"b": SHORT}}],  # {}
        [{"enum": ["x", "y"]}, {"type": "string"}],  # "x" is both
        [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},  # k is not required in the
         {"type": "object", "properties": {"k": {"const": "b"}}}],                   # second: {"k":"a"} is both
    ],
)
def test_overlapping_one_of_raises_and_suggests_any_of(branches):
    with pytest.raises(grammars.GrammarError, match=r"'oneOf' at #: branches 0 and 1 may both match.*'anyOf'"):
        grammars.json_schema({"oneOf": branches})
