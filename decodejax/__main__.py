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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
