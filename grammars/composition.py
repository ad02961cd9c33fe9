"""JSON-schema composition rewritten into what outlines-core enforces exactly: `allOf`, `oneOf`, and the keywords
beside `anyOf` / `oneOf` / `$ref` / `enum` / `const`.

outlines-core reads one keyword per schema node: `allOf` parts are concatenated (two objects give `{...}{...}`),
`oneOf` is read as `anyOf`, the keywords beside the one it picks are dropped, and an empty `enum` / `anyOf` / `oneOf`
matches the empty text. `Composer.normalize` rewrites one node so that the keyword outlines-core reads says it all:

- `allOf` (and `$ref` beside other keywords): the parts and the node's own keywords merged into one schema, keyword
  by keyword: properties and required united, bounds tightened, types and enums intersected. Two different values of
  any other keyword (two patterns, say) raise a `GrammarError` naming `allOf`.
- `anyOf` / `oneOf` beside other keywords: those keywords merged into every branch; a branch nothing satisfies is
  dropped.
- `oneOf`: kept only where no value can match two branches (different types, disjoint const / enum values, or a
  property both require whose schemas are disjoint, such as a const discriminator); else a `GrammarError` that
  suggests `anyOf`.
- `enum` / `const` beside other keywords: reduced to the values those keywords accept (checked with jsonschema).
- An empty `enum` / `anyOf` / `oneOf`, or parts that no value satisfies together: "no value can satisfy ...".
"""

from __future__ import annotations

import itertools

import jsonschema
import referencing.exceptions

from grammars.errors import GrammarError

# Keywords that do not constrain a value (or, like $defs, only hold schemas for $ref): never merged or distributed.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "$id",
        "$defs",
        "definitions",
        "deprecated",
        "readOnly",
        "writeOnly",
        "discriminator",
    }
)
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")  # merged: the largest wins
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")  # merged: the smallest wins
_OBJECT = ("properties", "required", "additionalProperties")  # merged together, part by part
_DEPTH = 16  # $ref chains and nested disjointness checks followed at most this deep


class Unsatisfiable(GrammarError):
    """No value satisfies the schema (an empty enum, types that do not meet, a required property forbidden...)."""


class Composer:
    """Rewrites the nodes of one schema document (`root`, which `$ref`s point into)."""

    def __init__(self, root) -> None:
        self.root = root
        kind = jsonschema.validators.validator_for(root if isinstance(root, dict) else {})
        self._validator = kind(root, format_checker=kind.FORMAT_CHECKER)  # resolves $refs against root

    def normalize(self, node: dict, where: str) -> dict:
        """`node` rewritten so that outlines-core's reading of it is exact (see the module docstring)."""
        for key in ("enum", "anyOf", "oneOf", "allOf"):
            if key in node and not isinstance(node[key], list):
                raise GrammarError(f"invalid JSON schema at {where}: {key!r} must be a list, got {node[key]!r}")
            if key in node and not node[key]:
                if key == "allOf":
                    raise GrammarError(f"invalid JSON schema at {where}: 'allOf' must be a non-empty list")
                raise Unsatisfiable(f"no value can satisfy {key!r}: [] at {where}")
        if "allOf" in node or ("$ref" in node and constraints(node).keys() - {"$ref"}):
            node = self.merge([node], where)
        if "anyOf" in node and "oneOf" in node:
            raise GrammarError(f"unsupported JSON schema at {where}: 'anyOf' and 'oneOf' in one schema")
        for key in ("anyOf", "oneOf"):
            if key in node:
                branches = self._branches(node, key, where)
                if key == "oneOf":
                    self._check_exclusive(branches, where)
                node = {**annotations(node), key: [branch for _, branch in branches]}
        if "enum" in node or "const" in node:
            node = self._values_only(node, where)
        return node

    def merge(self, parts: list, where: str) -> dict:
        """One schema that accepts exactly the values every one of `parts` accepts (an `allOf`)."""
        try:
            flat = [p for part in parts for p in self._flatten(part, where, 0)]
            merged = self._merge_objects(flat, where)
            for part in flat:
                for key, value in part.items():
                    if key in _OBJECT:
                        continue
                    merged[key] = value if key not in merged else self._merge_keyword(key, merged[key], value, where)
        except Unsatisfiable as error:
            if str(error).startswith("no value can satisfy"):
                raise
            raise Unsatisfiable(f"no value can satisfy 'allOf' at {where}: {error}") from None
        return merged

    def disjoint(self, a, b, depth: int = 0) -> bool:
        """True if provably no value satisfies both schemas (False: some may, or it cannot be told)."""
        a, b = self._resolve(a, depth), self._resolve(b, depth)
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict) or depth > _DEPTH:
            return False
        for one, other in ((a, b), (b, a)):
            values = [one["const"]] if "const" in one else one.get("enum")
            if isinstance(values, list) and not any(self._maybe_accepts(other, v) for v in values):
                return True
        types_a, types_b = _types(a), _types(b)
        if types_a is not None and types_b is not None and not _type_meet(sorted(types_a), sorted(types_b)):
            return True
        if types_a == types_b == {"object"}:  # a property both require, with disjoint schemas (a discriminator)
            common = [n for n in a.get("required", []) if n in b.get("required", [])]
            own_a, own_b = a.get("properties", {}), b.get("properties", {})
            return any(n in own_a and n in own_b and self.disjoint(own_a[n], own_b[n], depth + 1) for n in common)
        return False

    def accepts(self, schema, value) -> bool:
        """True if `value` is valid under `schema` (a node of this document: its `$ref`s resolve against it)."""
        try:
            return self._validator.evolve(schema=schema).is_valid(value)
        except referencing.exceptions.Unresolvable as error:
            raise GrammarError(f"invalid JSON schema: cannot resolve $ref {error.ref!r}") from None

    # ------------------------------------------------------------------------------------------------ internals

    def _flatten(self, part, where: str, depth: int) -> list[dict]:
        """The plain parts of `part`: `$ref`s resolved, nested `allOf`s spread out, `true` / `{}` left out."""
        if part is True:
            return []
        if part is False:
            raise Unsatisfiable("a part is the schema false")
        if not isinstance(part, dict):
            raise GrammarError(f"invalid JSON schema at {where}: an 'allOf' part must be a schema, got {part!r}")
        if depth > _DEPTH:
            raise GrammarError(f"unsupported JSON schema at {where}: $ref / allOf nested more than {_DEPTH} deep")
        rest = {k: v for k, v in part.items() if k not in ("allOf", "$ref")}
        inner = list(part.get("allOf", []))
        if "$ref" in part:
            inner.insert(0, self._target(part["$ref"], where))
        return ([rest] if rest else []) + [p for sub in inner for p in self._flatten(sub, where, depth + 1)]

    def _merge_objects(self, parts: list[dict], where: str) -> dict:
        """The merged `properties`, `required` and `additionalProperties`: a property follows every part's rule for it
        (its schema there, else that part's additionalProperties); one forbidden by some part is left out, or, if
        required, makes the merge unsatisfiable."""
        if not any(key in part for part in parts for key in _OBJECT):
            return {}
        required = _ordered(name for part in parts for name in part.get("required", []))
        names = _ordered(itertools.chain((n for part in parts for n in part.get("properties", {})), required))
        properties = {}
        for name in names:
            rules = [_rule(part, name) for part in parts]
            try:
                if any(rule is False for rule in rules):
                    raise Unsatisfiable(f"property {name!r} is forbidden by one part")
                schemas = [rule for rule in rules if rule is not True] or [{}]
                properties[name] = (
                    schemas[0] if len(schemas) == 1 else self.merge(schemas, f"{where}/properties/{name}")
                )
            except Unsatisfiable:
                if name in required:
                    raise
        out: dict = {"properties": properties}
        if required:
            out["required"] = required
        extra = [part["additionalProperties"] for part in parts if "additionalProperties" in part]
        if extra and False in extra:
            out["additionalProperties"] = False
        elif extra:
            out["additionalProperties"] = (
                extra[0] if len(extra) == 1 else self.merge(extra, f"{where}/additionalProperties")
            )
        return out

    def _merge_keyword(self, key: str, a, b, where: str):
        """The value of `key` in a merge of two parts that both give it."""
        if a == b or key in ANNOTATIONS:
            return a
        if key in _LOWER + _UPPER and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
            return max(a, b) if key in _LOWER else min(a, b)
        if key == "type":
            common = _type_meet(_type_set(a), _type_set(b))
            if not common:
                raise Unsatisfiable(f"types {a!r} and {b!r} do not meet")
            return common[0] if len(common) == 1 else common
        if key == "enum":
            common = [v for v in a if self.accepts({"enum": b}, v)]
            if not common:
                raise Unsatisfiable(f"enums {a!r} and {b!r} share no value")
            return common
        if key == "const":
            if not self.accepts({"const": b}, a):
                raise Unsatisfiable(f"consts {a!r} and {b!r} differ")
            return a
        if key in ("items", "additionalItems"):
            return self.merge([a, b], f"{where}/{key}")
        raise GrammarError(
            f"unsupported JSON schema at {where}: 'allOf' parts give {key!r} different values ({a!r} and {b!r}), which "
            "the grammar backend cannot combine; merge them by hand"
        )

    def _branches(self, node: dict, key: str, where: str) -> list[tuple[int, object]]:
        """The branches of an `anyOf` / `oneOf` node with their indices, and with the keywords beside them merged into
        each (outlines-core drops those); a branch nothing satisfies is left out."""
        beside = {k: v for k, v in constraints(node).items() if k != key}
        if not beside:
            return list(enumerate(node[key]))
        branches = []
        for i, branch in enumerate(node[key]):
            try:
                branches.append((i, self.merge([beside, branch], f"{where}/{key}/{i}")))
            except Unsatisfiable:
                continue  # no value satisfies this branch: it never matches
        if not branches:
            raise Unsatisfiable(
                f"no value can satisfy {key!r} at {where}: no branch agrees with the keywords beside it"
            )
        return branches

    def _check_exclusive(self, branches: list[tuple[int, object]], where: str) -> None:
        """Raise unless no value can satisfy two of the `oneOf` branches (outlines-core would allow either)."""
        for (i, a), (j, b) in itertools.combinations(branches, 2):
            if not self.disjoint(a, b):
                raise GrammarError(
                    f"unsupported JSON schema feature 'oneOf' at {where}: branches {i} and {j} may both match one "
                    "value, and the grammar backend (outlines-core) cannot exclude a value that matches two; use "
                    "'anyOf' if that is fine, or make the branches exclusive (different types, different const or "
                    "enum values, or a required property with a different const in each)"
                )

    def _values_only(self, node: dict, where: str) -> dict:
        """An `enum` / `const` node reduced to the values the keywords beside it accept (outlines-core drops them)."""
        key = "const" if "const" in node else "enum"
        values = [node["const"]] if key == "const" else node["enum"]
        beside = {k: v for k, v in constraints(node).items() if k != key}
        if not beside:
            return node
        kept = [v for v in values if self.accepts(beside, v)]
        if not kept:
            raise Unsatisfiable(
                f"no value can satisfy {key!r} at {where}: none of {values!r} satisfies the keywords "
                f"beside it ({', '.join(beside)})"
            )
        return {**annotations(node), key: kept[0] if key == "const" else kept}

    def _target(self, ref, where: str):
        """The schema a local `$ref` ("#/$defs/Name") points to."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"unsupported JSON schema at {where}: only local $refs ('#/...') can be merged: {ref!r}")
        node = self.root
        for step in filter(None, ref[1:].split("/")):
            step = step.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and step.isdigit() and int(step) < len(node):
                node = node[int(step)]
            elif isinstance(node, dict) and step in node:
                node = node[step]
            else:
                raise GrammarError(f"invalid JSON schema at {where}: $ref {ref!r} points to nothing")
        return node

    def _resolve(self, schema, depth: int):
        """`schema`, or what a `$ref` with nothing but annotations beside it points to (followed along a chain)."""
        for _ in range(_DEPTH - depth):
            if not (isinstance(schema, dict) and "$ref" in schema and constraints(schema).keys() == {"$ref"}):
                break
            try:
                schema = self._target(schema["$ref"], "#")
            except GrammarError:
                break
        return schema

    def _maybe_accepts(self, schema, value) -> bool:
        try:
            return self.accepts(schema, value)
        except GrammarError:
            return True  # cannot tell: assume it may


def constraints(node: dict) -> dict:
    """The keywords of `node` that constrain a value."""
    return {k: v for k, v in node.items() if k not in ANNOTATIONS}


def annotations(node: dict) -> dict:
    """The keywords of `node` that do not constrain a value."""
    return {k: v for k, v in node.items() if k in ANNOTATIONS}


def _rule(part: dict, name: str):
    """What `part` asks of property `name`: its schema, False (forbidden) or True (anything)."""
    if name in part.get("properties", {}):
        rule = part["properties"][name]
    else:
        rule = part.get("additionalProperties", True)
    return True if rule == {} else rule


def _ordered(names) -> list:
    return list(dict.fromkeys(names))


def _type_set(kind) -> list[str]:
    return [kind] if isinstance(kind, str) else list(kind)


def _type_meet(a: list[str], b: list[str]) -> list[str]:
    """The JSON types in both lists (an integer is a number)."""
    out = [t for t in a if t in b or (t == "integer" and "number" in b)]
    return _ordered(out + (["integer"] if "number" in a and "integer" in b else []))


def _types(schema: dict) -> set[str] | None:
    """The JSON types a schema allows, from `type` or its const / enum values (None: any type)."""
    if "type" in schema:
        return set(_type_set(schema["type"]))
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(values, list):
        return None
    names = {
        bool: "boolean",
        type(None): "null",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }
    return {names.get(type(v), "object") for v in values}
