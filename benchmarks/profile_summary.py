"""Where a step's device time goes: GPU activity of a jax.profiler trace, summed by name.

    summary = traced_device_activity(run_n_steps, steps=N)  # or, for a trace of your own:
    summary = device_activity(trace_dir, steps=N)

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


def device_activity(trace_dir: str, steps: int, top: int = 15) -> dict:
    import jax

    planes = []
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        planes.extend(jax.profiler.ProfileData.from_file(path).planes)
    return summarize_planes(planes, steps, top)


def traced_device_activity(run, steps: int, top: int = 15) -> dict:
    """Calls run() (which must end with its device work done) under a jax.profiler trace and
    returns its GPU activity per step, `steps` being the steps run() made, with the wall time
    per step from the trace's start to its end (`wall_ms_per_step_traced`)."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="decodejax_trace_")
    t = time.perf_counter()
    with jax.profiler.trace(trace_dir):
        run()
    wall_ms = (time.perf_counter() - t) * 1e3
    return device_activity(trace_dir, steps, top) | {"wall_ms_per_step_traced": wall_ms / steps}
