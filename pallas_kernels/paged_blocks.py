"""Pieces shared by the paged attention kernels (traced inside their Pallas bodies).

    load_kv_block       the K/V rows of `block_k` key positions, through the page table
    online_softmax_step one block folded into the running (max, sum, acc), base 2, EMPTY-aware
    finish              (max, sum, acc) -> normalized o and natural-log lse; EMPTY rows -> (0, -inf)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from decodejax.addressing import KVLayout, pool_row
from decodejax.split_state import LOG2_E, rescale_base2


def load_kv_block(k_ref, v_ref, table_ref, cache_row, t, live, kv_head, lanes, *, page_size: int, num_kv_heads: int,
                  layout: KVLayout):
    """K and V [block_k, D] of key positions t (i32[block_k]) of cache row `cache_row`; lanes where
    `live` is False read nothing and hold 0."""
    width = table_ref.shape[-1]
    page = plgpu.load(table_ref.at[cache_row, jnp.minimum(t // page_size, width - 1)], mask=live, other=0)
    row = pool_row(page, t % page_size, kv_head, page_size=page_size, num_kv_heads=num_kv_heads, layout=layout)
    k = plgpu.load(k_ref.at[row[:, None], lanes], mask=live[:, None], other=0.0)
    v = plgpu.load(v_ref.at[row[:, None], lanes], mask=live[:, None], other=0.0)
    return k, v


def online_softmax_step(carry, q, k, v, seen, *, sm_scale: float, soft_cap: float | None):
    """Folds one key block into carry = (m [R] base-2 max, l [R] sum, acc [R, D]); seen: bool[R, block_k]."""
    m, l, acc = carry
    # float32 K/V are for accuracy, not speed: Triton would round their dots to TF32 (~1e-3).
    exact = k.dtype == jnp.float32
    scores = plgpu.dot(q, k, trans_b=True, allow_tf32=not exact) * sm_scale  # [R, block_k] f32
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(seen, scores * LOG2_E, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_safe, scale = rescale_base2(m, m_new)
    p = jnp.exp2(scores - m_safe[:, None])
    acc = acc * scale[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact)
    return m_new, l * scale + jnp.sum(p, axis=1), acc


def initial_carry(rows: int, head_dim: int):
    return jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, head_dim), jnp.float32)


def finish(m, l, acc):
    """(o [R, D] = acc / l, lse [R] natural log); rows that saw no key give (0, -inf)."""
    valid = l > 0
    safe_l = jnp.where(valid, l, 1.0)
    o = jnp.where(valid[:, None], acc / safe_l[:, None], 0.0)
    lse = jnp.where(valid, (m + jnp.log2(safe_l)) / LOG2_E, -jnp.inf)
    return o, lse
