"""JSON schema -> regex, through outlines-core, with numeric bounds added and silently-ignored keywords refused.

outlines-core's `build_regex_from_schema` drops some keywords without a word (`minimum`, `multipleOf`,
`uniqueItems` ...), which would let outputs violate the schema. Bounds are supported here: each bounded integer or
number is swapped for a placeholder constant, and the placeholder in the regex for a range regex (grammars/numbers.py).
Composition (`allOf`, `oneOf`, keywords beside `anyOf` / `enum` ...) is rewritten first (grammars/composition.py).
The other keywords raise a `GrammarError` that names them and where they are.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from decimal import Decimal

from outlines_core.json_schema import build_regex_from_schema

from grammars.composition import Composer
from grammars.errors import GrammarError
from grammars.numbers import integer_range, number_range

# Keywords outlines-core would ignore, each with the value for which ignoring it is harmless (None: never harmless).
_IGNORED = {
    "multipleOf": None,
    "uniqueItems": False,
    "patternProperties": None,
    "propertyNames": None,
    "dependentRequired": None,
    "dependentSchemas": None,
    "dependencies": None,
    "contains": None,
    "minContains": None,
    "maxContains": None,
    "unevaluatedProperties": None,
    "unevaluatedItems": None,
    "maxProperties": None,
    "not": None,
    "if": None,
    "then": None,
    "else": None,
}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Keywords whose values are schemas (or lists / maps of schemas): where the walk goes on.
_SCHEMA = ("items", "additionalProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_MARKER = "dkRange{}n{}"  # a placeholder constant (a nonce, a number); its quoted form becomes the range regex


def schema_text(schema) -> str:
    """The schema as canonical JSON text, from a pydantic model class, a dict or a JSON string."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    elif isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise GrammarError(f"invalid JSON schema: not valid JSON ({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(
            f"json_schema() takes a pydantic model class, a dict or a JSON string, got {type(schema).__name__}"
        )
    return json.dumps(schema)  # key order kept: properties are generated in the order the schema lists them


def schema_regex(text: str, whitespace: str | None) -> str:
    """The regex of every JSON text that the schema `text` accepts (`whitespace`: the pattern between tokens)."""
    schema = json.loads(text)
    nonce = next(n for n in itertools.count() if f"dkRange{n}n" not in text)  # never a string of the user's schema
    ranges = _Walk(Composer(schema), nonce)
    prepared = _prepare(schema, "#", ranges)
    try:
        regex = build_regex_from_schema(json.dumps(prepared), whitespace)
    except (ValueError, TypeError) as error:
        raise GrammarError(f"unsupported or invalid JSON schema: {error}".rstrip()) from None
    for i, range_regex in enumerate(ranges.regexes):  # a placeholder only in an unused $defs entry is not in it
        regex = regex.replace('"' + _MARKER.format(nonce, i) + '"', f"({range_regex})")
    if f"dkRange{nonce}n" in regex:
        raise GrammarError("internal error: a range placeholder is left in the schema's regex")
    return regex


@dataclass
class _Walk:
    """What the walk over one schema carries: the composer of its document, the range regexes found so far."""

    composer: Composer
    nonce: int
    regexes: list[str] = field(default_factory=list)


def _prepare(node, where: str, ranges: _Walk):
    """A copy of the schema with composition rewritten and numeric bounds replaced by placeholders; raises on keywords
    that would be ignored."""
    if not isinstance(node, dict):
        return node
    node = ranges.composer.normalize(node, where)
    for key, harmless in _IGNORED.items():
        if key in node and node[key] != harmless and not (key == "maxProperties" and _max_ok(node)):
            raise GrammarError(
                f"unsupported JSON schema feature {key!r} at {where}: the grammar backend (outlines-core) cannot "
                "enforce it, so outputs could violate the schema; remove it or validate afterwards"
            )
    if key := _min_properties_problem(node):
        raise GrammarError(f"unsupported JSON schema feature 'minProperties' at {where}: {key}")
    if problem := _string_problem(node):
        raise GrammarError(f"unsupported JSON schema at {where}: {problem}")
    if any(b in node for b in _BOUNDS):
        return _bounded(node, where, ranges)
    out = dict(node)
    for key in _SCHEMA:
        if isinstance(node.get(key), dict):
            out[key] = _prepare(node[key], f"{where}/{key}", ranges)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_prepare(s, f"{where}/{key}/{i}", ranges) for i, s in enumerate(node[key])]
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: _prepare(s, f"{where}/{key}/{name}", ranges) for name, s in node[key].items()}
    return out


def _bounded(node: dict, where: str, ranges: _Walk) -> dict:
    """A placeholder constant for an integer or number schema with bounds, its range regex appended to `ranges`."""
    kind = node.get("type")
    if isinstance(kind, list):  # e.g. ["integer", "null"]: one branch per type, the bounds on the numeric ones
        rest = {k: v for k, v in node.items() if k != "type"}
        return _prepare({"anyOf": [dict(rest, type=t) for t in kind]}, where, ranges)
    if kind not in ("integer", "number"):
        if kind is None:
            raise GrammarError(
                f'unsupported JSON schema at {where}: numeric bounds without "type": "integer" or "number"'
            )
        return _prepare({k: v for k, v in node.items() if k not in _BOUNDS}, where, ranges)
    extra = sorted(set(node) - set(_BOUNDS) - {"type", "title", "description", "default", "examples", "$comment"})
    if extra:
        raise GrammarError(f"unsupported JSON schema at {where}: bounds combined with {', '.join(extra)}")
    bounds = {}
    for key in _BOUNDS:
        value = node.get(key)
        if isinstance(value, bool) or (value is not None and not isinstance(value, (int, float))):
            raise GrammarError(f"invalid JSON schema at {where}: {key} must be a number, got {value!r}")
        bounds[key] = None if value is None else Decimal(str(value))
    low, low_strict = _tighter(bounds["minimum"], bounds["exclusiveMinimum"], max)
    high, high_strict = _tighter(bounds["maximum"], bounds["exclusiveMaximum"], min)
    if kind == "integer":
        low_int = high_int = None  # the bounds as integers: 2.5 <= n means 3 <= n, 3 < n means 4 <= n
        if low is not None:
            low_int = int(low.to_integral_value("ROUND_FLOOR")) + (1 if low_strict or low % 1 else 0)
        if high is not None:
            high_int = int(high.to_integral_value("ROUND_CEILING")) - (1 if high_strict or high % 1 else 0)
        regex = integer_range(low_int, high_int)
    else:
        regex = number_range(low, high, low_strict, high_strict)
    if regex is None:
        raise GrammarError(f"invalid JSON schema at {where}: no {kind} satisfies its bounds {json.dumps(node)}")
    ranges.regexes.append(regex)
    return {"const": _MARKER.format(ranges.nonce, len(ranges.regexes) - 1)}


def _tighter(inclusive: Decimal | None, exclusive: Decimal | None, pick) -> tuple[Decimal | None, bool]:
    """The tighter of an inclusive and an exclusive bound: (value, strict)."""
    if exclusive is None:
        return inclusive, False
    if inclusive is None or pick(inclusive, exclusive) == exclusive:
        return exclusive, True
    return inclusive, False


def _max_ok(node: dict) -> bool:
    """maxProperties is harmless when the object cannot hold more properties than it allows."""
    closed = node.get("additionalProperties") is False or ("additionalProperties" not in node and "properties" in node)
    return closed and len(node.get("properties", {})) <= node["maxProperties"]


def _string_problem(node: dict) -> str | None:
    """outlines-core reads one of a string's length, `pattern` and `format`, in that order, and drops the others."""
    given = [k for k in ("minLength", "maxLength", "pattern", "format") if k in node]
    if "pattern" in given and given[0] != "pattern":
        return (
            f"'pattern' together with {given[0]!r}: the grammar backend (outlines-core) would ignore the pattern; "
            "write the length into the pattern instead (e.g. {1,10})"
        )
    if "format" in given and given[0] != "format":
        return f"'format' together with {given[0]!r}: the grammar backend (outlines-core) would ignore the format"
    return None


def _min_properties_problem(node: dict) -> str | None:
    minimum = node.get("minProperties")
    if minimum is None or len(node.get("required", [])) >= minimum:
        return None
    return f"{minimum} properties are required but only {len(node.get('required', []))} are listed in 'required'"
