"""Questions about the decode kernels' speed (the Mosaic GPU kernel beside the Triton kernel) on the GPU.

    python -m benchmarks.mosaic_probes layout  OUT.json   # NHD against HND pools (B 32, B 128)
    python -m benchmarks.mosaic_probes configs OUT.json   # ring slots and warpgroups (B 1, 32, 128)
    python -m benchmarks.mosaic_probes bottleneck OUT.json  # the kernel with parts of its work removed
    python -m benchmarks.mosaic_probes splits OUT.json   # split counts, i.e. programs and waves per SM
    python -m benchmarks.mosaic_probes profile OUT.json  # GPU time per kernel of one decode call
    python -m benchmarks.mosaic_probes dispatch OUT.json  # host time per call, and the wall time by run length
    python -m benchmarks.mosaic_probes plans OUT.json     # the Triton kernel under other split plans
    python -m benchmarks.mosaic_probes plan_configs OUT.json  # split plans crossed with smaller tiles
    python -m benchmarks.mosaic_probes timeline OUT.json  # GPU idle between back-to-back calls, and the host's work
    python -m benchmarks.mosaic_probes launches OUT.json  # the host's cost of a call by its number of launches
    python -m benchmarks.mosaic_probes sync OUT.json      # waiting for a result asleep (block_until_ready) or spinning
    python -m benchmarks.mosaic_probes table_width OUT.json  # short requests in a page table sized for 8k tokens
    python -m benchmarks.mosaic_probes programs OUT.json  # the persistent Mosaic kernel's program count
    python -m benchmarks.mosaic_probes compiler OUT.json  # Mosaic GPU's approximate math and lowering semantics
    python -m benchmarks.mosaic_probes deal OUT.json      # the Mosaic path without its longest-first argsort
    python -m benchmarks.mosaic_probes in_program OUT.json  # calls inside one jitted program, as a model forward makes them
    python -m benchmarks.mosaic_probes triton_deal OUT.json  # the Triton kernel's programs longest split first, or in launch order
    python -m benchmarks.mosaic_probes merge_step OUT.json  # the merge's slots per step: its default, or 16
    python -m benchmarks.mosaic_probes mosaic_call OUT.json  # the Mosaic call's kernels beside the Triton call's, eight cases
    python -m benchmarks.mosaic_probes mosaic_tiles OUT.json  # Mosaic tiles and plans at D 64 and 128
    python -m benchmarks.mosaic_probes depth OUT.json     # ring depth (bytes in flight per SM), and 132 programs' quantum
    python -m benchmarks.mosaic_probes rounds OUT.json    # fewer programs than SMs, so that every round is full
    python -m benchmarks.mosaic_probes pair_heads OUT.json  # D 64: two K/V heads an item, or one (the earlier default)

`layout`: are strided page copies (NHD rows are H_kv * D apart) what holds the kernel back?
`configs`: do configs small enough for two programs per SM (80 KiB of shared memory) beat the
default (one program per SM)? `bottleneck`: how fast is the kernel with its matrix products,
its softmax, or both replaced by constants (outputs wrong, bytes moved the same), and with three
compute warpgroups? `splits`: the kernel holds one program per SM; how does its speed follow the
number of programs (waves) and their length, GQA against MHA? `profile`: of a call's time, how
much is the decode kernel and how much the small XLA kernels around it (bounds, merge)?
`dispatch`: is a call host-bound? The host's time to issue a call (no sync) against the wall
time per call of runs of 10 to 200 back-to-back calls, beside a one-op jitted function of the
same arguments (JAX's dispatch floor). `plans`: on the benchmark's eight cases, does the Triton
kernel run faster with a higher split target, a shorter or longer split cap
(`planning.MAX_SPLIT_TOKENS`, which also sets the slot capacity), or fixed 1,024-token splits
(deterministic mode)? Each plan is also timed as 20 calls inside one jitted program (no
dispatch per call). `plan_configs`: with the default tile (128-token blocks, 3 stages: 192 KiB
of shared memory) one program runs per SM, so nothing may hide a program's pipeline fill; with
tiles small enough for two or three programs per SM, do fine split plans (which balance a ragged
batch) stop costing uniform batches? Same timing method as `decode_attention.py` (`time_jax`:
back-to-back calls) unless a question says otherwise. `timeline`: back to back, a call takes
several microseconds longer than its kernels' GPU time; is the GPU idle between calls, and is it
waiting for the host? A trace of 50 back-to-back calls (Python's tracer off) gives the GPU's busy
and idle time per call, the gaps between launches and the host's traced work per call, for our
call (results dropped as the benchmark does, kept alive, and through the AOT-compiled
executable) beside the one-op floor; OUT.raw.json keeps every traced event. `launches`: what
does the host pay per call for one launch, for two (kernel and merge), and for the one-op
floor? Short contexts (B 1, T 1,024 and 4,096: a few microseconds of GPU time), so that every
figure is the host's; `_dispatch_timings` and a trace of each, as `timeline`. `sync`: after
`block_until_ready` the host's next dispatch is several times slower than a warm one (the
timeline traces); does waiting by polling `is_ready()` instead (a spinning wait, as
torch.cuda.synchronize's default) keep it warm? Back-to-back runs of 50 calls, single calls each
waited for, and one call kept in flight while the previous one is waited for (the engine's
overlapped decode), each with both waits. `table_width`: the engine's page tables are as wide as
its longest context (8,238 tokens in e2e_decode.py), and the slot capacity follows that width
(three slots under the 4,096-token split cap), so a batch of short requests launches EMPTY
programs and the merge; what does that cost against a table of the requests' own width, and
against one slot on the wide table, and with the programs longest split first (the deal ranks
the batch in every program, EMPTY ones too)? Host clock and the kernels' GPU time (a trace of 20
calls). (Its results of 783fb1d to 336fa8a were taken while launch order was the default:
there `e2e_width` is in launch order and `e2e_width/longest_first` is dealt.)
`programs`: the persistent Mosaic kernel deals its work items to one program per SM in a fixed
order, which cannot balance a ragged batch (0.80x of the Triton kernel there, against 1.02x when
each item was a program). With two or four programs per SM, programs wait for a free SM and the
hardware scheduler balances again, at the cost of more pipeline fills: what does each count cost
the uniform cases, and what does it win on the ragged one? It also tries finer split plans.
`compiler`: the Mosaic kernel issued 2.3x the Triton kernel's instructions (ncu_decode.json).
Triton's exp2 is the approximate `ex2.approx.f32`; Mosaic GPU computes exp2, log2 and division
exactly unless `CompilerParams(approx_math=True)`. jax 0.11 also lowers Pallas kernels with
warpgroup semantics (layout inference) by default where jax 0.10 used lane semantics. What does
each setting do to the kernel's time, and to its output (max abs difference from the Triton
kernel's)?
`deal`: the persistent Mosaic kernel takes its items longest first, from an XLA argsort per call
(its sort, iota and key kernels took 3 to 5 us of GPU time a call on the H200). What does the
call cost with the items in (b, h, s) order instead (uniform batches: the same balance), and what
does the ragged batch lose? Host clock and the kernels' GPU time (a trace of 20 calls).
`in_program`: back to back, B 1 is host-bound (the host's dispatch of a JAX call outlasts 39 us
of GPU work), and the benchmark's in-program figure, which takes the host out, came out slower
than back-to-back calls at every case (B 32: 153.9 against 135.0 us). That program calls the op
on 50 slices of a stacked q: does slicing cost kernels, may the independent calls run
concurrently (command buffers can keep independent launches as parallel graph nodes), and what
do the program's single dispatch and sync add? Each backend's call back to back, in that
program, in a program of 50 calls on distinct q arrays (no slicing), the same with the calls
chained (each q passes an optimization barrier with the previous call's output, so the calls
run in order as a model's layers do), and the chained program run five times per sample; with a
trace of each program (GPU busy, idle and overlap per call).
`triton_deal`: with `DecodeConfig.longest_first` the Triton kernel's programs take the requests
longest split first when the plan has several slots. What does that win on the ragged batch, and
what does ranking the batch in every program cost the uniform multi-slot cases (B 1, B 8, D 64;
B 32 has one slot and is the control)? Host clock, and GPU time inside one program
(`decode_attention.time_in_program`). (Its results of 783fb1d to 336fa8a were taken while
launch order was the default: there `triton/nhd` is in launch order and `triton/longest_first`
is dealt.)
`merge_step`: the merge launch folds its slots in steps, each a chain of two dependent global
loads; with 16 slots a step an engine's B 1 call (33 slots in its wide table) took three steps.
What do the default's wider steps (`merge_states.default_block_s`) win against 16, on the
requests' own table width and on the engine's, inside one program and by the kernels' GPU time?
`mosaic_call`: the Mosaic call launched small XLA kernels around its decode kernel (query padding,
the longest-first argsort, the output's slice, mask and convert). Now it reads q's rows in
place where G divides 8, writes rows straight to o [B, H_q, S, D], and at one slot writes the
call's output in q's dtype without an argsort. Which launches are left, and what does the call
cost against the Triton call on the benchmark's eight cases: back to back, inside one program
(`time_in_program`), and by the kernels' GPU time (a trace of 20 calls)?
`mosaic_tiles`: at D 64 the Mosaic kernel is compute-bound (the `bottleneck` probe: 144.6 us with
its matmuls and softmax, 97.5 without); half the bytes per block meet the same per-block work. At
D 128 the kernel is within 3% of the Triton kernel, and per block it takes about as long as the
bytes allow. Do 128-token blocks (half the blocks, so half the per-block waits, loop and mask
setup), a deeper ring, or a third compute warpgroup (more blocks in flight) help at D 64, and what
do they do at D 128? At B 1 and 8, does half the split target (fewer work items: less to merge,
fewer per-item waits) help, or twice it? Host clock and inside one program; a config the kernel's
admission refuses is left out, one that fails to build is recorded with its error. PROBE_VARIANTS
(a regular expression) narrows the Mosaic variants.
`depth`: the Mosaic kernel moves about 30 GB/s per busy SM at every batch, as if each SM's copies
in flight, not HBM, set its speed: its four 64-token slots are two per compute warpgroup, one
being computed while the other lands. Do 32-token blocks in eight slots (the same 128 KiB, three
of four slots a warpgroup in flight) or one compute warpgroup with four or five slots move more?
And B x H_kv items of equal length on 132 programs leave SMs idle in the last round (B 32: 256
items, 124 programs take two): is B 33 (264 items, two each) as fast as B 32, i.e. would
balancing the last round pay? Host clock and inside one program. Answer at db11cf6 (results/
probe_depth.json, in-program): no deeper ring helped. At B 32 the default took 130.5 us, 32-token
blocks 141.9 to 143.3 (6 to 10 slots), one warpgroup 133.1 (4 slots) and 136.3 (5; its output
no longer fits a staging tile); at B 8 and 128 the same order. So the kernel since admits only
64-token multiples again, and this probe runs the one-warpgroup rings. B 33 took 5.1% longer
than B 32 for 3.1% more work (the last round's 8 idle programs cost nothing: HBM-bound), while
B 132 took 0.6% longer than B 128 for 3.1% more (the 32 programs idle in B 128's last round
cost about 3%).
`rounds`: B 128, T 1,024 and the MHA case (1,024 equal items each) on 132 programs run 7.76 rounds,
the last with 100 programs; B 32 and B 64 run 1.94 and 3.88. With 128 programs every round is
full: is a call with 4 SMs idle throughout as fast as one with 32 idle in its last round (then
the last round's SMs are not bandwidth the others take up, and balancing it would pay), and what
do 64 and 96 programs cost? Host clock and inside one program.
`pair_heads`: at D 64 the Mosaic kernel runs two K/V heads an item (`pairable_heads`), a block
then holding D 128's bytes for one softmax; how does that compare with one head an item and the
128-token tiles that were the D 64 default, at B 1 to 128 (H_kv 8, G 4)? Two turns each, host clock
and inside one program, each output against the Triton kernel's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import re
import sys

E2E_TABLE_PAGES = 515  # e2e_decode.py's engine: max context 8,192 + 30 steps + 16, in pages of 16


@contextlib.contextmanager
def patched(patches: dict):
    """Sets every (module, name) of `patches` to its replacement, and back on exit."""
    originals = {key: getattr(*key) for key in patches}
    try:
        for (module, name), replacement in patches.items():
            setattr(module, name, replacement)
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


def _without(*parts: str) -> dict:
    """Patches {(module, name): replacement} of the Mosaic kernel's helpers that skip `parts`
    ("mma", "softmax")."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels import decode_attention_mgpu as kernel

    def scores(q_smem, k_slot, *, interpret):
        zeros = jnp.zeros((q_smem.shape[0], k_slot.shape[0]), jnp.float32)
        return plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)

    patches = {}
    if "mma" in parts:
        patches |= {(kernel, "_scores"): scores, (kernel, "_accumulate"): lambda acc, p, v_slot, **_: acc}
    if "softmax" in parts:
        # alpha = 1 computed from m, so that it keeps m's register layout (a constant's splat layout
        # does not broadcast in Mosaic GPU)
        patches[(kernel, "_online_softmax")] = lambda scores, m, l, scale: (scores, jnp.where(m == m, 1.0, 0.0), m, l)
    return patches


def _compiler_params(**overrides) -> dict:
    """Patches {(module, name): replacement} that build the Mosaic kernel's CompilerParams with
    `overrides` (approx_math, lowering_semantics)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return {(plgpu, "CompilerParams"): functools.partial(plgpu.CompilerParams, **overrides)}


def _compiler_variants(k, v):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    mosaic, lane = dict(backend="pallas_mosaic_gpu"), plgpu.LoweringSemantics.Lane
    return {
        "mgpu/default": (mosaic, k, v, {}),
        "mgpu/approx_math": (mosaic, k, v, _compiler_params(approx_math=True)),
        "mgpu/lane": (mosaic, k, v, _compiler_params(lowering_semantics=lane)),
        "mgpu/approx_math,lane": (mosaic, k, v, _compiler_params(approx_math=True, lowering_semantics=lane)),
    }


def _deal_variants(k, v):
    """The Mosaic path as it is, and with its items dealt in (b, h, s) order: no argsort."""
    import jax.numpy as jnp

    from pallas_kernels import decode_attention_mgpu as kernel

    in_index_order = lambda split_start, split_end, block_k: jnp.arange(split_start.size, dtype=jnp.int32)
    mosaic = dict(backend="pallas_mosaic_gpu")
    return {"mgpu/longest_first": (mosaic, k, v, {}),
            "mgpu/index_order": (mosaic, k, v, {(kernel, "split_order"): in_index_order})}


def _e2e_width(table):
    """The page table padded (with the null page) to the e2e engine's width, E2E_TABLE_PAGES."""
    import jax.numpy as jnp

    return jnp.pad(table, ((0, 0), (0, E2E_TABLE_PAGES - table.shape[1])))


def _launch_order(head_dim: int):
    """The Triton kernel's default config with its programs in launch order (no deal)."""
    from pallas_kernels.decode_attention import default_config

    return dataclasses.replace(default_config(head_dim), longest_first=False)


def _bottleneck_variants(k, v):
    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

    default = dict(backend="pallas_mosaic_gpu")
    return {
        "mgpu/full": (default, k, v, {}),
        "mgpu/wg=3,st=3": (dict(default, config=MosaicDecodeConfig(64, 3, 3)), k, v, {}),
        "mgpu/no_mma": (default, k, v, _without("mma")),
        "mgpu/no_softmax": (default, k, v, _without("softmax")),
        "mgpu/no_mma_no_softmax": (default, k, v, _without("mma", "softmax")),
    }


def plan_patches(target_scale: float = 1, max_split_tokens: int | None = None) -> dict:
    """Patches {(module, name): replacement} of the planner's two rules: the splits a batch
    aims at per K/V head (`decode_target_splits`, times target_scale, at least 1) and the longest split an
    adaptive plan cuts (`MAX_SPLIT_TOKENS`, which also sets the slot capacity)."""
    from decodejax import planning

    target = planning.decode_target_splits
    patches = {}
    if target_scale != 1:
        patches[(planning, "decode_target_splits")] = lambda *a, **kw: max(1, round(target_scale * target(*a, **kw)))
    if max_split_tokens is not None:
        patches[(planning, "MAX_SPLIT_TOKENS")] = max_split_tokens
    return patches


def _tile_variants(k, v, case):
    """The Mosaic kernel's default, other tiles (block_k, ring slots, compute warpgroups) that its
    admission takes at the case's head dim, and, where the split target decides the plan, half and
    twice that target."""
    import jax.numpy as jnp

    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig, supports

    mosaic = dict(backend="pallas_mosaic_gpu")
    variants = {"mgpu/auto": (mosaic, k, v, {})}
    for block_k, stages, warpgroups in ((64, 4, 2), (64, 8, 2), (128, 2, 2), (128, 4, 2), (128, 6, 2), (64, 3, 3), (64, 6, 3),
                                        (128, 3, 3)):
        config = MosaicDecodeConfig(block_k=block_k, num_stages=stages, compute_warpgroups=warpgroups)
        if not supports(16, case.head_dim, case.q_heads // case.kv_heads, jnp.bfloat16, config):
            variants[f"mgpu/bk={block_k},st={stages},wg={warpgroups}"] = (dict(mosaic, config=config), k, v, {})
    if case.batch <= 8 or case.head_dim < 128:  # where the split target decides the plan
        variants["mgpu/target_half"] = (mosaic, k, v, plan_patches(target_scale=0.5))
        variants["mgpu/target_x2"] = (mosaic, k, v, plan_patches(target_scale=2))
    wanted = os.environ.get("PROBE_VARIANTS")  # a regular expression: the variants to run (default all)
    return {name: spec for name, spec in variants.items() if not wanted or re.search(wanted, name)}


def _pair_variants(k, v):
    """At D 64, in turns: the Mosaic default (two K/V heads an item, D 128's tiles) and one head an item
    with the 128-token tiles that were the D 64 default before it."""
    from pallas_kernels.decode_attention_mgpu import default_config

    mosaic = dict(backend="pallas_mosaic_gpu")
    one_head = dict(mosaic, config=default_config(64))  # pairable=False: 128-token blocks
    return {f"mgpu/{name}#{turn}": (options, k, v, {}) for turn in (1, 2)
            for name, options in (("paired", mosaic), ("one_head", one_head))}


def _depth_variants(k, v, case):
    """The Mosaic kernel's default and, at the benchmark's batch sizes, one compute warpgroup with 4 or
    5 slots of 64 tokens (more bytes in flight per SM). db11cf6 also ran 32-token blocks in 6, 8 and 10
    slots."""
    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

    mosaic = dict(backend="pallas_mosaic_gpu")
    variants = {"mgpu/auto": (mosaic, k, v, {})}
    if case.batch in (8, 32, 128):
        for tile in ((64, 5, 1), (64, 4, 1)):
            variants["mgpu/bk={},st={},wg={}".format(*tile)] = (dict(mosaic, config=MosaicDecodeConfig(*tile)), k, v, {})
    return variants


def _plan_variants(k, v):
    """The Triton kernel under other split plans than auto's."""
    triton = dict(backend="pallas_triton")
    return {
        "triton/deterministic": (dict(triton, deterministic=True), k, v, {}),
        "triton/max_split_2048": (triton, k, v, plan_patches(max_split_tokens=2048)),
        "triton/max_split_8192": (triton, k, v, plan_patches(max_split_tokens=8192)),
        "triton/target_x2": (triton, k, v, plan_patches(target_scale=2)),
        "triton/target_x2_max_split_2048": (triton, k, v, plan_patches(target_scale=2, max_split_tokens=2048)),
    }


def _plan_config_variants(k, v):
    """Split plans (auto, fixed 1,024-token chunks, a 4x target, splits of at most 2,048 tokens)
    crossed with Triton tiles of one to three programs per SM."""
    from pallas_kernels.decode_attention import DecodeConfig

    plans = {"auto": ({}, {}), "deterministic": (dict(deterministic=True), {}),
             "target_x4": ({}, plan_patches(target_scale=4)), "max_split_2048": ({}, plan_patches(max_split_tokens=2048))}
    configs = {"bk128,st3": DecodeConfig(128, 4, 3), "bk64,st3": DecodeConfig(64, 4, 3), "bk64,st2": DecodeConfig(64, 4, 2),
               "bk32,st4": DecodeConfig(32, 4, 4)}
    return {f"triton/{c}/{p}": (dict(backend="pallas_triton", config=config, **options), k, v, patches)
            for c, config in configs.items() for p, (options, patches) in plans.items()}


def _device_activity(fn, *args, calls: int = 20) -> dict:
    """GPU time per call by kernel name, from a jax.profiler trace of `calls` calls."""
    import jax

    from benchmarks.profile_summary import traced_device_activity

    jax.block_until_ready(fn(*args))
    return traced_device_activity(lambda: jax.block_until_ready([fn(*args) for _ in range(calls)]), calls)


def _dispatch_timings(fn, args, runs=(10, 50, 200), samples: int = 15) -> dict:
    """Median microseconds per call: to issue it (`host_us`, no sync) and, per run length n, the
    wall time of n back-to-back calls and one sync, divided by n (`wall_us_by_run`)."""
    import time

    import jax
    import numpy as np

    for _ in range(3):
        jax.block_until_ready(fn(*args))
    host, wall = [], {n: [] for n in runs}
    for _ in range(samples):
        for n in runs:
            t0 = time.perf_counter()
            for _ in range(n):
                result = fn(*args)
            issued = time.perf_counter()
            jax.block_until_ready(result)
            wall[n].append((time.perf_counter() - t0) * 1e6 / n)
            if n == max(runs):
                host.append((issued - t0) * 1e6 / n)
    return {"host_us": float(np.median(host)), "wall_us_by_run": {n: float(np.median(w)) for n, w in wall.items()}}


def _kept_calls_us(fn, args, calls: int = 50, samples: int = 15) -> list[float]:
    """Microseconds per call of `calls` back-to-back calls whose results all stay alive until
    the sync (nothing is freed while the calls run)."""
    import time

    import jax

    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        kept = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(kept)
        out.append((time.perf_counter() - t0) * 1e6 / calls)
    return out


def _spin_until_ready(x) -> None:
    """Waits for x by polling (the thread never sleeps), then returns."""
    while not x.is_ready():
        pass


def _sync_timings(fn, args, spin: bool, samples: int = 30) -> dict:
    """Median microseconds per call: runs of 50 back-to-back calls and a wait (`back_to_back`),
    single calls each waited for (`single`), and one call in flight while the previous one is
    waited for (`overlapped`); the wait spins on is_ready() before block_until_ready when `spin`."""
    import time

    import jax
    import numpy as np

    def wait(x):
        if spin:
            _spin_until_ready(x)
        jax.block_until_ready(x)

    wait(fn(*args))
    runs = {"back_to_back": [], "single": [], "overlapped": []}
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(50):
            result = fn(*args)
        wait(result)
        runs["back_to_back"].append((time.perf_counter() - t0) * 1e6 / 50)
        t0 = time.perf_counter()
        for _ in range(20):
            wait(fn(*args))
        runs["single"].append((time.perf_counter() - t0) * 1e6 / 20)
        t0 = time.perf_counter()
        previous = fn(*args)
        for _ in range(20):
            current = fn(*args)
            wait(previous)
            previous = current
        wait(previous)
        runs["overlapped"].append((time.perf_counter() - t0) * 1e6 / 21)
    return {name: float(np.median(v)) for name, v in runs.items()} | {"samples_us": runs}


def _timeline(fn, args, keep: bool, calls: int = 50) -> tuple[dict, list]:
    """stream_timeline of `calls` back-to-back calls (results kept alive or dropped), and the
    trace's raw events (plane, line, name, start ns, duration ns), Python's left out."""
    import jax

    from benchmarks.profile_summary import stream_timeline, traced

    def run():
        kept, result = [], None
        for _ in range(calls):
            result = fn(*args)
            if keep:
                kept.append(result)
        jax.block_until_ready(result)

    run()
    planes, wall_ms = traced(run, python_tracer=False)
    raw = [(plane.name, line.name, e.name[:120], e.start_ns, e.duration_ns) for plane in planes for line in plane.lines
           for e in line.events if not e.name.startswith("$")]
    return stream_timeline(planes, calls) | {"wall_us_per_call_traced": wall_ms * 1e3 / calls}, raw


def _in_program_variants(fn, args, calls: int = 50) -> dict:
    """Microseconds per call of fn: back to back; in one program of `calls` calls on slices of a
    stacked q (the benchmark's in-program timing until 33c536e); on `calls` distinct q arrays,
    independent or chained (evidence.chained_program, also run five times per sample); with a
    trace of one run of each program (GPU busy, idle and overlap per call)."""
    import jax
    import numpy as np

    from benchmarks.cases import SAMPLES
    from benchmarks.decode_attention import time_jax
    from benchmarks.profile_summary import stream_timeline, traced
    from decodejax import evidence

    chained, chained_args = evidence.chained_call(fn, args, calls)
    programs = {  # name: (program, its arguments)
        "program_copies": (jax.jit(lambda stacked, *rest: [fn(stacked[i], *rest) for i in range(calls)]),
                           (jax.numpy.stack([args[0]] * calls), *args[1:])),
        "program_separate": (jax.jit(lambda qs, *rest: [fn(q, *rest) for q in qs]), chained_args),
        "program_chained": (chained, chained_args),
    }
    out = {"back_to_back": time_jax(fn, *args)}
    for name, reps in (("program_copies", 1), ("program_separate", 1), ("program_chained", 1), ("program_chained_x5", 5)):
        program, program_args = programs[name.removesuffix("_x5")]
        out[name] = [t / calls for t in evidence.timed_samples(program, program_args, samples=SAMPLES, reps=reps)]
    summary = {name: {"median_us": float(np.median(v)), "min_us": float(np.min(v)), "samples_us": v} for name, v in out.items()}
    for name, (program, program_args) in programs.items():
        jax.block_until_ready(program(*program_args))
        planes, _ = traced(lambda: jax.block_until_ready(program(*program_args)), python_tracer=False)
        summary[name]["trace"] = stream_timeline(planes, calls)
    return summary


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import decodejax
    from benchmarks import cases as bench_cases
    from benchmarks.decode_attention import summarize, time_in_program, time_jax
    from decodejax import KVLayout, evidence
    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

    question, out_path = (argv or sys.argv[1:])[:2]
    shapes = {"layout": ((32, 4096), (128, 1024)), "configs": ((1, 32768), (32, 4096), (128, 1024)),
              "bottleneck": ((8, 8192), (32, 4096), (128, 1024), (32, 4096, 64)),
              "splits": ((1, 32768), (8, 8192), (32, 4096), (128, 1024), (128, 4096), (32, 4096, 128, 32)),
              "profile": ((1, 32768), (8, 8192), (32, 4096), (128, 1024)),
              "dispatch": ((1, 32768), (8, 8192), (32, 4096), (128, 1024)), "plans": (),
              "timeline": ((1, 32768), (8, 8192), (32, 4096), (128, 1024)),
              "launches": ((1, 1024), (1, 4096)),
              "sync": ((1, 32768), (8, 8192), (32, 4096)),
              "plan_configs": (),
              "table_width": ((128, 512), (64, 512), (32, 512), (128, 2048), (32, 2048), (8, 2048), (1, 2048)),
              "programs": ((1, 32768), (32, 4096), (128, 1024)),
              "compiler": ((1, 32768), (32, 4096), (128, 1024), (32, 4096, 64)),
              "deal": ((1, 32768), (8, 8192), (32, 4096), (128, 1024)),
              "in_program": ((1, 32768), (8, 8192), (32, 4096), (128, 1024), (32, 4096, 64)),
              "triton_deal": ((1, 32768), (8, 8192), (32, 4096), (32, 4096, 64)),
              "merge_step": ((1, 2048), (8, 2048), (32, 512), (1, 32768), (8, 8192)),
              "mosaic_call": (), "mosaic_tiles": (), "pair_heads": ((1, 32768, 64), (8, 8192, 64), (128, 1024, 64)),
              "depth": ((8, 8192), (32, 4096), (33, 4096), (128, 1024), (132, 1024)), "rounds": ()}[question]
    cases = {"plans": list(bench_cases.CASES), "plan_configs": [c for c in bench_cases.CASES if c.name.startswith(
        ("B8_", "B32_", "B64_", "ragged", "d64"))], "programs": bench_cases.selected("ragged_B32_T1-16384"),
             "deal": bench_cases.selected("ragged_B32_T1-16384"),
             "triton_deal": bench_cases.selected("ragged_B32_T1-16384"), "mosaic_call": list(bench_cases.CASES),
             "mosaic_tiles": bench_cases.selected("B1_T32768,B8_T8192,B32_T4096,d64_B32_T4096"),
             "pair_heads": bench_cases.selected("d64_B32_T4096"),
             "rounds": bench_cases.selected("B32_T4096,B64_T2048,B128_T1024,mha_B32_T4096")}.get(question, [])
    for batch, length, *rest in shapes:
        head_dim, kv_heads = (rest + [128, 8][len(rest):])[:2]  # defaults: D 128, 8 K/V heads
        cases.append(bench_cases.Case(f"B{batch}_T{length}_D{head_dim}_Hkv{kv_heads}", batch, length, head_dim=head_dim,
                                      q_heads=max(32, kv_heads), kv_heads=kv_heads))
    out, raw = {}, {}

    def save():
        with open(out_path, "w") as f:
            json.dump({"question": question, "machine": jax.devices()[0].device_kind, "jax": jax.__version__, "results": out}, f,
                      indent=1)
        if raw:
            with open(out_path.removesuffix(".json") + ".raw.json", "w") as f:
                json.dump(raw, f)

    for case in cases:
        data = bench_cases.make_case(case)
        q, k, v = (jnp.asarray(data[n], jnp.bfloat16) for n in ("q", "k_pages", "v_pages"))
        table, lens = jnp.asarray(data["page_table"]), jnp.asarray(data["seq_lens"])
        variants = {"triton/nhd": (dict(backend="pallas_triton"), k, v, {})}
        if question == "layout":
            variants["mgpu/nhd"] = (dict(backend="pallas_mosaic_gpu"), k, v, {})
            hnd = dict(backend="pallas_mosaic_gpu", layout=KVLayout.PAGED_HND)
            variants["mgpu/hnd"] = (hnd, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), {})
        elif question == "configs":
            for block_k, stages, warpgroups in ((64, 2, 1), (64, 2, 2), (64, 4, 2)):
                config = MosaicDecodeConfig(block_k=block_k, num_stages=stages, compute_warpgroups=warpgroups)
                variants[f"mgpu/bk={block_k},st={stages},wg={warpgroups}"] = (dict(backend="pallas_mosaic_gpu", config=config), k, v, {})
        elif question == "programs":
            sms = decodejax._ops._num_sms()
            for per_sm in (1, 2, 4):
                config = MosaicDecodeConfig(programs=per_sm * sms)
                variants[f"mgpu/programs={per_sm}x{sms}"] = (dict(backend="pallas_mosaic_gpu", config=config), k, v, {})
            for name, patches in {"target_x2": plan_patches(target_scale=2), "target_x4": plan_patches(target_scale=4),
                                  "max_split_1024": plan_patches(max_split_tokens=1024)}.items():  # more, smaller items
                variants[f"mgpu/{name}"] = (dict(backend="pallas_mosaic_gpu"), k, v, patches)
        elif question in ("profile", "mosaic_call"):
            variants["mgpu/auto"] = (dict(backend="pallas_mosaic_gpu"), k, v, {})
        elif question == "mosaic_tiles":
            variants.update(_tile_variants(k, v, case))
        elif question == "depth":
            variants.update(_depth_variants(k, v, case))
        elif question == "rounds":
            variants["mgpu/auto"] = (dict(backend="pallas_mosaic_gpu"), k, v, {})
            for programs in (128, 96, 64):
                config = MosaicDecodeConfig(programs=programs)
                variants[f"mgpu/programs={programs}"] = (dict(backend="pallas_mosaic_gpu", config=config), k, v, {})
        elif question == "dispatch":
            floor = jax.jit(lambda q, k, v, table, lens: q * 2)
            out[f"{case.name}/one_op_floor"] = _dispatch_timings(floor, (q, k, v, table, lens))
            fn = jax.jit(functools.partial(decodejax.decode_attention, backend="pallas_triton"))
            out[f"{case.name}/triton/nhd"] = _dispatch_timings(fn, (q, k, v, table, lens))
            print(case.name, json.dumps(out[f"{case.name}/one_op_floor"]), json.dumps(out[f"{case.name}/triton/nhd"]), flush=True)
            continue
        elif question == "sync":
            args = (q, k, v, table, lens)
            callers = {"one_op_floor": jax.jit(lambda q, k, v, table, lens: q * 2),
                       "triton/nhd": jax.jit(functools.partial(decodejax.decode_attention, backend="pallas_triton"))}
            for name, caller in callers.items():
                for spin in (False, True, False, True):  # twice each, interleaved: process drift shows up
                    key = f"{case.name}/{name}/{'spin' if spin else 'block'}"
                    stats = _sync_timings(caller, args, spin)
                    out.setdefault(key, []).append(stats)
                    print(key, {n: round(stats[n], 1) for n in ("back_to_back", "single", "overlapped")}, flush=True)
            save()
            continue
        elif question in ("timeline", "launches"):
            args = (q, k, v, table, lens)
            ours = lambda **kw: jax.jit(functools.partial(decodejax.decode_attention, backend="pallas_triton", **kw))
            callers = {"one_op_floor": jax.jit(lambda q, k, v, table, lens: q * 2)}
            if question == "timeline":
                callers |= {"triton/nhd": ours(), "triton/nhd/aot": ours().lower(*args).compile()}
            else:
                callers |= {"triton/one_launch": ours(num_splits=1), "triton/two_launches": ours(num_splits=2),
                            "triton/one_launch_two_partials": ours(num_splits=2, return_partial_states=True)}
            for name, caller in callers.items():
                if question == "launches":
                    out[f"{case.name}/{name}/dispatch"] = _dispatch_timings(caller, args)
                    print(f"{case.name}/{name}/dispatch", json.dumps(out[f"{case.name}/{name}/dispatch"]), flush=True)
                for keep in (False, True):
                    key = f"{case.name}/{name}/{'kept' if keep else 'dropped'}"
                    summary, raw[key] = _timeline(caller, args, keep)
                    samples = _kept_calls_us(caller, args) if keep else time_jax(caller, *args)
                    out[key] = summary | {"median_us": float(np.median(samples)), "min_us": float(np.min(samples)), "samples_us": samples}
                    print(key, f"{out[key]['median_us']:.1f} us; GPU busy {summary['busy_us_per_step']:.1f} idle "
                          f"{summary['idle_us_per_step']:.1f} per call; gaps {summary['gaps_us']}", flush=True)
            save()
            continue
        elif question == "in_program":
            for backend in ("pallas_triton", "pallas_mosaic_gpu"):
                fn = jax.jit(functools.partial(decodejax.decode_attention, backend=backend))
                key = f"{case.name}/{backend}"
                out[key] = _in_program_variants(fn, (q, k, v, table, lens))
                print(key, {n: round(r["median_us"], 1) for n, r in out[key].items()},
                      {n: {m: round(r["trace"][m], 1) for m in ("span_us_per_step", "busy_us_per_step", "idle_us_per_step")}
                       for n, r in out[key].items() if "trace" in r}, flush=True)
            save()
            continue
        elif question == "table_width":
            wide = _e2e_width(table)
            for name, (width_table, options) in {"exact_width": (table, {}), "e2e_width": (wide, {}),
                                                 "e2e_width/launch_order": (wide, dict(config=_launch_order(case.head_dim))),
                                                 "e2e_width/one_slot": (wide, dict(num_splits=1))}.items():
                fn = jax.jit(functools.partial(decodejax.decode_attention, backend="pallas_triton", **options))
                stats = summarize(time_jax(fn, q, k, v, width_table, lens), bench_cases.kv_bytes(case))
                stats["profile"] = _device_activity(fn, q, k, v, width_table, lens)
                out[f"{case.name}/{name}"] = stats
                print(f"{case.name} {name} {stats['median_us']:.1f} us (GPU {stats['profile']['device_us_per_step']:.1f})",
                      json.dumps(stats["profile"]["top"][:3]), flush=True)
            save()
            continue
        elif question == "merge_step":
            from pallas_kernels import merge_states as merge_module

            widths = {"exact_width": table}
            if table.shape[1] < E2E_TABLE_PAGES:
                widths["e2e_width"] = _e2e_width(table)
            steps = {"": {}, "/step_16": {(merge_module, "default_block_s"): lambda head_dim: 16}}
            for (width, width_table), (step, patches) in itertools.product(widths.items(), steps.items()):
                with patched(patches):
                    jax.clear_caches()  # the merge traced again with (or without) the patch
                    fn = jax.jit(functools.partial(decodejax.decode_attention, backend="pallas_triton"))
                    args = (q, k, v, width_table, lens)
                    stats = summarize(time_jax(fn, *args), bench_cases.kv_bytes(case))
                    stats["in_program"] = summarize(time_in_program(fn, *args), bench_cases.kv_bytes(case))
                    stats["profile"] = _device_activity(fn, *args)
                out[f"{case.name}/{width}{step}"] = stats
                print(f"{case.name} {width}{step} {stats['median_us']:.1f} us in-program {stats['in_program']['median_us']:.1f} "
                      f"(GPU {stats['profile']['device_us_per_step']:.1f})", json.dumps(stats["profile"]["top"][:3]), flush=True)
            save()
            continue
        elif question == "bottleneck":
            variants.update(_bottleneck_variants(k, v))
        elif question == "compiler":
            variants.update(_compiler_variants(k, v))
        elif question == "pair_heads":
            variants.update(_pair_variants(k, v))
        elif question == "deal":
            variants.update(_deal_variants(k, v))
        elif question == "triton_deal":
            variants["triton/launch_order"] = (dict(backend="pallas_triton", config=_launch_order(case.head_dim)), k, v, {})
        elif question == "plans":
            variants.update(_plan_variants(k, v))
        elif question == "plan_configs":
            variants = _plan_config_variants(k, v)
        else:
            variants["mgpu/auto"] = (dict(backend="pallas_mosaic_gpu"), k, v, {})
            variants["mgpu/auto/no_mma_no_softmax"] = (dict(backend="pallas_mosaic_gpu"), k, v, _without("mma", "softmax"))
            for splits in (1, 2, 4, 8, 16, 32):
                if case.batch * case.kv_heads * splits <= 8 * 132 and case.max_len // splits >= 256:
                    variants[f"mgpu/splits={splits}"] = (dict(backend="pallas_mosaic_gpu", num_splits=splits), k, v, {})
        triton_out = None
        for name, (options, k_pool, v_pool, patches) in variants.items():
            with patched(patches):
                jax.clear_caches()  # traced again with (or without) the patches
                fn = jax.jit(functools.partial(decodejax.decode_attention, **options))
                try:
                    stats = summarize(time_jax(fn, q, k_pool, v_pool, table, lens), bench_cases.kv_bytes(case))
                except Exception as e:  # a tile that does not build: its error is the answer
                    out[f"{case.name}/{name}"] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
                    print(f"{case.name} {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                if question in ("compiler", "pair_heads"):  # triton/nhd comes first: the others against its output
                    o = np.asarray(fn(q, k_pool, v_pool, table, lens), np.float32)
                    triton_out = o if triton_out is None else triton_out
                    stats["max_abs_diff_vs_triton"] = float(np.max(np.abs(o - triton_out)))
                if question in ("triton_deal", "mosaic_call", "mosaic_tiles", "depth", "rounds", "pair_heads"):
                    stats["in_program"] = summarize(time_in_program(fn, q, k_pool, v_pool, table, lens), bench_cases.kv_bytes(case))
                    stats["in_program_median_us"] = stats["in_program"]["median_us"]
                if question == "plans":  # as inside a jitted program: no dispatch per call
                    samples = evidence.timed_samples_in_program(fn, (q, k_pool, v_pool, table, lens), samples=10, calls=20)
                    stats |= {"in_program_samples_us": samples, "in_program_median_us": float(np.median(samples))}
            if question in ("profile", "deal", "mosaic_call"):
                stats["profile"] = _device_activity(fn, q, k_pool, v_pool, table, lens)
                print(json.dumps(stats["profile"]["top"][:6]), flush=True)
            out[f"{case.name}/{name}"] = stats
            print(f"{case.name} {name} {stats['median_us']:.1f} us {stats['tbps_median']:.2f} TB/s"
                  f" in-program {stats.get('in_program_median_us', float('nan')):.1f} us"
                  f" vs Triton {stats.get('max_abs_diff_vs_triton', float('nan')):.2e}", flush=True)
        save()  # after every case: a run cut short still leaves what it measured
    save()


if __name__ == "__main__":
    main()
