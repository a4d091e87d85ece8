"""Host overhead of the decode runtime: where a step's time goes, padding waste, capture cost.

    python -m benchmarks.runtime_overhead --out benchmarks/results/runtime_overhead_cpu.json

Per batch size, over `--steps` steps: host pack+validate time (timed alone), dispatch time
(the runner's submit, which packs again, minus that pack time, until the compiled step returns), device time (dispatch return until buffers are ready), the one
device-to-host copy, and the eager (un-jitted) step for comparison. Also: the capture time of
every bucket, and the padding each bucket costs (padded rows / bucket rows).
"""

import argparse
import json
import platform
import time

import jax
import numpy as np

from benchmarks._toy_runtime import CFG, make_runner
from decodejax.metadata import DecodeRow, pack_decode_batch
from decodejax.runner import RunnerConfig


def rows_for(n):
    return [DecodeRow(i, 40 + i % 20, (i % CFG.vocab_size,), {"main": [1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i]}) for i in range(n)]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/runtime_overhead_cpu.json")
    args = parser.parse_args(argv)
    config = RunnerConfig(max_decode_bs=64, max_capture_bs=64)
    runner = make_runner(config)
    capture = runner.capture(progress=None)
    eager = make_runner(RunnerConfig(max_decode_bs=64, max_capture_bs=64, enforce_eager=True))
    sizes = {}
    for n in (1, 3, 8, 20, 33, 64):
        rows = rows_for(n)
        bs = runner.bucket_for(n)
        for _ in range(5):
            runner.step(rows)
        pack, dispatch, device, copy = [], [], [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            pack_decode_batch(rows, bs=bs, router=runner.router, window=1, vocab_size=CFG.vocab_size)
            t1 = time.perf_counter()
            pending = runner.submit(rows)  # packs again, then dispatches
            t2 = time.perf_counter()
            jax.block_until_ready(runner.buffers)
            t3 = time.perf_counter()
            runner.fetch(pending)
            t4 = time.perf_counter()
            pack.append(t1 - t0)
            dispatch.append(t2 - t1 - (t1 - t0))
            device.append(t3 - t2)
            copy.append(t4 - t3)
        eager.step(rows)
        eager_times = []
        for _ in range(10):
            t0 = time.perf_counter()
            eager.step(rows)
            eager_times.append(time.perf_counter() - t0)
        med = lambda xs: float(np.median(xs) * 1e6)  # noqa: E731
        sizes[n] = {"bucket": bs, "padding_fraction": (bs - n) / bs, "pack_us": med(pack), "dispatch_us": med(dispatch),
                    "device_us": med(device), "d2h_copy_us": med(copy), "replay_step_us": med(pack) + med(dispatch) + med(device) + med(copy),
                    "eager_step_us": med(eager_times)}
        print(n, json.dumps(sizes[n]), flush=True)
    ladder = config.ladder
    waste = {b: float(np.mean([(b - n) / b for n in range(1, b + 1) if runner.bucket_for(n) == b])) for b in ladder}
    result = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__, "device": jax.devices()[0].device_kind},
        "model": "models.toy (2 layers, d 32, H_q 4, H_kv 2, D 16, vocab 64), page 8, block 16",
        "capture_seconds": {str(k): v for k, v in capture.items()},
        "capture_total_seconds": sum(capture.values()),
        "mean_padding_fraction_per_bucket": {str(k): v for k, v in waste.items()},
        "per_batch_size": {str(k): v for k, v in sizes.items()},
    }
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
