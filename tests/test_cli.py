"""The `decodekit` command line, run in-process through `evals.cli.main` on a tiny model saved to disk."""

from __future__ import annotations

import copy
import io
import json
import os
import sys
from dataclasses import dataclass
from importlib import metadata

import pytest
import torch

import decoders
from conftest import INSTALLED, tiny_model, tiny_tokenizer
from decoders.drafting import cost as cost_module
from decoders.strategies.greedy import Greedy
from evals import cli, suites

PROMPT = "Index: A B C"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, monkeypatch_module) -> str:
    """A tiny random Llama and the in-memory tokenizer, saved like any local model folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield patch


@pytest.fixture
def marked_strategy():
    """Greedy that labels every other token as a draft token (so sources show up in the output)."""

    @decoders.register("test_every_other_draft")
    class EveryOtherDraft(Greedy):
        """Greedy, with every second token labelled "draft"."""

        def step(self, state):
            super().step(state)
            if len(state.sources) % 2 == 0:
                state.sources[-1] = "draft"

    yield "test_every_other_draft"
    decoders.unregister("test_every_other_draft")


def test_list_shows_strategies_peers_and_suites(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in decoders.available() + ["hf:greedy", "hf:assisted", "hf:prompt_lookup", "default", "edit", "json"]:
        assert name in out


@pytest.mark.parametrize(
    "command", [[], ["list"], ["generate"], ["compare"], ["calibrate"], ["leaderboard"], ["models"], ["models", "pull"]]
)
def test_every_help_has_examples(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(command + ["--help"])
    assert exit_.value.code == 0
    assert "examples:" in capsys.readouterr().out


def test_generate_prints_plain_text_when_piped_and_shows_sources_on_request(model_dir, marked_strategy, capsys):
    args = ["generate", "--model", model_dir, "--strategy", marked_strategy, "--max-new-tokens", "8", PROMPT]
    assert cli.main(args + ["--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    for plain in ([], ["--color", "never"]):  # captured stdout is not a terminal: the text as it is
        assert cli.main(args + plain) == 0
        out, err = capsys.readouterr()
        assert out == text + "\n" and "[draft:" not in out and "\033[" not in out
        assert "8 tokens" in err and "target calls" in err
    assert cli.main(args + ["--show-sources"]) == 0
    out = capsys.readouterr().out
    assert "[draft:" in out and "\033[" not in out
    assert cli.main(args + ["--color", "always"]) == 0
    out = capsys.readouterr().out
    assert "\033[32m" in out and "[draft:" not in out


def test_generate_json_prints_the_result(model_dir, capsys):
    assert cli.main(["generate", "--model", model_dir, "--max-new-tokens", "6", "--json", PROMPT]) == 0
    record = json.loads(capsys.readouterr().out)
    assert {"text", "tokens", "sources", "stats", "finish_reason", "prompt_tokens", "strategy"} <= set(record)
    assert len(record["tokens"]) == record["stats"]["new_tokens"] <= 6 and record["strategy"] == "greedy"
    assert {"target_calls", "acceptance_rate", "tokens_per_second", "ttft_seconds"} <= set(record["stats"])


@pytest.mark.skipif("guided" not in decoders.available(), reason="no grammar-constrained strategy registered")
def test_generate_with_a_json_schema_shows_grammar_forced_tokens(model_dir, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"]})
    )
    args = [
        "generate",
        "--model",
        model_dir,
        "--strategy",
        "guided",
        "--json-schema",
        str(schema),
        "--max-new-tokens",
        "12",
        "--show-sources",
        PROMPT,
    ]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.startswith('[grammar:{"name":"')
    assert cli.main(args[:5] + args[7:]) == 2  # guided without a schema
    assert "--json-schema FILE" in capsys.readouterr().err


def test_compare_prints_a_table_and_writes_every_report(model_dir, tmp_path, capsys):
    out = tmp_path / "results.json"
    args = [
        "compare",
        "--model",
        model_dir,
        "--suite",
        "article",
        "--strategies",
        "greedy,hf:greedy",
        "--max-new-tokens",
        "8",
        "--no-progress",
        "--bandwidth-mb",
        "8",
        "--out",
        str(out),
        "--markdown",
        str(tmp_path / "report.md"),
        "--html",
        str(tmp_path / "report.html"),
        "--plots",
        str(tmp_path / "plots"),
    ]
    assert cli.main(args) == 0
    stdout = capsys.readouterr().out
    assert "| strategy | lossless | tok/s ↑" in stdout and "| hf:greedy | ✓ exact" in stdout
    result = json.loads(out.read_text())
    assert result["config"]["suite"] == "article" and len(result["runs"]) == 6
    assert (tmp_path / "report.md").read_text().startswith("## decodekit compare")
    assert "<svg" in (tmp_path / "report.html").read_text()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "acceptance_by_position.png",
        "speedup_by_category.png",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "--model", "unused", "--strategies", "greedyy"], "Did you mean 'greedy'?"),
        (["compare", "--model", "unused", "--suite", "defualt"], "Did you mean 'default'?"),
        (["compare", "--model", "unused", "--strategies", "hf:assisted"], "needs a draft model"),
        (["compare", "--model", "unused", "-o", "k=3"], "STRATEGY.KEY=VALUE"),
        (["generate", "--model", "unused", "--strategy", "nope", "hi"], "unknown strategy 'nope'"),
        (["generate", "--model", "unused", "--json-schema", "/no/such/schema.json", "hi"], "cannot read a JSON schema"),
        (["models", "pull", "smollm3"], "unknown zoo model"),
        (["leaderboard", "/no/such/result.json"], "no such file"),
        (["generate", "--model", "unused", "--draft", "unused", "hi"], "'greedy' takes no draft model"),
        (["generate", "--model", "unused", ""], "the prompt is empty"),
        (["generate", "--model", "unused", " \n "], "the prompt is empty"),
        (["generate", "--model", "unused", "--strategy", "hf:greedy", "hi"], "is a peer"),
        (["generate", "--model", "unused", "--strategy", "prompt_lookup@k=0", "hi"], "k must be"),
        (["generate", "--model", "unused", "--draft-quantize", "int8", "hi"], "pass --draft MODEL too"),
        (["compare", "--model", "unused", "--draft", "self:int8", "--draft-quantize", "int8"], "drop --draft-quantize"),
        (
            ["compare", "--model", "unused", "--strategies", "prompt_lookup", "-o", "prompt_lookup.kk=1"],
            "unknown option",
        ),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_status_2(args, message, capsys):
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert err.startswith("decodekit: error: ") and message in err and "Traceback" not in err
    assert "loading" not in err  # refused before any model loads


def test_an_empty_stdin_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["generate", "--model", "unused", "-"]) == 2
    assert "the prompt is empty (nothing on stdin)" in capsys.readouterr().err


def test_version(capsys):
    if not INSTALLED:
        pytest.skip("decodekit is not installed here (run from its source tree): no version to print")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"decodekit {metadata.version('decodekit')}\n"


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch, capsys):
    read, write = os.pipe()
    os.close(read)  # `decodekit list | head -2`: the reader has gone
    with os.fdopen(write, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert cli.main(["list"]) == 0
        monkeypatch.undo()
    assert capsys.readouterr().err == ""


@pytest.fixture
def counted_strategy():
    """Greedy with an option `k`, noting the `k` of every instance built."""
    built: list[int] = []

    @dataclass(frozen=True)
    class CountedOptions:
        k: int = 1

    @decoders.register("test_counted")
    class Counted(Greedy):
        """Greedy that notes its constructions."""

        Options = CountedOptions

        def __init__(self, **options):
            super().__init__(**options)
            built.append(self.options.k)

    yield built
    decoders.unregister("test_counted")


def test_settings_after_at_reach_the_strategy_built_once(model_dir, counted_strategy, monkeypatch, capsys):
    from evals import methods

    parsed = []
    split = methods.split
    monkeypatch.setattr(methods, "split", lambda name: parsed.append(name) or split(name))
    args = ["generate", "--model", model_dir, "--strategy", "test_counted@k=3", "-o", "k=2", "--max-new-tokens", "4"]
    assert cli.main(args + ["--json", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] == "test_counted" and counted_strategy == [3]
    compare = [
        "compare",
        "--model",
        model_dir,
        "--suite",
        "article",
        "--strategies",
        "test_counted@k=2",
        "--repeats",
        "2",
        "--max-new-tokens",
        "4",
        "--no-progress",
        "--bandwidth-mb",
        "0",
    ]
    assert cli.main(compare) == 0
    assert "| test_counted@k=2 | ✓ exact" in capsys.readouterr().out
    assert counted_strategy == [3, 2]  # one instance for the warm-up and all six timed runs
    assert parsed == ["test_counted@k=3", "greedy", "test_counted@k=2"]  # each name parsed once, generate then compare


def test_a_suite_too_long_for_the_context_is_refused(model_dir, tmp_path, capsys):
    suite = tmp_path / "long.jsonl"
    suite.write_text(json.dumps({"id": "long", "category": "prose", "prompt": "A B C D " * 200}) + "\n")
    args = ["compare", "--model", model_dir, "--suite", str(suite), "--no-progress", "--bandwidth-mb", "0"]
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and "too long for the model's context of 256 tokens" in err


def test_a_draft_of_another_vocabulary_stops_compare_before_any_run(model_dir, tmp_path, capsys):
    folder = tmp_path / "stranger"
    tiny_model("llama", seed=1).save_pretrained(folder)
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(["zzqx"])
    tokenizer.save_pretrained(folder)
    args = [
        "compare",
        "--model",
        model_dir,
        "--draft",
        str(folder),
        "--suite",
        "article",
        "--strategies",
        "staged",
        "--no-progress",
        "--bandwidth-mb",
        "0",
    ]
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and "staged: draft model" in err and "does not share the tokenizer" in err


def test_runs_that_raise_are_written_and_the_exit_status_is_1(model_dir, tmp_path, capsys):
    @decoders.register("test_raises")
    class Raises(Greedy):
        """Raises at its first step."""

        def step(self, state):
            raise RuntimeError("boom")

    out = tmp_path / "results.json"
    try:
        args = [
            "compare",
            "--model",
            model_dir,
            "--suite",
            "article",
            "--strategies",
            "test_raises",
            "--max-new-tokens",
            "2",
            "--no-progress",
            "--bandwidth-mb",
            "0",
            "--out",
            str(out),
        ]
        assert cli.main(args) == 1
    finally:
        decoders.unregister("test_raises")
    stdout, err = capsys.readouterr()
    assert "| test_raises | ERROR (3 runs" in stdout and "RuntimeError: boom" in stdout
    assert "decodekit: 3 of 6 timed runs raised" in err
    assert len(json.loads(out.read_text())["errors"]) == 3


def test_a_draft_no_method_takes_is_not_loaded(model_dir, capsys):
    args = [
        "compare",
        "--model",
        model_dir,
        "--draft",
        "/no/such/draft",
        "--suite",
        "article",
        "--strategies",
        "prompt_lookup",
        "--max-new-tokens",
        "2",
        "--no-progress",
        "--bandwidth-mb",
        "0",
        "--no-warmup",
    ]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert "/no/such/draft" not in err and "the draft model is not used" in out and "draft: none" in out


def test_the_targets_own_int8_copy_drafts_once_and_a_draft_can_be_loaded_quantized(model_dir, monkeypatch, capsys):
    from decoders.models import quantize

    made = []
    original = quantize.quantize
    monkeypatch.setattr(quantize, "quantize", lambda lm, scheme: made.append(scheme) or original(lm, scheme))
    args = [
        "compare",
        "--model",
        model_dir,
        "--suite",
        "article",
        "--max-new-tokens",
        "6",
        "--no-progress",
        "--bandwidth-mb",
        "0",
    ]
    assert cli.main(args + ["--draft", "self:int8", "--strategies", "speculative,hf:assisted"]) == 0
    out = capsys.readouterr().out
    assert "draft: self:int8" in out and made == ["int8"]  # one copy for every run of both methods
    assert "| speculative | ✓ exact" in out and "| hf:assisted | ✓ exact" in out
    assert cli.main(args + ["--draft", model_dir, "--draft-quantize", "int8", "--strategies", "speculative"]) == 0
    assert f"draft: {model_dir} (int8)" in capsys.readouterr().out and made == ["int8", "int8"]
    generate = ["generate", "--model", model_dir, "--draft", "self:int8", "--strategy", "speculative", "--json"]
    assert cli.main(generate + ["--max-new-tokens", "6", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["drafted"] > 0


def test_no_progress_silences_the_weight_loading_bar(model_dir, capsys):
    from transformers.utils import logging

    try:
        assert cli.main(["generate", "--model", model_dir, "--max-new-tokens", "2", "--no-progress", PROMPT]) == 0
        assert not logging.is_progress_bar_enabled()
    finally:
        logging.enable_progress_bar()


def test_a_malformed_suite_file_reports_its_line(tmp_path, capsys):
    suite = tmp_path / "mine.jsonl"
    suite.write_text('{"id": "a", "category": "c", "prompt": "p"}\n{"id": "b", "category": "c"\n')
    assert cli.main(["compare", "--model", "unused", "--suite", str(suite)]) == 2
    assert f"{suite}:2: not valid JSON" in capsys.readouterr().err


def test_a_strategy_that_needs_a_draft_is_refused_without_one(capsys):
    @decoders.register("test_draft_only")
    class DraftOnly(Greedy):
        """Needs a draft model."""

        needs_draft = True

    try:
        assert cli.main(["compare", "--model", "unused", "--strategies", "test_draft_only"]) == 2
        assert "'test_draft_only' needs a draft model" in capsys.readouterr().err
        assert cli.main(["generate", "--model", "unused", "--strategy", "test_draft_only", "hi"]) == 2
        assert "needs a draft model" in capsys.readouterr().err
    finally:
        decoders.unregister("test_draft_only")


def test_bench_greedy_prints_the_ratio_and_the_roofline_fraction(model_dir, capsys):
    from evals import bench_greedy

    args = [
        "--models",
        model_dir,
        "--dtype",
        "float32",
        "--suite",
        "article",
        "--repeats",
        "1",
        "--max-new-tokens",
        "6",
        "--no-progress",
    ]
    assert bench_greedy.main(args) == 0
    out = capsys.readouterr().out
    assert "| model | dtype | MiB/token | greedy tok/s ↑ | hf:greedy tok/s ↑ | ratio ↑" in out
    assert "✓ exact" in out  # hf:greedy reproduces greedy token for token


def test_calibrate_prints_measured_call_costs_and_plots_them(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))  # the fit is cached here, not in the user's cache
    monkeypatch.delenv("DECODEKIT_CALIBRATION")  # the default folder under DECODEKIT_CACHE
    plot = tmp_path / "cost.png"
    args = ["calibrate", "--model", model_dir, "--draft", "self:int8", "--no-progress", "--plot", str(plot)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "| role | model | tokens | context | measured ms ↓ | fit ms ↓" in out
    where = torch.zeros(0, device=decoders.models.device.resolve_device(None)).device  # where the CLI loads it: cuda:0
    assert f"device: {cost_module.machine(where)} · dtype: float32" in out  # the machine its costs are cached for
    assert f"| target | {model_dir} | 1 |" in out and "| draft | self:int8 | 1 |" in out
    assert "µs per cached position" in out and plot.stat().st_size > 1000
    assert list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert "auto drafts with: self:int8" not in out and f"auto drafts with: {model_dir}:int8" in out  # (the copy)


def test_peers_draft_with_the_draft_as_loaded_and_strategies_with_its_quantized_copy(model_dir, monkeypatch, capsys):
    from decoders.models.quantize import is_quantized
    from evals import peers, timing

    seen = []
    run_peer, run_decodekit = peers.run_peer, timing.run_decodekit
    monkeypatch.setattr(
        peers, "run_peer", lambda *a, **kw: seen.append(("peer", is_quantized(kw["draft"]))) or run_peer(*a, **kw)
    )
    monkeypatch.setattr(
        "evals.runner.run_decodekit",
        lambda *a, **kw: (
            seen.append(("decodekit", kw["draft"] and is_quantized(kw["draft"]))) or run_decodekit(*a, **kw)
        ),
    )
    args = [
        "compare",
        "--model",
        model_dir,
        "--suite",
        "article",
        "--max-new-tokens",
        "6",
        "--no-progress",
        "--bandwidth-mb",
        "0",
        "--draft",
        model_dir,
        "--draft-quantize",
        "int8",
        "--strategies",
        "speculative,hf:assisted",
    ]
    assert cli.main(args) == 0
    assert "| speculative | ✓ exact" in capsys.readouterr().out
    assert ("peer", None) in seen and ("decodekit", "int8") in seen
    assert ("peer", "int8") not in seen


def test_limit_and_per_category_pick_the_prompts(model_dir, tmp_path):
    out = tmp_path / "r.json"
    args = [
        "compare",
        "--model",
        model_dir,
        "--suite",
        "default",
        "--per-category",
        "1",
        "--limit",
        "2",
        "--max-new-tokens",
        "3",
        "--no-progress",
        "--bandwidth-mb",
        "0",
        "--strategies",
        "greedy",
        "--out",
        str(out),
    ]
    assert cli.main(args) == 0
    result = json.loads(out.read_text())
    assert [p["id"] for p in result["prompts"]] == [p.id for p in suites.load("default", limit=2, per_category=1)]
    assert result["config"]["limit"] == 2 and result["config"]["per_category"] == 1


def test_a_suffix_store_kept_across_the_suite(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = [
        "compare",
        "--model",
        model_dir,
        "--suite",
        "article",
        "--max-new-tokens",
        "8",
        "--no-progress",
        "--bandwidth-mb",
        "0",
        "--strategies",
        "suffix,suffix@store=run",
        "--out",
        str(out),
    ]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "| suffix@store=run | ✓ exact" in text and "one SuffixStore across the suite's prompts" in text
    runs = [r for r in json.loads(out.read_text())["runs"] if r["strategy"].startswith("suffix")]
    assert {r["strategy"] for r in runs} == {"suffix", "suffix@store=run"}


def test_export_hub_writes_a_custom_generate_folder(tmp_path, capsys):
    assert cli.main(["export-hub", str(tmp_path / "hub"), "--strategy", "prompt_lookup"]) == 0
    code = (tmp_path / "hub" / "custom_generate" / "generate.py").read_text()
    assert "prompt_lookup" in code and "custom_generate=" in capsys.readouterr().out
    assert cli.main(["export-hub", str(tmp_path / "bad"), "--strategy", "nosuch"]) == 2


def test_the_report_shows_what_auto_chose(model_dir, capsys):
    args = [
        "compare",
        "--model",
        model_dir,
        "--suite",
        "article",
        "--max-new-tokens",
        "8",
        "--no-progress",
        "--bandwidth-mb",
        "0",
        "--strategies",
        "auto",
    ]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "What the choosing strategies chose:" in text
    assert "auto on article-pi: steps by proposer:" in text and "predicted" in text and "measured" in text


@pytest.mark.parametrize("choice", ["on", "off", "compiled"])
def test_cuda_graphs_option_sets_the_models_calls(model_dir, choice):
    from evals.cli_parser import build_parser

    args = build_parser().parse_args(["compare", "--model", model_dir, "--no-progress", "--cuda-graphs", choice])
    lm = cli._load(model_dir, args, None)
    assert lm.cuda_graphs == (lm.device.type == "cuda" and choice != "off")  # (a CPU runs transformers' cache)
    assert lm.compile_calls == (choice == "compiled")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare", "--model", model_dir, "--cuda-graphs", "maybe"])
