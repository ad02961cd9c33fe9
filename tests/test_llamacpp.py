"""The llama.cpp peers (`llamacpp:*`) without a llama.cpp build: a fake `llama-server` (a Python script serving
/health and /completion with canned timings) and a fake converter stand in for it, so the refusals, the errors and the
records can be checked here; the last tests run the real build where there is one (`decodekit peers install llamacpp`).
"""

from __future__ import annotations

import json
import sys

import pytest

from decoders.models import zoo
from evals import cli, llamacpp, llamacpp_build, measure
from evals.methods import build

QUICK = ["--suite", "article", "--limit", "2", "--max-new-tokens", "6", "--no-progress", "--bandwidth-mb", "0"]

FAKE_SERVER = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
with open(os.environ["FAKE_LLAMA_CALLS"], "a") as calls:
    calls.write(json.dumps(args) + "\n")
if mode == "fail-start":
    print("error: unknown model architecture: 'fake'", file=sys.stderr)
    sys.exit(1)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({"status": "ok"})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["FAKE_LLAMA_CALLS"], "a") as calls:
            calls.write(json.dumps(request) + "\n")
        if mode == "die":
            os._exit(3)
        n = request["n_predict"]
        tokens = [5 + i % 7 for i in range(n)]
        self.answer({"tokens": tokens, "content": "", "stop_type": "limit", "timings": {
            "prompt_n": len(request["prompt"]), "prompt_ms": 2.0, "predicted_n": n, "predicted_ms": 1e-6,
            "draft_n": 4, "draft_n_accepted": 3}})


ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
'''

FAKE_CONVERTER = r'''
import json, os, sys
import numpy as np
import gguf

folder, out = sys.argv[1], sys.argv[sys.argv.index("--outfile") + 1]
arch = json.load(open(os.path.join(folder, "config.json")))["architectures"][0]
if arch in os.environ.get("FAKE_UNSUPPORTED", ""):
    print(f"ERROR:hf-to-gguf:Model {arch} is not supported", file=sys.stderr)
    sys.exit(1)
writer = gguf.GGUFWriter(out, "llama")
writer.add_tensor("token_embd.weight", np.zeros((64, 16), dtype=np.float32))  # tied: read in full
writer.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), dtype=np.float32))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
'''
FAKE_BYTES_PER_TOKEN = (64 * 16 + 16 * 16) * 4


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh decodekit cache folder (no llama.cpp build in it)."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake(cache, tmp_path, monkeypatch):
    """A fake llama.cpp build at the install command's place: its server's calls are logged in `fake.calls`."""
    root = llamacpp_build.home()
    (root / "build" / "bin").mkdir(parents=True)
    (root / "src").mkdir()
    server = root / "build" / "bin" / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    (root / "src" / llamacpp_build.CONVERTER).write_text(FAKE_CONVERTER)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_CALLS", str(calls))
    monkeypatch.setattr(llamacpp, "START_SECONDS", 30)

    class Fake:
        def lines(self) -> list:
            return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

        def starts(self) -> list[list[str]]:
            return [line for line in self.lines() if isinstance(line, list)]

        def requests(self) -> list[dict]:
            return [line for line in self.lines() if isinstance(line, dict)]

    return Fake()


def compare(model_dir, tmp_path, *extra) -> tuple[int, dict | None]:
    out = tmp_path / "result.json"
    status = cli.main(["compare", "--model", model_dir, *QUICK, "--out", str(out), *extra])
    return status, json.loads(out.read_text()) if out.exists() else None


# ------------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("where", [None, "{tmp}/elsewhere"])
def test_without_a_build_the_llamacpp_peers_are_refused_in_one_line_naming_the_install_command(
        cache, model_dir, tmp_path, capsys, where):
    extra = ["--llamacpp", where.format(tmp=tmp_path)] if where else []
    status, result = compare(model_dir, tmp_path, "--strategies", "greedy,llamacpp:greedy", *extra)
    out, err = capsys.readouterr()
    assert status == 2 and result is None and out == "" and "loading" not in err  # before the model loads
    assert err.count("\n") == 1 and err.startswith("decodekit: error: llamacpp:greedy: ")
    assert "`decodekit peers install llamacpp`" in err


def test_the_default_set_runs_no_llamacpp_peer(cache):
    from evals.methods import plan

    methods, notes = plan((), has_draft=False)
    assert not any(m.name.startswith("llamacpp:") for m in methods) and not any("llamacpp" in n for n in notes)


def test_settings_of_the_llamacpp_peers():
    draft = build("llamacpp:draft@n_max=8@p_min=0.5")
    assert dict(draft.options) == {"n_max": 8, "n_min": 0, "p_min": 0.5} and draft.needs_draft
    assert "--spec-draft-n-max 8" in " ".join(llamacpp.arguments(draft.base, draft.options, "d.gguf"))
    ngram = build("llamacpp:ngram", {"n_min": 8})
    assert " ".join(llamacpp.arguments(ngram.base, ngram.options, None)).endswith(
        "--spec-type ngram-mod --spec-ngram-mod-n-match 24 --spec-ngram-mod-n-min 8 --spec-ngram-mod-n-max 64")
    with pytest.raises(ValueError, match="unknown setting k; its settings: n_max=3, n_min=0, p_min=0.0"):
        build("llamacpp:draft@k=3")
    with pytest.raises(ValueError, match="p_min must be a probability"):
        build("llamacpp:draft@p_min=2")
    with pytest.raises(ValueError, match="peers take no options"):
        build("llamacpp:greedy@n_max=3")


def test_a_model_the_converter_does_not_support_refuses_that_peer_by_name_and_the_others_run(
        fake, model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_UNSUPPORTED", "LlamaForCausalLM")
    status, result = compare(model_dir, tmp_path, "--strategies", "greedy,hf:greedy,llamacpp:greedy,llamacpp:ngram")
    assert status == 0 and [s["strategy"] for s in result["summary"]] == ["greedy", "hf:greedy"]
    for name in ("llamacpp:greedy", "llamacpp:ngram"):
        assert (f"{name}: refused (llama.cpp's converter failed: Model LlamaForCausalLM is not supported)"
                in result["notes"])
    assert fake.starts() == []  # no server started
    assert "llamacpp:greedy: refused" in capsys.readouterr().out  # (the printed report's notes)


# ------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("mode, error", [("fail-start", "exited with status 1 while starting: error: unknown model"),
                                         ("die", "died during the request (exit status 3)")])
def test_a_server_that_fails_is_an_error_of_that_peer_and_everything_else_is_written(
        fake, model_dir, tmp_path, monkeypatch, capsys, mode, error):
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    status, result = compare(model_dir, tmp_path, "--strategies", "greedy,llamacpp:greedy,prompt_lookup")
    assert status == 1  # written, then the runs that raised are counted
    assert {r["strategy"] for r in result["runs"]} == {"greedy", "prompt_lookup"} and len(result["runs"]) == 4
    assert [e["strategy"] for e in result["errors"]] == ["llamacpp:greedy"] * 2
    assert all(error in e["error"] and e["error"].startswith("LlamaCppError: llamacpp:greedy: ")
               for e in result["errors"])
    if mode == "fail-start":
        assert len(fake.starts()) == 1  # a server that cannot start is not tried again at every request
    else:
        assert len(fake.requests()) == 3  # warm-up and two prompts, each on a server started again
    assert "2 of 6 timed runs raised" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------- records
def test_a_llamacpp_run_is_counted_like_every_peers_with_its_own_timings_and_agreement(fake, model_dir, tmp_path):
    status, result = compare(model_dir, tmp_path, "--strategies", "greedy,llamacpp:greedy,llamacpp:ngram@n_min=4",
                             "--dtype", "float32", "--threads", "1")
    assert status == 0 and not result["errors"]
    starts = fake.starts()
    greedy_server = [s for s in starts if "--spec-type" not in s]
    assert len(greedy_server) == 1  # one server for llamacpp:greedy, kept for the whole run
    assert len(starts) - 1 == 3  # the ngram pool outlives a request: a server afresh for each (warm-up, 2 prompts)
    command = greedy_server[0]
    assert command[command.index("-t") + 1] == "1" and command[command.index("-np") + 1] == "1"
    assert command[command.index("-m") + 1].endswith(".f32.gguf")  # the same weights in the same dtype
    for request in fake.requests():
        assert request["cache_prompt"] is False and request["samplers"] == ["top_k"] and request["top_k"] == 1
        assert request["ignore_eos"] is False and request["return_tokens"] is True
    prompts = {p["id"]: p for p in result["prompts"]}
    runs = [r for r in result["runs"] if r["strategy"] == "llamacpp:greedy"]
    greedy = {r["prompt_id"]: r for r in result["runs"] if r["strategy"] == "greedy"}
    for run in runs:
        assert run["kind"] == "peer" and run["new_tokens"] == len(run["tokens"]) == 6
        assert run["finish_reason"] == "length"
        assert run["prompt_tokens"] == greedy[run["prompt_id"]]["prompt_tokens"] and run["prompt_id"] in prompts
        assert 0 <= run["ttft_seconds"] <= run["seconds"] and run["tokens_per_second"] == 6 / run["seconds"]
        assert run["extra"]["llamacpp"]["predicted_ms"] == 1e-6 and run["extra"]["llamacpp"]["prompt_ms"] == 2.0
        assert run["drafted"] is None and run["target_calls"] == 6
        assert run["lossless"]["status"] in ("exact", "tie", "differs") and "agreed" in run["lossless"]
    ngram = next(r for r in result["runs"] if r["strategy"] == "llamacpp:ngram@n_min=4")
    assert (ngram["drafted"], ngram["accepted"], ngram["target_calls"]) == (4, 3, 3)
    summary = {s["strategy"]: s for s in result["summary"]}["llamacpp:greedy"]
    assert summary["lossless"]["status"] != "failed" and summary["lossless"]["agreement"] is not None


def test_the_roofline_takes_llama_cpps_demonstrated_rate_where_it_is_better_and_says_so(
        fake, model_dir, tmp_path, capsys):
    status, result = compare(model_dir, tmp_path, "--strategies", "greedy,llamacpp:greedy", "--bandwidth-mb", "1")
    assert status == 0
    roof = result["roofline"]
    shown = roof["demonstrated"]
    assert shown["by"] == "llamacpp:greedy" and shown["bytes_per_token"] == FAKE_BYTES_PER_TOKEN
    assert shown["seconds_per_token"] == pytest.approx(2 * 1e-9 / (2 * 5))  # predicted_ms over 5 steps a run
    assert roof["bandwidth_source"] == "llamacpp:greedy"  # (the fake's canned step is implausibly fast)
    bandwidth = roof["bandwidth_bytes_per_second"]
    assert bandwidth == shown["bandwidth_bytes_per_second"] > roof["probe_bandwidth_bytes_per_second"]
    assert roof["limit_tokens_per_second"] == pytest.approx(bandwidth / roof["bytes_per_token"])
    assert "llamacpp:greedy's decoding step on the same weights, demonstrated here" in capsys.readouterr().out


def test_the_roofline_keeps_its_probe_where_that_is_better():
    line = {"bytes_per_token": 100, "bandwidth_bytes_per_second": 1e9, "limit_tokens_per_second": 1e7}
    slower = {"by": "llamacpp:greedy", "bandwidth_bytes_per_second": 5e8}
    kept = measure.with_demonstrated(line, slower)
    assert kept["bandwidth_source"] == "probe" and kept["limit_tokens_per_second"] == 1e7
    assert kept["demonstrated"] == slower and kept["probe_bandwidth_bytes_per_second"] == 1e9
    assert measure.with_demonstrated(line, None)["bandwidth_source"] == "probe"


# ------------------------------------------------------------------------------------------------------ install
def test_install_skips_what_is_built_and_says_where(fake, monkeypatch, capsys):
    bench = llamacpp_build.home() / "build" / "bin" / "llama-bench"
    bench.write_text("#!/bin/sh\n")
    bench.chmod(0o755)
    monkeypatch.setattr(llamacpp_build.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    monkeypatch.setattr(llamacpp_build.importlib.util, "find_spec", lambda name: object())
    assert cli.main(["peers", "install", "llamacpp"]) == 0
    out, err = capsys.readouterr()
    assert "already built" in err and str(bench) in out and llamacpp_build.CONVERTER in out


def test_a_zoo_models_gguf_lies_beside_its_folder(cache):
    folder = zoo.cache_dir() / "models" / "smollm2-135m"
    assert llamacpp_build.gguf_path(folder, "bf16") == zoo.cache_dir() / "models" / "smollm2-135m.bf16.gguf"
    assert llamacpp_build.gguf_path(cache.parent / "mine", "f32").parent == zoo.cache_dir() / "llamacpp" / "gguf"


# -------------------------------------------------------------------------------------------- the real llama.cpp
REAL = llamacpp_build.missing() is None and zoo.local_path("smollm2-135m") is not None
needs_real = pytest.mark.skipif(not REAL, reason="needs `decodekit peers install llamacpp` and zoo:smollm2-135m")


@needs_real
@pytest.mark.real_model
def test_the_real_llama_server_agrees_with_greedy_in_float32(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, result = compare("zoo:smollm2-135m", tmp_path, "--strategies", "greedy,llamacpp:greedy,llamacpp:ngram",
                             "--dtype", "float32", "--limit", "1")
    assert status == 0, result and result["errors"]
    summary = {s["strategy"]: s for s in result["summary"]}
    assert summary["llamacpp:greedy"]["lossless"]["status"] in ("pass", "tie")  # float32: exact up to ties
    assert all(r["extra"]["llamacpp"]["predicted_n"] == r["new_tokens"] for r in result["runs"]
               if r["strategy"] == "llamacpp:greedy")


@needs_real
@pytest.mark.real_model
def test_the_step_benchmark_reads_llama_bench():
    step = llamacpp.step_ms("zoo:smollm2-135m", "bfloat16", tokens=8, repetitions=1, threads=1)
    assert step["ms_per_token"] > 0 and step["bytes_per_token"] > 100e6 and step["gguf"].endswith(".bf16.gguf")

