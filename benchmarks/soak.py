"""Soak the decode runtime: >= 100,000 steps of changing batch composition.

    python -m benchmarks.soak --steps 100000 --out benchmarks/results/soak_cpu.json

A small scheduler admits requests while blocks are free, grows them one token per step
(allocating a block at each boundary), finishes them at a random length and frees their
blocks. Every `--every` steps it records: trace/compile events since warm-up, bytes of live
JAX arrays, process RSS, free blocks, batch size. At the end, with every request finished,
the free-block count must equal its starting value.
"""

import argparse
import json
import platform
import resource
import time

import jax
import numpy as np

from benchmarks._toy_runtime import BLOCK, CFG, MAX_BLOCKS, NUM_BLOCKS, make_runner
from decodejax.cache import OutOfPages, PageAllocator
from decodejax.metadata import DecodeRow
from decodejax.runner import RunnerConfig, compile_events
from decodejax.sampling import SamplingParams


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--max-bs", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    args = parser.parse_args(argv)

    runner = make_runner(RunnerConfig(max_decode_bs=args.max_bs, max_capture_bs=args.max_bs))
    runner.capture(progress=None)
    runner.set_sampling(0, SamplingParams())  # warms the parameter-pool update
    alloc = PageAllocator(NUM_BLOCKS)
    start_free = alloc.num_free
    rng = np.random.default_rng(0)
    free_slots = list(range(256))
    active = {}  # slot -> [committed_len, target_len, blocks, last_token]
    compiles0 = compile_events()
    records, finished, t0 = [], 0, time.perf_counter()

    def admit():
        target = int(rng.integers(2, MAX_BLOCKS * BLOCK - 1))
        try:
            blocks = alloc.allocate(1)
        except OutOfPages:
            return False
        slot = free_slots.pop()
        runner.set_sampling(slot, SamplingParams(temperature=0.0, seed=slot))
        active[slot] = [0, target, blocks, int(rng.integers(0, CFG.vocab_size))]
        return True

    step = 0
    while step < args.steps or active:
        draining = step >= args.steps
        while not draining and len(active) < args.max_bs and free_slots and rng.random() < 0.7 and admit():
            pass
        rows = [DecodeRow(s, a[0], (a[3],), {"main": a[2]}) for s, a in active.items()]
        out = runner.step(rows)
        for row, sampled in zip(rows, out):
            a = active[row.slot]
            a[0] += 1
            a[3] = int(sampled[0])
            if a[0] >= a[1]:
                alloc.free(a[2])
                del active[row.slot]
                free_slots.append(row.slot)
                finished += 1
            elif a[0] % BLOCK == BLOCK - 1:  # the next window position needs a new block
                try:
                    a[2] = a[2] + alloc.allocate(1)
                except OutOfPages:  # preempt: the request gives its blocks back
                    alloc.free(a[2])
                    del active[row.slot]
                    free_slots.append(row.slot)
        step += 1
        if step % args.every == 0:
            live = sum(x.nbytes for x in jax.live_arrays())
            records.append({"step": step, "compiles_since_warmup": compile_events() - compiles0, "live_array_bytes": live,
                            "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "free_blocks": alloc.num_free,
                            "batch": len(rows), "finished": finished, "seconds": time.perf_counter() - t0})
            print(json.dumps(records[-1]), flush=True)
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__, "device": jax.devices()[0].device_kind},
        "steps": step, "requests_finished": finished, "start_free_blocks": start_free, "end_free_blocks": alloc.num_free,
        "compiles_since_warmup": compile_events() - compiles0, "seconds": time.perf_counter() - t0, "records": records,
    }
    json.dump(result, open(args.out, "w"), indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "records"}))
    assert result["end_free_blocks"] == start_free and result["compiles_since_warmup"] == 0, result


if __name__ == "__main__":
    main()
