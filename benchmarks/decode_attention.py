"""Decode-attention benchmark on the GPU: decodejax against its peers, same shapes and data.

    python -m benchmarks.decode_attention --out benchmarks/results/decode_attention.json \
        [--flashinfer FLASHINFER.json]
    python -m benchmarks.decode_attention --report benchmarks/results/decode_attention.json

Each variant is timed as SAMPLES samples of REPS back-to-back calls followed by
block_until_ready (`samples_us`, the host-clock figure of every table), the variants of a case
taking their samples in turns once every one has been checked against the reference
(`evidence.timed_samples_interleaved`: the host's speed drifts within a process, and in turns
the drift reaches every variant alike); FlashInfer runs under
PyTorch in its own process (benchmarks.peers.flashinfer_decode) on data built by the same
`make_case`, timed the same way (`flashinfer_wall/`: perf_counter around REPS runs and a sync)
and with CUDA events around other runs of REPS (`flashinfer/`: its GPU time, without the
host's first dispatch and the final sync). FlashInfer's plan() runs once, outside the timing;
our split bounds are computed inside every call.

Our call and the JAX peers get a GPU-time figure too (`gpu_span`: TRACED_SAMPLES profiler
traces of REPS back-to-back calls, each the span from the first kernel's start to the last
one's end, over REPS; `gpu_busy`: the kernels' own time in the same traces), because a JAX
call's first dispatch after a sync costs the host several times a warm one
(benchmarks/README.md, the timeline probe), which the host-clock samples spread over their REPS
calls. A span longer than the variant's host-clock time is not GPU time (the tracer's host cost
starved the GPU) and `gpu_time` leaves it out. Ratios are given by both clocks (`comparisons`).

A third clock takes the host out altogether, as a jitted model forward does: `in_program`, the
GPU time per call inside one jitted program of REPS calls chained one after another
(`decodejax.evidence.chained_program`), PROGRAM_RUNS runs traced back to back, each run's span
over REPS (`profile_summary.program_spans`), for our two default paths and the JAX peers' best;
FlashInfer's counterpart is its REPS runs captured in one CUDA graph, timed by CUDA events
around each replay (`graph_samples_us`). Raw samples are microseconds per call.
Effective bandwidth is unique K/V bytes over the median time, against the H200's 4.8 TB/s
datasheet figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import platform

import numpy as np

from benchmarks import cases as bench_cases
from benchmarks.cases import REPS, SAMPLES

WARMUP = 3
TRACED_SAMPLES = 10
PROGRAM_RUNS = 20  # in-program samples: runs of one chained program of REPS calls, traced back to back
DATASHEET_TBPS = 4.8
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
BUILTIN_K_SPLITS = (1, 2, 4, 8, 16)
OURS = "decodejax/nhd/auto"  # the Triton kernel's default path: the figure every ratio is of
FUSED_MERGE = "decodejax/nhd/auto/fused_merge"  # the same with DecodeConfig.fused_merge on
LAUNCH_ORDER = "decodejax/nhd/auto/launch_order"  # the same with DecodeConfig.longest_first off
MOSAIC_AUTO = "decodejax/mgpu-nhd/auto"  # the Mosaic GPU kernel's default path, beside the Triton kernel's
# Issue 3's bars, judged inside one program: at least FlashInfer's best, 1.8x JAX's builtin kernel,
# and 4.1 TB/s (FlashInfer's own reference figures) wherever B >= 32 at D 128.
TARGET_VS_FLASHINFER, TARGET_VS_BUILTIN, TARGET_TBPS = 1.0, 1.8, 4.1
# (block_k, num_stages, compute_warpgroups) of the Mosaic GPU kernel; one that does not fit a
# case's shared memory is recorded as an error
MOSAIC_TUNE = ((64, 2, 1), (64, 2, 2), (64, 4, 2), (64, 6, 2), (64, 8, 2), (64, 12, 2), (64, 3, 1), (64, 5, 1),
               (128, 3, 1), (128, 2, 2))


def time_jax(fn, *args) -> list[float]:
    """Microseconds per call, REPS back-to-back calls per sample."""
    from decodejax import evidence

    return evidence.timed_samples(fn, args, samples=SAMPLES, reps=REPS, warmup=WARMUP)


def time_in_program(fn, *args) -> list[float]:
    """GPU microseconds per call inside one jitted program of REPS chained calls: PROGRAM_RUNS runs
    of the program traced back to back (Python's tracer off), each run's span over REPS."""
    import jax

    from benchmarks.profile_summary import program_spans, traced
    from decodejax import evidence

    program, program_args = evidence.chained_call(fn, args, REPS)
    jax.block_until_ready(program(*program_args))

    def run():
        for _ in range(PROGRAM_RUNS):
            result = program(*program_args)
        jax.block_until_ready(result)

    return program_spans(traced(run, python_tracer=False)[0], PROGRAM_RUNS, REPS)


def time_gpu_span(fn, *args) -> tuple[list[float], list[float]]:
    """GPU microseconds per call of REPS back-to-back calls, one profiler trace per sample (Python's
    tracer off): the span from the first kernel's start to the last one's end, over REPS, and
    the kernels' own time (busy: the span less the GPU's idle gaps)."""
    import jax

    from benchmarks.profile_summary import stream_timeline, traced

    def run():
        for _ in range(REPS):
            result = fn(*args)
        jax.block_until_ready(result)

    timelines = [stream_timeline(traced(run, python_tracer=False)[0], REPS) for _ in range(TRACED_SAMPLES)]
    return [t["span_us_per_step"] for t in timelines], [t["busy_us_per_step"] for t in timelines]


def in_program_stats(fn, args, nbytes) -> dict:
    """{"in_program": statistics of time_in_program}, or {"in_program_error": why} (a program that
    fails is recorded, and the variant's other figures stand)."""
    try:
        return {"in_program": summarize(time_in_program(fn, *args), nbytes)}
    except Exception as exc:
        return {"in_program_error": repr(exc)[:600]}


def summarize(samples, nbytes):
    med, lo = float(np.median(samples)), float(np.min(samples))
    return {"samples_us": samples, "median_us": med, "min_us": lo, "tbps_median": nbytes / med / 1e6, "tbps_min_time": nbytes / lo / 1e6}


def run_case(case, results, sweep: bool, tune: bool = False, ours_only: bool = False, tune_mosaic: bool = False):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import paged_attention as builtin

    import decodejax
    from decodejax import KVLayout, reference
    from pallas_kernels import decode_attention as triton_kernel

    data = bench_cases.make_case(case)
    nbytes = bench_cases.kv_bytes(case)
    q = jnp.asarray(data["q"], jnp.bfloat16)
    k = jnp.asarray(data["k_pages"], jnp.bfloat16)
    v = jnp.asarray(data["v_pages"], jnp.bfloat16)
    table = jnp.asarray(data["page_table"])
    lens = jnp.asarray(data["seq_lens"])
    entry = {"case": case.__dict__ | {"tags": list(case.tags)}, "kv_bytes": nbytes, "variants": {}}
    results["cases"][case.name] = entry

    ref_o, _ = jax.jit(reference.paged_decode)(q, k, v, table, lens)
    ref_o = np.asarray(ref_o, np.float32)
    entry["reference_checksum"] = float(np.abs(ref_o).sum())

    pending = {}  # name: (fn, args, gpu_span, in_program): timed together once the case's variants are in

    def record(name, fn, *args, gpu_span: bool = False, in_program: bool = False):
        """Checks a variant against the reference (compiling it) and queues it for `time_variants`."""
        try:
            out = fn(*args)
            err = float(np.max(np.abs(np.asarray(out, np.float32) - ref_o)))
            entry["variants"][name] = {"max_abs_err_vs_reference": err}
            pending[name] = (fn, args, gpu_span, in_program)
        except Exception as exc:  # a peer that cannot run this shape is recorded, not hidden
            entry["variants"][name] = {"error": repr(exc)[:600]}
            print(f"{case.name:24s} {name:34s} ERROR {repr(exc)[:200]}", flush=True)

    ours = lambda backend="pallas_triton", **kw: jax.jit(functools.partial(decodejax.decode_attention, backend=backend, **kw))
    record(OURS, ours(), q, k, v, table, lens, gpu_span=True, in_program=True)
    record(MOSAIC_AUTO, ours("pallas_mosaic_gpu"), q, k, v, table, lens, gpu_span=True, in_program=True)
    # The split slots merged in the kernel's own launch instead of by a second one (merge_states);
    # a plan of one slot has nothing to merge and runs the same single launch either way.
    config, _, _ = decodejax._ops.kernel_items(triton_kernel, None, case.head_dim, case.kv_heads, case.q_heads // case.kv_heads,
                                               KVLayout.PAGED_NHD, batch=case.batch)
    plan = decodejax._ops.decode_plan(case.batch, case.kv_heads, table.shape[1] * case.page_size, config, num_splits=None,
                                      deterministic=False, head_dim=case.head_dim)
    if plan.capacity > 1:
        record(FUSED_MERGE, ours(config=dataclasses.replace(config, fused_merge=True)), q, k, v, table, lens, gpu_span=True,
               in_program=True)
        record(LAUNCH_ORDER, ours(config=dataclasses.replace(config, longest_first=False)), q, k, v, table, lens, gpu_span=True,
               in_program=True)
    if tune_mosaic:
        from pallas_kernels import decode_attention_mgpu

        # the op's own config for the case (at D 64, paired items), retiled
        mosaic_config, _, _ = decodejax._ops.kernel_items(decode_attention_mgpu, None, case.head_dim, case.kv_heads,
                                                          case.q_heads // case.kv_heads, KVLayout.PAGED_NHD)
        for bk, stages, wgs in MOSAIC_TUNE:
            cfg = dataclasses.replace(mosaic_config, block_k=bk, num_stages=stages, compute_warpgroups=wgs)
            record(f"decodejax/mgpu-nhd/tune/bk={bk},st={stages},wg={wgs}", ours("pallas_mosaic_gpu", config=cfg), q, k, v, table, lens)
    if ours_only:  # a re-measure of the default path alone (its peers are in an earlier run's file)
        time_variants(case.name, entry, pending, nbytes)
        return
    k_hnd, v_hnd = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    record("decodejax/hnd/auto", ours(layout=KVLayout.PAGED_HND), q, k_hnd, v_hnd, table, lens)
    if sweep:
        for s in SPLIT_SWEEP:
            record(f"decodejax/nhd/splits={s}", ours(num_splits=s), q, k, v, table, lens)
    record("decodejax/nhd/deterministic", ours(deterministic=True), q, k, v, table, lens)
    if tune:
        from pallas_kernels.decode_attention import DecodeConfig

        for bk in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    cfg = DecodeConfig(block_k=bk, num_warps=warps, num_stages=stages)
                    record(f"decodejax/nhd/tune/bk={bk},w={warps},st={stages}", ours(config=cfg), q, k, v, table, lens)

    # JAX's builtin Pallas paged attention: pool [H_kv, num_pages, P, D]; best of its k_splits.
    # It applies no score scale, so it gets q pre-scaled by 1 / sqrt(D) (outside the timing).
    k_h, v_h = jnp.transpose(k, (2, 0, 1, 3)), jnp.transpose(v, (2, 0, 1, 3))
    q_scaled = (q.astype(jnp.float32) * case.head_dim**-0.5).astype(jnp.bfloat16)
    width = table.shape[1]
    for ks in BUILTIN_K_SPLITS:
        if width % ks == 0 and (width // ks) % min(8, width // ks) == 0:
            fn = jax.jit(functools.partial(builtin.paged_attention, k_splits=ks, pages_per_compute_block=min(8, width // ks)))
            record(f"jax_builtin_pallas/k_splits={ks}", fn, q_scaled, k_h, v_h, table, lens, gpu_span=True)

    record("xla_gather_reference", jax.jit(lambda *a: reference.paged_decode(*a)[0].astype(jnp.bfloat16)), q, k, v, table, lens)

    # cuDNN on contiguous K/V [B, T, H_kv, D] (the paged data gathered once, outside the timing).
    k_c = decodejax.gather_pages(k, table, lens, backend="xla")
    v_c = decodejax.gather_pages(v, table, lens, backend="xla")

    def cudnn(q, k_c, v_c, lens):
        o = jax.nn.dot_product_attention(q[:, None], k_c, v_c, key_value_seq_lengths=lens, implementation="cudnn")
        return o[:, 0]

    record("cudnn_contiguous", jax.jit(cudnn), q, k_c, v_c, lens, gpu_span=True, in_program=True)
    time_variants(case.name, entry, pending, nbytes)
    best_builtin, _ = _best(entry["variants"], "jax_builtin_pallas/")
    if best_builtin:  # in one program, the setting that was fastest back to back
        fn, args, _, _ = pending[best_builtin]
        entry["variants"][best_builtin] |= in_program_stats(fn, args, nbytes)


def time_variants(case_name: str, entry: dict, pending: dict, nbytes: int) -> None:
    """Host-clock samples of every pending variant of a case, taken in turns (`timed_samples_interleaved`),
    then the traced figures of those that ask for them, into entry["variants"]."""
    from decodejax import evidence

    calls = {name: (fn, args) for name, (fn, args, _, _) in pending.items()}
    samples, errors = evidence.timed_samples_interleaved(calls, samples=SAMPLES, reps=REPS, warmup=WARMUP)
    for name, (fn, args, gpu_span, in_program) in pending.items():
        variant = entry["variants"][name]
        if name in errors:
            variant["error"] = errors[name]
            print(f"{case_name:24s} {name:34s} ERROR {errors[name][:200]}", flush=True)
            continue
        variant |= summarize(samples[name], nbytes)
        if gpu_span:
            try:
                span, busy = time_gpu_span(fn, *args)
                variant["gpu_span"], variant["gpu_busy"] = summarize(span, nbytes), summarize(busy, nbytes)
            except Exception as exc:  # the host-clock figures stand
                variant["gpu_span_error"] = repr(exc)[:600]
        if in_program:
            variant |= in_program_stats(fn, args, nbytes)
        print(f"{case_name:24s} {name:34s} {variant['median_us']:9.1f} us  {variant['tbps_median']:5.2f} TB/s  "
              f"err {variant['max_abs_err_vs_reference']:.2e}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/decode_attention.json")
    parser.add_argument("--flashinfer", help="JSON written by benchmarks.peers.flashinfer_decode")
    parser.add_argument("--report", help="only render the markdown table of this JSON")
    parser.add_argument("--merge", default="", help="comma-separated JSONs of runs over disjoint cases (one run split "
                        "across device calls): their cases, every figure recomputed from its raw samples, into --out")
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--tune", default="", help="comma-separated case names to sweep DecodeConfig on")
    parser.add_argument("--tune-mosaic", default="", help="comma-separated case names to sweep MosaicDecodeConfig on")
    parser.add_argument("--ours-only", action="store_true", help="time decodejax's default (auto) variants alone")
    parser.add_argument("--no-sweep", action="store_true", help="leave out the split-count sweep (a side-by-side run that "
                        "must fit one device call)")
    args = parser.parse_args(argv)
    if args.report:
        results = json.load(open(args.report))  # a recorded result: rendered, never rewritten
        print(render_table(results | {"comparisons": comparisons(results)}))
        return
    if args.merge:
        finish(merge_runs([json.load(open(path)) for path in args.merge.split(",")]), args.flashinfer, args.out)
        return
    import jax

    from decodejax import evidence

    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"device": jax.devices()[0].device_kind, "platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__},
        "source_commit": evidence.source_identity()["commit"],
        "method": {"samples": SAMPLES, "reps_per_sample": REPS, "warmup": WARMUP, "unit": "microseconds per call", "datasheet_tbps": DATASHEET_TBPS,
                   "samples_us": f"{REPS} back-to-back jitted calls per sample, then a sync; the variants of a case take "
                                 "their samples in turns (one each, round after round)",
                   "gpu_span": f"{TRACED_SAMPLES} profiler traces of {REPS} back-to-back calls: first kernel start to last kernel end, / {REPS}",
                   "gpu_busy": "the same traces: the kernels' time (the span less the GPU's idle gaps), / REPS",
                   "in_program": f"{PROGRAM_RUNS} runs of one jitted program of {REPS} chained calls, traced back to back: "
                                 f"each run's first kernel start to last kernel end, / {REPS}",
                   "flashinfer": "flashinfer/: CUDA events around REPS back-to-back runs; flashinfer_wall/: perf_counter around "
                                 "REPS runs and a sync, as ours; graph_samples_us (its in_program): CUDA events around "
                                 "each replay of one CUDA graph of REPS runs"},
        "cases": {},
    }
    try:
        import jaxlib

        results["machine"]["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    for case in bench_cases.selected(args.cases):
        run_case(case, results, sweep=bool({"target", "e2e"} & set(case.tags)) and not (args.ours_only or args.no_sweep), tune=case.name in args.tune.split(","),
                 ours_only=args.ours_only, tune_mosaic=case.name in args.tune_mosaic.split(","))
        json.dump(results, open(args.out, "w"), indent=1)
    finish(results, args.flashinfer, args.out)


def merge_runs(runs: list[dict]) -> dict:
    """One result from runs of the same machine, method and source commit over disjoint cases."""
    shared = ("machine", "method", "source_commit")  # source_commit: absent from runs before 3c7793f
    merged = {"date": runs[0]["date"]} | {key: runs[0].get(key) for key in shared} | {"cases": {}, "merged_from_dates": [r["date"] for r in runs]}
    for run in runs:
        if any(run.get(key) != merged[key] for key in shared):
            raise ValueError(f"run of {run['date']} differs in machine, method or source commit from the run of {merged['date']}")
        for name, entry in run["cases"].items():
            if name in merged["cases"]:
                raise ValueError(f"case {name} is in two runs")
            for variant in entry["variants"].values():
                if "samples_us" in variant:
                    variant.update(summarize(variant["samples_us"], entry["kv_bytes"]))
            merged["cases"][name] = entry
    return merged


def finish(results, flashinfer_json: str | None, out_path: str) -> None:
    """Attaches FlashInfer's rows (if any), the peer comparisons and writes the JSON and the table."""
    if flashinfer_json:
        fi = json.load(open(flashinfer_json))
        results["flashinfer"] = fi
        for name, entry in results["cases"].items():
            for tc in (False, True):
                raw = fi.get(f"{name}/tensor_cores={tc}", {})
                if "wall_samples_us" in raw:
                    entry["variants"][f"flashinfer_wall/tensor_cores={tc}"] = summarize(raw["wall_samples_us"], entry["kv_bytes"])
                if "samples_us" in raw:
                    entry["variants"][f"flashinfer/tensor_cores={tc}"] = {
                        **summarize(raw["samples_us"], entry["kv_bytes"]),
                        **({"in_program": summarize(raw["graph_samples_us"], entry["kv_bytes"])}
                           if "graph_samples_us" in raw else {"graph_error": raw.get("graph_error", "")}),
                        "abs_checksum": raw["out_checksum"],
                    }
                elif raw:
                    entry["variants"][f"flashinfer/tensor_cores={tc}"] = {"error": raw.get("error", "")}
    results["comparisons"] = comparisons(results)
    json.dump(results, open(out_path, "w"), indent=1)
    print(render_table(results))


PEERS = {"flashinfer": "flashinfer/", "flashinfer_wall": "flashinfer_wall/", "jax_builtin_pallas": "jax_builtin_pallas/", "cudnn_contiguous": "cudnn_contiguous", "xla_gather_reference": "xla_gather_reference"}
# GPU time per call: FlashInfer's CUDA events (in one program: its CUDA graph's) against the JAX
# variants' traced spans
GPU_TIME_PEERS = {"flashinfer": "flashinfer/", "jax_builtin_pallas": "jax_builtin_pallas/", "cudnn_contiguous": "cudnn_contiguous"}


def gpu_time(name: str, variant: dict) -> dict:
    """A variant's GPU-time statistics: FlashInfer's CUDA-event samples, a JAX variant's traced
    spans; {} when it has none, or when the span is longer than the host clock's time for the
    same calls untraced: the tracer's host cost then starved the GPU, so the span is not GPU time."""
    if name.startswith("flashinfer/"):
        return variant if "median_us" in variant else {}
    span = variant.get("gpu_span", {})
    return span if span and span["median_us"] <= variant.get("median_us", 0.0) else {}


def comparisons(results) -> dict:
    """Speedup estimators of decodejax (auto, NHD) over each peer's best variant on the target
    cases: by the host's clock (`host_clock`, every variant's samples_us), by GPU time per call
    (`gpu_time`: `gpu_time`'s figures) and inside one program (`in_program`).

    Rows go through decodejax.evidence.compare, which refuses rows that differ in scope, phase,
    metric, GPU, precision, workload or statistic.
    """
    from decodejax import evidence

    def estimators(scope, peers, stats_of):
        def row(case, stats):
            return {"case": case, "scope": scope, "phase": "decode", "metric": "latency", "gpu": results["machine"]["device"],
                    "precision": "bf16", "workload": "paged decode, same data per case", "statistic": "median",
                    "median_us": stats["median_us"]}

        ours, rows = [], {name: [] for name in peers}
        for case, entry in results["cases"].items():
            mine = stats_of(OURS, entry["variants"].get(OURS, {}))
            if "target" not in entry["case"]["tags"] or "median_us" not in mine:
                continue
            ours.append(row(case, mine))
            for name, prefix in peers.items():
                _, best = _best(entry["variants"], prefix, stats_of)
                if best:
                    rows[name].append(row(case, best))
        return {name: evidence.compare(peer_rows, ours) for name, peer_rows in rows.items() if peer_rows}

    return {"host_clock": estimators("kernel call (back-to-back calls, host clock)", PEERS, lambda name, v: v),
            "gpu_time": estimators("GPU time per call (back-to-back calls)", GPU_TIME_PEERS, gpu_time),
            "in_program": estimators("GPU time per call inside one program (FlashInfer: one CUDA graph)", GPU_TIME_PEERS, in_program)}


def _best(variants, prefix, stats_of=lambda name, v: v):
    """(name, statistics) of the fastest variant whose name starts with `prefix`, by the median of
    stats_of(name, variant); (None, None) if none is timed."""
    timed = {k: stats_of(k, v) for k, v in variants.items() if k.startswith(prefix) and "median_us" in stats_of(k, v)}
    if not timed:
        return None, None
    name = min(timed, key=lambda k: timed[k]["median_us"])
    return name, timed[name]


def in_program(name: str, variant: dict) -> dict:
    """A variant's statistics inside one program (FlashInfer: its CUDA graph's replays); {} if none."""
    return variant.get("in_program", {})


def _clock_table(results, stats_of, intro: str, fi_column: str, note_starved: bool) -> list[str]:
    """Markdown lines: per case, our call and the peers' figures by one clock (`stats_of`)."""
    rows = []
    for name, entry in results["cases"].items():
        var = entry["variants"]
        span = var.get(OURS, {}).get("gpu_span")
        ours = stats_of(OURS, var.get(OURS, {}))
        if not (ours or (note_starved and span)):
            continue
        stats = {label: _best(var, prefix, stats_of)[1] for label, prefix in
                 (("mosaic", MOSAIC_AUTO), ("builtin", "jax_builtin_pallas/"), ("cudnn", "cudnn_contiguous"), ("fi", "flashinfer/"))}
        fmt = lambda v: f"{v['median_us']:.1f}" if v else "n/a"
        ratio = lambda peer: f"{peer['median_us'] / ours['median_us']:.2f}x" if peer and ours else "n/a"
        mine = f"{ours['median_us']:.1f} / {ours['min_us']:.1f} | {ours['tbps_median']:.2f}" if ours else f"({span['median_us']:.1f}) | "
        rows.append(f"| {name} | {mine} | {fmt(stats['mosaic'])} | {fmt(stats['builtin'])} | {fmt(stats['cudnn'])} | "
                    f"{fmt(stats['fi'])} | {ratio(stats['builtin'])} | {ratio(stats['fi'])} |")
    if not rows:
        return []
    return ["", intro, "",
            "| case | decodejax (auto, NHD) med / min | TB/s | Mosaic GPU (auto) | JAX builtin Pallas (best) | cuDNN contiguous "
            f"| {fi_column} | ours vs builtin | ours vs FlashInfer |", "|---|---|---|---|---|---|---|---|---|", *rows]


def gpu_time_table(results) -> list[str]:
    """Markdown lines: GPU time per call of back-to-back calls, ours and the peers' (`gpu_time`), where traced."""
    return _clock_table(
        results, gpu_time,
        f"GPU time per call (us, median of {TRACED_SAMPLES} runs of {results['method']['reps_per_sample']} back-to-back "
        "calls): ours and the JAX peers from a profiler trace of each run (first kernel's start to last kernel's end), "
        "FlashInfer from CUDA events around its runs. Neither includes the host's first dispatch of a run or the final sync. "
        "A traced span longer than the same calls' host-clock time is no GPU time (the tracer's host cost starved the GPU): "
        "such a figure is left out (n/a), ours in parentheses.",
        "FlashInfer best (CUDA events)", note_starved=True)


def in_program_table(results) -> list[str]:
    """Markdown lines: GPU time per call inside one program (`in_program`), ours and the peers'."""
    return _clock_table(
        results, in_program,
        f"GPU time per call inside one program (us, median of {PROGRAM_RUNS} runs): ours and the JAX peers as "
        f"{results['method']['reps_per_sample']} calls chained in one jitted program (as a model's layers), from a trace "
        "of the runs (each run's first kernel start to last kernel end); FlashInfer as the same number of runs captured "
        "in one CUDA graph, from CUDA events around each replay. The host's dispatch is in neither.",
        "FlashInfer best (CUDA graph)", note_starved=False)


def _verdict(value: float, bar: float, unit: str) -> str:
    return f"{value:.3f}{unit} {'met' if value >= bar else 'MISSED'}"


def targets_table(results) -> list[str]:
    """Markdown lines: each default path against issue 3's bars (TARGET_*), inside one program."""
    rows = []
    for name, entry in results["cases"].items():
        var, case = entry["variants"], entry["case"]
        fi, builtin = _best(var, "flashinfer/", in_program)[1], _best(var, "jax_builtin_pallas/", in_program)[1]
        for label, key in (("Triton (auto)", OURS), ("Mosaic GPU", MOSAIC_AUTO)):
            ours = in_program(key, var.get(key, {}))
            if "median_us" not in ours:
                continue
            ratio = lambda peer, bar: _verdict(peer["median_us"] / ours["median_us"], bar, "x") if peer else "n/a"
            judged = case.get("batch", 0) >= 32 and case.get("head_dim") == 128
            tbps = _verdict(ours["tbps_median"], TARGET_TBPS, "") if judged else f"{ours['tbps_median']:.3f} (no bar)"
            rows.append(f"| {name} | {label} | {ours['median_us']:.1f} | {ratio(fi, TARGET_VS_FLASHINFER)} | "
                        f"{ratio(builtin, TARGET_VS_BUILTIN)} | {tbps} |")
    if not rows:
        return []
    return ["", f"Against issue 3's targets, inside one program: FlashInfer's time over ours >= {TARGET_VS_FLASHINFER}, the "
            f"builtin kernel's >= {TARGET_VS_BUILTIN}, and >= {TARGET_TBPS} TB/s at B >= 32, D 128:", "",
            "| case | path | us | vs FlashInfer | vs builtin | TB/s |", "|---|---|---|---|---|---|", *rows]


def render_table(results) -> str:
    m = results["machine"]
    lines = [
        f"Machine: {m['device']}, jax {m['jax']}, Python {m['python']}; {', '.join(results.get('merged_from_dates', [results['date']]))}. "
        f"{results['method']['samples']} samples x {results['method']['reps_per_sample']} back-to-back calls; "
        "TB/s = unique K/V bytes / median time (datasheet 4.8 TB/s).",
        "",
        "FlashInfer twice: by the host's clock as ours (`flashinfer_wall/`), and by CUDA events around runs of the same length "
        "(`flashinfer/`).",
        "",
        "| case | decodejax (auto, NHD) us med / min | TB/s | best decodejax | JAX builtin Pallas (best k_splits) | XLA gather | cuDNN contiguous "
        "| FlashInfer best, host clock | FlashInfer best, CUDA events | ours vs builtin | ours vs FlashInfer (host clock) | ours vs FlashInfer (events) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["cases"].items():
        var = entry["variants"]
        auto = var.get(OURS, {})
        if "median_us" not in auto:
            lines.append(f"| {name} | error | | | | | | | | | | |")
            continue
        best_name, best = _best(var, "decodejax/")
        bi_name, bi = _best(var, "jax_builtin_pallas/")
        fi_name, fi = _best(var, "flashinfer/")
        fw_name, fw = _best(var, "flashinfer_wall/")
        fmt = lambda v: f"{v['median_us']:.1f}" if v and "median_us" in v else "n/a"
        setting = lambda name: f" ({name.split('/')[1]})" if name else ""
        ratio = lambda peer: f"{peer['median_us'] / auto['median_us']:.2f}x" if peer else "n/a"
        lines.append(
            f"| {name} | {auto['median_us']:.1f} / {auto['min_us']:.1f} | {auto['tbps_median']:.2f} | "
            f"{best['median_us']:.1f} ({best_name.split('/', 1)[1]}) | "
            f"{fmt(bi)}{' (' + bi_name.split('=')[1] + ')' if bi else ''} | {fmt(var.get('xla_gather_reference'))} | "
            f"{fmt(var.get('cudnn_contiguous'))} | {fmt(fw)}{setting(fw_name)} | {fmt(fi)}{setting(fi_name)} | "
            f"{ratio(bi)} | {ratio(fw)} | {ratio(fi)} |"
        )
    lines += gpu_time_table(results) + in_program_table(results) + targets_table(results)
    if results.get("comparisons"):
        lines += ["", "Speedup of decodejax (auto) over each peer's best variant on the five target shapes "
                  "(peer median / decodejax median; `decodejax.evidence.ratio_estimators`), by the host's clock, by GPU time "
                  "and by GPU time inside one program:", "",
                  "| timing | peer | arithmetic mean of ratios | ratio of summed times | geometric mean | max | per case |",
                  "|---|---|---|---|---|---|---|"]
        for timing, by_peer in results["comparisons"].items():
            for name, est in by_peer.items():
                per_case = ", ".join(f"{c}: {r:.2f}" for c, r in est["ratios"].items())
                lines.append(f"| {timing} | {name} | {est['arithmetic_mean_of_ratios']:.2f} | {est['ratio_of_sums']:.2f} | "
                             f"{est['geometric_mean']:.2f} | {est['max']:.2f} | {per_case} |")
    program_us = lambda v: f"{v['in_program']['median_us']:.1f}" if "in_program" in v else "n/a"
    both = [(name, e["variants"]) for name, e in results["cases"].items() if "median_us" in e["variants"].get(FUSED_MERGE, {})]
    if both:
        busy = lambda v: f"{v['gpu_busy']['median_us']:.1f}" if "gpu_busy" in v else "n/a"
        lines += ["", "The split slots merged by a second launch (`merge_states`, the default) or in the kernel's own launch "
                  "(`fused_merge`), median us (host clock; the kernels' GPU time from the traces; inside one program), for "
                  "the cases whose plan has more than one slot:", "",
                  "| case | merge launch | GPU | in one program | merged in the launch | GPU | in one program |",
                  "|---|---|---|---|---|---|---|"]
        for name, var in both:
            launched, fused = var[OURS], var[FUSED_MERGE]
            lines.append(f"| {name} | {launched['median_us']:.1f} | {busy(launched)} | {program_us(launched)} | "
                         f"{fused['median_us']:.1f} | {busy(fused)} | {program_us(fused)} |")
    dealt = [(name, e["variants"]) for name, e in results["cases"].items() if "in_program" in e["variants"].get(LAUNCH_ORDER, {})]
    if dealt:
        lines += ["", "The programs longest split first (`longest_first`, the default) or in launch order, median us by "
                  "the host's clock and inside one program, for the cases whose plan has more than one slot:", "",
                  "| case | longest first | in one program | launch order | in one program |", "|---|---|---|---|---|"]
        for name, var in dealt:
            first, launched = var[OURS], var[LAUNCH_ORDER]
            lines.append(f"| {name} | {first['median_us']:.1f} | {program_us(first)} | {launched['median_us']:.1f} | "
                         f"{program_us(launched)} |")
    mosaic = [(name, e["variants"]) for name, e in results["cases"].items() if "median_us" in e["variants"].get(MOSAIC_AUTO, {})]
    if mosaic:
        lines += ["", "The Mosaic GPU kernel against the Triton kernel, both default paths of this run, median / min us:", "",
                  "| case | Triton (auto) | Mosaic GPU (auto) | TB/s (Mosaic) | Mosaic speed / Triton speed |", "|---|---|---|---|---|"]
        for name, var in mosaic:
            tri, mg = var[OURS], var[MOSAIC_AUTO]
            lines.append(f"| {name} | {tri['median_us']:.1f} / {tri['min_us']:.1f} | {mg['median_us']:.1f} / {mg['min_us']:.1f} | "
                         f"{mg['tbps_median']:.2f} | {tri['median_us'] / mg['median_us']:.2f}x |")
    swept = {name: entry["variants"] for name, entry in results["cases"].items()
             if any(k.startswith("decodejax/nhd/splits=") for k in entry["variants"])}
    if not swept:  # a --no-sweep or --ours-only run
        return "\n".join(lines)
    lines += ["", "Split-count sweep (decodejax, NHD), median us:", ""]
    header = "| case | " + " | ".join(f"S={s}" for s in SPLIT_SWEEP) + " | auto | deterministic |"
    lines += [header, "|" + "---|" * (len(SPLIT_SWEEP) + 3)]
    for name, var in swept.items():
        cells = [f"{var.get(f'decodejax/nhd/splits={s}', {}).get('median_us', float('nan')):.1f}" for s in SPLIT_SWEEP]
        cells += [f"{var.get(OURS, {}).get('median_us', float('nan')):.1f}", f"{var.get('decodejax/nhd/deterministic', {}).get('median_us', float('nan')):.1f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
