"""Paged split-KV decode attention (Pallas, Triton lowering): the producer kernel.

One program owns (request b, K/V head h, split slot s). It finds its key range [start, end)
from the static split plan (`SplitPlan.slot_bounds`), loads the G = H_q / H_kv query rows of
that K/V head once and streams the range in blocks of `block_k` tokens; every query head of
the group shares each K/V load (GQA). Each token's row is found through the page table, so
any page size works:

    token t of request b:  page = table[c, t // P], r = t % P,  c = cache_batch_idx[b]
    PAGED_NHD pool [num_pages, P, H_kv, D] -> flat row (page P + r) H_kv + h
    PAGED_HND pool [num_pages, H_kv, P, D] -> flat row (page H_kv + h) P + r

With more than one slot and `DecodeConfig.longest_first` (the default), the programs of a
batch (launched axis 0 first) take its requests longest split first (`deal_longest_first`; a
batch of equal lengths keeps launch order without ranking): the hardware starts programs in
launch order as SMs free up, so the long splits start first and the short ones fill the tail.

Loads of tokens outside [start, end) or invisible to the query (length, window, sinks) are
masked, so they touch no memory: page tails, unused pages and the null page are never read.
The program writes its split's normalized partial state (o, lse) in float32; an EMPTY split
writes (0, -inf). With a plan of one slot the program writes the output itself. With more,
`merge_states` reduces the slots in a second launch, or, with `DecodeConfig.fused_merge`, in
the same launch: each program counts itself done on an i32[B, H_kv] counter (an atomic add,
acquire-release at GPU scope, after a block barrier, so every thread's partial-state stores
come before it), and the program that counts last folds the S states of each of its G rows
as the merge launch does (`merge_states.fold_slots`: a block of slots a step, in slot order),
so the result is the same whichever program that is.
Its pure-jnp twin is `decodejax.reference.paged_decode`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from decodejax.addressing import KVLayout, pool_geometry
from decodejax.masks import DecodeMask, visible
from decodejax.planning import SplitPlan
from pallas_kernels.merge_states import default_block_s, fold_slots, merge_states
from pallas_kernels.paged_blocks import finish, initial_carry, load_kv_block, online_softmax_step

MIN_DOT_ROWS = 16  # Triton dots need >= 16 rows: the G query rows are padded to this.
# Every program ranks the batch's requests itself (B x B comparisons); past this batch the
# programs keep their launch order.
LONGEST_FIRST_MAX_BATCH = 128


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static tiling of the producer kernel.

    Attributes:
      block_k: tokens per inner step (a power of two).
      num_warps: Triton warps per program.
      num_stages: software-pipelining depth of the K/V loads.
      longest_first: with more than one split slot, the programs take the requests longest split
        first (`deal_longest_first`) rather than in (s, h, b) launch order; a batch of equal
        lengths skips the ranking and runs in launch order. On by default: on the H200 it took
        the ragged benchmark batch from 278.1 to 268.1 us of GPU time inside one program (3.6%
        faster) and left the uniform multi-slot cases within 0.3 us, an engine's wide tables
        included (B 32, T 512 in a 515-page table: 25.6 us either way; benchmarks/README.md,
        fourteenth session). Before the equal-lengths skip, ranking cost those up to 17%.
      fused_merge: with more than one split slot, merge them in the kernel's launch (the last
        program of a (request, K/V head) to finish merges) rather than in a second launch. Off
        by default: on the H200, inside one program, the kernel merging its own slots took 8.5
        against 6.2 us at B 1, T 2,048, 13.3 against 10.8 at B 1, T 8,192 and 68.3 against 66.9
        at B 8, T 8,192 (kernel plus merge launch), and the llama3-8b engine's B 1 step 4.24
        against 4.17 ms (benchmarks/README.md, forty-second session). The ragged batch and
        D 64, where the earlier slot-by-slot fold was faster fused, were not rerun with this fold.
    """

    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    fused_merge: bool = False
    longest_first: bool = True

    @property
    def split_align(self) -> int:
        """Tokens a split's bounds are multiples of: one block, so no block is shared by two splits."""
        return self.block_k

    @property
    def items_per_sm(self) -> int:
        """Work items per SM an auto plan aims at (`planning.decode_target_splits`): two, as an SM
        holds several programs at once and the hardware starts the next as one ends."""
        return 2


def default_config(head_dim: int, *, grouped_batch_fills_gpu: bool = False) -> DecodeConfig:
    """Heuristic tiling: one K plus one V tile per stage near 64 KiB of shared memory, or half
    that for a batch of grouped queries (H_q > H_kv) whose (request, K/V head) programs alone fill
    the GPU (`planning.batch_fills_gpu`), where every request runs whole in one program.

    On the H200 (D = 128) block_k = 128 with 4 warps was the fastest or within 3% of it in
    the config sweep at B = 1, 32 and 128 (benchmarks/results/decode_attention_sweep.json).
    Where a batch of groups of 4 fills the GPU, block_k = 64 was faster in every case measured,
    inside one program on the engine's 515-page table: B 64, T 512 37.97 -> 35.70 us; B 64,
    T 2,048 127.01 -> 123.55; B 64, T 8,192 480.2 -> 473.0; B 128, T 512 70.09 -> 66.79; B 128,
    T 2,048 249.0 -> 242.9. Below that it was slower (B 32, T 2,048: 71.4 -> 83.3 us with the
    split slots of a wide table; B 32, T 4,096 in one slot: 125.1 -> 126.5), 32-token blocks
    were slower at every shape, and ungrouped queries, which also fill the GPU at B 32, T 4,096
    with 32 K/V heads, took 486.9 -> 488.2 us (benchmarks/results/probe_large_batch_*_5d6931d.json,
    probe_mha_tiles_da022e6.json).
    """
    tile_elements = 8192 if grouped_batch_fills_gpu else 16384
    return DecodeConfig(block_k=max(16, min(128, tile_elements // head_dim)), num_warps=4, num_stages=3)


def deal_longest_first(keys, b, h, s, *, batch: int, kv_heads: int, slots: int):
    """(b, h, s) of the work item that program (b, h, s) of the (B, H_kv, S) grid takes.

    keys: i32[N >= batch] each request's first split size (-1 past the batch). The programs, in
    launch order (b fastest, then h, then s), take the requests in decreasing key order; the
    requests of one key are taken together, in launch order among themselves, so a batch of
    equal keys runs exactly in launch order. A request's splits are within a block of each other,
    so this is longest-processing-time-first scheduling by the hardware, which starts programs
    in launch order as SMs free up. On the ragged benchmark batch (B 32, 4 slots, 132 SMs, one
    program per SM) a list-scheduling model (program cost = blocks + 1.5) finishes 12% past the
    ideal balance in launch order and 3.5% past it dealt this way. Equal keys keep launch order
    because the other order (a request's slots and heads together) made uniform batches on a wide
    table slower on the H200: B 32, T 2,048 with 3 slots took 81.3 us of GPU time against 70.9.
    """
    requests = jnp.arange(keys.shape[0])
    longer = keys[None, :] > keys[:, None]  # [i, j]: request j's key beats request i's
    tied = keys[None, :] == keys[:, None]
    ahead = jnp.sum(longer.astype(jnp.int32), axis=1)  # requests of a longer key
    ties = jnp.sum(tied.astype(jnp.int32), axis=1)  # requests of this key, itself included
    rank = ahead + jnp.sum((tied & (requests[None, :] < requests[:, None])).astype(jnp.int32), axis=1)

    def of_rank(r, values):
        return jnp.sum(jnp.where(rank == r, values, 0))

    items = slots * kv_heads  # the programs of one request
    launched = (s * kv_heads + h) * batch + b
    first = of_rank(launched // items, ahead)  # the rank of the first request of this key
    count = of_rank(launched // items, ties)
    within = launched - first * items  # launch order within the key's programs: (s, h, request)
    return of_rank(first + within % count, requests), (within // count) % kv_heads, within // (count * kv_heads)


def _decode_kernel(
    q_ref,  # [B, H_q, D]
    k_ref,  # [num_pages * P * H_kv, D]  flat rows of the pool
    v_ref,  # [num_pages * P * H_kv, D]
    table_ref,  # i32[B_c, W]
    seq_lens_ref,  # i32[B]
    *refs,  # (cache_idx_ref i32[B] when remapped,) (the counter's input when merged,) then by `writes`:
    #         "output" (a plan of one slot) o [B, H_q, D] in q.dtype, lse f32[B, H_q];
    #         "partials" o f32[B, H_q, S, D], lse f32[B, H_q, S];
    #         "merged" o, lse as "output", the partials as "partials", counter i32[B, H_kv] (zeros in)
    group: int,
    num_kv_heads: int,
    page_size: int,
    layout: KVLayout,
    block_k: int,
    sm_scale: float,
    soft_cap: float | None,
    mask: DecodeMask,
    plan: SplitPlan,
    longest_first: bool,
    remapped: bool,
    writes: str,
    interpret: bool,
):
    cache_idx_ref, refs = (refs[0], refs[1:]) if remapped else (None, refs)
    if writes == "merged":
        _, o_ref, lse_ref, o_part_ref, lse_part_ref, counter_ref = refs  # the counter's input aliases its output
    else:
        o_ref, lse_ref = refs
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = q_ref.shape[-1]
    batch = seq_lens_ref.shape[0]
    deal = longest_first and plan.capacity > 1 and 1 < batch <= LONGEST_FIRST_MAX_BATCH
    # The program finds its own split from the plan: no bounds arrays (and no XLA kernels to
    # build them) before the launch. Adaptive plans divide the batch's blocks, and the deal ranks
    # the requests, so each program reads the batch's lengths itself (B loads from L2).
    total_blocks = None
    if plan.adapts_to_batch or deal:
        requests = jnp.arange(1 << (batch - 1).bit_length())
        lengths = plgpu.load(seq_lens_ref.at[jnp.minimum(requests, batch - 1)], mask=requests < batch, other=0)
        total_blocks = plan.total_blocks(jnp, lengths)
        if deal:

            def longest_first_item():
                first_start, first_end = plan.slot_bounds(jnp, lengths, 0, total_blocks)
                keys = jnp.where(requests < batch, first_end - first_start, -1)
                return deal_longest_first(keys, b, h, s, batch=batch, kv_heads=num_kv_heads, slots=plan.capacity)

            # Equal lengths deal in launch order anyway: skip the ranking, which costs every program.
            uneven = jnp.sum(((lengths != seq_lens_ref[0]) & (requests < batch)).astype(jnp.int32)) > 0
            b, h, s = jax.lax.cond(uneven, longest_first_item, lambda: (b, h, s))
    seq_len = seq_lens_ref[b]
    c = cache_idx_ref[b] if remapped else b
    start, end = plan.slot_bounds(jnp, seq_len, s, total_blocks)
    q_pos = seq_len - 1

    # Refs are indexed with arrays only (no slices), the form Pallas interpret mode can gather.
    lanes = jnp.arange(d)[None, :]
    g = jnp.arange(MIN_DOT_ROWS)
    g_live = g < group
    q_rows = (h * group + jnp.minimum(g, group - 1))[:, None]
    q = plgpu.load(q_ref.at[b, q_rows, lanes], mask=g_live[:, None], other=0.0)  # [16, D]

    def body(i, carry):
        t = (start // block_k + i) * block_k + jnp.arange(block_k)
        live = (t >= start) & (t < end) & visible(q_pos, t, seq_len, mask)
        k, v = load_kv_block(k_ref, v_ref, table_ref, c, t, live, h, lanes, page_size=page_size, num_kv_heads=num_kv_heads,
                             layout=layout)
        return online_softmax_step(carry, q, k, v, live[None, :], sm_scale=sm_scale, soft_cap=soft_cap)

    steps = pl.cdiv(end - (start // block_k) * block_k, block_k)
    steps = jnp.where(end > start, steps, 0)
    o, lse = finish(*jax.lax.fori_loop(0, steps, body, initial_carry(MIN_DOT_ROWS, d)))
    # Rows past the group are masked. Their indices are another head's rows or past H_q, never
    # a row of this store: interpret mode's masked store writes back what it read there and
    # drops what is out of range (a clamped index would alias a live row), the GPU writes nothing.
    rows = h * group + g
    if writes == "output":
        plgpu.store(o_ref.at[b, rows[:, None], lanes], o.astype(o_ref.dtype), mask=g_live[:, None])
        plgpu.store(lse_ref.at[b, rows], lse, mask=g_live)
        return
    o_slots, lse_slots = (o_ref, lse_ref) if writes == "partials" else (o_part_ref, lse_part_ref)
    plgpu.store(o_slots.at[b, rows[:, None], s, lanes], o, mask=g_live[:, None])
    plgpu.store(lse_slots.at[b, rows, s], lse, mask=g_live)
    if writes == "merged":
        _merge_if_last(o_part_ref, lse_part_ref, counter_ref, o_ref, lse_ref, b, h, group=group, num_slots=plan.capacity,
                       interpret=interpret)


def _merge_if_last(o_part_ref, lse_part_ref, counter_ref, o_ref, lse_ref, b, h, *, group: int, num_slots: int, interpret: bool):
    """The last of (b, h)'s num_slots programs to get here writes the merge of their states."""
    if not interpret:  # interpret mode runs programs one after another, each as one thread
        plgpu.debug_barrier()  # every thread's partial-state stores come before the count
    done_before = plgpu.atomic_add(counter_ref, (b, h), jnp.int32(1))  # acquire-release, GPU scope

    @pl.when(done_before == num_slots - 1)
    def _merge():
        d = o_ref.shape[-1]
        lanes = jnp.arange(d)
        # Every row's loads come before any store: the rows' folds are independent, so their
        # loads can be in flight together rather than one row's after another's store.
        rows = [h * group + r for r in range(group)]
        states = [fold_slots(o_part_ref, lse_part_ref, (b, row), num_slots=num_slots, block_s=default_block_s(d)) for row in rows]
        for row, (o, lse) in zip(rows, states):
            plgpu.store(o_ref.at[b, row, lanes], o.astype(o_ref.dtype))
            lse_ref[b, row] = lse


def _launch(q, k_pages, v_pages, page_table, seq_lens, cache_batch_idx, *, layout, sm_scale, soft_cap, mask, config, plan,
            interpret, writes):
    """One pallas_call of the kernel over the grid (B, H_kv, S); what it writes is `writes`
    ("output" only with one slot)."""
    B, H_q, D = q.shape
    num_pages, P, H_kv, _ = pool_geometry(k_pages, layout)
    if D & (D - 1) or config.block_k & (config.block_k - 1):
        raise ValueError(f"head_dim={D} and block_k={config.block_k} must be powers of two")
    group = H_q // H_kv
    if group > MIN_DOT_ROWS:
        raise ValueError(f"group size H_q / H_kv = {group} exceeds {MIN_DOT_ROWS}")
    S = plan.capacity
    kernel = functools.partial(
        _decode_kernel,
        group=group,
        num_kv_heads=H_kv,
        page_size=P,
        layout=layout,
        block_k=config.block_k,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        mask=mask,
        plan=plan,
        longest_first=config.longest_first,
        remapped=cache_batch_idx is not None,
        writes=writes,
        interpret=interpret,
    )
    output = (jax.ShapeDtypeStruct((B, H_q, D), q.dtype), jax.ShapeDtypeStruct((B, H_q), jnp.float32))
    partials = (jax.ShapeDtypeStruct((B, H_q, S, D), jnp.float32), jax.ShapeDtypeStruct((B, H_q, S), jnp.float32))
    rows = num_pages * P * H_kv
    inputs = [q, k_pages.reshape(rows, D), v_pages.reshape(rows, D), page_table, seq_lens]
    inputs += [] if cache_batch_idx is None else [cache_batch_idx]
    aliases = {}
    if writes == "merged":  # the counter starts at zero in every call; its output (the last) is the input's buffer
        out_shape = (*output, *partials, jax.ShapeDtypeStruct((B, H_kv), jnp.int32))
        aliases = {len(inputs): len(out_shape) - 1}
        inputs.append(jnp.zeros((B, H_kv), jnp.int32))
    else:
        out_shape = output if writes == "output" else partials
    results = pl.pallas_call(
        kernel,
        grid=(B, H_kv, S),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decodejax_paged_decode",
    )(*inputs)
    return results[:2]


@functools.partial(jax.jit, static_argnames=("layout", "sm_scale", "soft_cap", "mask", "config", "plan", "partial_states",
                                             "interpret"))
def paged_decode(
    q: jax.Array,  # [B, H_q, D]
    k_pages: jax.Array,  # PAGED_NHD [num_pages, P, H_kv, D] or PAGED_HND [num_pages, H_kv, P, D]
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[B_c, W]
    seq_lens: jax.Array,  # i32[B]
    cache_batch_idx: jax.Array | None,  # i32[B]; None: request b reads cache row b
    *,
    layout: KVLayout,
    sm_scale: float,
    soft_cap: float | None,
    mask: DecodeMask,
    config: DecodeConfig,
    plan: SplitPlan,
    partial_states: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The decode call: (o [B, H_q, D] in q.dtype, lse f32[B, H_q]); with partial_states, the
    state of every split slot of `plan` instead: (o f32[B, H_q, S, D], lse f32[B, H_q, S]).

    Slot s of request b covers `plan.slot_bounds`, which the kernel computes itself. Every XLA
    op around a kernel is another launch and more host work per call, so there are none but
    the zeros of a fused merge's counter: a plan of one slot is one launch (the kernel writes
    o), more slots are two (the partial states, then `merge_states`) or, with
    config.fused_merge, one that merges them itself.
    Shapes and dtypes are checked by the public op `decodejax.decode_attention`; this wrapper
    only checks what the kernel itself assumes.
    """
    args = (q, k_pages, v_pages, page_table, seq_lens, cache_batch_idx)
    options = dict(layout=layout, sm_scale=sm_scale, soft_cap=soft_cap, mask=mask, config=config, plan=plan, interpret=interpret)
    if partial_states:
        return _launch(*args, writes="partials", **options)
    if plan.capacity == 1:
        return _launch(*args, writes="output", **options)
    if config.fused_merge:
        return _launch(*args, writes="merged", **options)
    o, lse = _launch(*args, writes="partials", **options)
    return merge_states(o, lse, out_dtype=q.dtype, interpret=interpret)
