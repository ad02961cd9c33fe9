"""scripts/gpu_check.sh, the device check of issue 48, run end to end on a CPU (quick mode, tests skipped), and its
curves' conversion to decodekit's calibration format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_lm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from decoders.drafting.cost import CallCost, call_cost  # noqa: E402


@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")  # torch's threads: 1 on the busy test machine
    for name in ("GPU_CHECK_PARTS", "GPU_CHECK_TOTAL"):  # (set for the check this test may run inside)
        env.pop(name, None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--device", "cpu", "--quick",
                           "--tests", "none"], env=env, capture_output=True, text=True,
                          timeout=300)  # (the quick parts' own limits add up to 260 s; a busy machine nears them)
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 9 and all(name.replace(".", "").replace("_", "").isalnum() for name in files), files
    return json.loads((out / "summary.json").read_text())


def test_every_part_reports_a_result_or_an_error(summary):
    parts = summary["parts"]
    assert set(parts) == set(gpu_check.PARTS)
    for name, part in parts.items():
        assert ("result" in part) != ("error" in part), (name, part)
        assert part["exit_status"] == 0, (name, part)
    assert parts["tests"]["result"] == {"skipped": "--tests none"}
    assert parts["env"]["result"]["threads"] == 1


def test_curves_record_every_size_and_context_of_both_models(summary):
    curves = summary["parts"]["curves"]["result"]
    sizes, contexts = gpu_check.SIZES[True], gpu_check.CONTEXTS[True]
    for role in ("target", "draft"):
        curve = curves[role]
        assert curve["stopped"] is None and curve["weight_bytes"] > 0
        for context in contexts:
            chain = [p for p in curve["points"] if p["context"] == context and p["shape"] == "chain"]
            tree = [p for p in curve["points"] if p["context"] == context and p["shape"] == "tree"]
            assert [p["n"] for p in chain] == list(sizes)
            assert [p["n"] for p in tree] == [n for n in sizes if n > 1]
            assert all(0 < p["seconds"] <= p["median"] for p in chain + tree)
        calibration = CallCost.from_dict(curve["calibration"])
        assert calibration.sizes == (1, 2, 4, 8)  # the quick sizes, all among those calibration measures
        assert list(calibration.seconds) == sorted(calibration.seconds)


def test_greedy_is_set_against_the_bandwidth_limit(summary):
    greedy = summary["parts"]["greedy"]["result"]
    bandwidth = greedy["bandwidth"]["bytes_per_second"]
    assert bandwidth == max(greedy["bandwidth"]["sum_float32"], greedy["bandwidth"]["matvec_bfloat16"]) > 0
    for role in ("target", "draft"):
        measured = greedy[role]
        assert measured["limit_tokens_per_second"] == pytest.approx(bandwidth / measured["weight_bytes"])
        for name in ("decodekit_graphs", "decodekit_eager", "transformers_eager"):
            run = measured["runs"][name]
            assert run["same_leading_tokens"] == run["tokens"]  # the static cache's tokens are transformers' cache's
            assert run["tokens"] == gpu_check.NEW_TOKENS[True] and run["decode_tokens_per_second"] > 0
            assert run["share_of_limit"] == pytest.approx(
                run["decode_tokens_per_second"] / measured["limit_tokens_per_second"])
    assert summary["headline"]["target_limit_tokens_per_second"] == greedy["target"]["limit_tokens_per_second"]


def test_batched_greedy_runs_on_graphs_eagerly_and_in_transformers(summary):
    batch = summary["parts"]["batch"]["result"]
    for rows in gpu_check.BATCHES[True]:
        runs = batch[f"rows_{rows}"]
        for name in ("decodekit_graphs", "decodekit_eager", "transformers_eager"):
            run = runs[name]
            assert run["tokens"] == rows * gpu_check.NEW_TOKENS[True] and run["tokens_per_second"] > 0, name
            assert len(run["same_leading_tokens"]) == rows
        # a batch on the static cache (`BatchSlab`, eager on a CPU) gives transformers' cache's tokens
        assert runs["decodekit_eager"]["same_leading_tokens"] == [gpu_check.NEW_TOKENS[True]] * rows
    assert summary["headline"]["batch_tokens_per_second"][f"rows_{rows}"]["decodekit_graphs"] > 0
    for kind in ("graphs", "eager"):  # the cost of one batch call by rows, tokens per row and cached positions
        for rows in gpu_check.BATCHES[True]:
            curve = batch[f"curves_{kind}"][f"rows_{rows}"]
            assert curve["stopped"] is None
            assert [(p["context"], p["n"]) for p in curve["points"]] == [
                (c, n) for c in gpu_check.CONTEXTS[True][:2] for n in gpu_check.BATCH_WIDTHS[True]]
            assert all(0 < p["seconds"] <= p["median"] for p in curve["points"])


def test_graph_capture_is_skipped_on_a_cpu_with_the_reason(summary):
    skipped = summary["parts"]["compiled"]["result"]["skipped"]
    assert "CUDA" in skipped and "cpu" in skipped
    assert summary["headline"]["compiled"] == skipped


def test_a_curve_saved_as_a_calibration_is_what_call_cost_reads(tmp_path):
    lm = tiny_lm("qwen2")
    points = [{"n": n, "context": L, "shape": "chain", "seconds": 0.01 + 0.001 * n + 1e-5 * L,
               "median": 0.011 + 0.001 * n + 1e-5 * L} for L in (128, 512) for n in (1, 2, 4, 8, 16, 32, 64)]
    curve = {"points": points + [{**points[3], "shape": "tree"}], "measured": 1.0}
    path = gpu_check.save_calibration(curve, lm, "target", tmp_path)
    read = call_cost(lm, "target", folder=tmp_path)
    assert path.parent == tmp_path and read.to_dict() == gpu_check.to_calibration(curve, "target")
    assert read.sizes == (1, 2, 4, 8, 16, 32)  # the sizes calibration measures; 64 is past them
    assert read.predict(8, 300) == pytest.approx(0.018 + 3e-3, rel=0.01)
