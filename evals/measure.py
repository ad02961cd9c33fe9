"""Clocks and gauges: device sync, forward-call meters, peak memory, read and copy bandwidth, the run's environment."""

from __future__ import annotations

import datetime
import os
import platform
import resource
import socket
import sys
import time
from collections.abc import Sequence
from importlib import metadata

import torch

from decoders.models import linear
from decoders.models.device import cpu_model, synchronize


class ForwardMeter:
    """Counts a model's forward calls, the input tokens they scored and the seconds spent in them, via torch's public
    module hooks, and the calls of an LM's native step (`decoders.models.native`, which runs no module) that `natives`
    name."""

    def __init__(
        self, model: torch.nn.Module | Sequence[torch.nn.Module] | None, device: torch.device, natives: Sequence = ()
    ) -> None:
        self.models = [] if model is None else [model] if isinstance(model, torch.nn.Module) else list(model)
        self.natives = [n for n in natives if n is not None]
        self.device = device
        self.calls, self.tokens, self.seconds = 0, 0, 0.0
        self._handles: list = []
        self._started = 0.0

    def _before(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens += int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0
        synchronize(self.device)
        self._started = time.perf_counter()

    def _after(self, module, args, output) -> None:
        synchronize(self.device)
        self.calls += 1
        self.seconds += time.perf_counter() - self._started

    _before.decodekit_meter = _after.decodekit_meter = True  # (a native step still runs under these hooks)

    def counted(self, tokens: int, seconds: float) -> None:
        """A native step's call of `tokens` tokens took `seconds`."""
        self.calls += 1
        self.tokens += tokens
        self.seconds += seconds

    def __enter__(self) -> ForwardMeter:
        for model in self.models:
            self._handles += [
                model.register_forward_pre_hook(self._before, with_kwargs=True),
                model.register_forward_hook(self._after),
            ]
        for native in self.natives:
            native.meters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for native in self.natives:
            native.meters.remove(self)


class PeakMemory:
    """Peak memory of one run: CUDA max_memory_allocated, else the process's peak RSS (reset per run on Linux)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:  # Linux: writing 5 to clear_refs resets the VmHWM high-water mark
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # the resource fallback below then reports the process's lifetime peak

    def read(self) -> int:
        """Bytes at the high-water mark since `reset`."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (tied weights counted once)."""
    tensors = list(model.parameters()) + list(model.buffers())
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
    return int(sum(unique.values()))


def bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one batch-1 decoding step must read: every parameter, except that an input embedding table not tied
    to the output layer is read one row at a time (a row is negligible)."""
    total = parameter_bytes(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is not None and (output is None or output.weight.data_ptr() != embedding.weight.data_ptr()):
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return int(total)


PROBE = "matrix-vector"  # the roofline's bandwidth probe, as the report names it
PROBE_COLUMNS = 4096  # the probe matrix's width, a typical hidden size (its rows fill the megabytes asked for)


def _best_seconds(device: torch.device, work, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `work`, after one untimed (first touch: page faults are no bandwidth)."""
    work()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(
    device: torch.device, megabytes: int = 256, dtype: torch.dtype = torch.float32, repeats: int = 5
) -> float:
    """Bytes/s a matrix-vector product of a `megabytes` matrix of `dtype` streams: the best of `repeats`.

    A batch-1 decoding step only reads its weights, through one such product per weight matrix (a linear layer of one
    row), so this kernel over a buffer larger than the last-level cache is the rate a step can reach; a copy also
    writes, in another kernel, and overstates it. Where the native kernel runs (`decoders.models.native`, bfloat16 on
    a CPU), the faster of torch's and its product counts."""
    rows = max(1, megabytes * 2**20 // (PROBE_COLUMNS * dtype.itemsize))
    layer = torch.nn.Linear(PROBE_COLUMNS, rows, bias=False, device="meta")  # [rows, PROBE_COLUMNS] of ones
    layer.weight = torch.nn.Parameter(torch.ones(rows, PROBE_COLUMNS, dtype=dtype, device=device), requires_grad=False)
    vector = torch.ones(1, PROBE_COLUMNS, dtype=dtype, device=device)
    layers = [layer]
    if device.type == "cpu" and dtype == torch.bfloat16 and linear.available():
        from decoders.models.kernel import library

        layers.append(linear.NativeLinear(layer, library(), native_rows=1))
    with torch.inference_mode():
        seconds = min(_best_seconds(device, lambda probe=probe: probe(vector), repeats) for probe in layers)
    return layer.weight.numel() * layer.weight.element_size() / seconds


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of copying a `megabytes` float32 tensor, read and write counted: the best of `repeats`."""
    source = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = _best_seconds(device, lambda: target.copy_(source), repeats)
    return 2 * source.numel() * source.element_size() / seconds


def roofline(
    model: torch.nn.Module, device: torch.device, megabytes: int = 256, dtype: torch.dtype | None = None
) -> dict:
    """The batch-1 decoding limit: bytes read per step / the read bandwidth of a matrix-vector product of `dtype`
    (default: the model's first floating-point parameter's), as tokens/s; the copy bandwidth beside it."""
    dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    per_token = bytes_per_token(model)
    bandwidth = read_bandwidth(device, megabytes, dtype)
    return {
        "parameter_bytes": parameter_bytes(model),
        "bytes_per_token": per_token,
        "bandwidth_bytes_per_second": bandwidth,
        "bandwidth_probe": PROBE,
        "bandwidth_probe_dtype": str(dtype).removeprefix("torch."),
        "bandwidth_probe_megabytes": megabytes,
        "copy_bandwidth_bytes_per_second": copy_bandwidth(device, megabytes),
        "limit_tokens_per_second": bandwidth / per_token,
    }


def with_demonstrated(line: dict, shown: dict | None) -> dict:
    """`roofline`'s `line` at the better of its probe's read bandwidth and the rate a real decoding step `shown` on
    the same machine ({"by": its method, "bandwidth_bytes_per_second", ...}, e.g. `evals.llamacpp.demonstrated`), and
    which it is: `bandwidth_source` "probe" or the method's name. The probe's own figure stays beside it."""
    probe = line["bandwidth_bytes_per_second"]
    line = {**line, "probe_bandwidth_bytes_per_second": probe, "demonstrated": shown, "bandwidth_source": "probe"}
    if shown and shown["bandwidth_bytes_per_second"] > probe:
        line.update(
            bandwidth_bytes_per_second=shown["bandwidth_bytes_per_second"],
            bandwidth_source=shown["by"],
            limit_tokens_per_second=shown["bandwidth_bytes_per_second"] / line["bytes_per_token"],
        )
    return line


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def device_name(device: torch.device) -> str:
    """A human name for the device: the GPU's name, or the CPU model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    """Where and with what a result was measured: the leaderboard header."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "accelerate": _version("accelerate"),
        "decodekit": _version("decodekit"),
    }
