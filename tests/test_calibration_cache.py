"""The calibration cache's reliability: a cache that cannot be written, files of the wrong shape, curves a run finds
far off. Tiny models measured with no budget beyond the rounds; never a wall-clock value."""

from __future__ import annotations

import errno
import json
import math
import warnings
from pathlib import Path

import pytest

from conftest import tiny_lm, tiny_model, tiny_tokenizer
from decoders.drafting import curve
from decoders.drafting.cost import CostModel, call_cost
from evals import cli


class CountingLM:
    """An LM that counts its forward calls: a measured calibration makes some, one read from the cache none."""

    def __init__(self, lm) -> None:
        self.lm, self.calls = lm, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.lm.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.lm, name)


def cost_of(lm, role="target", **options):
    return call_cost(lm, role, budget=0.0, **options)


def only_file(folder: Path, role="target") -> Path:
    (path,) = folder.glob(f"{role}-*.json")
    return path


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DECODEKIT_CALIBRATION", str(tmp_path / "calibration"))
    return tmp_path / "calibration"


# --- a cache that cannot be written -------------------------------------------------------------------------------


@pytest.mark.parametrize("variable, below", [("DECODEKIT_CALIBRATION", ""), ("DECODEKIT_CALIBRATION", "sub"),
                                             ("DECODEKIT_CACHE", "")])
def test_a_cache_folder_that_cannot_be_made_measures_warns_once_and_keeps_the_curve_in_memory(tmp_path, monkeypatch,
                                                                                              variable, below):
    regular = tmp_path / "a-file"
    regular.write_text("not a folder")
    monkeypatch.delenv("DECODEKIT_CALIBRATION")
    monkeypatch.setenv(variable, str(regular / below if below else regular))
    lm = CountingLM(tiny_lm("llama"))
    with pytest.warns(UserWarning, match="could not be saved") as record:
        first = cost_of(lm)
    assert len(record) == 1
    measured = lm.calls
    assert measured > 0 and first.seconds[0] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost_of(lm) == first and lm.calls == measured  # this process measures once
    assert regular.read_text() == "not a folder"


@pytest.mark.parametrize("fails", ["mkdir", "write_text", "replace"])
def test_a_read_only_cache_reads_what_it_holds_and_a_measurement_it_cannot_save_is_kept_in_memory(folder, monkeypatch,
                                                                                                  fails):
    lm = CountingLM(tiny_lm("llama"))
    saved = cost_of(lm)
    measured = lm.calls

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, fails, read_only)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost_of(lm) == saved and lm.calls == measured  # the valid file is read, nothing written
    with pytest.warns(UserWarning, match="Read-only file system") as record:
        again = cost_of(lm, refresh=True)  # measured again: the file cannot take it
    assert len(record) == 1
    assert lm.calls == 2 * measured
    assert not list(folder.glob("*.tmp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost_of(lm) is not again and cost_of(lm) == again and lm.calls == 2 * measured  # kept in memory


# --- files of the wrong shape -------------------------------------------------------------------------------------


def cost_field(name, value):
    def change(data):
        data["cost"][name] = value(data["cost"][name]) if callable(value) else value
        return data
    return change


WRONG = {  # what a file holds -> how it is wrong
    "null": lambda data: None,
    "a list": lambda data: [],
    "a number": lambda data: 42,
    "cost not an object": lambda data: {**data, "cost": "fast"},
    "no sizes": cost_field("sizes", []),
    "sizes not increasing": cost_field("sizes", lambda sizes: sizes[::-1]),
    "a size of 0": cost_field("sizes", lambda sizes: [0, *sizes[1:]]),
    "fewer seconds than sizes": cost_field("seconds", lambda seconds: seconds[:-1]),
    "seconds as strings": cost_field("seconds", lambda seconds: [str(s) for s in seconds]),
    "seconds of 0": cost_field("seconds", lambda seconds: [0.0] * len(seconds)),
    "NaN seconds": cost_field("seconds", lambda seconds: [math.nan, *seconds[1:]]),
    # a curve falling as tokens rise: the last segment, extended, predicts negative seconds for wider calls
    "seconds falling": lambda data: {**data, "cost": {**data["cost"], "sizes": [1, 2], "seconds": [1e-3, 1e-9]}},
    "seconds falling at one knot": cost_field("seconds", lambda seconds: [*seconds[:-1], seconds[-2] / 2]),
    "no per_position": cost_field("per_position", None),
    "a negative per_position": cost_field("per_position", -1.0),
    "a scale of 0": cost_field("scale", 0.0),
    "samples of two": cost_field("samples", lambda samples: [s[:2] for s in samples]),
}
DAMAGED = {"truncated": lambda text: text[:len(text) // 2], "empty": lambda text: "",
           "binary": lambda text: "\udcff\udcfe\x00".encode("utf-8", "surrogateescape")}


def check_replaced(lm, path: Path) -> None:
    """`path` is bad: reading it warns, naming it, measures again, and replaces it with a file read back as is."""
    before = lm.calls
    with pytest.warns(UserWarning, match=path.name) as record:
        cost = cost_of(lm, role=path.name.split("-")[0])
    assert len(record) == 1
    assert lm.calls > before and cost.seconds[0] > 0
    assert CostModel(cost).target_seconds(1, 0) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost_of(lm, role=path.name.split("-")[0]) == cost and lm.calls > before  # the file replaced: read
    assert json.loads(path.read_text())["cost"]["sizes"] == list(cost.sizes)


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_a_calibration_file_of_the_wrong_shape_is_measured_again_and_replaced(folder, wrong):
    role = "draft" if wrong == "seconds of 0" else "target"  # (a draft's 0 s calls divided plans' rates by 0)
    lm = CountingLM(tiny_lm("llama"))
    cost_of(lm, role)
    path = only_file(folder, role)
    path.write_text(json.dumps(WRONG[wrong](json.loads(path.read_text()))))
    check_replaced(lm, path)


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_calibration_file_is_measured_again_and_replaced(folder, damage):
    lm = CountingLM(tiny_lm("llama"))
    cost_of(lm)
    path = only_file(folder)
    damaged = DAMAGED[damage](path.read_text())
    path.write_bytes(damaged) if isinstance(damaged, bytes) else path.write_text(damaged)
    check_replaced(lm, path)


def test_a_folder_where_the_file_should_be_is_warned_of_left_alone_and_the_curve_kept_in_memory(folder):
    lm = CountingLM(tiny_lm("llama"))
    cost_of(lm)
    path = only_file(folder)
    path.unlink()
    path.mkdir()
    (path / "keep.txt").write_text("the user's")
    measured = lm.calls
    with pytest.warns(UserWarning, match=path.name) as record:
        first = cost_of(lm)
    assert len(record) == 1
    assert lm.calls == 2 * measured and (path / "keep.txt").read_text() == "the user's"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cost_of(lm) == first and lm.calls == 2 * measured


# --- curves a run finds far off -----------------------------------------------------------------------------------


def test_a_file_says_when_its_curve_was_measured_and_how_noisy(folder):
    cost = cost_of(tiny_lm("llama"))
    data = json.loads(only_file(folder).read_text())["cost"]
    assert isinstance(data["measured"], float) and data["measured"] > 0
    assert math.isfinite(data["noise"]) and data["noise"] >= 0
    assert (cost.measured, cost.noise) == (data["measured"], data["noise"])


def observe_at(model: CostModel, ratios) -> None:
    """Target calls of 1-4 tokens that take `ratios` of what the cached curve fitted."""
    for i, ratio in enumerate(ratios):
        model.observe("target", 1 + i % 4, 50, ratio * model.target.fitted(1 + i % 4, 50))


def test_a_cached_curve_that_the_runs_calls_beat_by_far_is_marked_stale_for_the_next_run(folder):
    lm, ratio = CountingLM(tiny_lm("llama")), 0.3  # calls at 0.3x the curve: it was measured on a busy machine
    cost_of(lm)
    measured = lm.calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        observe_at(CostModel(cost_of(lm)), [3.0] * 20)  # slower calls: a busy machine now, or the run's own
        # bookkeeping, which the online correction follows; measuring again would be no better: kept
        observe_at(CostModel(cost_of(lm)), [5.0 if i % 9 == 4 else 1.3 if i % 2 else 0.8 for i in range(40)])  # within
        # the noise, with a stall now and then: kept
        model = CostModel(cost_of(lm))
        observe_at(model, [ratio] * (curve.STALE_CALLS - 1))
    assert lm.calls == measured and only_file(folder).is_file()  # read from the cache; too few calls to tell
    with pytest.warns(UserWarning, match="stale") as record:
        observe_at(model, [ratio])
    assert len(record) == 1 and not list(folder.iterdir())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        observe_at(model, [ratio] * 10)  # warned once
    cost_of(lm)
    assert lm.calls == 2 * measured  # the next run measures again


def test_calibrate_says_how_old_and_how_noisy_each_curve_is(tmp_path, monkeypatch, capsys):
    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    monkeypatch.setenv("DECODEKIT_CALIBRATION", str(tmp_path / "calibration"))
    assert cli.main(["calibrate", "--model", str(model_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "target: measured " in out and " ago" in out and "noise" in out
