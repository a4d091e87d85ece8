"""FlashInfer's BatchDecodeWithPagedKVCache on the benchmark cases, in its own (PyTorch) process.

Run from the repository root: `python -m benchmarks.peers.flashinfer_decode OUT.json [CASE,CASE...]`. It builds
the same data as the JAX benchmark (benchmarks.cases.make_case) and writes raw samples
(microseconds per call) as JSON, SAMPLES samples of REPS runs each (benchmarks.cases):
`wall_samples_us`, perf_counter around REPS back-to-back runs and a synchronize, as the JAX
benchmark times its calls; `samples_us`, other runs of REPS between CUDA events (GPU time: no
first dispatch, no sync); `graph_samples_us`, the REPS runs captured once in a CUDA graph and
replayed per sample (no host launch cost). plan() runs once, outside all three.
"""

import json
import sys
import time
import traceback

import numpy as np
import torch

from benchmarks import cases as bench_cases
from benchmarks.cases import REPS, SAMPLES

WARMUP = 5


def host_clock_us(fn) -> float:
    """REPS back-to-back runs and a synchronize, by perf_counter (as the JAX benchmark times its calls)."""
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6


def cuda_events_us(fn, runs: int = REPS) -> float:
    """`runs` back-to-back runs between CUDA events: GPU time, no first dispatch, no sync."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3


def time_runs(fn, clock) -> list[float]:
    """Microseconds per run: after WARMUP runs, SAMPLES samples timed by `clock` (host_clock_us
    or cuda_events_us), each divided by its REPS runs."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    return [clock(fn) / REPS for _ in range(SAMPLES)]


def time_graph(fn) -> list[float]:
    """Like time_runs, with the REPS calls captured once into a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as graph capture requires
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return [cuda_events_us(graph.replay, runs=1) / REPS for _ in range(SAMPLES)]


def main(out_path: str, case_names: str = "") -> None:
    """FlashInfer on the benchmark's cases (`case_names`: comma-separated, default all)."""
    results = {}
    try:
        import flashinfer

        results["version"] = flashinfer.__version__
    except Exception as exc:  # recorded, not hidden: the JSON says why there is no peer
        results["import_error"] = repr(exc)
        json.dump(results, open(out_path, "w"), indent=1)
        return
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    for case in bench_cases.selected(case_names):
        data = bench_cases.make_case(case)
        P = case.page_size
        lens = data["seq_lens"]
        pages_per_row = -(-lens // P)
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages_per_row)]), dtype=torch.int32, device="cuda")
        indices = torch.tensor(np.concatenate([data["page_table"][b, : pages_per_row[b]] for b in range(case.batch)]), dtype=torch.int32, device="cuda")
        last = torch.tensor((lens - 1) % P + 1, dtype=torch.int32, device="cuda")
        k = torch.tensor(data["k_pages"], device="cuda").to(torch.bfloat16)
        v = torch.tensor(data["v_pages"], device="cuda").to(torch.bfloat16)
        q = torch.tensor(data["q"], device="cuda").to(torch.bfloat16)
        for tc in (False, True):
            key = f"{case.name}/tensor_cores={tc}"
            try:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
                wrapper.plan(indptr, indices, last, case.q_heads, case.kv_heads, case.head_dim, P,
                             pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                out = wrapper.run(q, (k, v))
                torch.cuda.synchronize()
                samples = time_runs(lambda: wrapper.run(q, (k, v)), cuda_events_us)
                results[key] = {"samples_us": samples, "wall_samples_us": time_runs(lambda: wrapper.run(q, (k, v)), host_clock_us), "out_head": out[:2, :2, :8].float().cpu().numpy().tolist(),
                                "out_checksum": float(out.float().abs().sum())}
                try:
                    results[key]["graph_samples_us"] = time_graph(lambda: wrapper.run(q, (k, v)))
                except Exception as exc:  # recorded: the JSON then has no graph-timed figure for this row
                    results[key]["graph_error"] = repr(exc)[:800]
            except Exception as exc:
                results[key] = {"error": repr(exc)[:800], "traceback": traceback.format_exc()[-1500:]}
            print(key, {k2: (np.median(v2) if k2.endswith("samples_us") else v2) for k2, v2 in results[key].items()
                        if k2 in ("samples_us", "wall_samples_us", "graph_samples_us", "error", "graph_error")}, flush=True)
        del k, v
        torch.cuda.empty_cache()
    json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
