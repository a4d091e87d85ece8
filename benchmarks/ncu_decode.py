"""Hardware counters of the decode kernels (Nsight Compute) on the benchmark's cases.

The timing benchmarks say how long a call takes; these counters say why: DRAM throughput against
its peak, occupancy and what limits it, registers, shared memory, and where the warps stall.

    # the workload ncu profiles: a few calls of one case on one backend
    ncu --clock-control none -k regex:decodejax --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats \\
        -o OUT/B32_T4096.pallas_triton python3 -m benchmarks.ncu_decode run B32_T4096 pallas_triton
    ncu --import OUT/B32_T4096.pallas_triton.ncu-rep --csv --page details > OUT/B32_T4096.pallas_triton.details.csv
    ncu --import OUT/B32_T4096.pallas_triton.ncu-rep --csv --page raw > OUT/B32_T4096.pallas_triton.raw.csv
    # the exports' key figures, per kernel, into one JSON and a table
    python3 -m benchmarks.ncu_decode summarize OUT/ncu_decode.json OUT/B32_T4096.pallas_triton

`benchmarks/run_h200.sh ncu` runs both for the cases of `NCU_CASES`. `--launch-skip 2` leaves
out the first call's launches (module load); a call of two launches (kernel, merge) gives both.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys

CALLS = 4  # enough launches after --launch-skip for --launch-count at one or two launches per call

# (section, metric name) of ncu's details page -> our key. Units are kept as ncu prints them.
METRICS = {
    ("GPU Speed Of Light Throughput", "Duration"): "duration",
    ("GPU Speed Of Light Throughput", "DRAM Throughput"): "dram_throughput_pct",
    ("GPU Speed Of Light Throughput", "Memory Throughput"): "memory_throughput_pct",
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"): "sm_throughput_pct",
    ("Memory Workload Analysis", "Memory Throughput"): "dram_bandwidth",
    ("Memory Workload Analysis", "L2 Hit Rate"): "l2_hit_rate_pct",
    ("Launch Statistics", "Grid Size"): "grid_size",
    ("Launch Statistics", "Block Size"): "block_size",
    ("Launch Statistics", "Registers Per Thread"): "registers_per_thread",
    ("Launch Statistics", "Dynamic Shared Memory Per Block"): "dynamic_shared_memory_per_block",
    ("Launch Statistics", "Static Shared Memory Per Block"): "static_shared_memory_per_block",
    ("Launch Statistics", "Waves Per SM"): "waves_per_sm",
    ("Occupancy", "Theoretical Occupancy"): "theoretical_occupancy_pct",
    ("Occupancy", "Achieved Occupancy"): "achieved_occupancy_pct",
    ("Occupancy", "Block Limit Shared Mem"): "block_limit_shared_memory",
    ("Occupancy", "Block Limit Registers"): "block_limit_registers",
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"): "warp_cycles_per_issued_instruction",
    ("Scheduler Statistics", "Issued Warp Per Scheduler"): "issued_warp_per_scheduler",
}
# Raw-page stall reasons: warps stalled for that reason per issued instruction.
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def run(case_name: str, backend: str) -> None:
    """CALLS synchronized calls of decode_attention on one benchmark case."""
    import jax
    import jax.numpy as jnp

    import decodejax
    from benchmarks import cases as bench_cases

    (case,) = bench_cases.selected(case_name)
    data = bench_cases.make_case(case)
    q, k, v = (jnp.asarray(data[n], jnp.bfloat16) for n in ("q", "k_pages", "v_pages"))
    table, lens = jnp.asarray(data["page_table"]), jnp.asarray(data["seq_lens"])
    fn = jax.jit(lambda *args: decodejax.decode_attention(*args, backend=backend))
    for _ in range(CALLS):
        fn(q, k, v, table, lens).block_until_ready()


def _read_csv(path: str) -> list[dict]:
    with open(path) as f:
        text = f.read()
    return list(csv.DictReader(io.StringIO(text[text.index('"'):])))  # ncu may print notes before the table


def summarize(out_path: str, report_stems: list[str]) -> dict:
    """{report name: [{kernel, metric: value ...} per profiled launch]} from each report's two CSV
    exports (`ncu --import R.ncu-rep --csv --page details > R.details.csv`, and `--page raw`)."""
    summary = {}
    for stem in report_stems:
        launches = {}
        for row in _read_csv(f"{stem}.details.csv"):
            launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
            key = METRICS.get((row["Section Name"], row["Metric Name"]))
            if key:
                launch[key] = f"{row['Metric Value']} {row['Metric Unit']}".strip()
        for row in _read_csv(f"{stem}.raw.csv")[1:]:  # the raw page's first row holds units
            launch, stalls = launches[row["ID"]], {}
            for name, value in row.items():
                try:
                    if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX):
                        stalls[name.removeprefix(STALL_PREFIX).removesuffix(STALL_SUFFIX)] = float(value.replace(",", ""))
                except ValueError:
                    continue
            launch["top_stalls_per_issued_instruction"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
        summary[os.path.basename(stem)] = list(launches.values())
    with open(out_path, "w") as f:
        json.dump(summary, f, indent=1)
    for name, launches in summary.items():
        for launch in launches:
            print(name, launch["kernel"][:40], {k: launch.get(k) for k in (
                "duration", "dram_throughput_pct", "dram_bandwidth", "achieved_occupancy_pct", "registers_per_thread",
                "block_limit_shared_memory", "block_limit_registers", "waves_per_sm")})
            print("   stalls", launch.get("top_stalls_per_issued_instruction"))
    return summary


def main(argv=None):
    command, *rest = argv or sys.argv[1:]
    if command == "run":
        run(*rest)
    elif command == "summarize":
        summarize(rest[0], rest[1:])
    else:
        raise SystemExit(f"unknown command {command!r}: run CASE BACKEND, or summarize OUT.json REPORT_STEM...")


if __name__ == "__main__":
    main()
