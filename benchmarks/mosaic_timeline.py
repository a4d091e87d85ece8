"""Where a Mosaic decode call's time goes, program by program: Mosaic GPU's profiler on the kernel's
named scopes (`MosaicDecodeConfig.profile_dir`).

    python -m benchmarks.mosaic_timeline OUT.json [CASES] [--calls N] [--runs R]    # on the GPU machine
    python -m benchmarks.mosaic_timeline OUT.json [CASES] --chain L

Per case, N calls (default 3), each compiled afresh, and each compiled call run R times (default
1). The profiler names its trace file when the kernel is lowered and writes it only if it does not
exist yet, so each run's trace is moved aside before the next run: runs after the first trace a
call whose code, buffers and address translations are warm (the first run of a compile is not),
but each run still starts on an idle GPU, after the host's sync and the trace's dump. With
--chain, one jitted program of L calls chained one after another (`chained_profiled_program`),
each call with a profile directory of its own and so a kernel and a trace of its own: calls after
the first start as the one before ends, as a model's layers do. The scopes are the producer's
`first_pages` and `stream`, and each compute warpgroup's `query_wait`, `blocks`, `handoff_wait`
and `merge_write` (item k's as name#k).

Units: the profiler stamps events with the SM's cycle counter (`%clock`), counted from each
program's first event, and its dump writes those counts where the trace format wants ns; only a
program's start is in ns (`%globaltimer`). So every figure here is in thousands of SM cycles (a
B 8, T 8,192 call read 109 to 131 thousand against its 68.9 us in the benchmark, H200), and is read
as a share of the call. Programs of one call start within a fraction of a microsecond of each
other, which is what makes their cycle counts comparable.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
import tempfile

import numpy as np


def _stats(values) -> dict:
    v = np.asarray(values, float)
    return {"n": int(v.size), "min": float(v.min()), "median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
            "max": float(v.max())}


def summarize_trace(events: list[dict]) -> dict:
    """One call's trace (the profiler's Chrome-trace events: name, ph B/E, ts, pid = 1 + SM id, tid =
    1 + trace (warpgroup) index) -> the call's span, each scope's begin, end and duration over the
    programs' warpgroups (the k-th entry of a scope in a warpgroup as name#k; name/duration over
    every entry), each SM's last event, their spread, and the correlation of the last events of the
    two SMs of each TPC (ids 2k and 2k + 1; None with fewer than three pairs). Times from the call's
    first event."""
    t0 = min(e["ts"] for e in events)
    scopes: dict[str, list[float]] = {}
    last_by_sm: dict[int, float] = {}
    by_trace: dict[int, list[dict]] = {}
    for e in events:
        by_trace.setdefault(e["tid"], []).append(e)
        sm = e["pid"] - 1
        last_by_sm[sm] = max(last_by_sm.get(sm, 0.0), e["ts"] - t0)
    for trace in by_trace.values():
        open_scopes, entries = [], {}
        for e in sorted(trace, key=lambda e: e["ts"]):
            if e["ph"] == "B":
                open_scopes.append(e)
                continue
            begin = open_scopes.pop()
            k = entries[begin["name"]] = entries.get(begin["name"], -1) + 1
            scopes.setdefault(f"{begin['name']}#{k}/begin", []).append(begin["ts"] - t0)
            scopes.setdefault(f"{begin['name']}#{k}/end", []).append(e["ts"] - t0)
            scopes.setdefault(f"{begin['name']}#{k}/duration", []).append(e["ts"] - begin["ts"])
            scopes.setdefault(f"{begin['name']}/duration", []).append(e["ts"] - begin["ts"])
    span = max(e["ts"] for e in events) - t0
    ends = np.asarray(list(last_by_sm.values()))
    pairs = np.asarray([(last_by_sm[s], last_by_sm[s + 1]) for s in last_by_sm if s % 2 == 0 and s + 1 in last_by_sm])
    return {
        "span": span,
        "scopes": {name: _stats(v) for name, v in sorted(scopes.items())},
        "last_event_by_sm": {str(s): last_by_sm[s] for s in sorted(last_by_sm)},
        "last_event": _stats(ends),
        "last_event_spread_share": float((ends.max() - ends.min()) / span),
        "tail_share": float((ends.max() - np.median(ends)) / span),
        "tpc_pair_correlation": float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) if len(pairs) >= 3 else None,
    }


def _median_duration(summary: dict, scope: str) -> str:
    """The median duration of `scope` (e.g. blocks#1: each warpgroup's block loop of its program's
    second item) over the warpgroups that entered it, or '-' where none did."""
    duration = summary["scopes"].get(f"{scope}/duration")
    return f"{duration['median']:.1f}" if duration else "-"


def chained_profiled_program(configs):
    """A jitted program(qs, k, v, table, lens) of len(configs) Mosaic decode calls chained one after
    another (`evidence.chained_program`: call i takes qs[i], tied to call i - 1's output), call i with
    configs[i]. Configs whose profile_dir differ lower to kernels of their own, so each call writes a
    trace of its own (a kernel's profiler traces its first execution only)."""
    import itertools

    import decodejax
    from decodejax import evidence

    in_turn = itertools.cycle(configs)  # chained_program traces its len(configs) calls in order

    def call(q, k, v, table, lens):
        return decodejax.decode_attention(q, k, v, table, lens, backend="pallas_mosaic_gpu", config=next(in_turn))

    return evidence.chained_program(call, len(configs))


def _summary_of_trace_in(directory: str, path: str | None = None) -> dict:
    """`summarize_trace` of the one trace the profiler dumped into `directory`; with `path`, the
    trace is first moved there (out of the way of the next run's dump)."""
    [trace] = glob.glob(os.path.join(directory, "*-trace.json"))
    if path is not None:
        os.rename(trace, path)
        trace = path
    with open(trace) as f:
        return summarize_trace(json.load(f)["traceEvents"])


def _line(name: str, s: dict) -> str:
    """One trace's summary `s` as a line of the log."""
    return (f"{name}: span {s['span']:.1f}, last events {s['last_event']['min']:.1f} to {s['last_event']['max']:.1f} "
            f"(tail {s['tail_share']:.1%} past the median), TPC pairs r = {s['tpc_pair_correlation']}, "
            f"blocks#0 {_median_duration(s, 'blocks#0')}, blocks#1 {_median_duration(s, 'blocks#1')}")


def main(argv=None):
    import dataclasses

    import jax
    import jax.numpy as jnp

    import decodejax
    from benchmarks import cases as bench_cases
    from decodejax import evidence
    from pallas_kernels import decode_attention_mgpu

    args = list(sys.argv[1:] if argv is None else argv)
    counts = {"--calls": 3, "--runs": 1, "--chain": 0}
    for flag in counts:
        if flag in args:
            at = args.index(flag)
            counts[flag] = int(args[at + 1])
            del args[at:at + 2]
    calls, runs, chain = counts["--calls"], counts["--runs"], counts["--chain"]
    out_path, *names = args
    results = {"machine": jax.devices()[0].device_kind, "jax": jax.__version__, "units": "thousands of SM cycles", "cases": {}}
    for case in bench_cases.selected(names[0] if names else ""):
        data = bench_cases.make_case(case)
        q, k, v = (jnp.asarray(data[n], jnp.bfloat16) for n in ("q", "k_pages", "v_pages"))
        table, lens = jnp.asarray(data["page_table"]), jnp.asarray(data["seq_lens"])
        trace_dir = tempfile.mkdtemp(prefix="decodejax_timeline_")
        default, _, _ = decodejax._ops.kernel_items(decode_attention_mgpu, None, case.head_dim, case.kv_heads,
                                                    case.q_heads // case.kv_heads, decodejax.KVLayout.PAGED_NHD)
        config = dataclasses.replace(default, profile_dir=trace_dir)
        summaries = []
        if chain:
            configs = [dataclasses.replace(config, profile_dir=tempfile.mkdtemp(dir=trace_dir)) for _ in range(chain)]
            jax.clear_caches()
            jax.block_until_ready(chained_profiled_program(configs)(evidence.distinct_copies(q, chain), k, v, table, lens))
            jax.effects_barrier()  # every call's dump is a host callback
            for link, c in enumerate(configs):
                summaries.append(dict(_summary_of_trace_in(c.profile_dir), link=link))
                print(_line(f"{case.name} chained call {link}", summaries[-1]), flush=True)
        else:
            for call in range(calls):
                jax.clear_caches()  # lowered afresh: a trace file of its own
                fn = jax.jit(functools.partial(decodejax.decode_attention, backend="pallas_mosaic_gpu", config=config))
                for run in range(runs):
                    jax.block_until_ready(fn(q, k, v, table, lens))
                    jax.effects_barrier()  # the profiler's dump is a host callback
                    kept = os.path.join(trace_dir, f"call{call}-run{run}.json")  # room for the next run's dump
                    summaries.append(dict(_summary_of_trace_in(trace_dir, kept), call=call, run=run))
                    print(_line(f"{case.name} call {call} run {run}", summaries[-1]), flush=True)
        results["cases"][case.name] = {"calls": summaries}
        with open(out_path, "w") as f:  # after every case: a run cut short keeps what it measured
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
