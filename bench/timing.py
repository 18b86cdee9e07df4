"""How one benchmark step is timed (DESIGN §5), three ways: per call (events around one call, the GPU idle before
it: host work counts), back to back (N calls between two events: what a training loop that runs ahead sees) and
CUDA-graph replay; and the extra peak memory of one call.

The device work (events, synchronisation, graph capture, allocator statistics) sits behind a timer object, so the
logic here runs on the CPU too: CudaTimer on a GPU, HostTimer (perf_counter, graphs simulated by re-running) on
the CPU, fakes in the tests.
"""
import statistics
import time

import torch

REPLAY_TOLERANCE = 2e-2  # relative error between a graph replay's outputs and an eager call's (atomics reorder sums)


def short(ex):
    """One line naming the exception: 'TypeName: first line of the message' (at most 300 characters)."""
    return f"{type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"[:300]


def tensors_of(outputs):
    """The tensors of a step's outputs (a tensor or a tuple of tensors / None)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [t for t in outputs if isinstance(t, torch.Tensor)]


class CudaTimer:
    """CUDA events on the current stream, torch.cuda.graph, the caching allocator's statistics."""
    graphs = "CUDA graph"

    def elapsed_ms(self, fn, calls=1):
        """ms between two events around `calls` calls of fn(), the GPU idle before the first."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def capture(self, fn, warmup):
        """(replay, static outputs) of fn() captured in a CUDA graph, after `warmup` calls on a side stream (as
        torch.cuda.graph's documentation asks). A step that synchronizes with the host is refused before capture."""
        refuse_host_sync(fn)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn()
        return graph.replay, outputs

    def peak_extra_bytes(self, fn):
        """Bytes torch.cuda.max_memory_allocated rises above the allocation before one fn()."""
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def release(self):
        """Returns cached blocks (a finished graph's pool) to the device."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def refuse_host_sync(fn):
    """Runs fn() once with torch's sync debug mode set to error; a synchronizing call (which would break a capture,
    e.g. torch.bincount's size read) raises RuntimeError('not captured: ...') instead."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as ex:
        if "synchroniz" in str(ex):
            raise RuntimeError(f"not captured: the step synchronizes with the host ({short(ex)})") from ex
        raise
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class HostTimer:
    """perf_counter around the calls; a 'graph' is simulated by re-running the step into its first outputs (CPU
    runs of the benchmark flow only: no CUDA graphs, no memory statistics)."""
    graphs = "simulated (host re-run, no CUDA graph)"

    def elapsed_ms(self, fn, calls=1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return 1e3 * (time.perf_counter() - t0)

    def capture(self, fn, warmup):
        for _ in range(warmup):
            fn()
        outputs = fn()

        def replay():
            for static, fresh in zip(tensors_of(outputs), tensors_of(fn())):
                static.copy_(fresh)
        return replay, outputs

    def peak_extra_bytes(self, fn):
        fn()
        return None

    def release(self):
        pass


def per_call(fn, timer, warmup, iters, max_seconds):
    """Median, min and max ms of fn() timed alone, after warm-up; stops early (>= 3 runs) past max_seconds."""
    for _ in range(warmup):
        fn()
    times = []
    while len(times) < iters and (len(times) < 3 or sum(times) < 1e3 * max_seconds):
        times.append(timer.elapsed_ms(fn))
    return {"ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": len(times)}


def cuda_time(fn, warmup, iters, max_seconds):
    """per_call on the CUDA timer: the profile scripts' timing of one call."""
    return per_call(fn, CudaTimer(), warmup, iters, max_seconds)


def back_to_back_calls(iters, per_call_ms, max_seconds):
    """N for the back-to-back window: iters, fewer (>= 3) where iters calls would take over max_seconds."""
    if not per_call_ms or per_call_ms <= 0:
        return iters
    return max(min(iters, 3), min(iters, int(1e3 * max_seconds / per_call_ms)))


def back_to_back(fn, timer, calls):
    """ms per call of `calls` calls of fn() queued between two events."""
    return {"b2b_ms": timer.elapsed_ms(fn, calls) / calls, "b2b_calls": calls}


def verify_replay(replay, outputs, fn):
    """Zeroes the captured outputs, replays, and compares them to a fresh eager call: raises RuntimeError if the
    replay does not reproduce it (work left out of the graph)."""
    static = tensors_of(outputs)
    for t in static:
        t.zero_()
    replay()
    eager = tensors_of(fn())
    for i, (a, b) in enumerate(zip(static, eager)):
        err = rel_diff(a, b)
        if not err <= REPLAY_TOLERANCE:
            raise RuntimeError(f"graph replay differs from an eager call: output {i} rel err {err:.2e}")


def rel_diff(a, b, chunk=1 << 26):
    """||a - b|| / ||b|| (||a - b|| when b is all zeros), in float32 slices of the flattened tensors."""
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    num = den = 0.0
    for i in range(0, b.numel(), chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        num += torch.linalg.vector_norm(x - y, dtype=torch.float64).item() ** 2
        den += torch.linalg.vector_norm(y, dtype=torch.float64).item() ** 2
    return (num / den) ** 0.5 if den > 0 else num ** 0.5


def graph_replay(fn, timer, warmup, iters, max_seconds):
    """Per-call timing of the replay of fn() captured once, checked against an eager call first."""
    replay, outputs = timer.capture(fn, warmup)
    try:
        verify_replay(replay, outputs, fn)
        r = per_call(replay, timer, warmup, iters, max_seconds)
    finally:
        del replay, outputs
        timer.release()
    return {"graph_ms": r["ms"], "graph_min_ms": r["min_ms"], "graph_max_ms": r["max_ms"], "graph_iters": r["iters"]}


TIMINGS = ("per_call", "back_to_back", "graph")


def time_step(fn, timer, settings, timings=("per_call", "back_to_back")):
    """The cell of one pass and implementation: per call (always) with the extra peak memory of one call, and back
    to back where asked."""
    r = per_call(fn, timer, settings.warmup, settings.iters, settings.max_seconds)
    peak = timer.peak_extra_bytes(fn)
    r["peak_extra_gib"] = None if peak is None else peak / 2**30
    if "back_to_back" in timings:
        r.update(back_to_back(fn, timer, back_to_back_calls(settings.iters, r["ms"], settings.max_seconds)))
    return r


def time_graph(fn, timer, settings):
    """The graph_* entries of a cell, or its graph_error: a failing capture or replay never raises."""
    try:
        return graph_replay(fn, timer, settings.warmup, settings.iters, settings.max_seconds)
    except Exception as ex:  # noqa: BLE001 - recorded in the cell, the run goes on
        timer.release()
        return {"graph_error": short(ex)}
