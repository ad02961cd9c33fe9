"""Grammar constraints (JSON schema, regex, choice, context-free grammar) as matchers with explicit advance / rollback.

    import decoders, grammars
    result = decoders.generate(lm, prompt, strategy="guided", grammar=grammars.json_schema(Character))

A constraint is a small frozen object; `constraint.matcher(lm)` gives a matcher for one run. The regular constraints
(`json_schema`, `regex`, `choice`) give a `Matcher` on an outlines-core index of their regex over the tokenizer's
vocabulary; `cfg` gives a `CfgMatcher` on an llguidance parser of its Lark grammar. Both are built once per tokenizer
and constraint, then cached. Both follow `GrammarMatcher`, the protocol a decoding loop relies on: a matcher answers
`allowed()` (a mask over the logits), `forced()` (the tokens the grammar alone determines), `is_finished()`,
`is_complete()` and `masks_along(tokens)`, gives an independent copy with `fork()`, and moves only by `advance(tokens)`
and `rollback(n)`.
"""

from __future__ import annotations

from collections.abc import Iterable

from grammars import cfg_index as _cfg_index
from grammars import index as _index
from grammars.cfg_matcher import CfgMatcher
from grammars.constraints import Cfg, Choice, Constraint, JsonSchema, Regex
from grammars.errors import GrammarError
from grammars.matcher import Matcher
from grammars.protocol import GrammarMatcher
from grammars.schema import schema_text

__all__ = [
    "json_schema",
    "regex",
    "choice",
    "cfg",
    "Constraint",
    "JsonSchema",
    "Regex",
    "Choice",
    "Cfg",
    "GrammarMatcher",
    "Matcher",
    "CfgMatcher",
    "GrammarError",
    "clear_cache",
]


def json_schema(schema, *, whitespace: str | None = "", canonical: bool = True) -> JsonSchema:
    """JSON valid under `schema`: a pydantic model class, a dict or a JSON string.

    `whitespace` is the regex allowed between JSON tokens: "" (default) gives compact JSON, whose keys and punctuation
    the grammar fully determines (forced, no model call); None uses outlines-core's default, an optional space.
    """
    return JsonSchema(schema_text(schema), whitespace=whitespace, canonical=canonical)


def regex(pattern: str, *, canonical: bool = True) -> Regex:
    """Text that fully matches `pattern` (Rust regex syntax: no look-around, no back-references)."""
    return Regex(pattern, canonical=canonical)


def choice(options: Iterable[str], *, canonical: bool = True) -> Choice:
    """Exactly one of `options`."""
    if isinstance(options, str) or not isinstance(options, Iterable):
        raise GrammarError(f"choice() takes a list of strings, got {options!r}")
    return Choice(tuple(options), canonical=canonical)


def cfg(grammar: str) -> Cfg:
    """Text in the language of a context-free grammar written in Lark syntax, as llguidance reads it.

    Unlike a regex, a grammar can nest: balanced brackets, arithmetic, code. Rule `start` is the whole output:

        grammars.cfg('''
            start: expr
            expr: term (("+" | "-") term)*
            term: NUMBER | "(" expr ")"
            NUMBER: /[0-9]+/
        ''')

    Rules are lowercase, terminals (lexemes, matched by regex) uppercase; `%ignore`, `%import common.X` and llguidance's
    extensions (`%json {...}` schemas, `<|special|>` tokens) work too. An invalid grammar raises `GrammarError` with
    llguidance's message.

    Forced tokens are llguidance's fast-forward tokens: where the grammar determines the next text, only the first
    token of the tokenizer's own spelling of it is allowed (canonical, like the regular constraints' default), except
    near the end of that text, where a longer token could reach past it and every spelling stays allowed.
    """
    return Cfg(grammar)


def clear_cache() -> None:
    """Forget every compiled index and grammar (for tests and memory)."""
    _index.clear_cache()
    _cfg_index.clear_cache()
