"""Prompt suites: JSONL files of prompts, one object a line, shipped in `evals/suites/` or written by users.

Each line: {"id": str, "category": str, "prompt": str, "max_new_tokens": int (optional), "schema": object (optional)}.
A `schema` (JSON schema) marks a structured-output prompt: grammar-constrained strategies (`guided`) run only there.
`all` is every shipped suite except `default`; `default` is a small mix of every category.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUITES_DIR = Path(__file__).parent / "suites"
_FIELDS = {"id": str, "category": str, "prompt": str, "max_new_tokens": int, "schema": dict}
_REQUIRED = ("id", "category", "prompt")


class SuiteError(ValueError):
    """A suite that does not exist or a line that is not a valid prompt; the message names the file and line."""


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


def load(name_or_file: str | Path) -> list[Prompt]:
    """The prompts of a shipped suite (by name) or of a user's JSONL file."""
    text = str(name_or_file)
    if text == "all":
        return [p for name in names() if name not in ("all", "default") for p in load(name)]
    if Path(text).is_file():
        return read(Path(text))
    if text in names():
        return read(SUITES_DIR / f"{text}.jsonl")
    if text.endswith(".jsonl") or "/" in text:
        raise SuiteError(f"suite file not found: {text}")
    nearest = difflib.get_close_matches(text, names(), n=1, cutoff=0.5)
    hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
    raise SuiteError(f"unknown suite {text!r}.{hint} Shipped suites: {', '.join(names())}; "
                     "or give a path to a .jsonl file")


def read(path: Path) -> list[Prompt]:
    """Parse a JSONL suite file; any bad line raises `SuiteError` with the file and line number."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        prompt = parse(line, f"{path}:{number}")
        if prompt.id in seen:
            raise SuiteError(f"{path}:{number}: duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        seen[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise SuiteError(f"{path}: the suite has no prompts")
    return prompts


def parse(line: str, where: str) -> Prompt:
    """One JSONL line as a `Prompt`; `where` ("file:line") prefixes every error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise SuiteError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise SuiteError(f"{where}: expected a JSON object like {{\"id\": ..., \"category\": ..., \"prompt\": ...}}")
    unknown = sorted(set(record) - set(_FIELDS))
    if unknown:
        raise SuiteError(f"{where}: unknown field(s) {', '.join(unknown)}; a line may have {', '.join(_FIELDS)}")
    missing = [f for f in _REQUIRED if f not in record]
    if missing:
        raise SuiteError(f"{where}: missing required field(s) {', '.join(missing)}")
    for name, kind in _FIELDS.items():
        value = record.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise SuiteError(f"{where}: field {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    if not record["prompt"].strip() or not record["id"].strip():
        raise SuiteError(f"{where}: 'id' and 'prompt' must not be empty")
    if record.get("max_new_tokens") is not None and record["max_new_tokens"] <= 0:
        raise SuiteError(f"{where}: 'max_new_tokens' must be > 0")
    return Prompt(**record)


def render(lm, prompt: Prompt, chat_template: bool = True) -> list[int]:
    """The prompt's token ids: through the tokenizer's chat template when it has one (and it is wanted)."""
    tokenizer = lm.tokenizer
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt.prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already holds any BOS
    return lm.encode(prompt.prompt)
