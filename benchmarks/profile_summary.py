"""Where a step's device time goes: GPU activity of a jax.profiler trace, summed by name.

    summary = traced_device_activity(run_n_steps, steps=N)  # or, for a trace of your own:
    summary = summarize_planes(load_planes(trace_dir), steps=N)
    timeline = stream_timeline(planes, steps=N)  # GPU busy and idle, and the host's traced work
    spans = program_spans(planes, runs=R, calls=N)  # GPU time per call of each of R runs of one program

`stream_timeline` answers what the sums cannot: whether the GPU waits between launches (the
idle time from the first launch's start to the last one's end) and what the host's traced
work per step is (host events summed by name, each thread apart; nested events are each
counted, so the names overlap).

Reads every `*.xplane.pb` under the trace directory with `jax.profiler.ProfileData` and sums
the events of the GPU planes' stream lines (kernels and copies, one event per launch) by
name. The summary says which lines it read, so a trace whose layout differs shows up as an
empty or odd summary rather than as wrong numbers.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import time

DEVICE_PLANE_PREFIX = "/device:GPU"
STREAM_LINE_PREFIX = "Stream"
HOST_PLANE_PREFIX = "/host:CPU"
PYTHON_EVENT_PREFIX = "$"  # the Python tracer's function events


def summarize_planes(planes, steps: int, top: int = 15) -> dict:
    """Per-step device time and the `top` names by time, from ProfileData-like planes."""
    time_ns, launches, lines = collections.Counter(), collections.Counter(), set()
    for plane in planes:
        if not plane.name.startswith(DEVICE_PLANE_PREFIX):
            continue
        for line in plane.lines:
            if not line.name.startswith(STREAM_LINE_PREFIX):
                continue
            lines.add(f"{plane.name} {line.name}")
            for event in line.events:
                time_ns[event.name] += event.duration_ns
                launches[event.name] += 1
    total = sum(time_ns.values())
    return {
        "steps": steps,
        "lines_read": sorted(lines),
        "device_us_per_step": total / steps / 1e3,
        "launches_per_step": sum(launches.values()) / steps,
        "top": [{"name": name[:160], "us_per_step": ns / steps / 1e3, "launches_per_step": launches[name] / steps,
                 "share": ns / total if total else 0.0} for name, ns in time_ns.most_common(top)],
    }


def _percentile(sorted_values: list, q: float):
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] if sorted_values else None


def _stream_events(planes) -> list[tuple[int, int]]:
    """(start ns, end ns) of every event on the GPU planes' stream lines, in start order."""
    return sorted((e.start_ns, e.start_ns + e.duration_ns) for plane in planes if plane.name.startswith(DEVICE_PLANE_PREFIX)
                  for line in plane.lines if line.name.startswith(STREAM_LINE_PREFIX) for e in line.events)


def _equal_runs(events: list, runs: int, what: str) -> list[list]:
    """`events` cut into `runs` consecutive runs of equal count; an error if they do not divide."""
    if not events or len(events) % runs:
        raise ValueError(f"{len(events)} GPU {what} do not split into {runs} runs of one program")
    n = len(events) // runs
    return [events[i * n:(i + 1) * n] for i in range(runs)]


def stream_timeline(planes, steps: int, top: int = 12) -> dict:
    """GPU busy and idle time per step over the traced stream events, and the host's traced work.

    `gaps_us` are the waits between one stream event's end and the next one's start, in start
    order over all GPU stream lines (a negative gap is an overlap); `idle_us_per_step` is the
    span from the first start to the last end less the busy time, per step."""
    spans, host = _stream_events(planes), collections.defaultdict(collections.Counter)
    for plane in planes:
        if plane.name.startswith(HOST_PLANE_PREFIX):
            for line in plane.lines:
                for e in line.events:
                    if not e.name.startswith(PYTHON_EVENT_PREFIX):
                        host[line.name][e.name] += e.duration_ns
    gaps = sorted(b[0] - a[1] for a, b in zip(spans, spans[1:]))
    busy = sum(end - start for start, end in spans)
    span = spans[-1][1] - spans[0][0] if spans else 0
    threads = sorted(host, key=lambda t: -sum(host[t].values()))
    return {
        "steps": steps,
        "gpu_events": len(spans),
        "span_us_per_step": span / steps / 1e3,
        "busy_us_per_step": busy / steps / 1e3,
        "idle_us_per_step": (span - busy) / steps / 1e3,
        "gaps_us": {name: (g / 1e3 if g is not None else None) for name, g in
                    (("median", _percentile(gaps, 0.5)), ("p90", _percentile(gaps, 0.9)), ("max", gaps[-1] if gaps else None))},
        "host_us_per_step": {t: {name: ns / steps / 1e3 for name, ns in host[t].most_common(top)} for t in threads[:4]},
    }


def program_spans(planes, runs: int, calls: int) -> list[float]:
    """Microseconds per call of each of `runs` runs of one program that makes `calls` calls, traced
    back to back: the stream events in start order cut into `runs` runs of equal count, each
    run's first start to last end, over `calls`. The host's dispatch of a run and the GPU's wait
    between runs are left out, as CUDA events around a CUDA graph's replays leave them out."""
    chunks = _equal_runs(_stream_events(planes), runs, f"events (runs={runs})")
    return [(max(end for _, end in chunk) - chunk[0][0]) / calls / 1e3 for chunk in chunks]


def load_planes(trace_dir: str) -> list:
    import jax

    planes = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        planes.extend(jax.profiler.ProfileData.from_file(path).planes)
    return planes


def traced(run, *, python_tracer: bool = True) -> tuple[list, float]:
    """Calls run() (which must end with its device work done) under a jax.profiler trace:
    (the trace's planes, run()'s wall time in ms). python_tracer=False leaves Python's function
    events out, so the host's traced times are not inflated by the tracer."""
    import jax

    options = jax.profiler.ProfileOptions()
    if not python_tracer:
        options.python_tracer_level = 0
    trace_dir = tempfile.mkdtemp(prefix="decodejax_trace_")
    t = time.perf_counter()
    with jax.profiler.trace(trace_dir, profiler_options=options):
        run()
    return load_planes(trace_dir), (time.perf_counter() - t) * 1e3


def traced_device_activity(run, steps: int, top: int = 15) -> dict:
    """run()'s GPU activity per step (`summarize_planes`), `steps` being the steps run() made,
    with the wall time per step from the trace's start to its end (`wall_ms_per_step_traced`)."""
    planes, wall_ms = traced(run)
    return summarize_planes(planes, steps, top) | {"wall_ms_per_step_traced": wall_ms / steps}
