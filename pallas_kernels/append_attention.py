"""Paged append attention, a.k.a. chunked prefill (Pallas, Triton lowering).

The new tokens of C requests are packed request-major: request c's rows are
[qo_indptr[c], qo_indptr[c + 1]) and they are the last of its kv_lens[c] key positions
(bottom-right causal, `decodejax.masks.visible`). Their K/V are already in the pool.

One program owns (tile j, K/V head h). A tile is up to `tile_tokens` consecutive new rows of
one request; with the G query heads of h they form one block of TILE_ROWS query rows
(token-major, the group padded to a power of two), so every K/V block is loaded once for the
whole tile instead of once per token as a decode kernel would. The program streams the keys
its rows can see, through the page table as the decode kernel does, and writes normalized
(o, lse) into its own padded slots; `append_attention` maps them back to the packed rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from decodejax.addressing import KVLayout, pool_geometry
from decodejax.masks import DecodeMask, packed_rows, segment_of, visible
from pallas_kernels.paged_blocks import finish, initial_carry, load_kv_block, online_softmax_step

TILE_ROWS = 64  # query rows (tokens x padded group) of one program: the dot's M


@dataclasses.dataclass(frozen=True)
class AppendConfig:
    """Static tiling: keys per inner step, Triton warps and pipelining depth."""

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2


def padded_group(group: int) -> int:
    return 1 << (group - 1).bit_length()


def tile_tokens(group: int) -> int:
    """New tokens per tile: TILE_ROWS over the padded group."""
    return max(1, TILE_ROWS // padded_group(group))


def plan_tiles(qo_indptr: jax.Array, *, tokens: int, num_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Tiles of `tokens` rows that never straddle two requests.

    Returns (first_tile i32[C + 1], request i32[num_tiles], first row i32[num_tiles],
    rows i32[num_tiles]); tiles past the last request's have 0 rows. num_tiles must be at
    least sum_c ceil(len_c / tokens) (cdiv(N, tokens) + C always is).
    """
    lens = qo_indptr[1:] - qo_indptr[:-1]
    first_tile = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pl.cdiv(lens, tokens)).astype(jnp.int32)])
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    request = segment_of(first_tile, j)
    first_row = qo_indptr[request] + (j - first_tile[request]) * tokens
    rows = jnp.where(j < first_tile[-1], jnp.clip(qo_indptr[request + 1] - first_row, 0, tokens), 0)
    return first_tile, request, first_row, rows


def _append_kernel(
    q_ref,  # [N, H_q, D]
    k_ref,  # [num_pages * P * H_kv, D]  flat rows of the pool
    v_ref,
    table_ref,  # i32[C, W]
    qo_indptr_ref,  # i32[C + 1]
    kv_lens_ref,  # i32[C]
    tile_request_ref,  # i32[num_tiles]
    tile_row_ref,  # i32[num_tiles]
    tile_rows_ref,  # i32[num_tiles]
    o_ref,  # [num_tiles, H_kv, TILE_ROWS, D]
    lse_ref,  # f32[num_tiles, H_kv, TILE_ROWS]
    *,
    group: int,
    num_kv_heads: int,
    page_size: int,
    layout: KVLayout,
    block_k: int,
    sm_scale: float,
    soft_cap: float | None,
    mask: DecodeMask,
):
    j, h = pl.program_id(0), pl.program_id(1)
    d = q_ref.shape[-1]
    gpad = padded_group(group)
    c, row0, n = tile_request_ref[j], tile_row_ref[j], tile_rows_ref[j]
    kv_len = kv_lens_ref[c]
    pos0 = kv_len - (qo_indptr_ref[c + 1] - qo_indptr_ref[c]) + (row0 - qo_indptr_ref[c])  # position of the tile's first row

    # Query row r of the block is token i = r // gpad of the tile, head g = r % gpad of the group.
    lanes = jnp.arange(d)[None, :]
    r = jnp.arange(TILE_ROWS)
    i, g = r // gpad, r % gpad
    live = (i < n) & (g < group)
    token = jnp.clip(row0 + jnp.minimum(i, n - 1), 0, q_ref.shape[0] - 1)  # dead rows: any in-bounds row
    head = h * group + jnp.minimum(g, group - 1)
    q = plgpu.load(q_ref.at[token[:, None], head[:, None], lanes], mask=live[:, None], other=0.0)  # [TILE_ROWS, D]
    q_pos = pos0 + i

    hi = pos0 + n  # one past the last row's position: no row sees further
    if mask.window_left is None or mask.sinks:
        lo = 0
    else:  # nothing left of the first row's window is visible to any row of the tile
        lo = (jnp.maximum(pos0 - mask.window_left, 0) // block_k) * block_k

    def body(step, carry):
        t = lo + step * block_k + jnp.arange(block_k)
        # Keys some row of the tile sees: the union of the rows' windows (and the sinks). Only
        # those are loaded, so a block no row sees loads nothing (M1).
        needed = t < hi
        if mask.window_left is not None:
            needed &= (t >= pos0 - mask.window_left) | (t < mask.sinks)
        k, v = load_kv_block(k_ref, v_ref, table_ref, c, t, needed, h, lanes, page_size=page_size,
                             num_kv_heads=num_kv_heads, layout=layout)
        seen = visible(q_pos[:, None], t[None, :], kv_len, mask) & live[:, None] & needed[None, :]
        return online_softmax_step(carry, q, k, v, seen, sm_scale=sm_scale, soft_cap=soft_cap)

    steps = jnp.where(n > 0, pl.cdiv(hi - lo, block_k), 0)
    o, lse = finish(*jax.lax.fori_loop(0, steps, body, initial_carry(TILE_ROWS, d)))
    # Every (tile, head, row) has its own slot, so no two lanes of a store alias.
    plgpu.store(o_ref.at[j, h, r[:, None], lanes], o.astype(o_ref.dtype))
    plgpu.store(lse_ref.at[j, h, r], lse)


@functools.partial(jax.jit, static_argnames=("layout", "sm_scale", "soft_cap", "mask", "config", "interpret"))
def paged_append(
    q: jax.Array,  # [N, H_q, D] packed new tokens
    k_pages: jax.Array,  # PAGED_NHD [num_pages, P, H_kv, D] or PAGED_HND [num_pages, H_kv, P, D]
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[C, W]
    qo_indptr: jax.Array,  # i32[C + 1]
    kv_lens: jax.Array,  # i32[C]
    *,
    layout: KVLayout,
    sm_scale: float,
    soft_cap: float | None,
    mask: DecodeMask,
    config: AppendConfig,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(o [N, H_q, D] in q.dtype, lse f32[N, H_q]); rows past qo_indptr[C] give (0, -inf).

    Arguments are checked by the public op `decodejax.append_attention`; this wrapper only
    checks what the kernel itself assumes.
    """
    N, H_q, D = q.shape
    num_pages, P, H_kv, _ = pool_geometry(k_pages, layout)
    group = H_q // H_kv
    if D & (D - 1) or config.block_k & (config.block_k - 1):
        raise ValueError(f"head_dim={D} and block_k={config.block_k} must be powers of two")
    if padded_group(group) > TILE_ROWS:
        raise ValueError(f"group size H_q / H_kv = {group} exceeds {TILE_ROWS}")
    tokens = tile_tokens(group)
    C = kv_lens.shape[0]
    num_tiles = pl.cdiv(N, tokens) + C
    first_tile, request, first_row, rows = plan_tiles(qo_indptr, tokens=tokens, num_tiles=num_tiles)
    kernel = functools.partial(
        _append_kernel, group=group, num_kv_heads=H_kv, page_size=P, layout=layout, block_k=config.block_k,
        sm_scale=sm_scale, soft_cap=soft_cap, mask=mask,
    )
    flat_rows = num_pages * P * H_kv
    o_tiles, lse_tiles = pl.pallas_call(
        kernel,
        grid=(num_tiles, H_kv),
        out_shape=(
            jax.ShapeDtypeStruct((num_tiles, H_kv, TILE_ROWS, D), q.dtype),
            jax.ShapeDtypeStruct((num_tiles, H_kv, TILE_ROWS), jnp.float32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="decodejax_paged_append",
    )(q, k_pages.reshape(flat_rows, D), v_pages.reshape(flat_rows, D), page_table, qo_indptr, kv_lens, request, first_row, rows)
    # Packed row n -> its request, tile and row of the tile; then every head of the row.
    req, within, live = packed_rows(qo_indptr, N)
    tile = jnp.where(live, first_tile[req] + within // tokens, 0)
    hq = jnp.arange(H_q)
    slot = (within % tokens)[:, None] * padded_group(group) + (hq % group)[None, :]  # [N, H_q]
    o = o_tiles[tile[:, None], (hq // group)[None, :], slot]  # [N, H_q, D]
    lse = lse_tiles[tile[:, None], (hq // group)[None, :], slot]
    return jnp.where(live[:, None, None], o, 0).astype(q.dtype), jnp.where(live[:, None], lse, -jnp.inf)
