"""The constraints: small frozen objects that know their grammar and build a matcher for a model's tokenizer.

The regular ones (JSON schema, regex, choice) know their regex and build a `Matcher` on outlines-core; `Cfg` knows its
Lark grammar and builds a `CfgMatcher` on llguidance. Each is checked when it is made (invalid schema, regex or
grammar, unsupported schema feature), so a mistake shows up at `grammars.json_schema(...)`, not in the middle of a run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from outlines_core import Index, Vocabulary

from grammars.cfg_index import check_grammar, compile_grammar
from grammars.cfg_matcher import CfgMatcher
from grammars.errors import GrammarError
from grammars.index import compile_index
from grammars.matcher import Matcher
from grammars.protocol import GrammarMatcher
from grammars.schema import schema_regex

_RUST_META = set("\\.+*?()|[]{}^$#&-~")  # what Rust's regex_syntax::escape escapes


class Constraint:
    """Base of the constraints; the regular-language ones have `pattern` (a regex over the output text) and
    `canonical`, and build their matcher from them."""

    pattern: str
    canonical: bool

    def matcher(self, lm) -> GrammarMatcher:
        """A fresh `Matcher` for `lm` (a `decoders.LM`), on the index cached for its tokenizer and this regex."""
        return Matcher(compile_index(self.pattern, lm, self.canonical, self.describe()))

    def describe(self) -> str:
        """A short description for error messages."""
        return repr(self)


@dataclass(frozen=True)
class JsonSchema(Constraint):
    """JSON text valid under a JSON schema."""

    schema: str  # canonical JSON text of the schema
    whitespace: str | None = ""  # regex between JSON tokens: "" = compact JSON, None = outlines-core's default "[ ]?"
    canonical: bool = True  # spell text the grammar determines as the tokenizer would (see grammars.index)
    pattern: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "pattern", schema_regex(self.schema, self.whitespace))
        _check_regex(self.pattern, self.describe())

    def describe(self) -> str:
        text = self.schema if len(self.schema) <= 80 else self.schema[:77] + "..."
        return f"json_schema({text})"


@dataclass(frozen=True)
class Regex(Constraint):
    """Text that fully matches a regex (Rust `regex` syntax, as outlines-core reads it)."""

    regex: str
    canonical: bool = True
    pattern: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.regex, str):
            raise GrammarError(f"regex() takes a pattern string, got {type(self.regex).__name__}")
        object.__setattr__(self, "pattern", self.regex)
        _check_regex(self.pattern, self.describe())

    def describe(self) -> str:
        return f"regex({self.regex!r})"


@dataclass(frozen=True)
class Choice(Constraint):
    """Exactly one of a list of strings."""

    options: tuple[str, ...]
    canonical: bool = True
    pattern: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.options, str) or not self.options or not all(isinstance(o, str) for o in self.options):
            raise GrammarError(f"choice() takes a non-empty list of strings, got {self.options!r}")
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "pattern", "(" + "|".join(escape(o) for o in self.options) + ")")
        _check_regex(self.pattern, self.describe())

    def describe(self) -> str:
        return f"choice({list(self.options)!r})"


@dataclass(frozen=True)
class Cfg(Constraint):
    """Text in the language of a context-free grammar, in Lark syntax as llguidance reads it (rule `start` first).

    Not a regular language, so no `pattern`; forced tokens follow llguidance's canonical fast-forward (see
    `grammars.cfg_index`), so no `canonical` switch either.
    """

    grammar: str

    def __post_init__(self):
        if not isinstance(self.grammar, str):
            raise GrammarError(f"cfg() takes the grammar's text, got {type(self.grammar).__name__}")
        check_grammar(self.grammar, self.describe())

    def matcher(self, lm) -> CfgMatcher:
        """A fresh `CfgMatcher` for `lm` (a `decoders.LM`), on the grammar compiled for its tokenizer and cached."""
        return CfgMatcher(compile_grammar(self.grammar, lm, self.describe()))

    def describe(self) -> str:
        text = " ".join(self.grammar.split())
        return f"cfg({text if len(text) <= 60 else text[:57] + '...'!r})"


def escape(text: str) -> str:
    """`text` as a regex that matches it literally (Rust regex syntax)."""
    return "".join("\\" + c if c in _RUST_META else c for c in text)


@functools.lru_cache(maxsize=64)
def _check_regex(pattern: str, describe: str) -> None:
    """Compile `pattern` over a vocabulary of the 256 single bytes: catches syntax errors and unsupported features."""
    try:
        Index(pattern, _byte_vocabulary())
    except ValueError as error:
        message = str(error)
        if "error building NFA" in message or "Failed to build DFA" in message:
            detail = _python_regex_error(pattern)
            message = f"{message}{'; ' + detail if detail else ''}"
            raise GrammarError(f"invalid or unsupported regex in {describe}: {message}") from None
        raise GrammarError(f"{describe} matches no text: {message}") from None


@functools.cache
def _byte_vocabulary() -> Vocabulary:
    return Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def _python_regex_error(pattern: str) -> str | None:
    """A friendlier syntax error from the `regex` package, when it agrees the pattern is broken."""
    try:
        import regex

        regex.compile(pattern)
    except ImportError:
        return None
    except Exception as error:  # noqa: BLE001 - any compile error is the message we want
        return str(error)
    return None
