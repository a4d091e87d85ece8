"""Would the B 1 step's o projection run faster with its weights already in L2, and can a prefetch
issued beside the attention put them there? (Issue 6: B 1 within 1.3x of the roofline.)

    python -m benchmarks.l2_prefetch --out benchmarks/results/l2_prefetch.json

At B 1 each layer's o projection (4,096 x 4,096 bf16, 33.5 MB) reads its weights at about 3.3 TB/s
(9.8 us a layer on the H200), while the kernels just before it (the K/V row writes, the query's
RoPE, the decode kernel, its merge) leave HBM mostly idle. The thirty-first session prefetched the
o weights with a kernel placed in series before the attention: the o matmul was 0.5 us faster and
the layer 5 to 6 us slower. It left two questions, one part each here:

- `hot`: 32 chained M 1 matmuls on one o-projection matrix (in L2 after the first) against 32 on
  copies of it in buffers of their own (`cold`). If hot is not much faster than cold, no prefetch
  can help. (Its half and quarter columns were dropped after the first run: XLA made those chains
  reduction fusions, not GEMMs.)
- `beside`: 32 layers of [a 4,096 x 14,336 matmul (117 MB: what was in L2 leaves) -> six
  dependent small kernels -> the o matmul], with the o weights' first rows (all, half or a
  quarter) prefetched by a Mosaic GPU kernel that depends only on the first matmul's output, so
  that a concurrent command buffer (the runner's step options) may run it beside the small
  kernels. Its zero output is added to the o matmul's input. Against the same layers without it.

Each program is timed by the host's clock (`evidence.timed_samples`: back-to-back programs, then
one sync) as microseconds per layer, and traced for the GPU time per layer by kernel. A trace
runs the program op by op, so only the host clock sees whether the prefetch overlapped.

Answered on an H100 (fifty-second session, benchmarks/README.md): hot is twice as fast as cold, but
the prefetch slows the kernels beside it about as much as it speeds the o matmul, and end to end it
was level at B 1 and 1% slower at B 8. Not adopted; kept to ask the same of another card.
"""

import argparse
import functools
import json
import statistics

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import profile_summary
from decodejax import evidence, runner

LAYERS = 32
HIDDEN = 4096  # llama3-8b: the o projection is [HIDDEN, HIDDEN], the flushing matmul [HIDDEN, FLUSH_N]
FLUSH_N = 14336
TMA_TILE = 256  # a TMA box is at most 256 elements along each axis
PREFETCH_PROGRAMS = 32
PREFETCH_ROWS = {"beside": HIDDEN, "beside_half": HIDDEN // 2, "beside_quarter": HIDDEN // 4}
SMALL_KERNELS = 6  # between the flushing matmul and the o matmul, as a B 1 layer has about that many


def prefetch_rows_to_l2(w: jax.Array, after: jax.Array, rows: int) -> jax.Array:
    """Asks the TMA engine to bring w[:rows] (w: [K, N]; rows and N multiples of TMA_TILE, their
    tiles a multiple of PREFETCH_PROGRAMS) into L2 and returns f32[128] zeros, written once the
    prefetches are issued (not completed). `after` is only a data dependence: the kernel runs
    after whatever computes it."""
    K, N = w.shape
    if rows % TMA_TILE or N % TMA_TILE or rows > K:
        raise ValueError(f"rows={rows} and w.shape={w.shape}: rows <= K and both rows and N multiples of {TMA_TILE}")
    cols = N // TMA_TILE
    tiles = (rows // TMA_TILE) * cols
    if tiles % PREFETCH_PROGRAMS:
        raise ValueError(f"rows={rows} and w.shape={w.shape}: {tiles} tiles do not split over {PREFETCH_PROGRAMS} programs")
    per_program = tiles // PREFETCH_PROGRAMS

    def body(w_ref, after_ref, out_ref, zeros_smem):
        program = jax.lax.axis_index("p")
        for j in range(per_program):
            tile = program * per_program + j
            r, c = tile // cols, tile % cols
            plgpu.async_prefetch(w_ref.at[pl.ds(r * TMA_TILE, TMA_TILE), pl.ds(c * TMA_TILE, TMA_TILE)])

        @pl.when(program == 0)
        def _():
            zeros_smem[...] = jnp.zeros(zeros_smem.shape, zeros_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(zeros_smem, out_ref)
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32), grid=(PREFETCH_PROGRAMS,),
                        grid_names=("p",), scratch_types=[plgpu.SMEM((128,), jnp.float32)])(w, after)


def chain_cold(x, ws):
    for w in ws:  # each product, halved so that the values stay bounded, is the next matmul's input
        x = (x @ w) * 0.5
    return x


def chain_hot(x, w):
    """The cold chain with every layer's weights one matrix: after the first, read from L2."""
    return chain_cold(x, [w] * LAYERS)


def _small_kernel(s):
    s32 = s.astype(jnp.float32)
    s = (s32 * jax.lax.rsqrt(jnp.mean(s32 * s32, axis=-1, keepdims=True) + 1e-5)).astype(s.dtype)
    return jax.lax.optimization_barrier(s)  # one kernel each: XLA does not fuse across the barrier


def layers(x, flush_ws, o_ws, prefetch: str | None):
    for flush_w, o_w in zip(flush_ws, o_ws):
        h = x @ flush_w
        ready = prefetch_rows_to_l2(o_w, h[:, :8], PREFETCH_ROWS[prefetch]) if prefetch else None
        s = h[:, :HIDDEN]
        for _ in range(SMALL_KERNELS):
            s = _small_kernel(s)
        if ready is not None:
            s = s + ready[0].astype(s.dtype)
        x = s @ o_w
    return x


def _measure(name: str, fn, args, samples: int) -> dict:
    us = evidence.timed_samples(fn, args, samples=samples, reps=5)
    traced = profile_summary.traced_device_activity(lambda: jax.block_until_ready([fn(*args) for _ in range(4)]),
                                                    steps=4 * LAYERS, top=8)
    row = {"name": name, "us_per_layer_median": statistics.median(us) / LAYERS, "us_per_layer_min": min(us) / LAYERS,
           "us_per_program_samples": us,
           "gpu_us_per_layer_by_kernel": [(k["name"], k["us_per_step"], k["launches_per_step"]) for k in traced["top"]]}
    print(json.dumps({k: v for k, v in row.items() if k != "us_per_program_samples"}), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="beside,hot", help="comma-separated: beside, hot")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/l2_prefetch.json")
    args = parser.parse_args(argv)
    options = runner.default_step_xla_options(1)
    key = jax.random.key(0)
    result = {"machine": evidence.environment(), "step_xla_options": options, "source": evidence.source_identity(),
              "rows": []}

    def weights(shape):  # LAYERS bit-identical matrices in buffers of their own: each layer's read misses L2
        return evidence.distinct_copies(jax.random.normal(jax.random.fold_in(key, shape[1]), shape, jnp.bfloat16) * 0.02,
                                        LAYERS)

    def record(name, fn, fn_args):
        try:
            result["rows"].append(_measure(name, jax.jit(fn).lower(*fn_args).compile(compiler_options=options), fn_args,
                                           args.samples))
        except Exception as exc:  # recorded, and the other variants go on
            result["rows"].append({"name": name, "error": repr(exc)[:2000]})
            print(result["rows"][-1], flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    x = jax.random.normal(key, (1, HIDDEN), jnp.bfloat16)
    parts = args.parts.split(",")
    if "beside" in parts:
        flush_ws, o_ws = weights((HIDDEN, FLUSH_N)), weights((HIDDEN, HIDDEN))
        for prefetch in (None, *PREFETCH_ROWS):
            record(f"beside: prefetch {prefetch}", functools.partial(layers, prefetch=prefetch), (x, flush_ws, o_ws))
        del flush_ws, o_ws
    if "hot" in parts:
        ws = weights((HIDDEN, HIDDEN))
        record("hot/cold: o, cold", chain_cold, (x, ws))
        record("hot/cold: o, hot", chain_hot, (x, ws[0]))


if __name__ == "__main__":
    main()
