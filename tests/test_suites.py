"""Prompt suites: the three file formats, subsets (limit, per_category), schema checks, and the agentic suite."""

from __future__ import annotations

import difflib
import json

import pytest

from evals import suites

SPEC_BENCH = [  # Spec-Bench question.jsonl: an MT-Bench line, then its own task categories
    {"question_id": 81, "category": "mt_bench", "turns": ["Write a travel blog post about Hawaii.", "Rewrite it."]},
    {"question_id": 81 + 80, "category": "translation", "turns": ["Translate to German: good morning"]},
    {"question_id": 241, "category": "summarization", "turns": ["Summarize: the meeting moved to Friday."]},
    {"question_id": 321, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 401, "category": "math_reasoning", "turns": ["What is 12 * 7?"]},
    {"question_id": 481, "category": "rag", "turns": ["Using the passage, answer: ..."]},
]
MT_BENCH = [  # MT-Bench lines may carry a reference answer: ignored
    {"question_id": 101, "category": "reasoning", "turns": ["Which is heavier?", "Why?"], "reference": ["Same."]},
    {"question_id": 102, "category": "writing", "turns": ["Write a haiku about rain."]},
]


def write(tmp_path, name: str, lines: list) -> str:
    """A JSONL file of `lines` (dicts are dumped, strings written as they are) in tmp_path; returns its path."""
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return str(path)


def shape(prompts: list[suites.Prompt]) -> list[tuple[str, str]]:
    return [(p.id, p.category) for p in prompts]


# ---------------------------------------------------------------------------------------------------------- formats
def test_a_spec_bench_question_file_gives_ids_categories_and_the_first_turn(tmp_path):
    prompts = suites.load(write(tmp_path, "question.jsonl", SPEC_BENCH))
    assert shape(prompts) == [("81", "mt_bench"), ("161", "translation"), ("241", "summarization"), ("321", "qa"),
                              ("401", "math_reasoning"), ("481", "rag")]
    assert prompts[0].prompt == "Write a travel blog post about Hawaii."
    assert all(p.max_new_tokens is None and p.schema is None for p in prompts)


def test_an_mt_bench_question_file_ignores_reference_answers(tmp_path):
    prompts = suites.load(write(tmp_path, "mt.jsonl", MT_BENCH))
    assert shape(prompts) == [("101", "reasoning"), ("102", "writing")]
    assert prompts[0].prompt == "Which is heavier?"


def test_a_question_line_without_id_or_category_takes_them_from_the_file(tmp_path):
    lines = [{"turns": ["Hello?"]}, {"question_id": "q2", "turns": ["Hi"]}]
    prompts = suites.load(write(tmp_path, "mine.jsonl", lines))
    assert shape(prompts) == [("mine-1", "mine"), ("q2", "mine")]


def test_a_plain_prompt_file_derives_ids_and_the_category_from_the_file(tmp_path):
    lines = [{"prompt": "first"}, "", {"prompt": "second", "answer": "ignored", "id": "mine"},
             {"prompt": "third", "category": "qa", "max_new_tokens": 9}]
    prompts = suites.load(write(tmp_path, "prompts.jsonl", lines))
    assert shape(prompts) == [("prompts-1", "prompts"), ("mine", "prompts"), ("prompts-4", "qa")]
    assert [p.prompt for p in prompts] == ["first", "second", "third"]
    assert prompts[2].max_new_tokens == 9


def test_our_own_format_stays_strict(tmp_path):
    path = write(tmp_path, "ours.jsonl", [{"id": "a", "category": "c", "prompt": "p"},
                                          {"id": "b", "category": "c", "prompt": "p", "answer": "x"}])
    with pytest.raises(suites.SuiteError, match="unknown field"):
        suites.load(path)


@pytest.mark.parametrize("lines, line, message, form", [
    ([SPEC_BENCH[0], {"question_id": 2, "category": "qa", "prompt": "p"}], 2, "'turns' must be a list",
     "Spec-Bench/MT-Bench question.jsonl"),
    ([SPEC_BENCH[0], {"question_id": 2.5, "turns": ["p"]}], 2, "field 'question_id' must be an int or a str",
     "Spec-Bench/MT-Bench question.jsonl"),
    ([SPEC_BENCH[0], SPEC_BENCH[0]], 2, "duplicate id '81' (first on line 1)", "Spec-Bench/MT-Bench question.jsonl"),
    ([{"prompt": "p"}, {"text": "p"}], 2, "missing required field 'prompt'", "plain prompt JSONL"),
    ([{"prompt": "p"}, {"prompt": ["p"]}], 2, "field 'prompt' must be a str", "plain prompt JSONL"),
    ([{"id": "a", "category": "c", "prompt": "p"}, {"prompt": "p"}], 2, "missing required field(s) id, category",
     "decodekit suite"),
])
def test_an_error_names_the_line_and_the_format_the_file_was_read_as(tmp_path, lines, line, message, form):
    path = write(tmp_path, "s.jsonl", lines)
    with pytest.raises(suites.SuiteError) as error:
        suites.load(path)
    assert str(error.value).startswith(f"{path}:{line}: {message}")
    assert f"read as a {form}, detected from line 1" in str(error.value)


def test_a_first_line_of_no_known_format_lists_the_formats(tmp_path):
    path = write(tmp_path, "s.jsonl", [{"text": "p"}])
    with pytest.raises(suites.SuiteError) as error:
        suites.load(path)
    assert str(error.value).startswith(f"{path}:1: not a line of a known suite format")
    assert all(name in str(error.value) for name in ("decodekit", "question.jsonl", "plain", '"turns"'))


# ---------------------------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("line", [
    {"id": "a", "category": "json", "prompt": "p", "schema": {"type": "strin"}},
    {"prompt": "p", "schema": {"type": "object", "properties": {"age": {"minimum": "ten"}}}},
    {"id": "a", "category": "json", "prompt": "p", "schema": {"type": "object", "required": "name"}},
])
def test_a_bad_schema_is_reported_with_file_and_line_when_the_suite_is_read(tmp_path, line):
    good = {"id": "ok", "category": "json", "prompt": "p", "schema": {"type": "object"}}
    lines = [good if "id" in line else {"prompt": "p", "schema": {"type": "object"}}, line]
    path = write(tmp_path, "s.jsonl", lines)
    with pytest.raises(suites.SuiteError) as error:
        suites.load(path)
    assert str(error.value).startswith(f"{path}:2: schema: ")


def test_a_valid_schema_of_an_older_draft_is_accepted(tmp_path):
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "exclusiveMinimum": True,
              "minimum": 0}  # draft-04's boolean exclusiveMinimum, a number in later drafts
    (prompt,) = suites.load(write(tmp_path, "s.jsonl", [{"prompt": "p", "schema": schema}]))
    assert prompt.schema == schema


# ---------------------------------------------------------------------------------------------------------- subsets
def test_limit_and_per_category_pick_the_same_prompts_in_file_order(tmp_path):
    path = write(tmp_path, "question.jsonl", SPEC_BENCH + [
        {"question_id": 82, "category": "mt_bench", "turns": ["Second mt_bench"]},
        {"question_id": 162, "category": "translation", "turns": ["Second translation"]},
        {"question_id": 83, "category": "mt_bench", "turns": ["Third mt_bench"]},
    ])
    assert shape(suites.load(path, limit=3)) == [("81", "mt_bench"), ("161", "translation"), ("241", "summarization")]
    two = suites.load(path, per_category=2)
    assert [p.id for p in two] == ["81", "161", "241", "321", "401", "481", "82", "162"]
    assert [p.id for p in suites.load(path, per_category=1, limit=4)] == ["81", "161", "241", "321"]
    assert suites.load(path, per_category=2) == two  # deterministic
    assert suites.select(suites.load(path), per_category=2) == two
    assert suites.load(path, limit=100) == suites.load(path)


def test_per_category_over_all_shipped_suites_keeps_every_category():
    everything = suites.load("all")
    one = suites.load("all", per_category=1)
    assert [p.category for p in one] == list(dict.fromkeys(p.category for p in everything))


@pytest.mark.parametrize("options", [{"limit": 0}, {"per_category": -1}, {"limit": 2.5}, {"per_category": True}])
def test_a_subset_size_must_be_a_whole_number_of_at_least_one(options):
    with pytest.raises(suites.SuiteError, match="must be a whole number >= 1"):
        suites.load("code", **options)


# ---------------------------------------------------------------------------------------------------------- agentic
def test_the_agentic_suite_repeats_earlier_work_in_three_or_more_categories():
    prompts = suites.load("agentic")
    assert len(prompts) >= 12 and len({p.category for p in prompts}) >= 3
    assert all(len(p.prompt) < 4000 for p in prompts)  # about 1,000 tokens at most: CPU time matters
    chain = [p.prompt for p in prompts if p.category == "edit-chain"]
    for before, after in zip(chain, chain[1:]):  # each edit starts from the file the previous one asked for
        assert difflib.SequenceMatcher(None, before, after, autojunk=False).ratio() > 0.8


def test_the_agentic_suite_is_not_part_of_all():
    assert "agentic" in suites.names()
    assert not {p.id for p in suites.load("agentic")} & {p.id for p in suites.load("all")}


def test_the_mixed_suite_is_held_out_of_all_and_has_four_categories():
    mixed = suites.load("mixed")
    assert {p.category for p in mixed} == {"qa", "translation", "summarization", "math"}
    assert not {p.id for p in mixed} & {p.id for p in suites.load("all")}
