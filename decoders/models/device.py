"""The machine a model runs on: its device, waiting for it, its free memory, the CPU's model and flags."""

from __future__ import annotations

import functools
import platform

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (CUDA kernels run asynchronously), so a clock read after it sees it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device`, or None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        import psutil

        return psutil.virtual_memory().available
    return None


def _cpuinfo(field: str) -> str | None:
    """The first `field` line's value in Linux's /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith(field)), None)
    except OSError:
        return None


@functools.cache
def cpu_model() -> str:
    """This machine's CPU model name."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags, none where they cannot be read."""
    return frozenset((_cpuinfo("flags") or "").split())


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: CUDA when available and none was asked for, else what was asked."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but this machine has no CUDA device; use device='cpu'")
    return device
