"""Two questions about the Mosaic GPU decode kernel, timed beside the Triton kernel on the GPU.

    python -m benchmarks.mosaic_probes layout  OUT.json   # NHD against HND pools (B 32, B 128)
    python -m benchmarks.mosaic_probes configs OUT.json   # ring slots and warpgroups (B 1, 32, 128)

`layout`: are strided page copies (NHD rows are H_kv * D apart) what holds the kernel back?
`configs`: do configs small enough for two programs per SM (80 KiB of shared memory) beat the
default (one program per SM)? Same timing method as `decode_attention.py` (`time_jax`).
"""

from __future__ import annotations

import functools
import json
import sys


def main(argv=None):
    import jax
    import jax.numpy as jnp

    import decodejax
    from benchmarks import cases as bench_cases
    from benchmarks.decode_attention import summarize, time_jax
    from decodejax import KVLayout
    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

    question, out_path = (argv or sys.argv[1:])[:2]
    shapes = {"layout": ((32, 4096), (128, 1024)), "configs": ((1, 32768), (32, 4096), (128, 1024))}[question]
    out = {}
    for batch, length in shapes:
        case = bench_cases.Case(f"B{batch}_T{length}", batch, length)
        data = bench_cases.make_case(case)
        q, k, v = (jnp.asarray(data[n], jnp.bfloat16) for n in ("q", "k_pages", "v_pages"))
        table, lens = jnp.asarray(data["page_table"]), jnp.asarray(data["seq_lens"])
        variants = {"triton/nhd": (dict(backend="pallas_triton"), k, v)}
        if question == "layout":
            variants["mgpu/nhd"] = (dict(backend="pallas_mosaic_gpu"), k, v)
            hnd = dict(backend="pallas_mosaic_gpu", layout=KVLayout.PAGED_HND)
            variants["mgpu/hnd"] = (hnd, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
        else:
            for block_k, stages, warpgroups in ((64, 2, 1), (64, 2, 2), (64, 4, 2)):
                config = MosaicDecodeConfig(block_k=block_k, num_stages=stages, compute_warpgroups=warpgroups)
                variants[f"mgpu/bk={block_k},st={stages},wg={warpgroups}"] = (dict(backend="pallas_mosaic_gpu", config=config), k, v)
        for name, (options, k_pool, v_pool) in variants.items():
            fn = jax.jit(functools.partial(decodejax.decode_attention, **options))
            stats = summarize(time_jax(fn, q, k_pool, v_pool, table, lens), bench_cases.kv_bytes(case))
            out[f"{case.name}/{name}"] = stats
            print(f"{case.name} {name} {stats['median_us']:.1f} us {stats['tbps_median']:.2f} TB/s", flush=True)
    with open(out_path, "w") as f:
        json.dump({"question": question, "machine": jax.devices()[0].device_kind, "jax": jax.__version__, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
