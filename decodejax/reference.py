"""The oracle: dense and paged attention in float32 (float64 on request).

Every kernel is tested against these functions, and they are the XLA backend. They compute
through the split-state algebra (`summarize` over the whole key axis, then `finalize`), so
they follow the all-masked policy: a row that sees no key gives o = 0 and lse = -inf.

Score of query row r against key j: s = sm_scale * <q_r, k_j>, then, with a soft cap c,
s = c * tanh(s / c). LSE is natural log over the visible scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decodejax import addressing, split_state
from decodejax.masks import DecodeMask, visible


def _scores(q, k, sm_scale, soft_cap, dtype):
    """q: [B, C, H_kv, G, D], k: [B, T, H_kv, D] -> [B, C, H_kv, G, T] in dtype."""
    s = jnp.einsum(
        "bckgd,btkd->bckgt", q.astype(dtype), k.astype(dtype), precision=jax.lax.Precision.HIGHEST
    )
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def attention(
    q: jax.Array,  # [B, C, H_q, D]
    k: jax.Array,  # [B, T, H_kv, D]
    v: jax.Array,  # [B, T, H_kv, Dv]
    kv_lens: jax.Array,  # i32[B]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    mask: DecodeMask = DecodeMask(),
    dense_mask: jax.Array | None = None,  # bool[B, T] or bool[B, C, T]
    dtype=jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """C query rows per request after kv_lens - C committed rows, bottom-right causal.

    Args:
      q: [B, C, H_q, D]; row i of request b sits at position kv_lens[b] - C + i.
      k: [B, T, H_kv, D] contiguous keys; positions >= kv_lens[b] are never read.
      v: [B, T, H_kv, Dv].
      kv_lens: i32[B], keys of each request including its C new rows (0 for a padded row).
      sm_scale: score scale, default 1 / sqrt(D).
      soft_cap: optional logits soft cap c: s -> c * tanh(s / c).
      mask: sliding window and sinks.
      dense_mask: optional application mask ANDed with the visibility (a [B, T] mask applies
        to every query row).
      dtype: compute and output dtype (float32, or float64 with jax_enable_x64).

    Returns:
      o: [B, C, H_q, Dv] in dtype, lse: [B, C, H_q] in dtype (natural log).
    """
    B, C, H_q, D = q.shape
    _, T, H_kv, _ = k.shape
    if H_q % H_kv:
        raise ValueError(f"H_q={H_q} is not a multiple of H_kv={H_kv}")
    G = H_q // H_kv
    if sm_scale is None:
        sm_scale = D**-0.5
    s = _scores(q.reshape(B, C, H_kv, G, D), k, sm_scale, soft_cap, dtype)
    q_pos = kv_lens[:, None] - C + jnp.arange(C)[None, :]  # [B, C]
    k_pos = jnp.arange(T)
    allowed = visible(
        q_pos[:, :, None], k_pos[None, None, :], kv_lens[:, None, None], mask
    )  # [B, C, T]
    if dense_mask is not None:
        allowed &= dense_mask if dense_mask.ndim == 3 else dense_mask[:, None, :]
    allowed = jnp.broadcast_to(allowed[:, :, None, None, :], s.shape)
    values = jnp.transpose(v.astype(dtype), (0, 2, 1, 3))[:, None, :, None]  # [B, 1, H_kv, 1, T, Dv]
    state = split_state.summarize(s, values, allowed)
    o, lse = split_state.finalize(state)
    return o.reshape(B, C, H_q, -1), lse.reshape(B, C, H_q)


def decode(q, k, v, kv_lens, **options):
    """One query row per request: q [B, H_q, D] -> (o [B, H_q, Dv], lse [B, H_q])."""
    o, lse = attention(q[:, None], k, v, kv_lens, **options)
    return o[:, 0], lse[:, 0]


def gather_pages(
    pages: jax.Array,  # [num_pages, P, H_kv, D] (PAGED_NHD) or [num_pages, H_kv, P, D] (PAGED_HND)
    page_table: jax.Array,  # i32[B_c, max_pages]
    seq_lens: jax.Array,  # i32[B]
    *,
    layout: addressing.KVLayout = addressing.KVLayout.PAGED_NHD,
    cache_batch_idx: jax.Array | None = None,  # i32[B]
    max_len: int | None = None,
) -> jax.Array:
    """The visible rows of a paged pool as a contiguous [B, T_max, H_kv, D] view.

    Row t of request b is page_table[c, t // P] row t % P with c = cache_batch_idx[b]
    (or b); rows t >= seq_lens[b] are zero, whatever the pool holds there.
    """
    if layout == addressing.KVLayout.PAGED_HND:
        pages = jnp.swapaxes(pages, 1, 2)
    elif layout != addressing.KVLayout.PAGED_NHD:
        raise ValueError(f"layout must be PAGED_NHD or PAGED_HND, got {layout}")
    _, P, H_kv, D = pages.shape
    tables = page_table if cache_batch_idx is None else page_table[cache_batch_idx]
    if max_len is None:
        max_len = tables.shape[1] * P
    t = jnp.arange(max_len)
    page = tables[:, jnp.minimum(t // P, tables.shape[1] - 1)]  # [B, T_max]
    rows = pages[page, (t % P)[None, :]]  # [B, T_max, H_kv, D]
    live = t[None, :] < seq_lens[:, None]
    return jnp.where(live[:, :, None, None], rows, jnp.zeros((), pages.dtype))


def paged_decode(
    q: jax.Array,  # [B, H_q, D]
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[B_c, max_pages]
    seq_lens: jax.Array,  # i32[B]
    *,
    layout: addressing.KVLayout = addressing.KVLayout.PAGED_NHD,
    cache_batch_idx: jax.Array | None = None,
    **options,
) -> tuple[jax.Array, jax.Array]:
    """Paged decode through a gather: (o [B, H_q, Dv], lse [B, H_q]) in options' dtype."""
    k = gather_pages(k_pages, page_table, seq_lens, layout=layout, cache_batch_idx=cache_batch_idx)
    v = gather_pages(v_pages, page_table, seq_lens, layout=layout, cache_batch_idx=cache_batch_idx)
    return decode(q, k, v, seq_lens, **options)
