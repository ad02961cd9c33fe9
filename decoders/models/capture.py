"""CUDA graphs of a model's calls: captured once per shape on first use (`replayed`), in one memory pool per LM."""

from __future__ import annotations

import contextlib
import gc
import warnings

import torch


def replayed(owner, graphs: dict, key, lm, call, args: tuple, what: str) -> torch.Tensor | None:
    """Replay `graphs[key]` (graph, inputs, logits), captured on first use: its logits buffer; None, warned of once, if
    the capture failed (the caller runs the call eagerly)."""
    graph, static, logits = graphs[key]
    if graph is False:
        return None
    if graph is None:
        try:
            graph, logits = capture(owner, lm, call, args)
        except Exception as error:  # noqa: BLE001 - any failure: this call runs eagerly from now on
            warnings.warn(
                f"{lm.name}: its {what} could not be captured as a CUDA graph ({type(error).__name__}: "
                f"{error}); they run eagerly",
                stacklevel=1,
            )
            graphs[key] = (False, static, None)
            return None
        graphs[key] = (graph, static, logits)
    graph.replay()
    return logits


def capture(owner, lm, call, args: tuple):
    """(graph, its logits buffer) of `call(lm, *args)` on static tensors `args`, in the pool of `owner` (the LM whose
    buffers it writes). Warm-ups run the call for real (the replay rewrites their slots); the capture runs nothing."""
    device = owner.device

    # compiled, the call's small kernels (norms, rotary, masks) fuse
    mode = lm.compile_calls if isinstance(lm.compile_calls, str) else None
    function = torch.compile(call, mode=mode) if lm.compile_calls else call

    def run():
        return function(lm, *args)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up: kernels picked, workspaces allocated
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph, pool, caller = torch.cuda.CUDAGraph(), graph_pool(owner), torch.cuda.current_stream(device)
    # no garbage collection inside the capture: collecting a dropped LM (a cycle with its slabs) would free (cudaFree)
    # its graph pool, which invalidates the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        # thread_local: another thread's CUDA work (transformers' continuous batching) cannot invalidate the capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = run()
    except Exception:
        # a failed capture leaves the allocator recording into the pool (later captures refuse it), the capture stream
        # current, and the random generator capturing (later random ops raise "Offset increment outside graph capture")
        index = device.index if device.index is not None else torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):
            torch._C._cuda_endAllocateToPool(index, pool)
        owner.held.graph_pool = None
        torch.cuda.set_stream(caller)
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())  # (its seed and offset, not capturing)
        raise
    finally:
        if collecting:
            gc.enable()
    return graph, logits


def graph_pool(lm):
    """One memory pool for all of an LM's graphs: they never run at once, and each output is copied out."""
    if lm.held.graph_pool is None:
        lm.held.graph_pool = torch.cuda.graph_pool_handle()
    return lm.held.graph_pool
