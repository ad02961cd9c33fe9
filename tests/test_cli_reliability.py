"""The `decodekit compare` command's safety nets: output paths checked before the runs, Ctrl-C keeps what was measured,
empty lists refused, CLI spelling in its messages, a --limit subset labelled as such, and the roofline's read probe."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from evals import cli, measure, report
from evals.cli_parser import build_parser

QUICK = ["--suite", "article", "--strategies", "greedy", "--max-new-tokens", "2", "--no-progress",
         "--bandwidth-mb", "0", "--no-warmup"]


# ------------------------------------------------------------------------------------------------- output paths
@pytest.mark.parametrize("option, where", [
    ("--out", "/proc/decodekit-x.json"),
    ("--out", "{tmp}/no/such/folder/r.json"),
    ("--markdown", "{tmp}"),  # a folder, not a file
    ("--html", "/proc/decodekit-x.html"),
    ("--plots", "/proc/decodekit-plots"),
    ("--plots", "{tmp}/a-file"),  # a file, not a folder
])
def test_an_output_that_cannot_be_written_stops_compare_before_any_run(model_dir, tmp_path, option, where, capsys):
    (tmp_path / "a-file").write_text("x")
    ok = tmp_path / "fine.json"
    args = ["compare", "--model", model_dir, *QUICK, option, where.format(tmp=tmp_path)]
    assert cli.main(args + (["--out", str(ok)] if option != "--out" else [])) == 2
    out, err = capsys.readouterr()
    assert out == "" and "loading" not in err  # refused before the model loads, let alone runs
    assert err.startswith(f"decodekit: error: {option} ") and err.count("\n") == 1
    assert not ok.exists()  # the check leaves no file behind


@pytest.mark.parametrize("option, below", [("--out", "x.json"), ("--html", "x.html"), ("--markdown", "x.md"),
                                           ("--plots", "plots"), ("--plots", "deep/plots")])
def test_an_output_under_a_regular_file_is_one_clear_line(model_dir, tmp_path, option, below, capsys):
    """The probe's clean-up meets the same "Not a directory" as the probe: the clear error stands."""
    regular = tmp_path / "a-file"
    regular.write_text("x")
    where = regular / below
    args = ["compare", "--model", model_dir, *QUICK, option, str(where)]
    assert cli.main(args + (["--out", str(tmp_path / "fine.json")] if option != "--out" else [])) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"decodekit: error: {option} {where}: cannot write there (Not a directory)\n"
    assert regular.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_the_check_leaves_the_outputs_as_they_were(model_dir, tmp_path, capsys):
    kept = tmp_path / "old.md"
    kept.write_text("old")
    args = ["compare", "--model", model_dir, *QUICK, "--out", str(tmp_path / "r.json"), "--markdown", str(kept),
            "--html", str(tmp_path / "r.html")]
    assert cli.main(args + ["--plots", "/proc/decodekit-plots"]) == 2
    assert cli.main(args + ["--plots", str(tmp_path / "deep" / "plots"), "--strategies", "nosuch"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.md"] and kept.read_text() == "old"


# ------------------------------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_writes_the_prompts_measured_so_far_marked_partial(model_dir, tmp_path, monkeypatch, capsys):
    from evals import runner

    original = runner.run_decodekit

    def interrupted_on_the_second_prompt(*args, **kwargs):
        if kwargs["prompt_id"] != "article-tensor" and kwargs["name"] == "prompt_lookup" and kwargs["repeat"] >= 0:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "run_decodekit", interrupted_on_the_second_prompt)
    out, markdown = tmp_path / "r.json", tmp_path / "r.md"
    args = ["compare", "--model", model_dir, "--suite", "article", "--strategies", "greedy,prompt_lookup",
            "--max-new-tokens", "3", "--no-progress", "--bandwidth-mb", "0", "--out", str(out),
            "--markdown", str(markdown)]
    assert cli.main(args) == 130
    stdout, err = capsys.readouterr()
    result = json.loads(out.read_text())
    assert result["partial"] is True and result["config"]["prompts"] == 3
    # the unfinished round of the second prompt (greedy ran, prompt_lookup did not) is left out
    assert sorted((r["strategy"], r["prompt_id"]) for r in result["runs"]) == [
        ("greedy", "article-tensor"), ("prompt_lookup", "article-tensor")]
    assert "partial result" in stdout and "1 of 3 prompts" in stdout and "partial result" in markdown.read_text()
    assert "interrupted" in err
    assert "| article (partial) |" in report.leaderboard_markdown(report.leaderboard([result]))


# -------------------------------------------------------------------------------------------- lists and messages
@pytest.mark.parametrize("value", ["", " ", "greedy,,prompt_lookup", "greedy,"])
def test_an_empty_strategy_list_or_item_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compare", "--model", "unused", "--strategies", value])
    assert exit_.value.code == 2 and "argument --strategies: " in capsys.readouterr().err


@pytest.mark.parametrize("module, option", [("bench_greedy", "--models"), ("bench_grammars", "--models"),
                                            ("bench_grammars", "--schemas"), ("bench_grammars", "--strategies")])
def test_the_benchmarks_refuse_an_empty_list(module, option, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"evals.{module}").main([option, ""])
    assert exit_.value.code == 2 and f"argument {option}: " in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--model", "{model}", "--device", "cuda", "hi"],
                                     ["compare", "--model", "{model}", "--device", "cuda:1", *QUICK]])
def test_a_missing_cuda_device_is_reported_in_the_cli_spelling(model_dir, monkeypatch, command, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([part.format(model=model_dir) for part in command]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodekit: error: --device cuda") and "use --device cpu" in err
    assert "device='cpu'" not in err and "loading" not in err


def test_a_device_torch_does_not_know_is_one_line(capsys):
    assert cli.main(["generate", "--model", "unused", "--device", "gpu", "hi"]) == 2
    assert capsys.readouterr().err.startswith("decodekit: error: --device gpu")


def test_the_draft_help_says_other_tokenizers_work(capsys):
    for command in ("compare", "generate"):
        help_text = " ".join(build_parser()._subparsers._group_actions[0].choices[command].format_help().split())
        assert "same tokenizer as --model" not in help_text and "another tokenizer" in help_text


# ------------------------------------------------------------------------------------------------ --limit subsets
def test_a_limited_run_says_so_in_the_result_the_report_and_the_leaderboard(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["compare", "--model", model_dir, *QUICK, "--limit", "1", "--out", str(out)]) == 0
    assert "suite: article (first 1 of 3)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["partial"] is False and result["config"]["limit"] == 1
    assert result["config"]["prompts"] == 1 and result["config"]["suite_prompts"] == 3
    assert cli.main(["leaderboard", str(out)]) == 0
    assert "| article (first 1 of 3) |" in capsys.readouterr().out
    whole = dict(result, config=dict(result["config"], limit=None, prompts=3))
    assert "| article |" in report.leaderboard_markdown(report.leaderboard([whole]))
    per_category = dict(result, config=dict(result["config"], per_category=1))
    assert "| article (1 of 3, first 1 per category) |" in report.leaderboard_markdown(
        report.leaderboard([per_category]))


# -------------------------------------------------------------------------------------------------- the roofline
def test_the_roofline_limit_comes_from_the_read_probe_and_the_report_names_it(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(measure, "read_bandwidth", lambda device, megabytes, dtype: 2e9)
    monkeypatch.setattr(measure, "copy_bandwidth", lambda device, megabytes: 8e9)
    line = measure.roofline(model, torch.device("cpu"), 8)
    assert line["bandwidth_bytes_per_second"] == 2e9 and line["copy_bandwidth_bytes_per_second"] == 8e9
    assert line["limit_tokens_per_second"] == pytest.approx(2e9 / measure.bytes_per_token(model))
    assert line["bandwidth_probe"] == "matrix-vector" and line["bandwidth_probe_dtype"] == "float32"
    result = {"environment": {"device": "cpu", "device_name": "x", "dtype": "float32", "torch": "", "date": "",
                              "transformers": "", "decodekit": "", "host": ""},
              "model": {"name": "m", "class": "c", "draft": None}, "roofline": dict(line, greedy_fraction=0.5),
              "config": {"suite": "s", "prompts": 1, "max_new_tokens": 1, "repeats": 1, "processes": 1}}
    text = "\n".join(report.header_lines(result))
    assert "GB/s read (matrix-vector probe, float32)" in text and "copy: 8.0 GB/s" in text


def test_the_read_probe_measures_a_positive_bandwidth():
    for dtype in (torch.float32, torch.bfloat16):
        assert measure.read_bandwidth(torch.device("cpu"), 4, dtype) > 0
    assert measure.copy_bandwidth(torch.device("cpu"), 4) > 0


def test_compare_writes_the_probe_beside_the_limit(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["compare", "--model", model_dir, *QUICK[:-3], "--bandwidth-mb", "4", "--out", str(out)]
    assert cli.main(args) == 0
    assert "matrix-vector probe" in capsys.readouterr().out
    roof = json.loads(out.read_text())["roofline"]
    assert roof["bandwidth_probe"] == "matrix-vector" and roof["bandwidth_bytes_per_second"] > 0
    assert roof["copy_bandwidth_bytes_per_second"] > 0
