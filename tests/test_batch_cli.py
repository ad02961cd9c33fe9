"""`decodekit compare --batch-size`: the suite as one queue per method, through the command line on a tiny model.

One sweep (batch sizes 1 and 3, greedy, prompt_lookup, hf:batch and hf:continuous) is run once for the module and
read by several tests; the others run greedy-only queues of a few tokens.
"""

from __future__ import annotations

import json

import pytest

import decoders
from decoders.base import DecodeState, Steps
from decoders.strategies.greedy import Greedy
from evals import cli, metrics, report
from evals.cli_parser import build_parser
from evals.methods import plan
from evals.peers import BATCH_PEERS, PEERS
from evals.runner import CompareConfig

SUITE = [
    {"id": "fib", "category": "code", "prompt": "def fibonacci(n):"},
    {"id": "fox", "category": "prose", "prompt": "The quick brown fox"},
    {"id": "index", "category": "article", "prompt": "Index: A B C"},
    {"id": "pi", "category": "article", "prompt": "The digits of Pi are 3.14159", "max_new_tokens": 5},
]
NEW = 10
COMMON = ["--max-new-tokens", str(NEW), "--no-progress", "--bandwidth-mb", "0"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("suite") / "four.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in SUITE), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def sweep(model_dir, suite, tmp_path_factory):
    """One batched compare: batch sizes 1 and 3, every kind of method, every report written."""
    folder = tmp_path_factory.mktemp("sweep")
    args = ["compare", "--model", model_dir, "--suite", suite, "--batch-size", "3,1", *COMMON,
            "--strategies", "greedy,prompt_lookup,hf:batch,hf:continuous", "--out", str(folder / "r.json"),
            "--markdown", str(folder / "r.md"), "--html", str(folder / "r.html"), "--plots", str(folder / "plots")]
    status = cli.main(args)
    return status, (folder / "r.md").read_text(), json.loads((folder / "r.json").read_text()), folder


def continuous_ran(result: dict) -> bool:
    """Whether transformers' generate_batch ran on this machine (else it is reported as not run)."""
    return not result["skipped"]


def test_a_sweep_reports_throughput_latency_and_ttft_per_batch_size(sweep):
    status, text, result, _ = sweep
    assert status == 0
    assert result["config"]["batch_sizes"] == [1, 3]
    assert ("| strategy | batch | lossless | tok/s ↑ | speed-up ↑ | latency p50 ms ↓ | latency p90 ms ↓ | "
            "TTFT p50 ms ↓ | TTFT p90 ms ↓") in text
    methods = ["greedy", "prompt_lookup", "hf:batch"] + (["hf:continuous"] if continuous_ran(result) else [])
    summary = {(s["strategy"], s["batch_size"]): s for s in result["summary"]}
    assert list(summary) == [(m, n) for n in (1, 3) for m in methods]  # by batch size, greedy first
    for (name, size), s in summary.items():
        assert s["lossless"]["status"] in (("reference",) if (name, size) == ("greedy", 1) else ("pass", "tie"))
        assert s["prompts"] == len(SUITE) and s["tokens_per_second"]["mean"] > 0
        assert 0 < s["latency_p50_seconds"] <= s["latency_p90_seconds"]
        assert 0 < s["ttft_p50_seconds"] <= s["ttft_p90_seconds"]
    assert summary["greedy", 3]["speedup"]["mean"] == pytest.approx(1.0)
    greedy_3 = summary["greedy", 3]["lossless"]
    assert greedy_3["exact"] + greedy_3["tie"] == len(SUITE)  # greedy at batch 3 is checked against batch 1
    assert f"| hf:batch | 3 | {report.lossless_cell(summary['hf:batch', 3])} |" in text
    assert "Fastest lossless: batch 1: " in text and " · batch 3: " in text
    assert "Throughput (tok/s over the whole suite) by batch size:" in text
    assert "| strategy | batch 1 ↑ | batch 3 ↑ |" in text
    assert "batched: each method decodes the suite as one queue with 1, 3 requests in flight" in text


def test_every_request_is_a_run_and_every_queue_a_record(sweep):
    _, _, result, _ = sweep
    queues = result["queues"]
    assert {(q["strategy"], q["batch_size"]) for q in queues} == {(s["strategy"], s["batch_size"])
                                                                  for s in result["summary"]}
    for queue in queues:
        runs = [r for r in result["runs"] if (r["strategy"], r["batch_size"], r["repeat"]) ==
                (queue["strategy"], queue["batch_size"], queue["repeat"])]
        assert sorted(r["prompt_id"] for r in runs) == sorted(p["id"] for p in SUITE)
        assert queue["new_tokens"] == sum(r["new_tokens"] for r in runs) and queue["requests"] == len(SUITE)
        assert queue["tokens_per_second"] == pytest.approx(queue["new_tokens"] / queue["seconds"])
    for run in result["runs"]:
        assert run["new_tokens"] == len(run["tokens"]) <= run["max_new_tokens"]
        assert run["max_new_tokens"] == (5 if run["prompt_id"] == "pi" else NEW)  # the line's own cap, every method
        assert 0 < run["ttft_seconds"] <= run["seconds"]
    greedy_1 = {r["prompt_id"]: r["tokens"] for r in result["runs"]
                if (r["strategy"], r["batch_size"]) == ("greedy", 1)}
    for run in result["runs"]:  # the exact rows are greedy's batch-1 tokens
        if run["lossless"]["status"] == "exact":
            assert run["tokens"] == greedy_1[run["prompt_id"]]


def test_the_plot_html_and_leaderboard_of_a_sweep(sweep, capsys):
    _, _, result, folder = sweep
    assert sorted(p.name for p in (folder / "plots").iterdir()) == [
        "acceptance_by_position.png", "throughput_by_batch_size.png"]
    assert (folder / "plots" / "throughput_by_batch_size.png").stat().st_size > 1000
    page = (folder / "r.html").read_text()
    assert "<h2>Throughput by batch size</h2>" in page and "latency p50 ms" in page and "· batch 3 ·" in page
    assert cli.main(["leaderboard", str(folder / "r.json"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {"greedy (batch 1)", "greedy (batch 3)", "hf:batch (batch 3)"} <= {row["strategy"] for row in rows}


def test_hf_continuous_runs_or_says_why_not(sweep):
    _, text, result, _ = sweep
    if continuous_ran(result):
        assert any(q["strategy"] == "hf:continuous" and q["call_seconds"] >= q["seconds"] for q in result["queues"])
    else:
        assert result["skipped"][0]["strategy"] == "hf:continuous"
        assert "| hf:continuous | – | not run on this device (see notes) |" in text
        assert "hf:continuous: not run (transformers' generate_batch does not run" in text


def test_a_failing_generate_batch_is_a_row_and_a_note_not_a_failure(model_dir, suite, monkeypatch, capsys):
    from evals import batched

    def broken(*args, **kwargs):
        raise RuntimeError("paged attention needs a GPU here")

    monkeypatch.setattr(batched, "generate_batch", broken)
    args = ["compare", "--model", model_dir, "--suite", suite, "--batch-size", "2", "--max-new-tokens", "3",
            "--no-progress", "--bandwidth-mb", "0", "--no-warmup", "--strategies", "hf:continuous"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "| hf:continuous | – | not run on this device (see notes) |" in out
    assert "RuntimeError: paged attention needs a GPU here" in out and "| greedy | 2 | ✓ " in out  # (not reference)


@pytest.mark.parametrize("args, message", [
    (["--strategies", "hf:batch"], "hf:batch: runs only in a batched compare: pass --batch-size N"),
    (["--strategies", "hf:greedy", "--batch-size", "2"], "hf:greedy: decodes one prompt at a time"),
    (["--strategies", "guided", "--batch-size", "2"], "guided: runs only on prompts with a schema"),
])
def test_methods_that_cannot_run_in_this_kind_of_compare_are_refused_up_front(args, message, capsys):
    assert cli.main(["compare", "--model", "unused", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decodekit: error: ") and message in err and "loading" not in err


@pytest.mark.parametrize("value", ["0", "2,x", "4,,8"])
def test_a_bad_batch_size_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compare", "--model", "unused", "--batch-size", value])
    assert exit_.value.code == 2 and "--batch-size" in capsys.readouterr().err


@pytest.mark.parametrize("value, sizes", [("4,4", (4,)), ("4,1,4", (1, 4)), ("16, 4,04", (4, 16))])
def test_a_batch_size_given_twice_runs_once(value, sizes):
    """Duplicates are dropped, the sizes sorted: a sweep runs each size once (README, `--batch-size`)."""
    args = build_parser().parse_args(["compare", "--model", "unused", "--batch-size", value])
    assert args.batch_size == sizes
    assert CompareConfig(batch_sizes=(4, 4, 1)).batch_sizes == (1, 4)


def test_the_default_set_of_a_batched_compare():
    methods, notes = plan((), has_draft=False, batched=True)
    names = [m.name for m in methods]
    assert names[0] == "greedy" and set(BATCH_PEERS) <= set(names) and not set(PEERS) & set(names)
    assert all(not m.needs_grammar and not m.needs_draft for m in methods)
    assert any(n.startswith("guided: skipped (runs only on prompts with a schema") for n in notes)
    one_by_one, _ = plan((), has_draft=False)
    assert not set(BATCH_PEERS) & {m.name for m in one_by_one}  # compare without --batch-size: as before


@pytest.fixture
def wrong_on_fox():
    """Greedy, batchable, that picks another token at the third position of the prompt ending in "fox"."""

    @decoders.register("test_wrong_on_fox")
    class WrongOnFox(Greedy):
        """Greedy with one wrong token on one prompt."""

        def steps(self, state: DecodeState) -> Steps:
            logits = yield state.call()
            token = state.choose(logits[-1])
            if len(state.new_tokens) == 2 and state.lm.decode(state.tokens[: state.prompt_len]).endswith("fox"):
                token = int(logits[-1].argsort()[-2])  # the runner-up
            state.accept([token], ["target"], rows=logits[-1:])

    yield "test_wrong_on_fox"
    decoders.unregister("test_wrong_on_fox")


def test_the_lossless_check_holds_per_request(model_dir, suite, tmp_path, wrong_on_fox, capsys):
    out = tmp_path / "r.json"
    args = ["compare", "--model", model_dir, "--suite", suite, "--batch-size", "2", "--no-warmup",
            "--strategies", wrong_on_fox, "--out", str(out), *COMMON]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert f"| {wrong_on_fox} | 2 | FAILED @2 (fox) |" in text
    assert f"{wrong_on_fox} on fox (batch 2, repeat 0): failed at token 2" in text
    runs = json.loads(out.read_text())["runs"]
    verdicts = {r["prompt_id"]: r["lossless"]["status"] for r in runs if r["strategy"] == wrong_on_fox}
    assert verdicts.pop("fox") == "failed" and set(verdicts.values()) <= {"exact", "tie"} and len(verdicts) == 3


def test_percentiles_interpolate_between_ranks():
    assert metrics.percentile([], 50) is None and metrics.percentile([3.0], 90) == 3.0
    assert metrics.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_a_compare_without_batch_size_writes_what_it_wrote_before(model_dir, suite, tmp_path):
    out = tmp_path / "r.json"
    args = ["compare", "--model", model_dir, "--suite", suite, "--strategies", "greedy", "--no-warmup",
            "--out", str(out), *COMMON]
    assert cli.main(args) == 0
    result = json.loads(out.read_text())
    assert "queues" not in result and "skipped" not in result and "batch_sizes" not in result["config"]
    assert all("batch_size" not in r for r in result["runs"])
    assert all("batch_size" not in s and "latency_p50_seconds" not in s for s in result["summary"])


def test_ctrl_c_keeps_the_finished_rounds(model_dir, suite, tmp_path, monkeypatch, capsys):
    from evals import batched

    queue = batched.decodekit_queue

    def interrupted_at_batch_2(*args, **kwargs):
        if kwargs["batch_size"] == 2 and kwargs["repeat"] >= 0:
            raise KeyboardInterrupt
        return queue(*args, **kwargs)

    monkeypatch.setattr(batched, "decodekit_queue", interrupted_at_batch_2)
    out = tmp_path / "r.json"
    args = ["compare", "--model", model_dir, "--suite", suite, "--batch-size", "1,2", "--strategies", "greedy",
            "--out", str(out), *COMMON]
    assert cli.main(args) == 130
    result = json.loads(out.read_text())
    assert result["partial"] and {q["batch_size"] for q in result["queues"]} == {1}
    assert "interrupted (Ctrl-C) after 1 of 2 rounds" in capsys.readouterr().out
