"""`csrc/step.cpp` (the native step and its product), compiled on first use and loaded through ctypes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from decoders.models.device import cpu_flags

SOURCE = Path(__file__).parent / "csrc" / "step.cpp"
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
INT8 = 2  # the weight type of an int8 copy's layers (int8 rows, a bfloat16 scale each)


class DkModel(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "dtype", "wtype")
    ] + [
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p),
        ("lm_head_scale", ctypes.c_void_p),
        ("weights", ctypes.POINTER(ctypes.c_void_p)),
    ]


class DkCall(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "width", "past", "capacity", "keep", "threads")] + [
        ("embeddings", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("allowed", ctypes.c_void_p),
        ("keys", ctypes.POINTER(ctypes.c_void_p)),
        ("values", ctypes.POINTER(ctypes.c_void_p)),
        ("logits", ctypes.c_void_p),
    ]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")


@functools.cache
def library() -> ctypes.CDLL | str:
    """The compiled kernels (built once per source, flags, compiler and CPU, then cached), or why they are not here."""
    from decoders.models.zoo import cache_dir

    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (install g++ or set CXX)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"{compiler} --version failed: {error}"
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), *FLAGS, version, platform.machine(), " ".join(sorted(cpu_flags()))]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / key / "libdkstep.so"
    try:
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                run = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
                if run.returncode != 0:
                    return f"compiling {SOURCE.name} failed: {run.stderr.strip()[-400:]}"
                os.replace(built, target)  # (atomic: a process compiling at once finds one or the other)
        lib = ctypes.CDLL(str(target))
    except OSError as error:
        return f"the compiled kernels could not be written or loaded at {target}: {error}"
    lib.dk_forward.argtypes = [ctypes.POINTER(DkModel), ctypes.POINTER(DkCall)]
    lib.dk_forward.restype = ctypes.c_int
    lib.dk_vectorized.restype = ctypes.c_int
    lib.dk_linear.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    lib.dk_linear.restype = ctypes.c_int
    return lib


def why_not_here(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None if the native step can run models of `dtype` on this machine, else why not."""
    lib = library()
    if isinstance(lib, str):
        return lib
    if dtype == torch.bfloat16 and not lib.dk_vectorized():
        return "this CPU has neither AVX-512 BF16 nor AVX2 (the portable build is slower than transformers here)"
    return None
