"""Command line: `python -m decodejax selfcheck`."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodejax")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("selfcheck", help="recompute the seed fixtures in float64 and print them")
    ex = sub.add_parser("explain", help="print the backend candidates, their reasons and the winner for a decode call")
    ex.add_argument("--shape", required=True, help="B,T,H_q,H_kv,D,P")
    ex.add_argument("--device", choices=("gpu", "cpu"), default=None, help="default: this machine")
    ex.add_argument("--compute-capability", default="9.0")
    ex.add_argument("--dtype", default="bfloat16")
    ex.add_argument("--layout", default="paged_nhd", help="a KVLayout value")
    ex.add_argument("--mask", default="causal", choices=("causal", "dense_custom"))
    ex.add_argument("--bucket-mode", action="store_true")
    ex.add_argument("--backend", default="auto")
    ev = sub.add_parser("evidence", help="write the evidence bundle of one paged decode call")
    ev.add_argument("--shape", required=True, help="B,T,H_q,H_kv,D,P")
    ev.add_argument("--out", default="evidence")
    ev.add_argument("--backend", default="auto")
    ev.add_argument("--dtype", default="bfloat16")
    ev.add_argument("--samples", type=int, default=30)
    gen = sub.add_parser("generate", help="generate text with a model on the paged cache")
    gen.add_argument("--model", default="tiny", help="a preset (tiny, llama3-1b, llama3-8b, qwen2-0.5b) or a Hugging Face directory")
    gen.add_argument("--prompt", default="The decode phase of inference")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="float32")
    bench = sub.add_parser("bench", help="end-to-end decode benchmark on a GPU (from the repository root)")
    bench.add_argument("--model", default="llama3-8b")
    bench.add_argument("--batch", default="64")
    bench.add_argument("--context", default="2048")
    bench.add_argument("--steps", default="20")
    bench.add_argument("--out", default="benchmarks/results/e2e_decode.json")
    args = parser.parse_args(argv)
    if args.command == "bench":
        try:
            from benchmarks import e2e_decode
        except ImportError:
            print("python -m decodejax bench runs benchmarks/e2e_decode.py: run it from the repository root", file=sys.stderr)
            return 2
        e2e_decode.main(["--model", args.model, "--batch", args.batch, "--context", args.context, "--steps", args.steps,
                         "--dtype", "bfloat16", "--out", args.out])
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "evidence":
        import jax.numpy as jnp

        from decodejax import evidence

        shape = tuple(int(x) for x in args.shape.split(","))
        bundle = evidence.collect(shape, dtype=jnp.dtype(args.dtype), backend=args.backend, samples=args.samples)
        path = evidence.write_bundle(bundle, args.out)
        print(f"{path}: backend {bundle['selection']['selected']}, evidence level {bundle['evidence_level']}, "
              f"median {bundle['timing']['median_us']:.1f} us, correctness {'passed' if bundle['correctness']['passed'] else 'FAILED'}")
        return 0 if bundle["correctness"]["passed"] else 1
    if args.command == "explain":
        from decodejax import dispatch

        B, T, H_q, H_kv, D, P = (int(x) for x in args.shape.split(","))
        device = args.device or dispatch.DispatchKey.environment()[0]
        outcome = dispatch.explain(
            device_type=device, compute_capability=args.compute_capability if device == "gpu" else None,
            operation="attention", phase="decode", q_dtype=args.dtype, kv_dtype=args.dtype, q_len=1, kv_len=T,
            num_q_heads=H_q, num_kv_heads=H_kv, head_dim_qk=D, head_dim_v=D, cache_layout=args.layout,
            page_size=P if dispatch.KVLayout(args.layout).is_paged else None, mask_kind=args.mask,
            bucket_mode=args.bucket_mode, backend_request=args.backend,
        )
        return 0 if isinstance(outcome, dispatch.Selection) else 1
    if args.command == "selfcheck":
        from decodejax import _selfcheck

        return _selfcheck.main()
    return 2


def _generate(args) -> int:
    import os
    import time

    import jax.numpy as jnp

    from decodejax.engine import Engine, HFTokenizer, fitted_config
    from decodejax.sampling import SamplingParams
    from models import llama

    dtype = jnp.dtype(args.dtype)
    tokenizer = None
    if os.path.isdir(args.model):
        model = llama.from_pretrained(args.model, dtype=dtype)
        if os.path.exists(os.path.join(args.model, "tokenizer.json")):
            tokenizer = HFTokenizer(os.path.join(args.model, "tokenizer.json"))
    else:
        model = llama.random(args.model, dtype=dtype)
    # One prompt: one row; on a GPU the prefill chunks and the pool fit the device.
    config = fitted_config(model.config, model.functional()[1], max_batch=1, max_context=min(model.config.max_position_embeddings, 4096))
    engine = Engine(model, config, tokenizer=tokenizer)
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    result = engine.generate([args.prompt], params)[0]
    seconds = time.perf_counter() - t0
    print(f"{args.prompt}{result.text}")
    print(f"[{len(result.token_ids)} tokens in {seconds:.2f} s: {len(result.token_ids) / seconds:.1f} tokens/s; "
          f"finish: {result.finish_reason}; capture {sum(engine.capture_seconds.values()):.1f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
