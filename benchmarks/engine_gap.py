"""Where the engine's decode step loses time against the same step replayed back to back.

    python -m benchmarks.engine_gap --model llama3-8b --shapes 1x2048,32x512 --out gap.json

On the H200 the engine's step read 0.12 to 0.41 ms above `e2e_decode.py`'s replay at every
shape (thirty-fifth session, benchmarks/README.md); at B 1 that is the difference between 1.31x
and 1.26x of the memory roofline. Each variant below changes one thing
about the replay, most of them towards what the engine does:

- how the packed metadata reaches the step: `numpy` (one host array, uploaded by every call, as
  the replay passes it), `one_device` (one device array: the same address every call),
  `two_device` (two device arrays in turns), `fresh_kept` (a new upload each call while the
  previous call's stays alive, as the engine's step in flight keeps its own);
- how the host waits: `depth1_wait` (after each call, wait for the previous call's tokens, as the
  engine keeps one step in flight) and `depth1_fetch` (the same through the engine's host copy:
  `copy_to_host_async`, then `np.asarray` of the previous call's tokens), `depth1_poll` (the
  wait as a loop over `is_ready()` that never sleeps), `depth2_wait` and `depth8_wait` (two and
  eight calls left in flight), `depth1_late` (depth1_wait, then LATE_DISPATCH_S before the next
  dispatch: whether dispatching right as the GPU starts a call is what costs);
- and two that never wait: `numpy_query` (asks `is_ready()` of the previous call's tokens once a
  call) and `numpy_paced` (dispatches at 0.97 of the numpy replay's rate, so every call is
  dispatched while the one before runs, as in the engine, without waiting on a buffer; the host
  then leads the GPU by only 3% of a call, so a late dispatch idles the GPU).

`numpy_tail` is the numpy replay timed as 32 calls less 22: calls that the GPU runs after the
host has dispatched them all (12 less 2 keeps about half of them running while the host still
dispatches), so it tells whether the GPU runs a call slower while the host dispatches the next.

The engine's own steps are also timed with the runner's fetch polling the same way
(`engine_poll_step_ms`). `--trace` traces TRACED_CALLS calls of the engine and of
TRACED_VARIANTS' replays and records each call's GPU kernel span and the GPU's wait after it:
whether a slower variant's calls take longer on the GPU or leave it waiting between them.

Each variant's figure is `e2e_decode.steady_per_call_ms` (12 calls less 2, each run from an idle
device), three samples a round, the variants in turns over `--rounds` rounds; the engine's own
steps (`e2e_decode.timed_steps`) are timed first on the same seated batch. A variant that reads
like the engine's step names the cause.

Thirty-sixth session (benchmarks/README.md): the engine's step read like `depth1_wait` and
`depth1_fetch` in every run, 0.05 to 0.14 ms above `numpy`; neither the metadata's upload, nor
sleeping in the wait, nor asking `is_ready()`, nor dispatching 1 ms later moved the depth-1 figure,
and under the profiler every variant's calls had the same GPU span and gaps.
"""

import argparse
import platform

import numpy as np

VARIANTS = ("numpy", "one_device", "two_device", "fresh_kept", "depth1_wait", "depth1_fetch", "depth1_poll", "depth2_wait", "depth8_wait",
            "depth1_late", "numpy_query", "numpy_paced")
LATE_DISPATCH_S = 1e-3  # depth1_late: the host's pause between a call's tokens and the next dispatch
WAIT_DEPTH = {"depth1_wait": 1, "depth2_wait": 2, "depth8_wait": 8, "depth1_late": 1}  # calls left in flight while the host waits


def spin_until_ready(array) -> None:
    """Polls `array.is_ready()` on this thread instead of sleeping in a blocking wait."""
    while not array.is_ready():
        pass


def spinning_fetch(pending) -> np.ndarray:
    """The runner's fetch, polling for the step's tokens before it reads them."""
    from decodejax.runner import DecodeRunner

    spin_until_ready(pending.sampled)
    return DecodeRunner.fetch(pending)


def replay_runs(runner, step, host_packed: np.ndarray) -> dict:
    """variant -> run(calls): `calls` calls of the compiled step, then a wait for the last."""
    import time

    import jax

    from benchmarks.e2e_decode import steady_per_call_ms

    one = jax.device_put(host_packed)
    two = [jax.device_put(host_packed), jax.device_put(host_packed.copy())]
    kept = []

    def fresh_kept():
        kept.append(jax.device_put(host_packed))
        del kept[:-2]  # this call's and the previous call's
        return kept[-1]

    packed_of = {"numpy": lambda i: host_packed, "one_device": lambda i: one, "two_device": lambda i: two[i % 2],
                 "fresh_kept": lambda i: fresh_kept()}

    pace_s = 0.0  # numpy_paced's host period: set below from the numpy replay's rate

    def make(variant):
        def run(calls: int) -> None:
            outputs, start = [], time.perf_counter()
            for i in range(calls):
                packed = packed_of.get(variant, lambda i: host_packed)(i)
                runner.pool, runner.buffers, sampled, _ = step(runner.param_leaves, runner.pool, runner.buffers, runner.sampling, packed)
                if variant == "depth1_fetch":
                    sampled.copy_to_host_async()
                outputs = outputs[-8:] + [sampled]
                depth = WAIT_DEPTH.get(variant)
                if depth is not None and len(outputs) > depth:
                    jax.block_until_ready(outputs[-1 - depth])
                    if variant == "depth1_late":
                        time.sleep(LATE_DISPATCH_S)
                elif len(outputs) < 2:
                    continue
                elif variant == "depth1_fetch":
                    np.asarray(outputs[-2])
                elif variant == "depth1_poll":
                    spin_until_ready(outputs[-2])
                elif variant == "numpy_query":
                    outputs[-2].is_ready()
                elif variant == "numpy_paced":
                    while time.perf_counter() < start + (i + 1) * pace_s:
                        pass
            jax.block_until_ready(runner.buffers)
        return run

    runs = {v: make(v) for v in VARIANTS}
    runs["numpy"](2)
    pace_s = 0.97 * steady_per_call_ms(runs["numpy"], 2, 12) / 1e3
    return runs


ENGINE_STEPS = 40  # timed engine steps per run; two runs (blocking, polling) after three warm-up steps
TRACED_CALLS = 16  # calls (engine steps) of each traced run
TRACED_VARIANTS = ("numpy", "depth1_wait", "depth2_wait")
TOKENS_PAST_CONTEXT = 2 * ENGINE_STEPS + TRACED_CALLS + 16  # what a seated request generates, with room for the drains


def traced_calls(run_and_finish, calls: int) -> dict:
    """The GPU's kernel span of each call and its wait before the next, medians and all, over a
    jax.profiler trace (no Python tracer) of run_and_finish(), which makes `calls` calls."""
    from benchmarks.profile_summary import call_spans_and_gaps, traced

    planes, _ = traced(run_and_finish, python_tracer=False)
    per_call = call_spans_and_gaps(planes, calls)
    return per_call | {"span_us_median": float(np.median(per_call["span_us"])), "gap_us_median": float(np.median(per_call["gap_us"])),
                       "gap_us_mean": float(np.mean(per_call["gap_us"]))}


def trace_engine_and_replays(engine, runs: dict, calls: int = TRACED_CALLS) -> dict:
    """`traced_calls` of the engine's steps (drained before and after: calls - 1 engine steps
    dispatch `calls` steps) and of each of TRACED_VARIANTS' replays."""
    def engine_run():
        for _ in range(calls - 1):
            engine.step()
        engine.drain()

    engine.drain()
    traces = {"engine": traced_calls(engine_run, calls)}
    for variant in TRACED_VARIANTS:
        traces[variant] = traced_calls(lambda: runs[variant](calls), calls)
    return traces


def measure_shape(engine, batch: int, context: int, rounds: int, trace: bool = False) -> dict:
    from benchmarks.e2e_decode import replay_inputs, seat_prefilled, steady_per_call_ms, timed_steps

    free_before = engine.allocator.num_free
    seated = seat_prefilled(engine, batch, context, TOKENS_PAST_CONTEXT - 8, np.random.default_rng(0))
    for _ in range(3):
        engine.step()
    engine_ms = timed_steps(engine, batch, ENGINE_STEPS)["step"]
    engine_poll_ms = timed_steps(engine, batch, ENGINE_STEPS, fetch=spinning_fetch)["step"]
    runs = replay_runs(*replay_inputs(engine, seated))
    samples = {v: [] for v in VARIANTS + ("numpy_tail",)}
    for _ in range(rounds):
        for variant, run in runs.items():
            run(2)  # warm-up
            samples[variant] += [steady_per_call_ms(run, 2, 12) for _ in range(3)]
        samples["numpy_tail"] += [steady_per_call_ms(runs["numpy"], 22, 32) for _ in range(3)]
    traces = trace_engine_and_replays(engine, runs) if trace else None
    for req in seated:
        engine.abort(req.id)
    if engine.allocator.num_free != free_before:
        raise RuntimeError(f"free pages {engine.allocator.num_free} != {free_before} after the shape")
    return {"batch": batch, "context": context, "engine_step_ms_samples": engine_ms, "engine_step_ms_median": float(np.median(engine_ms)),
            "engine_poll_step_ms_samples": engine_poll_ms, "engine_poll_step_ms_median": float(np.median(engine_poll_ms)),
            "replay_ms_samples": samples, "replay_ms_median": {v: float(np.median(x)) for v, x in samples.items()}} | (
            {"traced": traces} if trace else {})


def main(argv=None):
    import jax
    import jax.numpy as jnp

    from benchmarks.e2e_decode import build_engine, fill_pool_with_noise, write_json
    from decodejax import evidence
    from models import llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--shapes", default="1x2048,32x512", help="comma-separated BATCHxCONTEXT")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace", action="store_true", help="also trace the engine's and some replays' calls: GPU span and wait per call")
    parser.add_argument("--pool-tokens", type=int, default=None, help="default: the shapes' largest batch x (context + TOKENS_PAST_CONTEXT)")
    parser.add_argument("--out", default="benchmarks/results/engine_gap.json")
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    batches, longest = sorted({b for b, _ in shapes}), max(t for _, t in shapes)
    model = llama.random(args.model, dtype=jnp.dtype(args.dtype))
    pool_tokens = args.pool_tokens or max(b * (t + TOKENS_PAST_CONTEXT) for b, t in shapes)
    engine = build_engine(model, batches, longest + TOKENS_PAST_CONTEXT, pool_tokens, 16, args.dtype)
    fill_pool_with_noise(engine)
    result = {"machine": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version()},
              "source_commit": evidence.source_identity()["commit"], "model": args.model, "dtype": args.dtype, "rows": []}
    for batch, context in shapes:
        row = measure_shape(engine, batch, context, args.rounds, args.trace)
        result["rows"].append(row)
        write_json(result, args.out)
        print(f"B={batch:4d} T={context:5d}  engine step {row['engine_step_ms_median']:.3f} ms (polling {row['engine_poll_step_ms_median']:.3f}); replay: "
              + ", ".join(f"{v} {ms:.3f}" for v, ms in row["replay_ms_median"].items()), flush=True)
        for name, t in row.get("traced", {}).items():
            print(f"    traced {name:12s} GPU span {t['span_us_median']:.1f} us/call, wait after it median {t['gap_us_median']:.1f} "
                  f"mean {t['gap_us_mean']:.1f} us", flush=True)


if __name__ == "__main__":
    main()
