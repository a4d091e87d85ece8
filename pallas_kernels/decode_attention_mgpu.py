"""Paged split-KV decode attention on Hopper (Pallas, Mosaic GPU lowering): the producer kernel.

The partial-state contract of the Triton producer (`pallas_kernels.decode_attention`,
`paged_decode(..., partial_states=True)`): one program owns (request b, K/V head h, split slot
s), streams the split's key range [start, end) and writes the split's normalized partial state
(o, lse) in float32, EMPTY as (0, -inf). It takes the bounds as i32[B, S] inputs
(`SplitPlan.bounds`) where the Triton kernel computes its own, and it moves data differently:

- Warpgroups specialize. A producer warpgroup copies K and V by TMA, one copy per page of a
  block of `block_k` tokens, into a ring of `num_stages` shared-memory slots (one barrier per
  slot counts the block's copies) and refills a slot's K, then its V, as soon as the compute
  warpgroup that owns the slot has read them. `compute_warpgroups` warpgroups take turns at the
  blocks, each with its own running state; at the end the others hand their states to the first
  through shared memory, which merges them in warpgroup order and writes the split's output.
- The output tiles alias the ring: once every compute warpgroup is past its last block, every
  issued copy has landed and been read, so the ring is free.
- Scores and the weighted sum are warpgroup MMAs (wgmma). wgmma's M is 64, so the G query rows
  of a K/V head ride in a 64-row operand: the wrapper pads them to `QUERY_ROWS` (a TMA tile of
  8 rows) and rows past 8 hold whatever shared memory held. Rows never mix in a matrix
  product, so those rows only produce outputs nobody reads.
- A block's pages are found through the page table: page index i of the block reads
  table[c, min(first_page + i, last_page)], where last_page holds the split's last key. Every
  copied page is therefore a page of this request, never past its table; positions outside
  [start, end) or invisible to the query get probability 0. K rows at such positions may hold
  anything (the score is replaced, not multiplied), but V rows are multiplied by that 0, and
  0 * NaN is NaN: the block that holds `end` zeroes its V rows at positions >= end before the
  MMA (page tails and the clamped duplicates of the last page live there).

Page sizes must be multiples of 8 (the shared-memory tile) and divide block_k or be divided by
it; K/V bf16 or fp16; head dims 64, 128, 256; groups up to 8. `dispatch` admits only that.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from decodejax.addressing import KVLayout, pool_geometry
from decodejax.masks import DecodeMask, visible
from decodejax.split_state import LOG2_E, rescale_base2

WGMMA_ROWS = 64  # the M of one warpgroup MMA: the padded query rows of a program
QUERY_ROWS = 8  # the G query rows of a K/V head padded to one shared-memory tile
TILE_ROWS = 8  # rows of the (8, 64) shared-memory tiling wgmma reads
SWIZZLE_BYTES = 128


@dataclasses.dataclass(frozen=True)
class MosaicDecodeConfig:
    """Static tiling of the Mosaic GPU producer.

    Attributes:
      block_k: tokens per block, a multiple of 64 (wgmma's rows) that pages divide (or that
        divides pages).
      num_stages: shared-memory slots of the K/V ring (blocks in flight, >= 2); a multiple of
        compute_warpgroups, so each slot always feeds the same warpgroup.
      compute_warpgroups: 1 to 3 warpgroups taking turns at the blocks (one more issues copies).
    """

    block_k: int = 64
    num_stages: int = 4
    compute_warpgroups: int = 2

    def shared_memory_bytes(self, head_dim: int, itemsize: int) -> int:
        """q, then the K/V ring and the hand-off and output tiles, which alias it."""
        ring = 2 * self.num_stages * self.block_k * head_dim * itemsize
        handoffs = max(1, self.compute_warpgroups - 1)
        output = handoffs * (WGMMA_ROWS * head_dim * 4 + 2 * WGMMA_ROWS * 4) + WGMMA_ROWS * 4
        return WGMMA_ROWS * head_dim * itemsize + max(ring, output)


# Shared memory a block may use on the H100/H200 (227 KiB), less Mosaic GPU's own scratch
# (CompilerParams.reduction_scratch_bytes, 2 KiB) and barriers.
SHARED_MEMORY_BUDGET = 227 * 1024 - 2048 - 512


def default_config(head_dim: int) -> MosaicDecodeConfig:
    """64-token blocks, two compute warpgroups, four ring slots (two at D = 256, for shared memory).

    On the H200 (D = 128, benchmarks/results/decode_attention_mgpu_sweep.json) six slots were
    within 5% at B 8 to 128 and 13% slower at B 1; one compute warpgroup (three slots) was 1 to
    13% slower."""
    return MosaicDecodeConfig(block_k=64, num_stages=4 if head_dim <= 128 else 2, compute_warpgroups=2)


def supports(page_size: int, head_dim: int, group: int, dtype, config: MosaicDecodeConfig) -> list[str]:
    """Why this kernel cannot run the shape ([] when it can)."""
    r = []
    if config.block_k % WGMMA_ROWS:
        r.append(f"block_k={config.block_k} is not a multiple of {WGMMA_ROWS}")
    if config.compute_warpgroups not in (1, 2, 3) or config.num_stages < 2 or config.num_stages % config.compute_warpgroups:
        r.append(f"num_stages={config.num_stages} must be >= 2 and a multiple of "
                 f"compute_warpgroups={config.compute_warpgroups} (1 to 3)")
    if page_size <= 0 or page_size % TILE_ROWS:
        r.append(f"page_size={page_size} is not a positive multiple of {TILE_ROWS}")
    elif config.block_k % page_size and page_size % config.block_k:
        r.append(f"page_size={page_size} and block_k={config.block_k}: neither divides the other")
    if head_dim not in (64, 128, 256):
        r.append(f"head_dim={head_dim} unsupported (64, 128, 256)")
    elif (need := config.shared_memory_bytes(head_dim, jnp.dtype(dtype).itemsize)) > SHARED_MEMORY_BUDGET:
        r.append(f"head_dim={head_dim} with {config}: {need} bytes of shared memory > {SHARED_MEMORY_BUDGET}")
    if group > QUERY_ROWS:
        r.append(f"group size {group} > {QUERY_ROWS}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        r.append(f"dtype={jnp.dtype(dtype).name}: bf16/fp16 only (wgmma)")
    return r


def _scores(q_smem, k_slot, *, interpret: bool):
    """q [64, D] @ k_slot^T -> f32 [64, block_k]."""
    if interpret:  # the interpreter's wgmma takes neither transposed nor register operands
        return jnp.dot(q_smem[...], k_slot[...].T, preferred_element_type=jnp.float32)

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_slot.transpose((1, 0)))
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC((q_smem.shape[0], k_slot.shape[0]), jnp.float32))


def _accumulate(acc, p, v_slot, *, interpret: bool):
    """acc + p [64, block_k] @ v_slot [block_k, D] (f32)."""
    if interpret:
        return acc + jnp.dot(p, v_slot[...], preferred_element_type=jnp.float32)

    def mma(acc_ref):
        plgpu.wgmma(acc_ref, p, v_slot)

    return pl.run_state(mma)(plgpu.ACC.init(acc))


def _laid_out(x, layout, *, interpret: bool):
    """x with its Mosaic GPU register layout fixed (the interpreter has no layouts)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _positions(first, shape, dimension: int, *, interpret: bool):
    """first + index along `dimension` of an i32 array of `shape` in the wgmma layout."""
    if interpret:
        return first + lax.broadcasted_iota(jnp.int32, shape, dimension)
    return first + plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def _load(ref, layout, *, interpret: bool, optimized: bool = True):
    """The whole of `ref` in registers (the interpreter reads refs by indexing only).

    optimized=False accepts shared-memory bank conflicts (an untiled f32 tile read once)."""
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout, optimized=optimized)


def _row_vector(x, shape):
    """[R] -> [R, N], each row's value repeated (the form Mosaic GPU broadcasts in)."""
    return lax.broadcast_in_dim(x, shape, [0])


def _online_softmax(scores, m, l):
    """One block of the running softmax in base 2: scores f32[R, N] (-inf where masked) and the
    state (m, l) f32[R] -> (p f32[R, N], alpha f32[R] rescaling what came before, m, l)."""
    m_new = jnp.maximum(m, scores.max(axis=1))
    m_safe, alpha = rescale_base2(m, m_new)
    p = jnp.exp2(scores - _row_vector(m_safe, scores.shape))
    return p, alpha, m_new, l * alpha + p.sum(axis=1)


def _merge_states(acc, m, l, acc_other, m_other, l_other):
    """Two running states (acc f32[R, D], m, l f32[R], base 2) of disjoint blocks -> one."""
    m_max = jnp.maximum(m, m_other)
    m_safe, scale = rescale_base2(m, m_max)
    scale_other = jnp.exp2(m_other - m_safe)
    merged = acc * _row_vector(scale, acc.shape) + acc_other * _row_vector(scale_other, acc.shape)
    return merged, m_max, l * scale + l_other * scale_other


def _decode_body(
    q_ref,  # [B, H_kv, QUERY_ROWS, D]
    k_ref,  # the pool, PAGED_NHD [num_pages, P, H_kv, D] or PAGED_HND [num_pages, H_kv, P, D]
    v_ref,
    table_ref,  # i32[B_c, W]
    seq_lens_ref,  # i32[B]
    cache_idx_ref,  # i32[B]
    start_ref,  # i32[B, S]
    end_ref,  # i32[B, S]
    o_ref,  # f32[B, H_kv, QUERY_ROWS, S, D]
    lse_ref,  # f32[B, H_kv, S, QUERY_ROWS]
    q_smem,  # [64, D]
    ring_then_output,  # ((K ring, V ring) [num_stages, block_k, D], then (o f32[W, 64, D], m, l f32[W, 64], lse f32[64])) aliased
    q_barrier,
    k_barriers,  # one per slot, counting the block's page copies
    v_barriers,
    k_consumed_barriers,  # one per slot: its K (V) has been read by the MMAs
    v_consumed_barriers,
    loops_done_barrier,  # every compute warpgroup is past its last block: the ring is free
    handoff_barrier,  # the other compute warpgroups' states are in shared memory (W = their count, >= 1)
    *,
    page_size: int,
    layout: KVLayout,
    block_k: int,
    num_stages: int,
    compute_wgs: int,
    sm_scale: float,
    soft_cap: float | None,
    mask: DecodeMask,
    interpret: bool,
):
    (k_smem, v_smem), (o_smem, m_smem, l_smem, lse_smem) = ring_then_output
    b, h, s = lax.axis_index("batch"), lax.axis_index("kv_head"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    d = q_smem.shape[-1]
    seq_len, c = seq_lens_ref[b], cache_idx_ref[b]
    start, end = start_ref[b, s], end_ref[b, s]
    q_pos = seq_len - 1
    first_block = start // block_k
    num_blocks = jnp.where(end > start, (end + block_k - 1) // block_k - first_block, 0)
    last_page = jnp.maximum(end - 1, 0) // page_size
    pages_per_block = max(1, block_k // page_size)

    def block_pages(block):
        """Page ids of a block's copies (clamped to the split's last page, so always in the table)."""
        first = (first_block + block) * block_k // page_size
        return tuple(table_ref[c, jnp.minimum(first + j, last_page)] for j in range(pages_per_block))

    def page_rows(ref, page, offset, rows):
        if layout is KVLayout.PAGED_NHD:
            return ref.at[page, pl.ds(offset, rows), h]
        return ref.at[page, h, pl.ds(offset, rows)]

    def issue(block, slot, pages, ref, ring, barriers):
        """Starts the TMA copies of block `first_block + block` of K or V into ring slot `slot`."""
        rows = min(block_k, page_size)
        offset = (first_block + block) * block_k % page_size  # 0 unless one page holds several blocks
        for j, page in enumerate(pages):
            plgpu.copy_gmem_to_smem(page_rows(ref, page, offset, rows), ring.at[slot, pl.ds(j * rows, rows)], barriers.at[slot])

    @pl.when(wg == compute_wgs)
    def _producer():
        """The memory warpgroup: fills the ring, refilling a slot once its block is consumed."""
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[pl.ds(0, QUERY_ROWS)], q_barrier)
        for i in range(num_stages):

            @pl.when(i < num_blocks)
            def _fill(i=i):
                pages = block_pages(i)
                issue(i, i, pages, k_ref, k_smem, k_barriers)
                issue(i, i, pages, v_ref, v_smem, v_barriers)

        def refill(j, pages):
            slot = lax.rem(j, num_stages)
            plgpu.barrier_wait(k_consumed_barriers.at[slot])  # K is read before V: refill it first
            issue(j, slot, pages, k_ref, k_smem, k_barriers)
            plgpu.barrier_wait(v_consumed_barriers.at[slot])
            issue(j, slot, pages, v_ref, v_smem, v_barriers)
            return block_pages(j + 1)  # read now, used next iteration: the table read is off the issue path

        lax.fori_loop(num_stages, jnp.maximum(num_blocks, num_stages), refill, block_pages(num_stages))

    def step(n, carry):
        """Folds block n * compute_wgs + wg into this warpgroup's (acc, m, l)."""
        acc, m, l = carry
        i = n * compute_wgs + wg
        slot = lax.rem(i, num_stages)
        t0 = (first_block + i) * block_k
        plgpu.barrier_wait(k_barriers.at[slot])
        scores = _scores(q_smem, k_smem.at[slot], interpret=interpret) * sm_scale
        refilled = i + num_stages < num_blocks  # the producer waits for a slot only to refill it
        pl.when(refilled)(lambda: plgpu.barrier_arrive(k_consumed_barriers.at[slot]))
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        t = _positions(t0, scores.shape, 1, interpret=interpret)
        live = (t >= start) & (t < end) & visible(q_pos, t, seq_len, mask)
        p, alpha, m_new, l = _online_softmax(jnp.where(live, scores * LOG2_E, -jnp.inf), m, l)
        plgpu.barrier_wait(v_barriers.at[slot])

        @pl.when(t0 + block_k > end)
        def _zero_rows_past_end():
            v = _load(v_smem.at[slot], plgpu.Layout.WGMMA, interpret=interpret)
            rows = _positions(t0, v.shape, 0, interpret=interpret)
            v_smem[slot] = jnp.where(rows < end, v, jnp.zeros_like(v))
            plgpu.commit_smem()  # the MMA reads through the async proxy

        acc = _accumulate(acc * _row_vector(alpha, acc.shape), p.astype(v_smem.dtype), v_smem.at[slot], interpret=interpret)
        pl.when(refilled)(lambda: plgpu.barrier_arrive(v_consumed_barriers.at[slot]))
        return acc, m_new, l

    def write_output(acc, m, l):
        valid = l > 0
        safe_l = jnp.where(valid, l, 1.0)
        o_smem[0] = jnp.where(_row_vector(valid, acc.shape), acc / _row_vector(safe_l, acc.shape), 0.0)
        lse_smem[...] = jnp.where(valid, (m + jnp.log2(safe_l)) / LOG2_E, -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[0, pl.ds(0, QUERY_ROWS)], o_ref.at[b, h, :, s])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, QUERY_ROWS)], lse_ref.at[b, h, s])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg < compute_wgs)
    def _consumer():
        """A compute warpgroup: every compute_wgs-th block, then the warpgroups' states merge."""
        rows = q_smem.shape[0]
        reduced = plgpu.Layout.WGMMA.reduce(1)
        carry = (
            _laid_out(jnp.zeros((rows, d), jnp.float32), plgpu.Layout.WGMMA, interpret=interpret),
            _laid_out(jnp.full((rows,), -jnp.inf, jnp.float32), reduced, interpret=interpret),
            _laid_out(jnp.zeros((rows,), jnp.float32), reduced, interpret=interpret),
        )
        plgpu.barrier_wait(q_barrier)
        acc, m, l = lax.fori_loop(0, (num_blocks - wg + compute_wgs - 1) // compute_wgs, step, carry)
        # The output tiles alias the ring. Every issued block has been waited for by the warpgroup
        # that owns it, so once all compute warpgroups are here no copy or MMA touches the ring.
        plgpu.barrier_arrive(loops_done_barrier)
        plgpu.barrier_wait(loops_done_barrier)
        if compute_wgs == 1:
            write_output(acc, m, l)
            return

        @pl.when(wg > 0)
        def _hand_over():
            o_smem[wg - 1] = acc
            m_smem[wg - 1] = m
            l_smem[wg - 1] = l
            plgpu.barrier_arrive(handoff_barrier)

        @pl.when(wg == 0)
        def _merge_and_write():
            plgpu.barrier_wait(handoff_barrier)
            state = (acc, m, l)
            for other in range(compute_wgs - 1):  # in warpgroup order: the same sums every run
                state = _merge_states(*state,
                                      _load(o_smem.at[other], plgpu.Layout.WGMMA, interpret=interpret, optimized=False),
                                      _load(m_smem.at[other], reduced, interpret=interpret, optimized=False),
                                      _load(l_smem.at[other], reduced, interpret=interpret, optimized=False))
            write_output(*state)


@functools.partial(jax.jit, static_argnames=("layout", "sm_scale", "soft_cap", "mask", "config", "interpret"))
def paged_decode_partials(
    q: jax.Array,  # [B, H_q, D]
    k_pages: jax.Array,  # PAGED_NHD [num_pages, P, H_kv, D] or PAGED_HND [num_pages, H_kv, P, D]
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[B_c, W]
    seq_lens: jax.Array,  # i32[B]
    cache_batch_idx: jax.Array,  # i32[B]
    split_start: jax.Array,  # i32[B, S]
    split_end: jax.Array,  # i32[B, S]
    *,
    layout: KVLayout,
    sm_scale: float,
    soft_cap: float | None,
    mask: DecodeMask,
    config: MosaicDecodeConfig,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Partial states of every split: (o f32[B, H_q, S, D], lse f32[B, H_q, S]).

    Shapes and dtypes are checked by the public op `decodejax.decode_attention` and admission
    (`supports`); this wrapper only checks what the kernel itself assumes.
    """
    B, H_q, D = q.shape
    _, P, H_kv, _ = pool_geometry(k_pages, layout)
    group = H_q // H_kv
    reasons = supports(P, D, group, k_pages.dtype, config)
    if reasons:
        raise ValueError(f"the Mosaic GPU decode kernel cannot run this call: {reasons}")
    S = split_start.shape[1]
    q_rows = jnp.pad(q.reshape(B, H_kv, group, D), ((0, 0), (0, 0), (0, QUERY_ROWS - group), (0, 0)))
    tiled = (plgpu.TilingTransform((TILE_ROWS, SWIZZLE_BYTES // q.dtype.itemsize)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    ring = (config.num_stages, config.block_k, D)
    body = functools.partial(
        _decode_body, page_size=P, layout=layout, block_k=config.block_k, num_stages=config.num_stages,
        compute_wgs=config.compute_warpgroups, sm_scale=sm_scale, soft_cap=soft_cap, mask=mask, interpret=interpret,
    )
    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        extra["interpret"] = InterpretGPUParams(detect_races=True, out_of_bounds_reads="raise")
    copies_per_block = max(1, config.block_k // P)
    handoffs = max(1, config.compute_warpgroups - 1)  # the output tile reuses the first
    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((B, H_kv, QUERY_ROWS, S, D), jnp.float32),
            jax.ShapeDtypeStruct((B, H_kv, S, QUERY_ROWS), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((WGMMA_ROWS, D), q.dtype, transforms=tiled),
            # The interpreter cannot alias refs; apart, the two groups behave the same.
            ((lambda *groups: groups) if interpret else plgpu.RefUnion)(
                (plgpu.SMEM(ring, k_pages.dtype, transforms=tiled), plgpu.SMEM(ring, v_pages.dtype, transforms=tiled)),
                (plgpu.SMEM((handoffs, WGMMA_ROWS, D), jnp.float32), *[plgpu.SMEM((handoffs, WGMMA_ROWS), jnp.float32)] * 2,
                 plgpu.SMEM((WGMMA_ROWS,), jnp.float32)),
            ),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=config.num_stages),
            plgpu.Barrier(num_barriers=config.num_stages),
            plgpu.Barrier(num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=config.compute_warpgroups),
            plgpu.Barrier(num_arrivals=handoffs),
        ],
        grid=(S, H_kv, B),
        grid_names=("split", "kv_head", "batch"),
        num_threads=config.compute_warpgroups + 1,
        thread_name="wg",
        kernel_name="decodejax_paged_decode_mgpu",
        **extra,
    )
    o, lse = kernel(q_rows, k_pages, v_pages, page_table, seq_lens, cache_batch_idx, split_start, split_end)
    o = o[:, :, :group].reshape(B, H_q, S, D)
    lse = jnp.swapaxes(lse[..., :group], 2, 3).reshape(B, H_q, S)
    return o, lse
