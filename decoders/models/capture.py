"""CUDA graphs of a model's calls: captured once per shape on first use (`replayed`), in one memory pool per LM."""

from __future__ import annotations

import contextlib
import gc
import warnings

import torch


def replayed(owner, graphs: dict, key, lm, call, args: tuple, what: str) -> torch.Tensor | None:
    """Replay `graphs[key]` (graph, inputs, logits), captured from `call(lm, *args)` on first use (`capture`): its
    logits buffer; None, with a warning the first time, if its capture failed (the caller runs the call eagerly)."""
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
    """A graph of `call(lm, *args)` on the static tensors `args`, which hold the caller's call, in the memory pool of
    `owner` (the LM whose buffers it writes): the warm-up calls run it for real (writing the slots its replay writes
    again), the capture runs nothing. Returns (graph, its logits buffer)."""
    device = owner.device

    # compiled, the call's many small kernels (norms, rotary, masks) fuse: fewer kernels in the graph to replay
    mode = lm.compile_calls if isinstance(lm.compile_calls, str) else None
    function = torch.compile(call, mode=mode) if lm.compile_calls else call

    def run():
        return function(lm, *args)

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture: kernels picked, workspaces allocated
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph, pool, caller = torch.cuda.CUDAGraph(), graph_pool(owner), torch.cuda.current_stream(device)
    # no garbage collection inside the capture: collecting a dropped LM (a cycle with its slabs) frees its graphs'
    # memory pool, a cudaFree that invalidates the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        # thread_local: CUDA work of another thread (transformers' continuous batching runs one) cannot invalidate
        # this capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = run()
    except Exception:
        # a capture failing midway leaves the allocator recording into the pool, which every later capture of
        # this LM would refuse, the capture stream current, and the device's random generator in capture mode,
        # where any later random op outside a graph raises ("Offset increment outside graph capture")
        index = device.index if device.index is not None else torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):
            torch._C._cuda_endAllocateToPool(index, pool)
        owner.held.graph_pool = None
        torch.cuda.set_stream(caller)
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())  # (a copy of its seed and offset, not capturing)
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
