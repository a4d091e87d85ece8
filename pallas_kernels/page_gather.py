"""Gather the visible rows of a paged K or V pool into a contiguous [B, T_max, H_kv, D] view.

One program owns (request b, block of `block_t` tokens, K/V head h): it translates each
token through the page table and copies its row; rows at t >= seq_len are written as zeros
and their pages are never read. Its pure-jnp twin is `decodejax.reference.gather_pages`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from decodejax.addressing import KVLayout, pool_geometry, pool_row


def _gather_kernel(pages_ref, table_ref, seq_lens_ref, cache_idx_ref, out_ref, *, page_size, num_kv_heads, layout, block_t):
    # pages_ref:  [num_pages * P * H_kv, D]  flat rows of the pool
    # table_ref:  i32[B_c, W]
    # seq_lens_ref, cache_idx_ref: i32[B]
    # out_ref:    [B, T_pad, H_kv, D]  T_max rounded up to block_t, so no two lanes alias
    b, j, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    width = table_ref.shape[-1]
    t = j * block_t + jnp.arange(block_t)
    live = t < seq_lens_ref[b]
    page = plgpu.load(table_ref.at[cache_idx_ref[b], jnp.minimum(t // page_size, width - 1)], mask=live, other=0)
    r = t % page_size
    row = pool_row(page, r, h, page_size=page_size, num_kv_heads=num_kv_heads, layout=layout)
    # Refs are indexed with arrays only (no slices), the form Pallas interpret mode can gather.
    lanes = jnp.arange(pages_ref.shape[-1])[None, :]
    rows = plgpu.load(pages_ref.at[row[:, None], lanes], mask=live[:, None], other=0.0)
    plgpu.store(out_ref.at[b, t[:, None], h, lanes], rows)


@functools.partial(jax.jit, static_argnames=("layout", "max_len", "block_t", "interpret"))
def gather_pages(
    pages: jax.Array,  # PAGED_NHD [num_pages, P, H_kv, D] or PAGED_HND [num_pages, H_kv, P, D]
    page_table: jax.Array,  # i32[B_c, W]
    seq_lens: jax.Array,  # i32[B]
    cache_batch_idx: jax.Array,  # i32[B]
    *,
    layout: KVLayout,
    max_len: int,
    block_t: int = 64,
    interpret: bool = False,
) -> jax.Array:
    """[B, max_len, H_kv, D] in the pool's dtype, zeros past each seq_len."""
    num_pages, P, H_kv, D = pool_geometry(pages, layout)
    B = seq_lens.shape[0]
    kernel = functools.partial(_gather_kernel, page_size=P, num_kv_heads=H_kv, layout=layout, block_t=block_t)
    blocks = pl.cdiv(max_len, block_t)
    out = pl.pallas_call(
        kernel,
        grid=(B, blocks, H_kv),
        out_shape=jax.ShapeDtypeStruct((B, blocks * block_t, H_kv, D), pages.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="decodejax_gather_pages",
    )(pages.reshape(num_pages * P * H_kv, D), page_table, seq_lens, cache_batch_idx)
    return out if blocks * block_t == max_len else out[:, :max_len]
