"""Prompt suites: JSONL files of prompts, one object a line, shipped in `evals/suites/` or written by users.

Three formats; the file's first line decides which one the whole file is read as:
- decodekit: {"id": str, "category": str, "prompt": str, "max_new_tokens": int (optional), "schema": object (optional)}.
  Strict: any other field is an error (most likely a typo). A line with both `id` and `category` is this format.
- Spec-Bench / MT-Bench `question.jsonl`: {"question_id": int | str, "category": str, "turns": [str, ...], ...}.
  The first turn is the prompt; other fields (`reference`, ...) are ignored.
- plain: {"prompt": str, ...}. `id` defaults to f"{file stem}-{line}", `category` to the file stem; `max_new_tokens`
  and `schema` are read as above; other fields are ignored.
A `schema` (JSON schema) marks a structured-output prompt: grammar-constrained strategies (`guided`) run only there.
It is checked against the JSON Schema meta-schema when the suite is read, so a bad one fails before any model loads.
`all` is every shipped suite except `default` (a small mix of every category of `all`), `mixed` (QA, translation,
summarization and math: held out, to check defaults on categories none was tuned on) and `agentic` (a session whose
later requests repeat earlier prompts and outputs: run it on its own, in order; its `regenerate` requests ask again
for code an earlier request produced, with changes, without that code in the prompt: what only a store of past
outputs can draft from).
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

SUITES_DIR = Path(__file__).parent / "suites"
NOT_IN_ALL = ("default", "agentic", "mixed")
_FIELDS = {"id": str, "category": str, "prompt": str, "max_new_tokens": int, "schema": dict}
_REQUIRED = ("id", "category", "prompt")


class SuiteError(ValueError):
    """A suite that does not exist or a line that is not a valid prompt; the message names the file and line."""


class _Bad(ValueError):
    """What is wrong with one line; `read` adds the file, the line and the format."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a suite."""

    id: str  # unique within the suite
    category: str  # groups prompts in the per-category tables (code, edit, rag, prose, json, article ...)
    prompt: str  # the user's message (the chat template is applied when the model has one)
    max_new_tokens: int | None = None  # a cap below the run's --max-new-tokens
    schema: dict[str, Any] | None = None  # JSON schema of the expected output, for grammar-constrained strategies


def names() -> list[str]:
    """Names of the shipped suites (plus `all`)."""
    return sorted([p.stem for p in SUITES_DIR.glob("*.jsonl")] + ["all"])


def load(name_or_file: str | Path, limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """The prompts of a shipped suite (by name) or of a user's JSONL file, cut down by `select`."""
    text = str(name_or_file)
    if text == "all":
        prompts = [p for name in names() if name != "all" and name not in NOT_IN_ALL for p in load(name)]
    elif Path(text).is_file():
        prompts = read(Path(text))
    elif text in names():
        prompts = read(SUITES_DIR / f"{text}.jsonl")
    elif text.endswith(".jsonl") or "/" in text:
        raise SuiteError(f"suite file not found: {text}")
    else:
        nearest = difflib.get_close_matches(text, names(), n=1, cutoff=0.5)
        hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
        raise SuiteError(
            f"unknown suite {text!r}.{hint} Shipped suites: {', '.join(names())}; or give a path to a .jsonl file"
        )
    return select(prompts, limit, per_category)


def select(prompts: list[Prompt], limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """A deterministic subset, in suite order: the first `per_category` of each category, then the first `limit`."""
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SuiteError(f"{name} must be a whole number >= 1, got {value!r}")
    if per_category is not None:
        taken: Counter[str] = Counter()  # prompts kept so far, by category
        kept = []
        for prompt in prompts:
            if taken[prompt.category] < per_category:
                taken[prompt.category] += 1
                kept.append(prompt)
        prompts = kept
    return prompts[:limit]


def read(path: Path) -> list[Prompt]:
    """Parse a JSONL suite file; any bad line raises `SuiteError` with the file, the line number and the format."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    form, first = None, 0  # the file's format, and the line it was detected on
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise SuiteError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if form is None:
            form, first = _detect(record, where), number
        try:
            if not isinstance(record, dict):
                raise _Bad(f"expected a JSON object like {form.shape}")
            prompt = form.read(record, path.stem or "default", number)
            if prompt.id in seen:
                raise _Bad(f"duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        except _Bad as problem:
            raise SuiteError(f"{where}: {problem} (read as {form.name}, detected from line {first})") from None
        seen[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise SuiteError(f"{path}: the suite has no prompts")
    return prompts


# ---------------------------------------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class Format:
    """A suite file format: how errors name it, what a line looks like, and how a line becomes a `Prompt`."""

    name: str
    shape: str  # a line of this format, for error messages
    read: Callable[[dict, str, int], Prompt]  # (record, file stem, line number) -> Prompt; raises _Bad


def _decodekit(record: dict, stem: str, number: int) -> Prompt:
    unknown = sorted(set(record) - set(_FIELDS))
    if unknown:
        raise _Bad(f"unknown field(s) {', '.join(unknown)}; a line may have {', '.join(_FIELDS)}")
    missing = [f for f in _REQUIRED if f not in record]
    if missing:
        raise _Bad(f"missing required field(s) {', '.join(missing)}")
    return _checked(record)


def _question(record: dict, stem: str, number: int) -> Prompt:
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise _Bad("'turns' must be a list of strings (the first one is the prompt)")
    question_id = record.get("question_id", f"{stem}-{number}")
    if not isinstance(question_id, (str, int)) or isinstance(question_id, bool):
        raise _Bad(f"field 'question_id' must be an int or a str, got {type(question_id).__name__}")
    return _checked({"id": str(question_id), "category": record.get("category", stem), "prompt": turns[0]})


def _plain(record: dict, stem: str, number: int) -> Prompt:
    if "prompt" not in record:
        raise _Bad("missing required field 'prompt'")
    given = {name: value for name, value in record.items() if name in _FIELDS and value is not None}
    return _checked({"id": f"{stem}-{number}", "category": stem} | given)


def _checked(fields: dict) -> Prompt:
    """The `Prompt` of a line's decodekit fields, after checking their types and values."""
    for name, kind in _FIELDS.items():
        value = fields.get(name)
        if value is None and name not in _REQUIRED:
            continue
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _Bad(f"field {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    if not fields["prompt"].strip() or not fields["id"].strip():
        raise _Bad("'id' and 'prompt' must not be empty")
    if fields.get("max_new_tokens") is not None and fields["max_new_tokens"] <= 0:
        raise _Bad("'max_new_tokens' must be > 0")
    if fields.get("schema") is not None:
        _check_schema(fields["schema"])
    return Prompt(**fields)


def _check_schema(schema: dict) -> None:
    """Raise `_Bad` unless `schema` is a valid JSON Schema (of its `$schema` draft, else of the latest one)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        at = f" (at {error.json_path})" if error.path else ""
        raise _Bad(f"schema: {error.message}{at}") from None


DECODEKIT = Format("a decodekit suite", '{"id": ..., "category": ..., "prompt": ...}', _decodekit)
QUESTION = Format(
    "a Spec-Bench/MT-Bench question.jsonl", '{"question_id": ..., "category": ..., "turns": [...]}', _question
)
PLAIN = Format("a plain prompt JSONL", '{"prompt": ...}', _plain)


def _detect(record: Any, where: str) -> Format:
    """The format of a file, from its first line."""
    keys = set(record) if isinstance(record, dict) else set()
    if "turns" in keys or "question_id" in keys:
        return QUESTION
    if {"id", "category"} <= keys or not isinstance(record, dict):
        return DECODEKIT
    if "prompt" in keys:
        return PLAIN
    raise SuiteError(
        f"{where}: not a line of a known suite format; expected {DECODEKIT.name} {DECODEKIT.shape}, "
        f"{QUESTION.name} {QUESTION.shape} or {PLAIN.name} {PLAIN.shape}"
    )


def render(lm, prompt: Prompt, chat_template: bool = True) -> list[int]:
    """The prompt's token ids: through the tokenizer's chat template when it has one (and it is wanted)."""
    tokenizer = lm.tokenizer
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already holds any BOS
    return lm.encode(prompt.prompt)
