"""Grammar constraints (JSON schema, regex, choice) as matchers with explicit advance / rollback, on outlines-core.

    import decoders, grammars
    result = decoders.generate(lm, prompt, strategy="guided", grammar=grammars.json_schema(Character))

A constraint is a small frozen object; `constraint.matcher(lm)` gives a `Matcher` for one run, built on an index of
the constraint's regex over the tokenizer's vocabulary (built once per tokenizer and regex, then cached). The matcher
answers `allowed()` (a mask over the logits), `forced()` (the tokens the grammar alone determines), `is_finished()`,
`is_complete()` and `masks_along(tokens)`, and moves only by `advance(tokens)` and `rollback(n)`.

Context-free grammars need a backend that the installed outlines-core lacks: `cfg()` says so.
"""

from __future__ import annotations

from collections.abc import Iterable

from grammars.constraints import Choice, Constraint, JsonSchema, Regex
from grammars.errors import GrammarError
from grammars.index import clear_cache
from grammars.matcher import Matcher
from grammars.schema import schema_text

__all__ = [
    "json_schema", "regex", "choice", "cfg",
    "Constraint", "JsonSchema", "Regex", "Choice", "Matcher", "GrammarError", "clear_cache",
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


def cfg(grammar: str):
    """A context-free grammar (Lark syntax) - not available: the installed backend handles regular languages only."""
    raise NotImplementedError(
        "grammars.cfg() needs a context-free-grammar backend, and none is installed: outlines-core (the backend "
        "here) compiles regular languages only (JSON schema, regex, choice), and outlines' CFG support goes through "
        "the llguidance or xgrammar packages, which decodekit does not depend on. Use grammars.regex() or "
        "grammars.json_schema() where the language is regular."
    )
