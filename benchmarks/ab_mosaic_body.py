"""A/B of the Mosaic GPU decode kernel's body: this tree's against another version's, on the benchmark's cases.

    git show <commit>:pallas_kernels/decode_attention_mgpu.py > /tmp/base_mgpu.py
    python -m benchmarks.ab_mosaic_body [--whole-module] /tmp/base_mgpu.py OUT.json [CASES]   # CASES: comma-separated

The other version's `_decode_body` replaces this tree's inside the same wrapper (same plan, launch
and merge), so only the kernel body differs. With --whole-module the other version's whole
kernel module (its wrapper, shared-memory tiles and config included) replaces this tree's, for
a change whose body and wrapper go together. Per case, the two take turns twice, each compiled
afresh; each run is timed inside one jitted program (`decode_attention.time_in_program`: traced
spans) and by the host's clock around such programs (`host_clock`: the profiler left out, for a
change to how kernels overlap, which tracing may alter), and its output compared with the first
run's (a change that should not alter the arithmetic shows 0).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import sys

HOST_SAMPLES = 10  # host-clock samples a run, each five chained programs (`evidence.timed_samples_in_program`)


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("base_decode_attention_mgpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def base_patches(base, whole_module: bool) -> dict:
    """{(module, name): replacement} that put the base (a loaded kernel module) in this tree's place."""
    import pallas_kernels
    from pallas_kernels import decode_attention_mgpu as current

    if whole_module:  # the ops and dispatch import the kernel module from its package at each call
        return {(pallas_kernels, "decode_attention_mgpu"): base}
    return {(current, "_decode_body"): base._decode_body}


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import decodejax
    from decodejax import evidence
    from benchmarks import cases as bench_cases
    from benchmarks.decode_attention import summarize, time_in_program
    from benchmarks.mosaic_probes import patched

    args = list(argv or sys.argv[1:])
    whole_module = "--whole-module" in args
    base_path, out_path, *names = [a for a in args if a != "--whole-module"]
    base = load_module(base_path)
    with open(base_path, "rb") as f:
        base_sha256 = hashlib.sha256(f.read()).hexdigest()
    bodies = {"base": base_patches(base, whole_module), "this_tree": {}}
    out = {}
    for case in bench_cases.selected(names[0] if names else ""):
        data = bench_cases.make_case(case)
        q, k, v = (jnp.asarray(data[n], jnp.bfloat16) for n in ("q", "k_pages", "v_pages"))
        table, lens = jnp.asarray(data["page_table"]), jnp.asarray(data["seq_lens"])
        first = None
        for turn in range(2):
            for name, patches in bodies.items():
                with patched(patches):
                    jax.clear_caches()  # traced again with this body
                    fn = jax.jit(functools.partial(decodejax.decode_attention, backend="pallas_mosaic_gpu"))
                    o = np.asarray(fn(q, k, v, table, lens), np.float32)
                    first = o if first is None else first
                    stats = summarize(time_in_program(fn, q, k, v, table, lens), bench_cases.kv_bytes(case))
                    host = evidence.timed_samples_in_program(fn, (q, k, v, table, lens), samples=HOST_SAMPLES)
                    stats["host_clock"] = summarize(host, bench_cases.kv_bytes(case))
                stats["max_abs_diff_vs_first_run"] = float(np.max(np.abs(o - first)))
                out.setdefault(f"{case.name}/{name}", []).append(stats)
                print(case.name, name, turn, f"{stats['median_us']:.1f} us {stats['tbps_median']:.2f} TB/s "
                      f"(host clock {stats['host_clock']['median_us']:.1f}), "
                      f"max |diff| {stats['max_abs_diff_vs_first_run']:.1e}", flush=True)
        with open(out_path, "w") as f:  # after every case: a run cut short keeps what it measured
            json.dump({"machine": jax.devices()[0].device_kind, "jax": jax.__version__, "base": base_path, "whole_module": whole_module,
                       "base_sha256": base_sha256, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
