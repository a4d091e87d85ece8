"""What `Engine(model)` picks on this device, and what one request sees with it.

    python -m benchmarks.engine_defaults --model llama3-8b --dtype bfloat16 \
        --prompt-lengths 512,2048,8000 --out benchmarks/results/engine_defaults.json

One process: the model is built, then `Engine(model)` with no config (`engine.fitted_config`:
K/V dtype, batch, context and pages from the model and the device's memory) captures its decode
buckets: cold, or warm when `--compilation-cache DIR` names a JAX compilation cache that an
earlier run with the same DIR filled. For each prompt length, one request (random token ids,
greedy, `--new-tokens`) is streamed once, which compiles the prefill buckets it uses (kept as
`first_request_s`), then `--samples` more times, each timed by the host's clock:
- TTFT: from the call to `engine.stream` to its first token. The engine yields a step's tokens
  when the step returns, and the step that finishes a prompt also runs the first decode step, so
  this is the prefill plus one decode step, as a streaming user sees it.
- ms per token after the first: the rest of the stream over its tokens.

Prefill is compute bound, so TTFT sits beside the prompt's useful FLOPs: 2 x the decoder layers'
matmul parameters x prompt tokens, 2 x 2 x layers x H_q x D x the causal (query, key) pairs for
attention, and the output head for the last token only; their rate is against the H200
datasheet's 989 dense bf16 TFLOP/s. No peer runs here.

`--prefill-token-budget N` runs the same defaults but for the prefill budget: N tokens, with
the CPU defaults' buckets (16 to 256) and one of N, to compare chunk sizes.
"""

import argparse
import dataclasses
import platform
import time

import numpy as np

DATASHEET_BF16_FLOPS = 989e12


def prefill_flops(config, prompt_len: int) -> float:
    """Useful FLOPs of prefilling prompt_len tokens (see the module docstring)."""
    c = config
    q_width = c.num_heads * c.head_dim
    kv_width = c.num_kv_heads * c.head_dim
    layer_params = c.hidden_size * (q_width + 2 * kv_width) + q_width * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    causal_pairs = prompt_len * (prompt_len + 1) / 2
    attention = 2 * 2 * c.num_heads * c.head_dim * causal_pairs
    return c.num_layers * (2 * layer_params * prompt_len + attention) + 2 * c.hidden_size * c.vocab_size


def stream_once(engine, prompt: list[int], new_tokens: int) -> dict:
    from decodejax.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    stamps = [time.perf_counter() for _ in engine.stream(prompt, params)]
    if len(stamps) != new_tokens:
        raise RuntimeError(f"streamed {len(stamps)} tokens, asked for {new_tokens}")
    return {"ttft_s": stamps[0] - t0, "ms_per_token_after_first": (stamps[-1] - stamps[0]) * 1e3 / (new_tokens - 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-lengths", default="512,2048,8000")
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--compilation-cache", default=None, help="a JAX persistent compilation cache directory")
    ap.add_argument("--prefill-token-budget", type=int, default=None, help="instead of the default's budget")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.e2e_decode import write_json
    from decodejax import evidence
    from decodejax.engine import Engine, fitted_config
    from models import llama

    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    t0 = time.perf_counter()
    model = llama.random(args.model, dtype=jnp.dtype(args.dtype))
    state = model.functional()[1]
    jax.block_until_ready(jax.tree.leaves(state))
    build_s = time.perf_counter() - t0
    stats_before = jax.devices()[0].memory_stats() or {}
    config = None
    if args.prefill_token_budget:
        config = dataclasses.replace(
            fitted_config(model.config, state),
            prefill_token_budget=args.prefill_token_budget, prefill_buckets=(16, 32, 64, 128, 256, args.prefill_token_budget))
    engine = Engine(model, config)
    ec = engine.config
    result = {
        "machine": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version()},
        "source_commit": evidence.source_identity()["commit"], "model": args.model, "dtype": args.dtype, "model_build_s": build_s,
        "memory_stats_at_engine_start": {k: stats_before[k] for k in ("bytes_limit", "bytes_in_use") if k in stats_before},
        "config": {"max_batch": ec.max_batch, "max_context": ec.max_context, "page_size": ec.page_size, "num_pages": ec.num_pages,
                   "kv_dtype": ec.kv_dtype, "prefill_token_budget": ec.prefill_token_budget, "ladder": list(engine.runner.config.ladder)},
        "compilation_cache": args.compilation_cache, "pool_pages": engine.allocator.num_pages,
        "pool_bytes": int(sum(x.nbytes for x in jax.tree.leaves(engine.runner.pool))),
        "capture_s": engine.capture_seconds, "new_tokens": args.new_tokens, "rows": [],
    }
    print(f"Engine(model): {result['config']}, pool {result['pool_bytes'] / 2**30:.1f} GiB, "
          f"capture {sum(engine.capture_seconds.values()):.1f} s", flush=True)
    rng = np.random.default_rng(0)
    for length in (int(x) for x in args.prompt_lengths.split(",")):
        prompt = [int(t) for t in rng.integers(0, model.config.vocab_size, length)]
        t1 = time.perf_counter()
        stream_once(engine, prompt, args.new_tokens)
        first_s = time.perf_counter() - t1
        samples = [stream_once(engine, prompt, args.new_tokens) for _ in range(args.samples)]
        ttft = [s["ttft_s"] for s in samples]
        ttft_median = float(np.median(ttft))
        flops = prefill_flops(model.config, length)
        row = {"prompt_len": length, "first_request_s": first_s, "samples": samples,
               "ttft_ms_median": ttft_median * 1e3, "ttft_ms_min": min(ttft) * 1e3,
               "ms_per_token_after_first_median": float(np.median([s["ms_per_token_after_first"] for s in samples])),
               "prefill_flops": flops, "tflops_per_s_at_median_ttft": flops / ttft_median / 1e12,
               "datasheet_fraction": flops / ttft_median / DATASHEET_BF16_FLOPS,
               "free_pages_after": engine.allocator.num_free}
        result["rows"].append(row)
        if row["free_pages_after"] != engine.allocator.num_pages - 1:
            raise RuntimeError(f"{row['free_pages_after']} pages free after the request, of {engine.allocator.num_pages - 1}")
        print(f"prompt {length:5d}: first request {first_s:6.1f} s; TTFT {row['ttft_ms_median']:8.1f} ms (min {row['ttft_ms_min']:.1f}), "
              f"{row['tflops_per_s_at_median_ttft']:.0f} TFLOP/s ({row['datasheet_fraction']:.0%}); then "
              f"{row['ms_per_token_after_first_median']:.2f} ms/token", flush=True)
        write_json(result, args.out)


if __name__ == "__main__":
    main()
