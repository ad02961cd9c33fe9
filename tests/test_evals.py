"""The evaluator: suites, compare's result document, the losslessness check, leaderboards, and the accelerate split."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import decoders
import grammars
from conftest import tiny_lm, tiny_model, tiny_tokenizer
from decoders.strategies.greedy import Greedy
from evals import cli, lossless, report, suites
from evals.methods import build, plan
from evals.peers import PEERS
from evals.runner import CompareConfig, compare

SUITE = [
    {"id": "fib", "category": "code", "prompt": "def fibonacci(n):"},
    {"id": "fox", "category": "prose", "prompt": "The quick brown fox"},
    {"id": "index", "category": "article", "prompt": "Index: A B C"},
    {"id": "pi", "category": "article", "prompt": "The digits of Pi are 3.14159", "max_new_tokens": 10},
    {"id": "name", "category": "json", "prompt": '{"name": "',
     "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
]
RUN_FIELDS = {
    "strategy", "kind", "prompt_id", "category", "repeat", "prompt_tokens", "max_new_tokens", "new_tokens", "seconds",
    "ttft_seconds", "target_calls", "draft_calls", "drafted", "accepted", "accepted_by_position",
    "drafted_by_position", "draft_seconds", "peak_memory_bytes", "finish_reason", "tokens", "sources", "pieces",
    "timeline", "grammar", "rank", "lossless", "tokens_per_second", "mean_accepted", "acceptance_rate", "draft_share",
}
SUMMARY_FIELDS = {
    "strategy", "kind", "runs", "prompts", "tokens_per_second", "speedup", "ttft_seconds", "new_tokens",
    "target_calls", "draft_calls", "mean_accepted", "acceptance_rate", "accepted_by_position",
    "accepted_by_position_per_call", "acceptance_by_position", "draft_share", "peak_memory_bytes", "lossless",
    "by_category",
}


def write_suite(path: Path, lines: list[dict] = SUITE) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory) -> Path:
    return write_suite(tmp_path_factory.mktemp("suite") / "tiny.jsonl")


@pytest.fixture(scope="module")
def result(suite_file) -> dict:
    """One compare on a tiny random Llama: every registered strategy and every peer, with a draft; two repeats."""
    config = CompareConfig(strategies=(*decoders.available(), *PEERS, "outlines:json"), suite=str(suite_file),
                           max_new_tokens=12, repeats=2, progress=False, bandwidth_megabytes=8)
    return compare(tiny_lm("llama"), config, draft=tiny_lm("llama", seed=1))


# ----------------------------------------------------------------------------------------------------------- suites
def test_shipped_suites_cover_every_category_and_the_seed_prompts():
    everything = suites.load("all")
    assert {"code", "edit", "rag", "prose", "json", "article"} <= {p.category for p in everything}
    assert all(p.schema for p in everything if p.category == "json")
    assert {p.prompt for p in suites.load("article")} == {
        "What is a tensor in machine learning?", "Index: A B C", "The digits of Pi are 3.14159"}
    default = suites.load("default")
    assert 6 <= len(default) <= 8 and {p.category for p in default} == {p.category for p in everything}


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ('{"id": "x", "category": "c"}', "missing required field(s) prompt"),
    ('{"id": "x", "category": "c", "prompt": 3}', "'prompt' must be a str"),
    ('{"id": "x", "category": "c", "prompt": "p", "colour": 1}', "unknown field(s) colour"),
    ('{"id": "fib", "category": "c", "prompt": "p"}', "duplicate id 'fib'"),
    ('["a list"]', "expected a JSON object"),
])
def test_a_malformed_suite_line_names_the_file_and_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(SUITE[0]) + "\n\n" + bad + "\n", encoding="utf-8")
    with pytest.raises(suites.SuiteError) as error:
        suites.load(path)
    assert f"{path}:3:" in str(error.value) and message in str(error.value)


def test_an_unknown_suite_suggests_the_nearest():
    with pytest.raises(suites.SuiteError, match="Did you mean 'code'"):
        suites.load("cod")
    with pytest.raises(suites.SuiteError, match="not found"):
        suites.load("missing/prompts.jsonl")


# ---------------------------------------------------------------------------------------------------------- compare
def test_compare_result_has_every_field_and_a_markdown_table(result):
    assert result["schema"] == "decodekit.compare/1"
    top = {"environment", "model", "config", "prompts", "notes", "roofline", "summary", "runs", "errors"}
    assert top <= set(result)
    assert {"device", "device_name", "dtype", "torch", "transformers", "decodekit", "date", "host"} <= set(
        result["environment"])
    roofline = {"limit_tokens_per_second", "parameter_bytes", "bytes_per_token", "bandwidth_bytes_per_second",
                "greedy_fraction"}
    assert roofline <= set(result["roofline"])
    for run in result["runs"]:
        assert RUN_FIELDS <= set(run), RUN_FIELDS - set(run)
        assert run["new_tokens"] == len(run["tokens"]) == len(run["sources"]) <= run["max_new_tokens"]
    summary = {s["strategy"]: s for s in result["summary"]}
    assert list(summary)[0] == "greedy" and set(summary) == {*decoders.available(), *PEERS}
    outlines_runs = [r for r in result["runs"] if r["strategy"] == "outlines:json"]
    assert outlines_runs and all(r["lossless"]["status"] == "valid" for r in outlines_runs)
    assert summary["outlines:json"]["lossless"]["status"] == "valid"
    for run in result["runs"]:  # grammar-only strategies run just on the schema prompt, under its grammar
        assert build(run["strategy"]).needs_grammar == run["grammar"] == (run["grammar"] and run["prompt_id"] == "name")
    for s in summary.values():
        assert SUMMARY_FIELDS <= set(s), SUMMARY_FIELDS - set(s)
        assert s["lossless"]["status"] in (("valid",) if s["strategy"] == "outlines:json" else ("pass", "tie"))
        assert {"code", "prose", "article", "json"} >= set(s["by_category"])
    assert summary["greedy"]["speedup"]["mean"] == pytest.approx(1.0)
    assert summary["hf:assisted"]["draft_calls"] > 0 and summary["hf:assisted"]["draft_share"] > 0
    for run in result["runs"]:  # transformers' drafting peers: drafted tokens counted from the target calls' inputs
        if run["strategy"] in ("hf:assisted", "hf:prompt_lookup"):
            assert 0 <= run["accepted"] <= run["drafted"] and run["new_tokens"] == run["accepted"] + run["target_calls"]
        elif run["strategy"] == "hf:greedy":
            assert run["drafted"] is None and run["target_calls"] == run["new_tokens"]
    assert len({(r["strategy"], r["prompt_id"], r["repeat"]) for r in result["runs"]}) == len(result["runs"])
    assert next(r for r in result["runs"] if r["prompt_id"] == "pi")["max_new_tokens"] == 10  # the line's own cap
    text = report.markdown(result)
    assert "| strategy | lossless | tok/s ↑ | speed-up ↑ | TTFT ms ↓" in text and "reference" in text
    assert "model: tiny-llama-0" in text and "dtype: float32" in text and "roofline:" in text
    assert "draft: tiny-llama-1" in text and f"\n{report.verdict(result)}\n" in text
    json.loads(json.dumps(result))  # JSON-ready throughout


def test_html_report_and_plots(result, tmp_path):
    from evals import html, plots

    page = html.compare_report(result)
    assert page.startswith("<!doctype html>") and "<svg" in page and "fib" in page
    files = plots.write_all(result, tmp_path / "plots")
    assert all(f.stat().st_size > 1000 for f in files)


def test_leaderboard_merges_two_result_files(result, tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    report.write_json(result, first)
    other = json.loads(json.dumps(result))
    other["model"]["name"] = "another-model"
    report.write_json(other, second)
    assert cli.main(["leaderboard", str(first), str(second)]) == 0
    table = capsys.readouterr().out
    assert "tiny-llama-0" in table and "another-model" in table and "speed-up ↑" in table
    assert cli.main(["leaderboard", str(first), str(second), "--format", "json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert len(merged["rows"]) == 2 * len(result["summary"])
    assert cli.main(["leaderboard", str(first), "--format", "html"]) == 0
    assert "<table>" in capsys.readouterr().out
    (tmp_path / "junk.json").write_text("{}")
    assert cli.main(["leaderboard", str(first), str(tmp_path / "junk.json")]) == 2
    assert "junk.json: not a decodekit compare result" in capsys.readouterr().err


def python_path() -> str:
    """The repository first, then the caller's path (on the GPU check's machine, its installed wheels)."""
    return os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))


def test_the_leaderboard_imports_no_torch(result, tmp_path):
    path = tmp_path / "a.json"
    report.write_json(result, path)
    code = ("import sys; from evals import cli; status = cli.main(['leaderboard', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(status)")
    env = dict(os.environ, PYTHONPATH=python_path())
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tiny-llama-0" in done.stdout


def _summary(strategy: str, kind: str, speedups: dict[str, float], status: str = "pass", prompts: int = 2) -> dict:
    """A summary record with just what the verdict reads: a speed-up per category, `prompts` prompts in each."""
    figures = {c: {"prompts": prompts, "speedup": {"mean": v}, "lossless": {"status": status}}
               for c, v in speedups.items()}
    overall = sum(speedups.values()) / len(speedups)
    return {"strategy": strategy, "kind": kind, "prompts": prompts * len(speedups), "speedup": {"mean": overall},
            "lossless": {"status": status}, "by_category": figures}


def test_the_verdict_names_the_fastest_lossless_strategy_overall_and_per_category():
    result = {"config": {"categories": ["code", "prose"]}, "summary": [
        _summary("greedy", "decodekit", {"code": 1.0, "prose": 1.0}, status="reference"),
        _summary("speculative", "decodekit", {"code": 3.0, "prose": 0.8}),
        _summary("broken", "decodekit", {"code": 9.0, "prose": 9.0}, status="failed"),  # not lossless: never named
        _summary("guided", "decodekit", {"code": 5.0, "prose": 5.0}, prompts=1),  # ran on fewer prompts
        _summary("hf:greedy", "peer", {"code": 0.8, "prose": 0.5}),
        _summary("hf:assisted", "peer", {"code": 1.5, "prose": 0.4}, status="tie"),
    ]}
    assert report.verdict(result) == ("Fastest lossless: speculative — 1.90× greedy, 2.00× hf:assisted · "
                                      "code: speculative — 3.00× greedy, 2.00× hf:assisted · "
                                      "prose: greedy — nothing beat it, 2.00× hf:greedy")
    result["summary"] = result["summary"][:1]
    assert report.verdict(result) == "Fastest lossless: greedy — nothing beat it · code: greedy — nothing beat it · " \
                                     "prose: greedy — nothing beat it"


def test_category_cells_say_where_an_output_left_greedys_at_a_tie_or_is_not_lossless():
    result = {"config": {"categories": ["code", "prose"]}, "summary": [
        _summary("greedy", "decodekit", {"code": 1.0, "prose": 1.0}, status="reference"),
        _summary("speculative", "decodekit", {"code": 3.0, "prose": 0.8}, status="tie"),
        _summary("broken", "decodekit", {"code": 9.0, "prose": 9.0}, status="failed"),
    ]}
    result["summary"][1]["by_category"]["code"]["lossless"]["status"] = "pass"  # the tie was in prose
    headers, rows = report.category_table(result)
    assert rows == [["greedy", "1.00", "1.00"], ["speculative", "3.00", "0.80 ≈"], ["broken", "9.00 ✗", "9.00 ✗"]]
    legend = report.legend(rows)
    assert [line[0] for line in legend] == ["≈", "✗"] and "different texts" in legend[0]
    assert report.legend(rows[:1]) == []


# ------------------------------------------------------------------------------------------------------- losslessness
def test_a_strategy_that_changes_one_token_fails_and_a_correct_one_passes(suite_file):
    @decoders.register("test_broken_fifth")
    class BrokenFifth(Greedy):
        """Greedy, except the 5th new token is the target's least likely one."""

        def step(self, state):
            if len(state.new_tokens) != 4:
                return super().step(state)
            logits = state.score()
            state.accept([int(logits[-1].argmin())], ["target"])

    @decoders.register("test_plain_copy")
    class PlainCopy(Greedy):
        """Greedy under another name."""

    try:
        config = CompareConfig(strategies=("test_broken_fifth", "test_plain_copy"), suite=str(suite_file),
                               max_new_tokens=12, progress=False, bandwidth_megabytes=0, warmup=False)
        result = compare(tiny_lm("qwen2"), config)
    finally:
        decoders.unregister("test_broken_fifth")
        decoders.unregister("test_plain_copy")
    summary = {s["strategy"]: s for s in result["summary"]}
    broken = summary["test_broken_fifth"]["lossless"]
    assert broken["status"] == "failed" and broken["first_failure"]["position"] == 4
    assert broken["first_failure"]["gap"] > broken["first_failure"]["tolerance"]
    assert summary["test_plain_copy"]["lossless"]["status"] == "pass"
    assert "FAILED @4" in report.markdown(result)


def test_a_gap_that_greedys_own_scoring_does_not_see_is_a_numeric_tie(monkeypatch):
    lm = tiny_lm("llama")
    one_pass = torch.zeros(lm.vocab_size)
    one_pass[[3, 4]] = torch.tensor([20.0, 20.5])  # the run's token 4 leads by 0.5 in the one-pass logits
    monkeypatch.setattr(lossless, "margin_at", lambda *args: one_pass)
    for greedy_view, status in ((20.0, "tie"), (19.0, "failed")):  # greedy's own scoring: a tie, or a clear lead
        again = torch.zeros(lm.vocab_size)
        again[[3, 4]] = torch.tensor([20.0, greedy_view])
        monkeypatch.setattr(lossless, "incremental_logits", lambda *args, again=again: again)
        found = lossless.verdict(lm, [1, 2], [5, 3], [5, 4])
        assert found["status"] == status and found["position"] == 1 and found["gap"] == pytest.approx(0.5)
        assert found["greedy_gap"] == pytest.approx(20.0 - greedy_view)


def test_greedys_own_scoring_is_recomputed_exactly():
    lm = tiny_lm("qwen2")
    prompt = lm.encode("The quick brown fox")
    reference = decoders.generate(lm, prompt, max_new_tokens=6).tokens
    again = lossless.incremental_logits(lm, prompt, reference, 4)
    assert int(again.argmax()) == reference[4]
    torch.testing.assert_close(again, lossless.margin_at(lm, prompt, reference, 4), atol=1e-4, rtol=1e-4)


def test_a_grammar_peer_is_checked_for_validity():
    lm = tiny_lm("qwen2")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    constraint = grammars.json_schema(schema)

    def run(text: str, finish: str) -> SimpleNamespace:  # the fields of a Run that the check reads
        tokens = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        return SimpleNamespace(tokens=tokens, pieces=[text], finish_reason=finish)

    assert lossless.validity(lm, run('{"n":7}', "eos"), schema, constraint)["status"] == "valid"
    assert lossless.validity(lm, run('{"n":', "length"), schema, constraint) == {
        "status": "valid", "position": None, "complete": False}
    out_of_bounds = lossless.validity(lm, run('{"n":12}', "eos"), schema, constraint)
    assert out_of_bounds["status"] == "failed" and "violates the schema" in out_of_bounds["reason"]
    assert "not JSON" in lossless.validity(lm, run('{"n":', "eos"), schema, constraint)["reason"]
    assert "not a prefix" in lossless.validity(lm, run('{"m":', "length"), schema, constraint)["reason"]


def test_first_divergence_counts_length_differences():
    assert lossless.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert lossless.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert lossless.first_divergence([1, 2, 3], [1, 2]) == 2
    assert lossless.first_divergence([1, 2], [1, 2, 3]) == 2
    assert lossless.tolerance(torch.float32, 20.0) == pytest.approx(2e-3)
    assert lossless.tolerance(torch.bfloat16, 0.5) == pytest.approx(2**-7)


def test_an_exact_logit_tie_is_a_numeric_tie_and_a_far_token_is_a_failure():
    model = tiny_model("llama", seed=3)
    lm = decoders.wrap(model, tiny_tokenizer(), name="tie")
    prompt = lm.encode("Index: A B C")
    chosen = decoders.generate(lm, prompt, max_new_tokens=6).tokens
    twin = (chosen[2] + 1) % lm.vocab_size
    with torch.no_grad():  # make token `twin` score exactly like greedy's third token, at every position
        model.lm_head.weight[twin] = model.lm_head.weight[chosen[2]]
    reference = decoders.generate(lm, prompt, max_new_tokens=6).tokens
    position = 2
    other = twin if reference[position] != twin else chosen[2]
    tie = lossless.verdict(lm, prompt, reference, reference[:position] + [other])
    assert tie["status"] == "tie" and tie["position"] == position and tie["gap"] == 0.0
    logits = lossless.margin_at(lm, prompt, reference, position)
    far = lossless.verdict(lm, prompt, reference, reference[:position] + [int(logits.argmin())])
    assert far["status"] == "failed" and far["gap"] > far["tolerance"]
    short = lossless.verdict(lm, prompt, reference, reference[:-1])
    assert short["status"] == "failed" and "length differs" in short["reason"]


def test_variants_rank_settings_of_one_strategy_side_by_side(suite_file):
    config = CompareConfig(strategies=("prompt_lookup@k=1", "prompt_lookup@k=6@max_ngram=2"), suite=str(suite_file),
                           max_new_tokens=12, progress=False, bandwidth_megabytes=0, warmup=False)
    result = compare(tiny_lm("gpt2"), config)
    summary = {s["strategy"]: s for s in result["summary"]}
    assert list(summary) == ["greedy", "prompt_lookup@k=1", "prompt_lookup@k=6@max_ngram=2"]
    assert all(summary[name]["lossless"]["status"] == "pass" for name in list(summary)[1:])
    one = [r for r in result["runs"] if r["strategy"] == "prompt_lookup@k=1"]
    assert one and all(len(r["drafted_by_position"]) <= 1 for r in one)
    assert max(len(r["drafted_by_position"]) for r in result["runs"] if "k=6" in r["strategy"]) > 1


# --------------------------------------------------------------------------------------------------------- bad input
def names(methods) -> list[str]:
    return [m.name for m in methods]


def test_unknown_strategies_and_missing_drafts_are_refused_up_front():
    @decoders.register("test_needs_draft")
    class NeedsDraft(Greedy):
        """A strategy that declares it needs a draft model."""

        needs_draft = True

    try:
        with pytest.raises(ValueError, match="needs a draft model"):
            plan(("test_needs_draft",), has_draft=False)
        methods, notes = plan((), has_draft=False)  # the default set skips it, with a note
        assert "test_needs_draft" not in names(methods) and any("test_needs_draft: skipped" in n for n in notes)
        assert "test_needs_draft" in names(plan((), has_draft=True)[0])
    finally:
        decoders.unregister("test_needs_draft")
    with pytest.raises(ValueError, match="Did you mean 'greedy'"):
        plan(("greedyy",), has_draft=False)
    with pytest.raises(ValueError, match="unknown peer 'hf:greed'"):
        plan(("hf:greed",), has_draft=False)
    assert names(plan(("hf:assisted",), has_draft=True)[0]) == ["greedy", "hf:assisted"]
    with pytest.raises(ValueError, match="needs a draft model"):
        plan(("hf:assisted",), has_draft=False)
    with pytest.raises(TypeError, match="unknown option.*kk"):
        plan(("prompt_lookup@kk=3",), has_draft=False)
    with pytest.raises(ValueError, match="k must be"):
        plan(("prompt_lookup@k=0",), has_draft=False)
    with pytest.raises(ValueError, match="STRATEGY@KEY=VALUE"):
        plan(("prompt_lookup@k",), has_draft=False)


# ------------------------------------------------------------------------------------------------------- accelerate
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_with_two_cpu_processes_gives_the_same_table_as_one(tmp_path, suite_file):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    args = ["compare", "--model", str(folder), "--suite", str(suite_file), "--strategies", "greedy,hf:greedy",
            "--max-new-tokens", "12", "--no-progress", "--bandwidth-mb", "0", "--no-warmup", "--device", "cpu"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=python_path())
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), "-m", "evals"]
    done = subprocess.run(launch + args + ["--out", str(tmp_path / "two.json")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert cli.main(args + ["--out", str(tmp_path / "one.json")]) == 0
    two, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "one"))
    assert two["config"]["processes"] == 2 and {r["rank"] for r in two["runs"]} == {0, 1}

    def rows(result):
        return [(r["strategy"], r["prompt_id"], r["repeat"], r["tokens"], r["lossless"]["status"])
                for r in result["runs"]]

    assert rows(two) == rows(one)
    assert [s["strategy"] for s in two["summary"]] == [s["strategy"] for s in one["summary"]]
    assert [report.lossless_cell(s) for s in two["summary"]] == [report.lossless_cell(s) for s in one["summary"]]
