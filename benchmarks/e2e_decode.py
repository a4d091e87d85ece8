"""End-to-end decode throughput of a Llama on the engine, against its memory-bound roofline.

    python -m benchmarks.e2e_decode --model llama3-8b --batch 1,8,32,64,128 --context 512,2048,8192 \
        --dtype bfloat16 --out benchmarks/results/e2e_decode.json [--peer] [--startup]

One Engine serves every (batch, context): its pool holds the largest batch x context that fits
the device (`--pool-tokens`), its decode buckets are exactly the batches asked for. For each
(batch, context), `batch` requests are seated as if their `context` prompt tokens had been
prefilled: blocks from the engine's allocator, K/V pages holding random values (the pool is
filled once), a first generated token. The decode kernel reads every visible key whatever its
value, so the timed work is what it would be after a real prefill; the prefill itself is not
run, which keeps a sweep up to 64 x 8,192 prompt tokens short. Then
`--steps` engine steps are timed one by one after `--warmup` steps; each step ends with the host
copy of its tokens, so it is synchronized. The requests are aborted afterwards and the free
page count is checked to return to its start.

Reported per shape: ms per step (median, min, raw samples), decode tokens/s = batch / median
step, and the memory-bound roofline per step: (weight bytes read + K/V bytes read) / 4.8 TB/s.
Weight bytes read = every parameter except the embedding table, plus the `batch` embedding
rows gathered (a tied head reads the table as the head). K/V bytes read = batch x context x
layers x H_kv x D x 2 x itemsize.

Each shape also replays its compiled step back to back (`replay_ms`), the step without the
engine's host work: the time of 12 calls less that of 2, over 10, each run started after
IDLE_BEFORE_RUN_S of idle and ended by reading its last call's tokens (`steady_per_call_ms`).
Until the forty-eighth session the runs followed each other with no pause and ended on the
donated buffers being ready, and the replay read 0.1 to 0.4 ms under the engine's step at every
shape; on an H100, runs started from idle read within about 0.1 ms of it (benchmarks/README.md,
forty-eighth session). Each step's time in the runner's submit (pack and dispatch) and fetch
(the wait for its tokens) is kept beside it.

The requests decode greedily. With `--top-p P` they sample (temperature 1, nucleus P, seeded):
each step then also dispatches the runner's sorting `resample_step`, which the replay leaves
out.

`--prefer-backends NAMES` captures the steps inside `decodejax.dispatch.preferring(*NAMES)` (e.g.
pallas_mosaic_gpu: decode attention on the Mosaic GPU kernel); the result records the backends
each bucket's step selected.

`--profile-steps N` traces N more steps per shape with jax.profiler and records the GPU time
per step by kernel name (benchmarks.profile_summary): what the step's time goes to.

`--peer` runs Hugging Face transformers `generate` (static cache, torch.compile) on the same
shapes in a second process (benchmarks.peers.hf_generate). `--startup` measures the capture
time of a fresh process with an empty compilation cache (cold) and again with it filled (warm).
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

DATASHEET_BPS = 4.8e12
IDLE_BEFORE_RUN_S = 1.0  # steady_per_call_ms: the pause before each timed run (on an H100, 0.25 s and 1 s sufficed)


def weight_bytes_read(model, batch: int) -> int:
    """Parameter bytes one decode step reads (see the module docstring)."""
    import jax
    from flax import nnx

    total = int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    table = model.embed[...]
    if model.config.tie_word_embeddings:
        return total  # the table is read whole as the output head
    return total - table.nbytes + batch * table.shape[1] * table.dtype.itemsize


def kv_bytes_read(config, batch: int, context: int, dtype_bytes: int) -> int:
    return batch * context * config.num_layers * config.num_kv_heads * config.head_dim * 2 * dtype_bytes


def fill_pool_with_noise(engine, seed: int = 0) -> None:
    """Replaces every K/V page with standard-normal values, one layer at a time, in place.

    The noise ignores the pages it replaces, and jit drops an unused argument, donated or not, so
    the pages are kept as an argument (keep_unused) for their buffer to be donated. Without that,
    the old pool lived until the rebind: on the H200 a 530,000-token pool (64.7 GiB beside 15 GiB
    of weights) peaked at 128.2 of 128.6 GiB while filling, 16 layers' noise failed to allocate,
    and the first decode step then stopped on an out-of-memory error. Each layer is waited for, so
    that at most one layer's new K and V are in flight even where a donation cannot be used."""
    import jax

    from decodejax.cache import KVPool

    noise = jax.jit(lambda key, pages: jax.random.normal(key, pages.shape, pages.dtype), donate_argnums=1, keep_unused=True)
    pool, key = engine.runner.pool, jax.random.key(seed)
    k, v = list(pool.k), list(pool.v)
    for layer in range(pool.num_layers):
        key, kk, kv = jax.random.split(key, 3)
        k[layer], v[layer] = jax.block_until_ready((noise(kk, k[layer]), noise(kv, v[layer])))
    engine.runner.rebind_pool(KVPool(k=tuple(k), v=tuple(v)))


def seat_prefilled(engine, batch: int, context: int, max_new_tokens: int, rng, top_p: float | None = None) -> list:
    """`batch` running requests whose first `context` tokens are cached and one token sampled;
    greedy, or nucleus sampling with top_p."""
    from decodejax.engine import Request
    from decodejax.sampling import SamplingParams

    sampling = dict(temperature=0.0) if top_p is None else dict(top_p=top_p, seed=int(rng.integers(2**31)))
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **sampling)
    vocab = engine.vocab_size
    seated = []
    for _ in range(batch):
        prompt = [int(t) for t in rng.integers(0, vocab, context)]
        # The engine's own bookkeeping, as its admission and prefill would leave it.
        req = Request(next(engine._ids), prompt, params)
        if not engine._blocks_for(req, context + max_new_tokens):
            raise RuntimeError(f"the pool cannot seat {batch} requests of {context} + {max_new_tokens} tokens")
        req.slot = engine.free_slots.pop()
        engine.runner.set_sampling(req.slot, params)
        req.cached = context
        req.generated.append(int(rng.integers(0, vocab)))
        engine.running.append(req)
        seated.append(req)
    return seated


def timed_steps(engine, batch: int, steps: int, fetch=None) -> dict:
    """ms of each of `steps` engine steps, and of the parts of each spent in the runner's submit
    (pack and dispatch) and fetch (waiting for the tokens); the rest is the engine's own work.
    `fetch(pending)`, if given, stands in for the runner's fetch during these steps."""
    runner, parts = engine.runner, {"submit": [0.0], "fetch": [0.0]}

    def timed(name, method):
        def call(*args):
            t = time.perf_counter()
            try:
                return method(*args)
            finally:
                parts[name][-1] += (time.perf_counter() - t) * 1e3
        return call

    runner.submit, runner.fetch = timed("submit", runner.submit), timed("fetch", fetch or runner.fetch)  # instance attributes shadow the methods
    try:
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            produced = engine.step()
            times.append((time.perf_counter() - t) * 1e3)
            if len(produced) != batch:
                raise RuntimeError(f"a step produced {len(produced)} tokens for a batch of {batch}")
            for samples in parts.values():
                samples.append(0.0)
    finally:
        del runner.submit, runner.fetch
    return {"step": times, "submit": parts["submit"][:-1], "fetch": parts["fetch"][:-1]}


def measure(engine, batch: int, context: int, steps: int, warmup: int, rng, profile_steps: int = 0, top_p: float | None = None,
            replay_idle_s: float = IDLE_BEFORE_RUN_S) -> dict:
    free_before = engine.allocator.num_free
    seated = seat_prefilled(engine, batch, context, warmup + steps + profile_steps + 4, rng, top_p)  # running after the last step and both drains
    for _ in range(warmup):
        engine.step()
    timed = timed_steps(engine, batch, steps)
    times = timed["step"]
    replay = replay_step_ms(engine, seated, idle_s=replay_idle_s)
    profile = profile_engine_steps(engine, profile_steps) if profile_steps else None
    for req in seated:
        engine.abort(req.id)
    if engine.allocator.num_free != free_before:
        raise RuntimeError(f"free pages {engine.allocator.num_free} != {free_before} after the shape")
    median = float(np.median(times))
    row = {"batch": batch, "context": context, "step_ms_samples": times, "step_ms_median": median,
           "step_ms_min": float(np.min(times)), "tokens_per_s": batch / (median / 1e3),
           "submit_ms_median": float(np.median(timed["submit"])), "fetch_ms_median": float(np.median(timed["fetch"])),
           "submit_ms_samples": timed["submit"], "fetch_ms_samples": timed["fetch"],
           "replay_ms_samples": replay, "replay_ms_median": float(np.median(replay))}
    if profile is not None:
        row["profile"] = profile
    return row


def replay_step_ms(engine, seated, samples: int = 5, short: int = 2, long: int = 12, idle_s: float = IDLE_BEFORE_RUN_S) -> list[float]:
    """ms per call of the batch's compiled step replayed back to back (`steady_per_call_ms` of runs
    of `short` and `long` calls, each started after `idle_s` of idle and ended by reading its last
    call's tokens to the host).

    The same packed batch each time (the next token's K/V slot is rewritten), so no host work
    runs between calls: the device-bound step time, which the engine's step is measured against.
    """
    runner, step, packed = replay_inputs(engine, seated)

    def run(calls: int) -> None:
        for _ in range(calls):
            runner.pool, runner.buffers, sampled, _ = step(runner.param_leaves, runner.pool, runner.buffers, runner.sampling, packed)
        # The last call's tokens, not the donated buffers: on an H100 the tokens came 0.6 to 0.8 ms
        # after block_until_ready(runner.buffers) had returned (forty-eighth session).
        np.asarray(sampled)

    run(short)  # warm-up
    return [steady_per_call_ms(run, short, long, idle_s) for _ in range(samples)]


def replay_inputs(engine, seated):
    """(runner, compiled step, packed batch) that replay the seated requests' decode step outside
    the engine. Drains the engine first: a replay overwrites the sampled tokens a step in flight
    would read."""
    from decodejax.metadata import DecodeRow, pack_decode_batch

    engine.drain()
    runner = engine.runner
    rows = [DecodeRow(r.slot, r.cached, (r.last_token,), {"main": r.blocks}) for r in seated]
    bs = runner.bucket_for(len(rows))
    packed = pack_decode_batch(rows, bs=bs, router=runner.router, window=runner.config.window, vocab_size=runner.vocab_size)
    step, _ = runner.executable(bs)  # the benchmark's requests are greedy: no resample
    return runner, step, packed


def steady_per_call_ms(run, short: int, long: int, idle_s: float = IDLE_BEFORE_RUN_S) -> float:
    """ms per call once calls follow each other: (time of run(long) - time of run(short)) / (long - short).

    run(n) makes n calls and waits for them. Each run starts after `idle_s` of idle, so that what
    each run pays once cancels: the first call's dispatch, which the device waits for with nothing
    queued, and the final sync. Without the pause the runs leaked into each other: on an H100
    (llama3-8b shape, B 1, T 2,048) six such rates read 5.30 to 5.62 ms against the engine's 5.6,
    and four windows read 5.61 to 5.66 with a 1-s pause (benchmarks/README.md, forty-eighth
    session)."""
    def timed(calls: int) -> float:
        time.sleep(idle_s)
        t = time.perf_counter()
        run(calls)
        return (time.perf_counter() - t) * 1e3

    return (timed(long) - timed(short)) / (long - short)


def profile_engine_steps(engine, steps: int) -> dict:
    """GPU time per decode step by kernel (benchmarks.profile_summary) over `steps` traced engine
    steps, and the GPU's idle time and gaps between launches (`timeline`).

    The engine is drained before and inside the trace, so the window holds exactly the steps
    dispatched in it: with overlap_decode, `steps` engine steps dispatch steps + 1 (the first
    also dispatches the step it reads), and the figures are per dispatched step.
    """
    from benchmarks.profile_summary import stream_timeline, summarize_planes, traced

    def run():
        for _ in range(steps):
            engine.step()
        engine.drain()

    engine.drain()
    dispatched = steps + 1 if engine.config.overlap_decode else steps
    planes, wall_ms = traced(run)
    timeline = stream_timeline(planes, dispatched)
    return summarize_planes(planes, dispatched) | {"wall_ms_per_step_traced": wall_ms / dispatched,
                                                   "timeline": {k: timeline[k] for k in ("span_us_per_step", "busy_us_per_step", "idle_us_per_step", "gaps_us",
                                                                                     "host_us_per_step")}}


def attach_peer_ratios(rows: list[dict], peer: dict) -> None:
    """Adds to each shape both measured: speedup_vs_transformers, our tokens/s over the peer's
    (whose step is its fastest generate less its fastest prefill, the estimate that favours it);
    and, from the peer's raw samples, its step as each timed generate alone puts it,
    (that generate - the fastest prefill) / steps, with our speedup over each of those: the
    peer's generates can differ by more than the margin a ratio is read against (at B 1,
    T 2,048 its 31-token calls took 309 to 344 ms in the forty-seventh session). Where the peer
    also stamped each of its decode steps (hf_generate's `step_ms_median`, from the fiftieth
    session), speedup_vs_transformers_median_step sets the two sides' median steps side by side:
    the same statistic of the same per-step timing."""
    by_shape = {(r["batch"], r["context"]): r for r in peer["rows"] if "tokens_per_s" in r}
    for r in rows:
        peer_row = by_shape.get((r["batch"], r["context"]))
        if "tokens_per_s" not in r or peer_row is None:
            continue
        r["speedup_vs_transformers"] = r["tokens_per_s"] / peer_row["tokens_per_s"]
        prefill_s = min(peer_row["prefill_s_samples"])
        per_call_ms = sorted((total - prefill_s) / peer["steps"] * 1e3 for total in peer_row["total_s_samples"])
        r["transformers_step_ms_per_generate"] = per_call_ms
        r["speedup_vs_transformers_per_generate"] = [ms / r["step_ms_median"] for ms in per_call_ms]
        if "step_ms_median" in peer_row:
            r["transformers_step_ms_median"] = peer_row["step_ms_median"]
            r["speedup_vs_transformers_median_step"] = peer_row["step_ms_median"] / r["step_ms_median"]


# Device memory left for compiled steps' temporaries (and autotuning) beside the weights and the pool.
HEADROOM_BYTES = 8 << 30


def default_pool_tokens(config, wanted: int, dtype_bytes: int) -> int:
    """`wanted`, or as many tokens as the device's free memory holds after HEADROOM_BYTES."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return wanted
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - HEADROOM_BYTES
    return max(0, min(wanted, free // kv_bytes_read(config, 1, 1, dtype_bytes)))


def build_engine(model, batches, max_context: int, pool_tokens: int, page: int, dtype: str, cache_dir=None, xla_defaults=False,
                 xla_options: dict | None = None):
    """The engine of the benchmark. Its decode steps compile with the runner's XLA options
    (`runner.default_step_xla_options`), or XLA's defaults with xla_defaults; xla_options are set
    on top of either for every bucket (an A/B of one option needs no code change)."""
    from decodejax.engine import Engine, EngineConfig

    num_pages = -(-pool_tokens // page) + 1
    options = dict(step_xla_options=_no_options) if xla_defaults else {}  # else EngineConfig's default
    config = EngineConfig(max_batch=max(batches), max_context=max_context, page_size=page, num_pages=num_pages,
                          capture_ladder=tuple(sorted(batches)), kv_dtype=dtype, compilation_cache_dir=cache_dir, **options)
    if xla_options:
        config = dataclasses.replace(config, step_xla_options=functools.partial(_with_options, config.step_xla_options, dict(xla_options)))
    return Engine(model, config)


def _no_options(bs: int) -> dict:
    return {}


def _with_options(policy, extra: dict, bs: int) -> dict:
    return {**policy(bs), **extra}


def parse_xla_option(text: str) -> tuple[str, bool | int | str]:
    """`--xla-option` KEY=VALUE: true/false as bools, integers as ints, anything else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.startswith("xla_"):
        raise argparse.ArgumentTypeError(f"--xla-option {text!r}: expected xla_NAME=VALUE")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, int(value)
    except ValueError:
        return key, value


def startup(model_name: str, dtype: str, batches, max_context: int, cache_dir: str) -> dict:
    """A fresh process: seconds to build the model and to capture the decode buckets."""
    code = ("import time, jax.numpy as jnp; t = time.perf_counter(); from models import llama; "
            "from benchmarks.e2e_decode import build_engine; "
            f"m = llama.random({model_name!r}, dtype=jnp.dtype({dtype!r})); b = time.perf_counter() - t; "
            f"e = build_engine(m, {tuple(batches)!r}, {max_context}, {max(batches) * max_context}, 16, {dtype!r}, {cache_dir!r}); "
            "print(b, sum(e.capture_seconds.values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    build, capture = (float(x) for x in out.stdout.strip().splitlines()[-1].split())
    return {"model_build_s": build, "capture_s": capture}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", default="1,8,32,64,128")
    parser.add_argument("--context", default="512,2048,8192")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--replay-idle-s", type=float, default=IDLE_BEFORE_RUN_S,
                        help="idle before each timed replay run (0 where the replay measures nothing, as on CPU in the tests)")
    parser.add_argument("--pool-tokens", type=int, default=None, help="pool capacity in tokens (default: the largest batch x context that fits)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling instead of greedy (adds the resample step)")
    parser.add_argument("--profile-steps", type=int, default=0, help="also trace this many steps per shape and sum GPU time by kernel")
    parser.add_argument("--startup", action="store_true", help="also measure the capture time of fresh processes, cold then warm")
    parser.add_argument("--startup-only", action="store_true", help="measure only that")
    parser.add_argument("--peer", action="store_true", help="run benchmarks.peers.hf_generate in a second process")
    parser.add_argument("--peer-json", default=None, help="a finished benchmarks.peers.hf_generate result to compare with")
    parser.add_argument("--from-json", default=None, help="an earlier result of this script to add the peer to (no measuring)")
    parser.add_argument("--prefer-backends", default="", help="comma-separated backends automatic selection tries first")
    parser.add_argument("--xla-defaults", action="store_true", help="compile the decode steps with XLA's default options, not the runner's")
    parser.add_argument("--xla-option", type=parse_xla_option, action="append", default=[], metavar="xla_NAME=VALUE",
                        help="an XLA compile option set on top of the decode steps' options (repeatable)")
    parser.add_argument("--out", default="benchmarks/results/e2e_decode.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
    elif args.startup_only:
        result = {"model": args.model, "dtype": args.dtype}
    else:
        result = measure_all(args, batches, [int(c) for c in args.context.split(",")])
    if args.startup or args.startup_only:
        from models.llama import PRESETS

        context, cache = min(2048, PRESETS[args.model].max_position_embeddings), tempfile.mkdtemp(prefix="decodejax_cc_")
        result["startup"] = {"batches": batches, "max_context": context,
                             "cold": startup(args.model, args.dtype, batches, context, cache),
                             "warm": startup(args.model, args.dtype, batches, context, cache)}
        print("startup", result["startup"], flush=True)
    peer_json = args.peer_json
    if args.peer:
        peer_json = os.path.join(tempfile.mkdtemp(), "hf.json")
        subprocess.run([sys.executable, "-m", "benchmarks.peers.hf_generate", "--model", args.model, "--batch", args.batch,
                        "--context", args.context, "--steps", str(args.steps), "--out", peer_json], check=False, timeout=3000)
    if peer_json and os.path.exists(peer_json):
        with open(peer_json) as f:
            result["peer_transformers"] = json.load(f)
        attach_peer_ratios(result["rows"], result["peer_transformers"])
    write_json(result, args.out)


def measure_all(args, batches: list[int], contexts: list[int]) -> dict:
    """Every (batch, context) on one engine; the result is rewritten to args.out after each shape."""
    import jax
    import jax.numpy as jnp

    from decodejax import dispatch, evidence
    from models import llama

    page, extra = 16, args.warmup + args.steps + args.profile_steps + 4
    t0 = time.perf_counter()
    model = llama.random(args.model, dtype=jnp.dtype(args.dtype))
    build_s = time.perf_counter() - t0
    pool_tokens = args.pool_tokens or default_pool_tokens(model.config, max(batches) * (max(contexts) + extra + page), jnp.dtype(args.dtype).itemsize)
    print(f"model built in {build_s:.1f} s; pool of {pool_tokens} tokens", flush=True)
    prefer = tuple(n for n in args.prefer_backends.split(",") if n)
    with dispatch.preferring(*prefer):
        engine = build_engine(model, batches, max(contexts) + extra + page, pool_tokens, page, args.dtype, xla_defaults=args.xla_defaults,
                              xla_options=dict(args.xla_option))
    print(f"captured {sorted(engine.capture_seconds)} in {sum(engine.capture_seconds.values()):.1f} s", flush=True)
    fill_pool_with_noise(engine)
    dbytes = jnp.dtype(args.dtype).itemsize
    rng = np.random.default_rng(0)
    rows = []
    result = {"machine": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
                          "host_cpu": evidence.host_cpu()},
              "source_commit": evidence.source_identity()["commit"], "model": args.model, "dtype": args.dtype, "pool_tokens": pool_tokens, "model_build_s": build_s,
              "capture_s": engine.capture_seconds, "compiled_memory": engine.runner.compiled_memory(), "steps": args.steps,
              "warmup": args.warmup, "replay_idle_s": args.replay_idle_s, "sampling": "greedy" if args.top_p is None else {"top_p": args.top_p},
              "prefer_backends": list(prefer),
              "step_xla_options": {bs: engine.runner.config.step_xla_options(bs) for bs in sorted(engine.capture_seconds)},
              "selected_backends": {bs: sorted({(s.key.operation, s.key.phase, s.backend) for s in sel}) for bs, sel in engine.runner.selections.items()},
              "rows": rows}
    print("compiled memory per bucket", result["compiled_memory"], flush=True)
    for context in contexts:
        for batch in batches:
            need = batch * -(-(context + extra) // page)
            if need > engine.allocator.num_free:
                rows.append({"batch": batch, "context": context, "skipped": f"{need} pages needed, the pool holds {engine.allocator.num_free}"})
                print(f"B={batch:4d} T={context:5d}  skipped: {rows[-1]['skipped']}", flush=True)
                continue
            r = measure(engine, batch, context, args.steps, args.warmup, rng, args.profile_steps, args.top_p, args.replay_idle_s)
            wbytes, kvbytes = weight_bytes_read(model, batch), kv_bytes_read(model.config, batch, context, dbytes)
            roof_ms = (wbytes + kvbytes) / DATASHEET_BPS * 1e3
            r.update(weight_bytes_read=wbytes, kv_bytes_read=kvbytes, roofline_ms=roof_ms, roofline_fraction=roof_ms / r["step_ms_median"])
            rows.append(r)
            write_json(result, args.out)  # after every shape: a cut-off run keeps what it measured
            print(f"B={batch:4d} T={context:5d}  {r['step_ms_median']:8.2f} ms/step (min {r['step_ms_min']:.2f}; submit "
                  f"{r['submit_ms_median']:.2f}, fetch {r['fetch_ms_median']:.2f}; replay {r['replay_ms_median']:.2f})  "
                  f"{r['tokens_per_s']:9.1f} tok/s  roofline {roof_ms:6.2f} ms ({r['roofline_fraction']:.0%})"
                  + (f"  GPU idle {r['profile']['timeline']['idle_us_per_step'] / 1e3:.2f} ms/step, gaps {r['profile']['timeline']['gaps_us']}"
                     if "profile" in r else ""), flush=True)
    return result


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
