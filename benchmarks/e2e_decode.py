"""End-to-end decode throughput of a Llama on the engine, against its memory-bound roofline.

    python -m benchmarks.e2e_decode --model llama3-8b --batch 1,8,32,64,128 --context 512,2048,8192 \
        --dtype bfloat16 --out benchmarks/results/e2e_decode.json [--peer]

For each (batch, context): `batch` requests with `context` random prompt tokens are prefilled,
then `--steps` decode steps are timed one by one (each step ends with the host copy of its
tokens, so it is synchronized). Reported: ms per step (median, min), decode tokens/s, and the
roofline per step, (weight bytes + K/V bytes read) / 4.8 TB/s, with the fraction reached.
`--peer` runs Hugging Face transformers `generate` (static cache, torch.compile) on the same
shapes and weights in a second process (benchmarks.peers.hf_generate). Start-up: the decode
buckets' capture time in a fresh process, cold (empty compilation cache) and warm (cache filled).

Not yet run on the H200. Known limit: the engine's prefill runs attention through the decode
kernel, one query row per prompt token, so its K/V reads grow with the square of the prompt
length; at the issue's 2048 and 8192 contexts the prefill phase (not the timed decode steps)
needs a dense prefill attention path first.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

DATASHEET_BPS = 4.8e12


def weight_bytes(model) -> int:
    import jax
    from flax import nnx

    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def kv_bytes_per_step(config, batch: int, context: int, dtype_bytes: int) -> int:
    return batch * context * config.num_layers * config.num_kv_heads * config.head_dim * 2 * dtype_bytes


def measure(model, batch: int, context: int, steps: int, dtype: str, cache_dir=None) -> dict:
    from decodejax.engine import Engine, EngineConfig
    from decodejax.sampling import SamplingParams

    page = 16
    engine = Engine(model, EngineConfig(max_batch=batch, max_context=context + steps + page, page_size=page, kv_dtype=dtype,
                                        prefill_token_budget=2048, prefill_buckets=(256, 512, 1024, 2048), compilation_cache_dir=cache_dir))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 1)
    for _ in range(batch):
        engine.add_request([int(t) for t in rng.integers(0, model.config.vocab_size, context)], params)
    t0 = time.perf_counter()
    while len([r for r in engine.running if r.generated]) < batch:
        engine.step()
    prefill_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    return {"batch": batch, "context": context, "step_ms_samples": times, "step_ms_median": float(np.median(times)),
            "step_ms_min": float(np.min(times)), "tokens_per_s": batch / (float(np.median(times)) / 1e3),
            "prefill_s": prefill_s, "capture_s": sum(engine.capture_seconds.values())}


def startup(model_name: str, dtype: str, cache_dir: str) -> float:
    """Capture seconds of a fresh process (decode ladder up to 64) with the given compilation cache."""
    code = (f"import jax.numpy as jnp; from models import llama; from decodejax.engine import Engine, EngineConfig; "
            f"e = Engine(llama.random({model_name!r}, dtype=jnp.dtype({dtype!r})), EngineConfig(max_batch=64, max_context=1024, "
            f"kv_dtype={dtype!r}, compilation_cache_dir={cache_dir!r})); print(sum(e.capture_seconds.values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", default="1,8,32,64,128")
    parser.add_argument("--context", default="512,2048,8192")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--startup", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/e2e_decode.json")
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from models import llama

    model = llama.random(args.model, dtype=jnp.dtype(args.dtype))
    wbytes = weight_bytes(model)
    dbytes = jnp.dtype(args.dtype).itemsize
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            r = measure(model, batch, context, args.steps, args.dtype)
            roof_ms = (wbytes + kv_bytes_per_step(model.config, batch, context, dbytes)) / DATASHEET_BPS * 1e3
            r.update(roofline_ms=roof_ms, roofline_fraction=roof_ms / r["step_ms_median"])
            rows.append(r)
            print(f"B={batch:4d} T={context:5d}  {r['step_ms_median']:8.2f} ms/step  {r['tokens_per_s']:9.1f} tok/s  "
                  f"roofline {roof_ms:6.2f} ms ({r['roofline_fraction']:.0%})", flush=True)
    result = {"machine": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version()},
              "model": args.model, "dtype": args.dtype, "weight_bytes": wbytes, "rows": rows}
    if args.startup:
        cache = tempfile.mkdtemp(prefix="decodejax_cc_")
        result["startup_capture_s"] = {"cold": startup(args.model, args.dtype, cache), "warm": startup(args.model, args.dtype, cache)}
    if args.peer:
        peer_out = os.path.join(tempfile.mkdtemp(), "hf.json")
        subprocess.run([sys.executable, "-m", "benchmarks.peers.hf_generate", "--model", args.model, "--batch", args.batch,
                        "--context", args.context, "--steps", str(args.steps), "--out", peer_out], check=False, timeout=3000)
        if os.path.exists(peer_out):
            result["peer_transformers"] = json.load(open(peer_out))
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
