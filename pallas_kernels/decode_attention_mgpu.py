"""Paged split-KV decode attention on Hopper (Pallas, Mosaic GPU lowering): the producer kernel.

The partial-state contract of the Triton producer (`pallas_kernels.decode_attention`,
`paged_decode(..., partial_states=True)`): each work item (request b, K/V head h, split slot s)
streams the split's key range [start, end) and returns the split's normalized partial state
(o, lse) in float32, EMPTY as (0, -inf). A batch of several requests split in several slots
with more work items than programs takes its bounds as i32[B, S] inputs (`SplitPlan.bounds`,
built by XLA with the longest-first order that needs them), as does a plan that adapts to the
batch's lengths; otherwise (one slot, one request, or no more items than programs) the kernel
finds the bounds itself from each request's length, as the Triton kernel's programs do. It
moves data differently:

- The kernel is persistent. One program fills an SM's shared memory and registers, so a program
  per work item would leave every SM idle while each program's first copies are in flight and
  its output is written (Nsight Compute on the H200: 1 program per SM, 3.5 TB/s at B 128 against
  the Triton kernel's 2 programs per SM and 4.0 TB/s; benchmarks/results/ncu_decode.json). So
  `programs` programs (at most one per SM) each take every programs-th work item, and their producer
  treats the items' blocks as one stream: the next item's copies start while the current
  item's last blocks are computed and its output written. When a batch's split slots outnumber
  the programs, the items are dealt longest first (`split_order`), and EMPTY splits are skipped,
  not written: the wrapper marks their lse -inf from the bounds. Otherwise (one slot, one
  request's balanced splits, or at most one item a program, where the order changes nothing)
  they are taken in index order and every item is written, so no XLA kernel runs before the
  launch.
- Warpgroups specialize. A producer warpgroup copies K and V by TMA, one copy per page of a
  block of `block_k` tokens, into a ring of `num_stages` shared-memory slots (one barrier per
  slot counts the block's copies) and refills a slot's K, then its V, as soon as the compute
  warpgroup that owns the slot has read them. `compute_warpgroups` warpgroups take turns at the
  blocks, each with its own running state; at an item's end the others hand their states
  through shared memory to the item's merger, which merges them in warpgroup order and writes
  the split's output. With two compute warpgroups the merger is the one that folded the item's
  last block, so neither waits for the other's last block (`item_merger`). The query tile is
  double-buffered where shared memory allows. (A TMA prefetch into L2 of each item's block n
  ahead, to have more bytes in flight than the ring holds, was slower at every benchmark case on
  the H200: 15% to 40% at n = 4, more at n = 8, 18% at B 8 with n = 2;
  results/ab_l2_prefetch4_vs_head_b94e4d4.json and its _vs_8, _vs_2 files.)
- The item's end stalls the ring: the merger's slots wait while it merges and writes,
  so the time its shared-memory traffic takes there is lost once an item. The states go through
  an f32 tile that is tiled and swizzled like the K/V ring: untiled, a warp's WGMMA-layout
  access puts its 8 rows on the same 8 banks. (H200, B 128, T 1,024, 8 items a program, inside
  one program: with the hand-over and the output store skipped the kernel took 126.6 us against
  138.7 and 139.5 in turns, results/ab_epilogue_skipped_95f8010.json; with the tiled tile the
  side-by-side run had B 128 at 131.4, against 135.8 in the run before,
  results/decode_attention_f711c91.json. Rows padded in an untiled tile lower in jax 0.10 but
  not in 0.11.2, whose layout inference wants row strides in whole 128-element tiles.) The
  staged output, in its own dtype, goes through a tile tiled and swizzled the same way; its
  query tile's 8 rows are read back in a layout of whole 8-row tiles (`_eight_rows`). (H200,
  in-program, in turns against the untiled output tile read back in a strided layout, which
  Mosaic GPU does not read from a swizzled tile: B 8 69.4, 69.3 against 69.8, 69.8 us; B 32
  128.2, 128.5 against 129.5, 129.1; MHA 493.9, 493.8 against 494.7, 494.6; D 64 level;
  results/ab_output_tile_tiled_7a0c41a.json.)
- Block j of an item always goes to warpgroup j % compute_wgs: each item starts at a stream
  position that is a multiple of compute_wgs (the positions in between pass through the ring
  without copies). So an item's states merge in one order wherever it sits in its program's
  stream, and deterministic mode stays batch-invariant.
- Scores and the weighted sum are warpgroup MMAs (wgmma). wgmma's M is 64, so the G query rows
  of a K/V head ride in a 64-row operand: the query tile is the 8 rows (one TMA tile) of q that
  hold them, read in place when G divides 8 (else the wrapper pads each head's rows to a tile),
  and rows past 8 hold whatever shared memory held. Rows never mix in a matrix product, so the
  other rows only produce outputs nobody reads; the item's own G rows are copied out. (Keys on
  the 64 rows instead, S^T = K Q^T then O^T = V^T P^T with 16 query columns, V and P^T at a
  32-byte swizzle and P^T through shared memory, lowers with one compute warpgroup, since its
  softmax reduces across warps through Mosaic GPU's one reduction scratch. On the H200 it was
  slower at every case measured: B 32, T 4,096 144.0 us against 130.7 inside one program;
  benchmarks/results/probe_keys_on_rows_05c4688.json. It was removed.)
- At D 64 two K/V heads share an item where the pool allows it (`pairable_heads`): in an NHD
  pool a token's heads 2i and 2i + 1 are one row of 128, so the item streams them as one head of
  D 128 against a block-diagonal query tile, with D 128's tiles. A block then carries twice the
  bytes for the same softmax, which bounds the kernel at D 64. (H200, in turns inside one
  program, against one head an item in 128-token blocks: B 32, T 4,096 67.9 and 68.0 us against
  71.2 and 71.1; B 1, T 32,768 23.7 against 26.9; B 8, T 8,192 38.8 against 42.3; B 128,
  T 1,024 67.5 against 76.6; benchmarks/results/probe_pair_heads_a21c8f0.json.)
- A block's pages are found through the page table: page index i of the block reads
  table[c, min(first_page + i, last_page)], where last_page holds the split's last key. Every
  copied page is therefore a page of this request, never past its table; positions outside
  [start, end) or invisible to the query get probability 0. K rows at such positions may hold
  anything (the score is replaced, not multiplied), but V rows are multiplied by that 0, and
  0 * NaN is NaN: the block that holds `end` zeroes its V rows at positions >= end before the
  MMA (page tails and the clamped duplicates of the last page live there). The producer reads a
  block's page ids one block ahead (the next item's first block at an item's last), so that a
  block's copies do not wait for the table read they depend on.

Page sizes must be multiples of 8 (the shared-memory tile) and divide block_k or be divided by
it; K/V bf16 or fp16; head dims 64, 128, 256; groups up to 8. `dispatch` admits only that.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu import fragmented_array

from decodejax.addressing import KVLayout, pool_geometry
from decodejax.masks import DecodeMask, visible_range
from decodejax.planning import SplitPlan
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
      programs: programs launched, each walking every programs-th work item; None:
        `balanced_programs` of one per SM (one program fills an SM's shared memory), or of
        INTERPRET_PROGRAMS in interpret mode.
      profile_dir: where Mosaic GPU's profiler writes a trace of every program's phases (the
        named scopes of `_decode_body`), one file per compile: `benchmarks/mosaic_timeline.py`
        reads them. None: no profiling (the scopes then lower to nothing).
      pair_heads: two K/V heads to an item where the call allows it (`item_geometry`): the
        tiles are then those of twice the head dim.
    """

    block_k: int = 64
    num_stages: int = 4
    compute_warpgroups: int = 2
    programs: int | None = None
    profile_dir: str | None = None
    pair_heads: bool = False

    def _bytes(self, head_dim: int, itemsize: int, q_buffers: int, out_itemsize: int | None = None) -> int:
        """Shared memory of the kernel; out_itemsize: with the staged output's tiles in that many
        bytes an element (`staged_output_fits`)."""
        q = q_buffers * WGMMA_ROWS * head_dim * itemsize
        ring = 2 * self.num_stages * self.block_k * head_dim * itemsize
        states = self.handoffs * WGMMA_ROWS * head_dim * 4 + self.row_vectors() * self.handoffs * WGMMA_ROWS * 4
        output = (WGMMA_ROWS + QUERY_ROWS) * head_dim * out_itemsize if out_itemsize else 0
        return q + ring + states + output

    @property
    def split_align(self) -> int:
        """Tokens a split's bounds are multiples of: a block per compute warpgroup, so that the
        warpgroups, which take turns at an item's blocks, share every split evenly but a request's
        last. It also keeps the plan off a rounding edge of 64-token blocks: at B 32, T 4,096 the
        auto plan cut every request in two (64 blocks against a split of 63, 33 splits a K/V head);
        in 128-token units it keeps one slot, as for the Triton kernel, and needs no merge (H200,
        the call's kernels traced: 147.0 us of GPU time a call in two slots, 138.0 in one; the
        decode kernel alone 132.8 and 129.1)."""
        return self.block_k * self.compute_warpgroups

    @property
    def items_per_sm(self) -> int:
        """Work items per SM an auto plan aims at (`planning.decode_target_splits`): one, as each SM
        runs one persistent program that takes its items in turn, so more items than programs add
        per-item waits (the query, the hand-over, the output) and slots to merge, not parallelism.
        On the H200 (benchmarks/results/probe_mosaic_tiles_ac2f871.json, inside one program) half the
        Triton kernel's two took B 8, T 8,192 from 75.0 to 72.4 us (2 slots instead of 4) and
        B 1, T 32,768 from 46.8 to 46.2 (16 instead of 32); with 128-token blocks at D 64, B 32,
        T 4,096 went from 90.5 to 80.3 (one slot instead of two; probe_mosaic_tiles_a11c695.json)."""
        return 1

    @property
    def handoffs(self) -> int:
        """State tiles: one per compute warpgroup but the first, and at least one, which holds the
        output where it is not staged (`staged_output_fits`)."""
        return max(1, self.compute_warpgroups - 1)

    def row_vectors(self) -> int:
        """Row vectors handed over per other warpgroup: m and l (the output's lse reuses the first);
        with one compute warpgroup only the lse."""
        return 2 if self.compute_warpgroups > 1 else 1

    def q_buffers(self, head_dim: int, itemsize: int, out_itemsize: int | None = None) -> int:
        """Two query tiles (the next item's lands during the current one) when they fit, else one
        (out_itemsize: beside a staged output's tiles)."""
        return 2 if self._bytes(head_dim, itemsize, 2, out_itemsize) <= SHARED_MEMORY_BUDGET else 1

    def shared_memory_bytes(self, head_dim: int, itemsize: int) -> int:
        """The query tiles, the K/V ring, and the states handed to the merger (the unstaged output's tile)."""
        return self._bytes(head_dim, itemsize, self.q_buffers(head_dim, itemsize))

    def staged_output_fits(self, head_dim: int, itemsize: int, out_itemsize: int) -> bool:
        """Whether the output's own tiles (out_itemsize bytes an element) fit beside one query tile
        and the rest: a 64-row tile the output is stored to and an 8-row one its query tile's rows
        pass through. Then the kernel writes each item's G rows to their heads' rows of o, in the
        output's dtype; else (D 256) whole 8-row query tiles in f32 out of the state tile, from
        which the wrapper takes each item's rows."""
        return self._bytes(head_dim, itemsize, 1, out_itemsize) <= SHARED_MEMORY_BUDGET


# Shared memory a block may use on the H100/H200 (227 KiB = 232,448 bytes), less what Mosaic GPU
# adds: it rounds the scratch up to whole KiB, then adds CompilerParams.reduction_scratch_bytes
# (0 here: every reduction of the kernel stays inside a warp) and 8 bytes a barrier (up to 128
# barriers fit in the last KiB). The lowering checks the sum
# (test_admitted_mosaic_configs_lower_within_shared_memory).
SHARED_MEMORY_BUDGET = 227 * 1024 - 1024
# Programs of an interpreted call: the interpreter runs them one at a time, and two of them
# walk several work items each in the tests' small problems.
INTERPRET_PROGRAMS = 2


def balanced_programs(num_items: int, capacity: int) -> int:
    """The fewest programs, at most `capacity`, that take `num_items` work items in as many rounds as
    `capacity` programs would: every round but the last full, the last as full as it can be.

    B 32, T 4,096 has 256 equal items: 132 programs (one per H200 SM) take them in two rounds with
    8 programs idle in the second; 128 take them in two full rounds. On the H200, in one process,
    128 programs were faster at every case with 256, 512 or 1,024 items (in-program: B 32 129.1 ->
    127.4 us, B 64 132.0 -> 129.7, B 128 136.0 -> 132.7, MHA 487.4 -> 482.6; results/
    probe_rounds_16a7f63.json); a side-by-side run on another machine start did not show the gain
    against the Triton kernel (results/decode_attention_b64_b128_6b81c05.json)."""
    rounds = max(1, -(-num_items // capacity))
    return -(-num_items // rounds)


def default_config(head_dim: int, *, pairable: bool = False) -> MosaicDecodeConfig:
    """Two compute warpgroups; 64-token blocks in four ring slots (two at D = 256, for shared memory).
    At D = 64: two K/V heads to an item where the call allows it (pairable, `pairable_heads`), with
    D = 128's tiles; else 128-token blocks.

    On the H200 (D = 128, benchmarks/results/decode_attention_mgpu_sweep.json, one program per
    work item then) six slots were within 5% at B 8 to 128 and 13% slower at B 1; one compute
    warpgroup (three slots) was 1 to 13% slower. Persistent (results/decode_attention_mgpu_
    persistent_tune.json), two slots with one or two compute warpgroups were 9% slower at B 128.
    At D 64 a block holds half the bytes for the same softmax and waits, and the kernel is bound by
    them: 128-token blocks in four slots took B 32, T 4,096 from 108.9 to 90.7 us inside one
    program, while at D 128 they were 53% slower at B 32; a third compute warpgroup was slower than
    two at D 128 and than these tiles at D 64 (results/probe_mosaic_tiles_ac2f871.json). Two heads
    an item read the bytes of 128-token blocks at D 64 for half their softmax, and were faster at
    every D 64 case measured (`pairable_heads`; results/probe_pair_heads_a21c8f0.json)."""
    if head_dim == 64:
        if pairable:
            return dataclasses.replace(default_config(2 * head_dim), pair_heads=True)
        return MosaicDecodeConfig(block_k=128, num_stages=4, compute_warpgroups=2)
    return MosaicDecodeConfig(block_k=64, num_stages=4 if head_dim <= 128 else 2, compute_warpgroups=2)


def pairable_heads(head_dim: int, kv_heads: int, group: int, layout: KVLayout) -> bool:
    """Whether two K/V heads can share a work item: D 64 in a PAGED_NHD pool (heads 2i and 2i + 1 of
    a token are then one contiguous row of 128, so the pool is a pool of H_kv / 2 heads of D 128, a
    free reshape), an even H_kv, and both heads' 2G query rows in one 8-row query tile.

    The item's query tile is block-diagonal: the 8-row tile of q that holds the pair's rows sits in
    rows 0-7 at columns 0-63 and again in rows 8-15 at columns 64-127, zeros elsewhere. Its scores
    against the pair's keys [k_2i | k_2i+1] are then q . k_2i in rows 0-7 and q . k_2i+1 in rows
    8-15; head 2i's rows of the first half and head 2i+1's of the second are the item's, and their
    products with [v_2i | v_2i+1] are read in columns 0-63 and 64-127. Rows never mix, so each
    head's softmax is its own. A block then carries D 128's bytes for the same softmax (at D 64 the
    kernel is bound by its softmax, `default_config`), and half as many items stream the pool."""
    return head_dim == 64 and layout is KVLayout.PAGED_NHD and kv_heads % 2 == 0 and 2 * group <= QUERY_ROWS


def item_geometry(config: MosaicDecodeConfig, head_dim: int, kv_heads: int, group: int, layout: KVLayout) -> tuple[int, int]:
    """(K/V heads, head dim) as the kernel's work items see the pool: (H_kv / 2, 2 D) where the config
    asks for pairs (pair_heads), the call allows them (`pairable_heads`) and the paired tiles stage
    the output in any dtype (f32 the largest); else (H_kv, D). Plans and shared memory follow it."""
    if (config.pair_heads and pairable_heads(head_dim, kv_heads, group, layout)
            and config.staged_output_fits(2 * head_dim, 2, 4)):
        return kv_heads // 2, 2 * head_dim
    return kv_heads, head_dim


def supports(page_size: int, head_dim: int, group: int, dtype, config: MosaicDecodeConfig) -> list[str]:
    """Why this kernel cannot run the shape ([] when it can)."""
    r = []
    if config.block_k % WGMMA_ROWS:
        r.append(f"block_k={config.block_k} is not a multiple of {WGMMA_ROWS}")
    if config.compute_warpgroups not in (1, 2, 3) or config.num_stages < 2 or config.num_stages % config.compute_warpgroups:
        r.append(f"num_stages={config.num_stages} must be >= 2 and a multiple of "
                 f"compute_warpgroups={config.compute_warpgroups} (1 to 3)")
    if config.programs is not None and config.programs < 1:
        r.append(f"programs={config.programs} must be >= 1 (or None: at most one per SM)")
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


def split_blocks(start, end, block_k: int):
    """Blocks of block_k tokens a split [start, end) touches; 0 for an EMPTY split (end <= start)."""
    return jnp.where(end > start, (end + block_k - 1) // block_k - start // block_k, 0)


def split_order(split_start: jax.Array, split_end: jax.Array, block_k: int) -> jax.Array:
    """i32[B * S]: the splits b * S + s, most blocks first (ties in index order).

    A persistent program's time is the sum of its items', so the programs finish together only if
    the long items are spread over them first. For the ragged benchmark batch (B 32, lengths 1 to
    16,384; its plan computed on CPU for 132 programs) the busiest program got 1.59x the mean
    blocks with the items dealt in (b, h, s) order, 1.42x in (s, b, h) order, and 1.04x longest
    first, dealt back and forth. An XLA sort of B * S keys per call buys that: on the H200 the sort,
    its iota and its key kernel take 3 to 5 us of GPU time a call (B 1 to 128). A one-array
    sort of packed keys ((blocks, index) in one int32) ran no faster there: XLA added a copy
    kernel, and its iota stayed a kernel of its own."""
    blocks = split_blocks(split_start, split_end, block_k).reshape(-1)
    return jnp.argsort(-blocks, stable=True).astype(jnp.int32)


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
    return ref[...] if interpret else plgpu.load(ref, *_WHOLE_REF_INDEX, layout=layout, optimized=optimized)


# `plgpu.load`'s index argument: required in jax 0.10 (() reads the whole ref), deprecated in 0.11,
# where leaving it out reads the whole ref and passing one warns.
_WHOLE_REF_INDEX = ((),) if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty else ()


def _tiled(dtype) -> tuple:
    """The transforms of a shared-memory tile that wgmma and TMA read: (8, 128-byte) tiles, swizzled."""
    return (plgpu.TilingTransform((TILE_ROWS, SWIZZLE_BYTES // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


def _eight_rows(dtype):
    """The register layout of a warpgroup's read of 8 rows (one shared-memory tile's height) out of a
    tile tiled (8, 128 bytes) and swizzled: in every 128-byte column tile a warp takes a quarter of
    each row, a lane 8 bytes of one row. (The WGMMA layouts want 64 rows; the strided one reads untiled
    tiles only.)"""
    cols = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    tiling = fragmented_array.Tiling(((QUERY_ROWS, cols), (QUERY_ROWS, cols // 4), (cols // 16,)))
    return plgpu.Layout.TILED(tiling, warp_dims=(-4,), lane_dims=(-3, -2), vector_dim=-1)


def _row_vector(x, shape):
    """[R] -> [R, N], each row's value repeated (the form Mosaic GPU broadcasts in)."""
    return lax.broadcast_in_dim(x, shape, [0])


def _online_softmax(scores, m, l, scale: float):
    """One block of the running softmax in base 2: scores f32[R, N] (-inf where masked) that
    scale (> 0) takes to base 2, and the state (m, l) f32[R] -> (p f32[R, N], alpha f32[R]
    rescaling what came before, m, l). The scale is applied to the row maxima and inside the
    exponent's argument, where the multiply and the subtraction contract to one FMA an element
    (the maximum commutes with a positive scale, rounding included)."""
    m_new = jnp.maximum(m, scores.max(axis=1) * scale)
    m_safe, alpha = rescale_base2(m, m_new)
    p = jnp.exp2(scores * scale - _row_vector(m_safe, scores.shape))
    return p, alpha, m_new, l * alpha + p.sum(axis=1)


def _merge_states(acc, m, l, acc_other, m_other, l_other):
    """Two running states (acc f32[R, D], m, l f32[R], base 2) of disjoint blocks -> one."""
    m_max = jnp.maximum(m, m_other)
    m_safe, scale = rescale_base2(m, m_max)
    scale_other = jnp.exp2(m_other - m_safe)
    merged = acc * _row_vector(scale, acc.shape) + acc_other * _row_vector(scale_other, acc.shape)
    return merged, m_max, l * scale + l_other * scale_other


def _decode_body(
    q_ref,  # [R / 8, 8, D]: the query rows in tiles, item (b, h)'s from row (b * H_kv + h) * q_row_stride
    k_ref,  # the pool, PAGED_NHD [num_pages, P, H_kv, D] or PAGED_HND [num_pages, H_kv, P, D]
    v_ref,
    table_ref,  # i32[B_c, W]
    seq_lens_ref,  # i32[B]
    cache_idx_ref,  # i32[B], or None: request b reads table row b
    start_ref,  # i32[B, S], or None with end_ref: the kernel finds each split's bounds from `plan`
    end_ref,  # i32[B, S]
    order_ref,  # i32[B * S]: the splits b * S + s, longest first; None (with the bounds): in index order
    o_ref,  # [B, H_q, S, D] in the output's dtype through stage_smem, else f32[B, H_kv, S, QUERY_ROWS, D] (query tiles)
    lse_ref,  # f32[B, H_kv, S, QUERY_ROWS]: the lse of the 8-row query tile that holds (b, h)'s rows (paired: 2 x 8)
    q_smem,  # [q_buffers, 64, D]: the query rows of the current (and next) work item; paired, block-diagonal
    k_smem,  # [num_stages, block_k, D]: the K/V ring
    v_smem,
    state_smem,  # f32[max(1, W - 1), 64, D], tiled and swizzled: the other warpgroups' states; [0] then the
    # output tile where there is no out_smem
    ml_smem,  # f32[2, W - 1, 64]: their m and l, or f32[1, 1, 64] for W = 1; [0, 0] then holds the output's lse
    q_barriers,  # one per q buffer: its copy has landed
    q_free_barriers,  # one per q buffer: every compute warpgroup is done with it
    k_barriers,  # one per slot, counting the block's page copies
    v_barriers,
    k_consumed_barriers,  # one per slot: its K (V) has been read by the MMAs
    v_consumed_barriers,
    handoff_barrier,  # the other compute warpgroups' states are in shared memory
    handoff_free_barrier,  # the merger has read them and the output copies have left shared memory
    out_smem,  # [64, D] in o_ref's dtype: the output tile; or None (then so is stage_smem)
    stage_smem,  # [QUERY_ROWS, D] in o_ref's dtype: the item's query tile's rows on their way out; paired,
    # [2, QUERY_ROWS, D / 2]: each head's half
    *,
    group: int,  # query rows of an item: 2G where paired
    paired: bool,  # two K/V heads an item (`pairable_heads`): the pool's heads are pairs, D is 2 x 64
    q_row_stride: int,
    plan: SplitPlan,  # its capacity is the slots per request, S
    programs: int,
    kv_heads: int,
    num_items: int,
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
    program, wg = lax.axis_index("program"), lax.axis_index("wg")
    d = q_smem.shape[-1]
    q_buffers = q_smem.shape[0]
    pages_per_block = max(1, block_k // page_size)
    rounds, last_round = divmod(num_items, programs)
    my_items = rounds + jnp.where(rounds % 2 == 0, program < last_round, program >= programs - last_round).astype(jnp.int32)

    assert start_ref is not None or not plan.adapts_to_batch, "an adaptive plan's bounds come as inputs"

    def work_item(k):
        """This program's k-th work item: (request b, K/V head h, split slot s) and the split's key
        range [start, end), its first block and block count (0: an EMPTY split, skipped).

        The items, longest first (`split_order`), are dealt to the programs in rounds that go
        back and forth: program p takes item p of even rounds and item programs - 1 - p of odd
        ones, so every program gets a long item and a short one in turn."""
        i = k * programs + jnp.where(k % 2 == 0, program, programs - 1 - program)
        split = i // kv_heads if order_ref is None else order_ref[i // kv_heads]
        h, b, s = lax.rem(i, kv_heads), split // plan.capacity, lax.rem(split, plan.capacity)
        start, end = split_bounds(b, s)
        return b, h, s, start, end, start // block_k, split_blocks(start, end, block_k)

    def split_bounds(b, s):
        """Split slot s of request b: [start, end)."""
        if start_ref is not None:
            return start_ref[b, s], end_ref[b, s]
        seq_len = seq_lens_ref[b]
        if plan.whole_requests:  # one slot: the whole request
            return 0, seq_len
        return plan.slot_bounds(jnp, seq_len, s, None)  # each request's bounds from its own length

    def stream_positions(num_blocks):
        """Positions an item takes in its program's block stream: its blocks, rounded up to a
        multiple of compute_wgs so that block j of every item goes to warpgroup j % compute_wgs
        (the states then merge in the same order wherever the item sits: batch invariance).
        A position past the blocks is a no-op both sides step through."""
        return (num_blocks + compute_wgs - 1) // compute_wgs * compute_wgs

    def query_tile(b, h):
        """(the 8-row query tile that holds item (b, h)'s G rows, their offset in it). The tile's
        other rows are other heads' queries (or padding): rows never mix in the MMAs."""
        first = (b * kv_heads + h) * q_row_stride
        return first // QUERY_ROWS, lax.rem(first, QUERY_ROWS)

    def written(num_blocks):
        """Whether the item is computed and written: with bounds inputs an EMPTY split is skipped (the
        wrapper masks its slot from them); without, nothing masks afterwards, so its state is
        written as (0, -inf) like any other's."""
        return (num_blocks > 0) | (start_ref is None)

    def block_pages(b, end, first_block, block):
        """Page ids of a block's copies (clamped to the split's last page, so always in the table)."""
        first = (first_block + block) * block_k // page_size
        last_page = jnp.maximum(end - 1, 0) // page_size
        c = b if cache_idx_ref is None else cache_idx_ref[b]
        return tuple(table_ref[c, jnp.minimum(first + j, last_page)] for j in range(pages_per_block))

    def page_rows(ref, page, h, offset, rows):
        if layout is KVLayout.PAGED_NHD:
            return ref.at[page, pl.ds(offset, rows), h]
        return ref.at[page, h, pl.ds(offset, rows)]

    def issue(pages, h, block_start, slot, ref, ring, barriers):
        """Starts the TMA copies of the block of keys from block_start into ring slot `slot`."""
        rows = min(block_k, page_size)
        offset = block_start % page_size  # 0 unless one page holds several blocks
        for j, page in enumerate(pages):
            plgpu.copy_gmem_to_smem(page_rows(ref, page, h, offset, rows), ring.at[slot, pl.ds(j * rows, rows)], barriers.at[slot])

    def fill(padding, pages, h, block_start, slot, ref, ring, barriers):
        """Starts a position's copies into ring slot `slot`, or, at a padding position of the
        stream, completes the slot's phase with arrivals and no copies."""

        @pl.when(padding)
        def _release():
            for _ in range(pages_per_block):
                plgpu.barrier_arrive(barriers.at[slot])

        pl.when(~padding)(lambda: issue(pages, h, block_start, slot, ref, ring, barriers))

    @pl.when(wg == compute_wgs)
    def _producer():
        """The memory warpgroup: walks this program's work items and their blocks as one stream
        (block g of the stream goes to ring slot g % num_stages), so the next item's copies start
        while the compute warpgroups finish the current one."""

        def item(k, carry):
            # stream position, live (non-EMPTY) items so far, this item (`work_item(k)`, found by
            # the item before) and the page ids of its first block
            g, live, current, pages = carry
            b, h, _, _, end, first_block, num_blocks = current
            following = work_item(jnp.minimum(k + 1, my_items - 1))
            next_b, _, _, _, next_end, next_first_block, _ = following
            positions = stream_positions(num_blocks)
            buffer = lax.rem(live, q_buffers)

            @pl.when(written(num_blocks))
            def _load_query():
                pl.when(live >= q_buffers)(lambda: plgpu.barrier_wait(q_free_barriers.at[buffer]))
                tile, _ = query_tile(b, h)
                if paired:  # the tile on the diagonal: rows 0-7 against the first head's keys, 8-15 the second's
                    for half in range(2):
                        quarter = q_smem.at[buffer, pl.ds(half * QUERY_ROWS, QUERY_ROWS), pl.ds(half * d // 2, d // 2)]
                        plgpu.copy_gmem_to_smem(q_ref.at[tile], quarter, q_barriers.at[buffer])
                else:
                    plgpu.copy_gmem_to_smem(q_ref.at[tile], q_smem.at[buffer, pl.ds(0, QUERY_ROWS)], q_barriers.at[buffer])

            def block(j, carry):
                g, pages = carry
                # The next position's page ids (this item's next block, or the next item's first),
                # read now and used an iteration later, so the copies never wait for a table read
                # (H200, in-program: D 64, eight pages a block, 78.7 -> 71.2 us; B 8 72.0 -> 70.4;
                # bit-identical; results/ab_page_id_read_ahead.json).
                last = j + 1 >= positions
                next_pages = block_pages(jnp.where(last, next_b, b), jnp.where(last, next_end, end),
                                         jnp.where(last, next_first_block, first_block), jnp.where(last, 0, j + 1))
                slot = lax.rem(g, num_stages)
                block_start = (first_block + j) * block_k
                refill = g >= num_stages  # the slot held position g - num_stages: wait until it is read
                padding = j >= num_blocks  # a position past the item's blocks: arrivals, no copies
                pl.when(refill)(lambda: plgpu.barrier_wait(k_consumed_barriers.at[slot]))  # K is read before V
                fill(padding, pages, h, block_start, slot, k_ref, k_smem, k_barriers)
                pl.when(refill)(lambda: plgpu.barrier_wait(v_consumed_barriers.at[slot]))
                fill(padding, pages, h, block_start, slot, v_ref, v_smem, v_barriers)
                return g + 1, next_pages

            g, pages = lax.fori_loop(0, positions, block, (g, pages))
            # An item without positions (EMPTY) read no next ids: the next item's first are read here
            # (a loop of at most one trip, so that a full item's carried ids wait on no read).
            pages = lax.fori_loop(0, (positions == 0).astype(jnp.int32),
                                  lambda _, pages: block_pages(next_b, next_end, next_first_block, 0), pages)
            return g, live + written(num_blocks).astype(jnp.int32), following, pages

        if paired:
            # Off the diagonal the query tile is 0, once for all items: the copies write only the
            # diagonal. (The stores reach the MMAs' async proxy and every thread's rows are in before
            # the first copy's arrival releases them.)
            for buffer in range(q_buffers):
                q_smem[buffer] = _laid_out(jnp.zeros(q_smem.shape[1:], q_smem.dtype), plgpu.Layout.WGMMA, interpret=interpret)
            plgpu.commit_smem()
        with jax.named_scope("first_pages"):
            first = work_item(0)
            first_b, _, _, _, first_end, first_item_block, _ = first
            first_pages = block_pages(first_b, first_end, first_item_block, 0)
        with jax.named_scope("stream"):
            stream_length, live_items, _, _ = lax.fori_loop(0, my_items, item, (0, 0, first, first_pages))
        # The compute warpgroups arrive at every slot and query buffer they are done with; the
        # last arrivals, which no refill waited for, are waited for here (the interpreter checks
        # that every phase of a barrier is observed).
        for slot in range(num_stages):

            @pl.when(slot < stream_length)
            def _drain_slot(slot=slot):
                plgpu.barrier_wait(k_consumed_barriers.at[slot])
                plgpu.barrier_wait(v_consumed_barriers.at[slot])

        for buffer in range(q_buffers):
            pl.when(buffer < live_items)(lambda buffer=buffer: plgpu.barrier_wait(q_free_barriers.at[buffer]))

    def step(j, carry, *, q_tile, g0, start, end, first_block, keys):
        """Folds block j of the item (block g0 + j of the stream) into this warpgroup's (acc, m, l).
        keys: the item's visible keys as intervals, `masks.visible_range` within [start, end)."""
        acc, m, l = carry
        slot = lax.rem(g0 + j, num_stages)
        t0 = (first_block + j) * block_k
        plgpu.barrier_wait(k_barriers.at[slot])
        scores = _scores(q_tile, k_smem.at[slot], interpret=interpret)
        plgpu.barrier_arrive(k_consumed_barriers.at[slot])
        scale = sm_scale * LOG2_E  # to base 2 (the softmax's exp2), inside the softmax's FMA
        if soft_cap is not None:
            scores, scale = (soft_cap * LOG2_E) * jnp.tanh(scores * (sm_scale / soft_cap)), 1.0
        # Each column's key against the intervals, shifted to the block: two compares an element
        # (four with sinks), not a position and the whole predicate.
        lo, hi, sink_end = keys
        column = _positions(0, scores.shape, 1, interpret=interpret)
        live = (column >= lo - t0) & (column < hi - t0)
        if mask.window_left is not None and mask.sinks:
            live = live | ((column >= start - t0) & (column < sink_end - t0))
        p, alpha, m_new, l = _online_softmax(jnp.where(live, scores, -jnp.inf), m, l, scale)
        plgpu.barrier_wait(v_barriers.at[slot])

        @pl.when(t0 + block_k > end)
        def _zero_rows_past_end():
            v = _load(v_smem.at[slot], plgpu.Layout.WGMMA, interpret=interpret)
            rows = _positions(t0, v.shape, 0, interpret=interpret)
            v_smem[slot] = jnp.where(rows < end, v, jnp.zeros_like(v))
            plgpu.commit_smem()  # the MMA reads through the async proxy

        acc = _accumulate(acc * _row_vector(alpha, acc.shape), p.astype(v_smem.dtype), v_smem.at[slot], interpret=interpret)
        plgpu.barrier_arrive(v_consumed_barriers.at[slot])
        return acc, m_new, l

    def write_output(acc, m, l, b, h, s):
        """The split's normalized state through shared memory (its lse through ml_smem[0, 0]); returns
        once the copies have read it. The lse goes out as the item's query tile's 8 rows (a copy
        from a 4-byte offset would break TMA's 16-byte alignment). Without out_smem, so does o, in
        f32 out of state_smem[0]. With it, o is stored in o_ref's dtype to out_smem, its query
        tile's rows pass through stage_smem, and the item's G rows go to their heads' rows of o_ref:
        Mosaic GPU tiles a 64-row tile in 8 rows for the WGMMA-layout store, and a copy of G < 8
        rows out of it does not lower (jax 0.11.2). (The lse has a buffer of its own: in jax 0.11.2
        a 1-D copy out of a slice of a 2-D tile makes layout inference fail on the tile's stores.)"""
        valid = l > 0
        safe_l = jnp.where(valid, l, 1.0)
        lse_smem = ml_smem.at[0, 0]
        o = jnp.where(_row_vector(valid, acc.shape), acc / _row_vector(safe_l, acc.shape), 0.0)
        lse_smem[...] = jnp.where(valid, (m + jnp.log2(safe_l)) / LOG2_E, -jnp.inf)
        if out_smem is None:
            state_smem[0] = o
            plgpu.commit_smem()  # (also a warpgroup barrier: every thread's rows are in before they are read back)
            plgpu.copy_smem_to_gmem(state_smem.at[0, pl.ds(0, QUERY_ROWS)], o_ref.at[b, h, s])
        else:
            out_smem[...] = o.astype(out_smem.dtype)
            plgpu.commit_smem()
            if paired:  # each head's quarter of the diagonal: rows 0-7 of columns 0-63, rows 8-15 of 64-127
                for half in range(2):
                    quarter = out_smem.at[pl.ds(half * QUERY_ROWS, QUERY_ROWS), pl.ds(half * d // 2, d // 2)]
                    stage_smem[half] = _load(quarter, _eight_rows(out_smem.dtype), interpret=interpret, optimized=False)
            else:
                stage_smem[...] = _load(out_smem.at[pl.ds(0, QUERY_ROWS)], _eight_rows(out_smem.dtype), interpret=interpret,
                                        optimized=False)
            plgpu.commit_smem()
            _, offset = query_tile(b, h)
            for first in range(0, QUERY_ROWS - group + 1, group):  # static slices: a dynamic row offset does not lower

                @pl.when(offset == first)
                def _copy_rows(first=first):
                    if paired:  # the first head's G rows of its quarter, the second's next G of its own
                        g = group // 2
                        for half in range(2):
                            rows = stage_smem.at[half, pl.ds(first + half * g, g)]
                            plgpu.copy_smem_to_gmem(rows, o_ref.at[b, pl.ds(h * group + half * g, g), s])
                    else:
                        plgpu.copy_smem_to_gmem(stage_smem.at[pl.ds(first, group)], o_ref.at[b, pl.ds(h * group, group), s])
        lse_rows = 2 * QUERY_ROWS if paired else QUERY_ROWS  # paired: both halves of the diagonal
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, lse_rows)], lse_ref.at[b, h, s])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    rotating = compute_wgs == 2  # whether the merger changes from item to item (`item_merger`)

    def item_merger(num_blocks):
        """The compute warpgroup that merges an item's states and writes its output. With two, the one
        that folds the item's last block: the other hands its state over as soon as its own blocks are
        done and goes on to the next item, instead of waiting for that last block, and the merger
        reads the state at once. (H200, in turns inside one program against the first warpgroup
        always merging, outputs bit-identical: MHA 472.6, 472.8 us against 478.1, 478.4; D 64 71.4
        against 71.7; B 8 67.1 against 67.3, 67.2; the ragged batch 0.2% faster; B 32 level;
        benchmarks/results/ab_rotating_merger_d4ea51f.json.) With three, the first: each of the
        other two would have to observe the hand-over's phase, which counts both of them, before it
        could merge a later item, so the first to finish would wait for the second."""
        return lax.rem(num_blocks + 1, 2) if rotating else 0

    @pl.when(wg < compute_wgs)
    def _consumer():
        """A compute warpgroup: blocks j = wg, wg + compute_wgs, ... of each work item (items start
        at stream positions that are multiples of compute_wgs, so each ring slot always feeds the
        same warpgroup); then the item's merger (`item_merger`) merges the warpgroups' states in
        warpgroup order and writes the item's output.

        Every warpgroup that waits on a barrier at all observes each of its phases, in order (a wait
        follows the phase parity it has seen). With a rotating merger both warpgroups do: a
        hand-over's warpgroup observes the hand-over it completed at once, and observes the merger's
        release of the state tile (`handoff_free_barrier`) at its next written item, before its next
        arrival could start another phase, or at the end."""
        rows = q_smem.shape[1]
        reduced = plgpu.Layout.WGMMA.reduce(1)

        def item(k, carry):
            # stream position, live (non-EMPTY) items so far, and 1 where this warpgroup has yet to
            # observe the last written item's release of the state tile
            g0, live, owes_release = carry
            b, h, s, start, end, first_block, num_blocks = work_item(k)
            next_g0 = g0 + stream_positions(num_blocks)
            merger = item_merger(num_blocks)

            @pl.when(written(num_blocks))
            def _fold_and_write():
                seq_len = seq_lens_ref[b]
                buffer = lax.rem(live, q_buffers)
                carry = (
                    _laid_out(jnp.zeros((rows, d), jnp.float32), plgpu.Layout.WGMMA, interpret=interpret),
                    _laid_out(jnp.full((rows,), -jnp.inf, jnp.float32), reduced, interpret=interpret),
                    _laid_out(jnp.zeros((rows,), jnp.float32), reduced, interpret=interpret),
                )
                with jax.named_scope("query_wait"):
                    plgpu.barrier_wait(q_barriers.at[buffer])
                lo, hi, sink_end = visible_range(seq_len - 1, seq_len, mask)
                keys = (jnp.maximum(lo, start), jnp.minimum(hi, end), jnp.minimum(sink_end, end))
                fold = functools.partial(step, q_tile=q_smem.at[buffer], g0=g0, start=start, end=end, first_block=first_block,
                                         keys=keys)
                mine = jnp.maximum(num_blocks - wg + compute_wgs - 1, 0) // compute_wgs
                with jax.named_scope("blocks"):
                    acc, m, l = lax.fori_loop(0, mine, lambda n, c: fold(wg + n * compute_wgs, c), carry)
                plgpu.barrier_arrive(q_free_barriers.at[buffer])
                if compute_wgs == 1:  # no padding positions, no states to hand over
                    write_output(acc, m, l, b, h, s)
                    return

                @pl.when(g0 + wg + mine * compute_wgs < next_g0)
                def _pass_padding():
                    """This warpgroup's position past the item's blocks passes through its slot."""
                    slot = lax.rem(g0 + wg + mine * compute_wgs, num_stages)
                    plgpu.barrier_wait(k_barriers.at[slot])
                    plgpu.barrier_arrive(k_consumed_barriers.at[slot])
                    plgpu.barrier_wait(v_barriers.at[slot])
                    plgpu.barrier_arrive(v_consumed_barriers.at[slot])

                # Whichever role it takes now, the state tile and the output's tiles are free only once
                # the last written item's merger has released them.
                pl.when(owes_release == 1)(lambda: plgpu.barrier_wait(handoff_free_barrier))

                @pl.when(wg != merger)
                def _hand_over():
                    tile = 0 if rotating else wg - 1  # the others' tiles in warpgroup order, the merger's left out
                    state_smem[tile] = acc
                    ml_smem[0, tile] = m
                    ml_smem[1, tile] = l
                    plgpu.barrier_arrive(handoff_barrier)
                    if rotating:  # observed now (this arrival completed it): a later merger waits on the next phase
                        plgpu.barrier_wait(handoff_barrier)

                for w in range(compute_wgs) if rotating else (0,):

                    @pl.when((wg == w) & (merger == w))
                    def _merge_and_write(w=w):
                        with jax.named_scope("handoff_wait"):
                            plgpu.barrier_wait(handoff_barrier)
                        with jax.named_scope("merge_write"):
                            state = None
                            for v in range(compute_wgs):  # in warpgroup order, whoever merges: the same sums every run
                                if v == w:
                                    current = (acc, m, l)
                                else:
                                    tile = v - 1 if v > w else v
                                    current = (_load(state_smem.at[tile], plgpu.Layout.WGMMA, interpret=interpret),
                                               _load(ml_smem.at[0, tile], reduced, interpret=interpret, optimized=False),
                                               _load(ml_smem.at[1, tile], reduced, interpret=interpret, optimized=False))
                                state = current if state is None else _merge_states(*state, *current)
                            write_output(*state, b, h, s)
                        plgpu.barrier_arrive(handoff_free_barrier)
                        if rotating:  # observed now: this warpgroup may hand over at the next item
                            plgpu.barrier_wait(handoff_free_barrier)

            live_now = written(num_blocks)
            owes_next = jnp.where(live_now, (wg != merger).astype(jnp.int32), owes_release)
            return next_g0, live + live_now.astype(jnp.int32), owes_next

        _, _, owes_release = lax.fori_loop(0, my_items, item, (0, 0, 0))
        if compute_wgs > 1:  # the last item's output has been copied out (observes that phase)
            pl.when(owes_release == 1)(lambda: plgpu.barrier_wait(handoff_free_barrier))


def _without_absent_inputs(body, inputs: tuple):
    """The kernel body for `inputs` of which some are None (absent: no XLA op builds them): the
    launch passes only the present ones, and the body gets None in place of the others."""
    present = [x is not None for x in inputs]

    def kernel_body(*refs):
        given = iter(refs[:sum(present)])
        return body(*(next(given) if p else None for p in present), *refs[sum(present):])

    return kernel_body


def _query_rows(q: jax.Array, kv_heads: int) -> tuple[jax.Array, int]:
    """q [B, H_q, D] as the kernel's rows in 8-row tiles [R / 8, 8, D] (a TMA copy's row offset
    must be a provable multiple of the shared-memory tile's 8) and the rows between two items'
    first rows.

    When G divides the 8-row tile and the rows fill whole tiles, the rows are q's own (a free
    reshape): every item's G rows then sit inside one tile. Otherwise each K/V head's G rows are
    padded to a tile of their own (an XLA copy of q)."""
    B, H_q, D = q.shape
    group = H_q // kv_heads
    if QUERY_ROWS % group == 0 and B * H_q % QUERY_ROWS == 0:
        return q.reshape(B * H_q // QUERY_ROWS, QUERY_ROWS, D), group
    padded = jnp.pad(q.reshape(B, kv_heads, group, D), ((0, 0), (0, 0), (0, QUERY_ROWS - group), (0, 0)))
    return padded.reshape(B * kv_heads, QUERY_ROWS, D), QUERY_ROWS


def _item_rows(tiles: jax.Array, group: int, q_row_stride: int, paired: bool = False) -> jax.Array:
    """[B, H_kv, S, 8, ...], each item's query tile -> [B, H_q, S, ...], the item's own `group` rows.
    Paired ([B, H_kv / 2, S, 16, ...], the diagonal's two halves): the first head's G = group / 2
    rows of the first half, and the second head's, G rows further, of the second."""
    B, H_kv, S, _, *rest = tiles.shape
    first = (np.arange(B)[:, None] * H_kv + np.arange(H_kv)[None, :]) * q_row_stride  # [B, H_kv]
    g = group // 2
    local = np.concatenate([np.arange(g), QUERY_ROWS + g + np.arange(g)]) if paired else np.arange(group)
    rows = (first % QUERY_ROWS)[:, :, None] + local  # [B, H_kv, group]
    picked = tiles[np.arange(B)[:, None, None], np.arange(H_kv)[None, :, None], :, rows]  # [B, H_kv, G, S, ...]
    return picked.reshape(B, H_kv * group, S, *rest)


@functools.partial(jax.jit, static_argnames=("plan", "layout", "sm_scale", "soft_cap", "mask", "config", "num_sms", "out_dtype",
                                             "interpret"))
def paged_decode_partials(
    q: jax.Array,  # [B, H_q, D]
    k_pages: jax.Array,  # PAGED_NHD [num_pages, P, H_kv, D] or PAGED_HND [num_pages, H_kv, P, D]
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[B_c, W]
    seq_lens: jax.Array,  # i32[B]
    cache_batch_idx: jax.Array | None,  # i32[B]; None: request b reads table row b
    *,
    plan: SplitPlan,
    layout: KVLayout,
    sm_scale: float,
    soft_cap: float | None,
    mask: DecodeMask,
    config: MosaicDecodeConfig,
    num_sms: int,
    out_dtype=jnp.float32,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Partial states of every split slot of `plan`: (o [B, H_q, S, D] in out_dtype, lse f32[B, H_q, S]).

    With one slot (S = 1), one request, or no more work items (B * H_kv * S) than programs, the
    kernel finds each split's bounds itself and writes every item, an EMPTY one as (0, -inf), in
    index order (as the Triton kernel deals only plans of several slots; one request's balanced
    splits differ by at most an aligned block, and a program with one item has no order to
    choose), unless the plan adapts to the batch's lengths (`SplitPlan.adapts_to_batch`; the auto
    plan does only where its items outnumber the SMs, `_ops.decode_plan`): its bounds come from
    XLA. No XLA kernel runs before the launch; with one slot, no cache rows and
    out_dtype = q.dtype (`MosaicDecodeConfig.staged_output_fits`), the kernel's o is the call's
    output. With more items than programs XLA builds the bounds and the longest-first order, and
    the kernel skips EMPTY splits: their lse is set to -inf here, and their o is left as the slot
    held it (undefined), since a merge never reads an EMPTY state's o as data; a caller that
    hands the states on zeroes it (on the H200 the zeroing here was a kernel of its own at B 1,
    2.3 us).

    At D 64 with `config.pair_heads` an item is two K/V heads where the pool allows it
    (`pairable_heads`); `plan` then counts their pairs (`item_geometry`, as `_ops.kernel_items`).

    Shapes and dtypes are checked by the public op `decodejax.decode_attention` and admission
    (`supports`); this wrapper only checks what the kernel itself assumes.
    """
    B, H_q, D = q.shape
    num_pages, P, H_kv, _ = pool_geometry(k_pages, layout)
    H_kv, D_item = item_geometry(config, D, H_kv, H_q // H_kv, layout)  # the heads and head dim of an item
    paired = D_item != D  # two K/V heads an item (`pairable_heads`)
    if paired:  # heads 2i and 2i + 1 of a token are one contiguous row: a free reshape
        k_pages, v_pages = (x.reshape(num_pages, P, H_kv, D_item) for x in (k_pages, v_pages))
    group = H_q // H_kv
    reasons = supports(P, D_item, group, k_pages.dtype, config)
    if reasons:
        raise ValueError(f"the Mosaic GPU decode kernel cannot run this call: {reasons}")
    out_dtype = jnp.dtype(out_dtype)
    staged = config.staged_output_fits(D_item, q.dtype.itemsize, out_dtype.itemsize)
    if out_dtype != jnp.float32 and not staged:
        raise ValueError(f"out_dtype={out_dtype.name}: no shared memory left to stage it at head_dim={D}")
    S = plan.capacity
    num_items = B * H_kv * S
    programs = (min(num_items, config.programs) if config.programs else
                balanced_programs(num_items, INTERPRET_PROGRAMS if interpret else num_sms))
    # Bounds and order from XLA only where the longest-first deal needs them: a batch's slots
    # outnumbering the programs (on the H200 the bounds, the batch's total, the argsort and its
    # key were four kernels of their own before the launch: 4 of 6 launches at B 1, 4.8 us of GPU
    # time a call at B 8, T 8,192, whose 128 items fit the 132 programs). An adaptive plan's
    # bounds come from XLA too, without the order (see the docstring).
    dealt = S > 1 and B > 1 and num_items > programs
    bounds_given = dealt or plan.adapts_to_batch
    split_start, split_end = plan.bounds(seq_lens) if bounds_given else (None, None)
    order = split_order(split_start, split_end, config.block_k) if dealt else None
    q_rows, q_row_stride = _query_rows(q, H_kv)
    ring = (config.num_stages, config.block_k, D_item)
    body = functools.partial(
        _decode_body, group=group, paired=paired, q_row_stride=q_row_stride, plan=plan, programs=programs,
        kv_heads=H_kv, num_items=num_items, page_size=P, layout=layout, block_k=config.block_k,
        num_stages=config.num_stages, compute_wgs=config.compute_warpgroups, sm_scale=sm_scale, soft_cap=soft_cap,
        mask=mask, interpret=interpret,
    )
    if not staged:
        body = functools.partial(body, out_smem=None, stage_smem=None)
    inputs = (q_rows, k_pages, v_pages, page_table, seq_lens, cache_batch_idx, split_start, split_end, order)
    extra = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        extra["interpret"] = InterpretGPUParams(detect_races=True, out_of_bounds_reads="raise")
    copies_per_block = max(1, config.block_k // P)
    handoffs = config.handoffs
    q_buffers = config.q_buffers(D_item, q.dtype.itemsize, out_dtype.itemsize if staged else None)
    profile = {}
    if config.profile_dir:  # room for every scope a program enters: two, and four an item
        profile = dict(profile_space=8 + 4 * -(-num_items // programs), profile_dir=config.profile_dir)
    kernel = plgpu.kernel(
        _without_absent_inputs(body, inputs),
        out_type=(
            jax.ShapeDtypeStruct((B, H_q, S, D) if staged else (B, H_kv, S, QUERY_ROWS, D), out_dtype),
            jax.ShapeDtypeStruct((B, H_kv, S, 2 * QUERY_ROWS if paired else QUERY_ROWS), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((q_buffers, WGMMA_ROWS, D_item), q.dtype, transforms=_tiled(q.dtype)),
            plgpu.SMEM(ring, k_pages.dtype, transforms=_tiled(k_pages.dtype)),
            plgpu.SMEM(ring, v_pages.dtype, transforms=_tiled(v_pages.dtype)),
            # Tiled and swizzled, as the output's tile: a warp's WGMMA-layout access of f32 to an
            # untiled tile of D floats a row puts its 8 rows on the same 8 banks.
            plgpu.SMEM((handoffs, WGMMA_ROWS, D_item), jnp.float32, transforms=_tiled(jnp.float32)),
            plgpu.SMEM((config.row_vectors(), handoffs, WGMMA_ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=2 if paired else 1, num_barriers=q_buffers),  # paired: the tile's two copies
            plgpu.Barrier(num_arrivals=config.compute_warpgroups, num_barriers=q_buffers),
            plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=copies_per_block, num_barriers=config.num_stages),
            plgpu.Barrier(num_barriers=config.num_stages),
            plgpu.Barrier(num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=handoffs),
            plgpu.Barrier(),
        ] + ([plgpu.SMEM((WGMMA_ROWS, D_item), out_dtype, transforms=_tiled(out_dtype)),
              plgpu.SMEM((2, QUERY_ROWS, D) if paired else (QUERY_ROWS, D), out_dtype)] if staged else []),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0, **profile),  # SHARED_MEMORY_BUDGET counts none
        grid=(programs,),
        grid_names=("program",),
        num_threads=config.compute_warpgroups + 1,
        thread_name="wg",
        kernel_name="decodejax_paged_decode_mgpu",
        **extra,
    )
    o, lse = kernel(*(x for x in inputs if x is not None))
    lse = _item_rows(lse, group, q_row_stride, paired)
    o = o if staged else _item_rows(o, group, q_row_stride)
    if not bounds_given:
        return o, lse
    # The kernel skips EMPTY splits: their slots hold whatever was there; the lse marks them EMPTY.
    return o, jnp.where((split_end > split_start)[:, None, :], lse, -jnp.inf)
