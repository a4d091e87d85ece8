"""Public ops: `decode_attention`, `append_attention`, `merge_states`, `gather_pages`.

Every op validates its arguments (ValueError naming the parameter and value) before any
launch, builds its DispatchKey and runs the backend `decodejax.dispatch.select` chooses:

    "pallas_triton"              the Pallas kernels lowered through Triton; NVIDIA GPUs
    "xla"                        the float32 reference (decodejax.reference); every platform
    "pallas_triton_interpret"    the same Pallas kernels in interpret mode; runs on CPU
    "pallas_mosaic_gpu"          the decode kernel lowered through Mosaic GPU (TMA, wgmma); Hopper
    "pallas_mosaic_gpu_interpret" that kernel in Mosaic GPU's interpret mode (race checks); CPU

Selection happens at trace time, so under jit it runs once per compiled shape.
"""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp

from decodejax import addressing, dispatch, planning, reference, split_state
from decodejax.addressing import KVLayout
from decodejax.masks import DecodeMask, packed_rows

_KV_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Deterministic (batch-invariant) mode: every request is cut into chunks of this many tokens,
# whatever its neighbours, so its splits and their merge order depend on it alone.
DETERMINISTIC_CHUNK = 1024
H200_SMS = 132


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _num_sms() -> int:
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or H200_SMS) if device.platform == "gpu" else H200_SMS


def _check_table_values(page_table, seq_lens, cache_batch_idx, *, page_size, num_pages, row_elements, lens_name="seq_lens") -> None:
    """Page-table values against the pool; only outside jit (inside, the caller's runtime validated them)."""
    if _is_concrete(page_table, seq_lens, cache_batch_idx):
        addressing.validate_page_table(
            np.asarray(page_table), np.asarray(seq_lens), page_size=page_size, num_pages=num_pages, row_elements=row_elements,
            cache_batch_idx=None if cache_batch_idx is None else np.asarray(cache_batch_idx), lens_name=lens_name,
        )


def _operation_key(operation, dtype, *, kv_len, heads, head_dim, layout, page_size, backend) -> dispatch.DispatchKey:
    """The dispatch key of a non-attention op (merge_states, gather_pages) on this platform."""
    dtype = str(jnp.dtype(dtype))
    return dispatch.DispatchKey(
        *dispatch.DispatchKey.environment(), operation=operation, phase="decode", q_dtype=dtype, kv_dtype=dtype,
        q_len=1, kv_len=kv_len, num_q_heads=heads, num_kv_heads=heads, head_dim_qk=head_dim, head_dim_v=head_dim,
        cache_layout=layout.value, page_size=page_size, backend_request=backend,
    )


def _validate_decode_args(q, k_pages, v_pages, page_table, seq_lens, cache_batch_idx, layout):
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H_q, D]; got shape {q.shape}")
    B = q.shape[0]
    if seq_lens.shape != (B,) or not jnp.issubdtype(seq_lens.dtype, jnp.integer):
        raise ValueError(f"seq_lens must be an integer [B={B}] array; got {seq_lens.dtype}{list(seq_lens.shape)}")
    _validate_paged_args(q, k_pages, v_pages, page_table, seq_lens, cache_batch_idx, layout)


def _validate_paged_args(q, k_pages, v_pages, page_table, seq_lens, cache_batch_idx, layout, lens_name="seq_lens"):
    """q against the pool, and the page table's rows [0, len(seq_lens)) against seq_lens and the pool."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be rank 4 ({layout.name}); got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} differs from k_pages shape {k_pages.shape}")
    if page_table.ndim != 2 or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be an integer [B_c, W] array; got {page_table.dtype}{list(page_table.shape)}")
    B, H_q, D = q.shape
    num_pages, P, H_kv, D_k = addressing.pool_geometry(k_pages, layout)
    if D_k != D:
        raise ValueError(f"head_dim of q ({D}) differs from k_pages ({D_k})")
    if H_q % H_kv:
        raise ValueError(f"H_q={H_q} is not a multiple of H_kv={H_kv}")
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if x.dtype not in _KV_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is not one of bfloat16, float16, float32")
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k_pages {k_pages.dtype}, v_pages {v_pages.dtype}")
    if cache_batch_idx is not None and cache_batch_idx.shape != (seq_lens.shape[0],):
        raise ValueError(f"cache_batch_idx must be [B={B}]; got shape {cache_batch_idx.shape}")
    if num_pages * P * H_kv * D > addressing.INT32_MAX:
        raise ValueError(f"k_pages of {num_pages * P * H_kv * D} elements overflows int32 offsets")
    _check_table_values(page_table, seq_lens, cache_batch_idx, page_size=P, num_pages=num_pages, row_elements=H_kv * D,
                        lens_name=lens_name)


def kernel_items(kernel, config, head_dim: int, kv_heads: int, group: int, layout: KVLayout, batch: int | None = None,
                 deterministic: bool = False):
    """(config, K/V heads, head dim) of a decode kernel's work items: `config`, or the kernel's default
    where it is None, and the geometry its items see. The Mosaic kernel may run two K/V heads an item
    (`decode_attention_mgpu.item_geometry`), and its plan then counts pairs of heads of twice the
    head dim; the Triton kernel's items are single heads, and its default tiling follows whether
    `batch` fills the GPU with grouped queries. A deterministic call, or one whose batch is not
    given, keeps the tiling of a small batch whatever the batch: another block size would sum a
    request's keys in another order in another batch."""
    from pallas_kernels import decode_attention_mgpu

    if kernel is not decode_attention_mgpu:
        if config is None:
            grouped_fills_gpu = (group > 1 and batch is not None and not deterministic
                                 and planning.batch_fills_gpu(batch, kv_heads, _num_sms(), head_dim))
            config = kernel.default_config(head_dim, grouped_batch_fills_gpu=grouped_fills_gpu)
        return config, kv_heads, head_dim
    if config is None:
        config = kernel.default_config(head_dim, pairable=kernel.pairable_heads(head_dim, kv_heads, group, layout))
    return (config, *kernel.item_geometry(config, head_dim, kv_heads, group, layout))


def decode_plan(
    batch: int, kv_heads: int, max_len: int, tiling, *, num_splits: int | None, deterministic: bool, head_dim: int = 128
) -> planning.SplitPlan:
    """The split plan of one decode call: static (shapes only). `tiling` is the kernel's config: the plan's
    bounds follow the lengths and fall on multiples of its `split_align` tokens, and an auto plan aims
    at its `items_per_sm` work items per SM, adapting its split counts to the batch's lengths only
    where its items outnumber those."""
    split_align, items_per_sm = tiling.split_align, tiling.items_per_sm
    if deterministic:
        if num_splits is not None:
            raise ValueError(f"num_splits={num_splits} cannot be combined with deterministic=True (fixed chunks)")
        capacity = max(1, -(-max_len // DETERMINISTIC_CHUNK))
        return planning.SplitPlan(1, capacity, policy="fixed_chunk", chunk=DETERMINISTIC_CHUNK)
    if num_splits is None:  # auto: the slots the shapes allow, used as the lengths need
        sms = _num_sms()
        capacity = planning.decode_split_capacity(batch, kv_heads, max_len, split_align, sms, head_dim, items_per_sm=items_per_sm)
        if batch * kv_heads * capacity <= sms * items_per_sm:
            # Every work item has a program of its own at once: fewer splits for a request (all an
            # adaptive count can do) would not end the call sooner, and fixed splits leave each
            # request's bounds to its own length, so a kernel that finds them reads no other
            # lengths (H200, Mosaic kernel, in-program, in turns: B 8, T 8,192 67.7 -> 66.8 us;
            # B 1, T 32,768 38.5 -> 38.2; results/ab_adaptive_bounds_ed1472f.json).
            return planning.SplitPlan(capacity, capacity, align=split_align)
        target = planning.decode_target_splits(kv_heads, sms, head_dim, items_per_sm)
        return planning.SplitPlan(capacity, capacity, align=split_align, target_splits=target,
                                  max_split_blocks=planning.split_cap_blocks(split_align))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return planning.SplitPlan(num_splits, num_splits, align=split_align)


def decode_attention(
    q: jax.Array,  # [B, H_q, D]
    k_pages: jax.Array,  # PAGED_NHD [num_pages, P, H_kv, D] (default) or PAGED_HND [num_pages, H_kv, P, D]
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[B_c, W]
    seq_lens: jax.Array,  # i32[B]
    *,
    layout: KVLayout = KVLayout.PAGED_NHD,
    cache_batch_idx: jax.Array | None = None,  # i32[B]
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    window_left: int | None = None,
    sinks: int = 0,
    return_lse: bool = False,
    return_partial_states: bool = False,
    deterministic: bool = False,
    num_splits: int | None = None,
    config=None,
    dense_mask: jax.Array | None = None,  # bool[B, W * P]
    backend: str = "auto",
):
    """Paged decode attention: one query row per request over its cached keys.

    Request b reads cache row c = cache_batch_idx[b] (default b): token t lives at page
    page_table[c, t // P], row t % P, and only t < seq_lens[b] is read. seq_lens[b] = 0 is a
    padded row: o = 0, lse = -inf. Query head h_q reads K/V head h_q // (H_q / H_kv).

    Args:
      q: [B, H_q, D], bfloat16, float16 or float32 (the K/V dtype).
      k_pages, v_pages: the paged pool in `layout`. PAGED_NHD is the default: its rows are the
        token-major write slots page * P + t % P.
      page_table: i32[B_c, W]; visible blocks must hold pages in [1, num_pages).
      seq_lens: i32[B], keys per request (the query sits at position seq_lens[b] - 1).
      layout: KVLayout.PAGED_NHD or KVLayout.PAGED_HND.
      cache_batch_idx: optional i32[B] active row -> cache row.
      sm_scale: score scale, default 1 / sqrt(D).
      soft_cap: logits soft cap c (s -> c tanh(s / c)).
      window_left: the query sees keys [q_pos - window_left, q_pos] (plus sinks).
      sinks: the first `sinks` positions are always visible.
      return_lse: also return lse f32[B, H_q] (natural log).
      return_partial_states: also return the per-split LseState f32[B, H_q, S] (Pallas backends).
      deterministic: fixed chunks of DETERMINISTIC_CHUNK tokens, so a request's output is bit
        identical whatever its neighbours and the batch size.
      num_splits: split count of every request; default: planning.decode_split_capacity slots,
        of which, where the work items outnumber the SMs, each request uses what the batch's
        lengths need (planning.adaptive_split_counts); otherwise every slot, by its own length.
      config: pallas_kernels.decode_attention.DecodeConfig; default from its default_config.
      dense_mask: optional bool[B, W * P], an application mask ANDed with the causal/window
        visibility (mask_kind dense_custom: admitted by the XLA backend only).
      backend: "auto" or one of `decodejax.backends()`; see `decodejax.explain`.

    Returns:
      o [B, H_q, D] in q.dtype; with return_lse, (o, lse); with return_partial_states, the
      LseState of every split slot is appended.
    """
    _validate_decode_args(q, k_pages, v_pages, page_table, seq_lens, cache_batch_idx, layout)
    B, _, D = q.shape
    P = addressing.pool_geometry(k_pages, layout)[1]
    if dense_mask is not None and dense_mask.shape != (B, page_table.shape[1] * P):
        raise ValueError(f"dense_mask must be bool[B={B}, W*P={page_table.shape[1] * P}]; got {dense_mask.shape}")
    key = dispatch.DispatchKey.from_call(
        q, k_pages, layout=layout, page_table=page_table, soft_cap=soft_cap, window_left=window_left, sinks=sinks,
        deterministic=deterministic, mask_kind="causal" if dense_mask is None else "dense_custom", backend=backend,
    )
    selected = dispatch.backend(dispatch.select(key).backend)
    return selected.run(
        "attention", q, k_pages, v_pages, page_table, seq_lens, layout=layout, cache_batch_idx=cache_batch_idx,
        sm_scale=float(D**-0.5 if sm_scale is None else sm_scale), soft_cap=soft_cap, mask=DecodeMask(window_left, sinks),
        return_lse=return_lse, return_partial_states=return_partial_states, deterministic=deterministic,
        num_splits=num_splits, config=config, dense_mask=dense_mask,
    )


def _attention_xla(q, k_pages, v_pages, page_table, seq_lens, *, layout, cache_batch_idx, sm_scale, soft_cap, mask,
                   return_lse, return_partial_states, deterministic, num_splits, config, dense_mask):
    del deterministic, num_splits, config  # the reference is unsplit: deterministic and batch-invariant as it is
    if return_partial_states:
        raise ValueError("return_partial_states=True needs a Pallas backend, got backend='xla'")
    o, lse = reference.paged_decode(
        q, k_pages, v_pages, page_table, seq_lens, layout=layout, cache_batch_idx=cache_batch_idx,
        sm_scale=sm_scale, soft_cap=soft_cap, mask=mask, dense_mask=dense_mask,
    )
    o = o.astype(q.dtype)
    return (o, lse) if return_lse else o


def _attention_pallas(q, k_pages, v_pages, page_table, seq_lens, *, layout, cache_batch_idx, sm_scale, soft_cap, mask,
                      return_lse, return_partial_states, deterministic, num_splits, config, dense_mask, interpret, mosaic=False):
    from pallas_kernels import decode_attention, decode_attention_mgpu

    kernel = decode_attention_mgpu if mosaic else decode_attention
    assert dense_mask is None  # admission rejects dense masks for this backend
    B, H_q, D = q.shape
    _, P, H_kv, _ = addressing.pool_geometry(k_pages, layout)
    config_type = decode_attention_mgpu.MosaicDecodeConfig if mosaic else decode_attention.DecodeConfig
    if config is not None and not isinstance(config, config_type):
        raise ValueError(f"config={config!r} does not configure this backend's kernel (a {config_type.__name__})")
    config, item_heads, item_dim = kernel_items(kernel, config, D, H_kv, H_q // H_kv, layout, batch=B,
                                                deterministic=deterministic)
    plan = decode_plan(B, item_heads, page_table.shape[1] * P, config, num_splits=num_splits, deterministic=deterministic,
                       head_dim=item_dim)
    seq_lens, page_table = seq_lens.astype(jnp.int32), page_table.astype(jnp.int32)
    cache_rows = None if cache_batch_idx is None else cache_batch_idx.astype(jnp.int32)
    options = dict(layout=layout, sm_scale=sm_scale, soft_cap=None if soft_cap is None else float(soft_cap), mask=mask,
                   config=config, interpret=interpret)
    if mosaic:  # the Mosaic path keeps clear of Triton: XLA fuses the (small) merge
        # A one-slot plan's state is the call's output, which the kernel writes in q's dtype where it can.
        final = (plan.capacity == 1 and not return_partial_states
                 and config.staged_output_fits(item_dim, q.dtype.itemsize, q.dtype.itemsize))
        part_o, part_lse = kernel.paged_decode_partials(q, k_pages, v_pages, page_table, seq_lens, cache_rows, plan=plan,
                                                        num_sms=_num_sms(), out_dtype=q.dtype if final else jnp.float32,
                                                        **options)
    elif return_partial_states:
        part_o, part_lse = kernel.paged_decode(q, k_pages, v_pages, page_table, seq_lens, cache_rows, plan=plan,
                                               partial_states=True, **options)
    else:  # one or two launches, no XLA around them
        o, lse = kernel.paged_decode(q, k_pages, v_pages, page_table, seq_lens, cache_rows, plan=plan, **options)
    if mosaic or return_partial_states:
        if plan.capacity == 1:
            o, lse = part_o[:, :, 0], part_lse[:, :, 0]
        else:
            o, lse = _merge_slot_by_slot(part_o, part_lse) if mosaic else _merge_pallas(part_o, part_lse, interpret=interpret)
    out = (o.astype(q.dtype), lse) if return_lse else (o.astype(q.dtype),)
    if return_partial_states:
        valid = part_lse > -jnp.inf
        if mosaic:  # its EMPTY slots' o is undefined (see paged_decode_partials): EMPTY is (0, -inf)
            part_o = jnp.where(valid[..., None], part_o, 0.0)
        out = out + (split_state.LseState(valid=valid, lse=part_lse, o=part_o),)
    return out if len(out) > 1 else out[0]


def append_attention(
    q: jax.Array,  # [N, H_q, D] new tokens, packed request-major
    k_pages: jax.Array,  # PAGED_NHD [num_pages, P, H_kv, D] (default) or PAGED_HND [num_pages, H_kv, P, D]
    v_pages: jax.Array,
    page_table: jax.Array,  # i32[C, W]
    qo_indptr: jax.Array,  # i32[C + 1]
    kv_lens: jax.Array,  # i32[C]
    *,
    layout: KVLayout = KVLayout.PAGED_NHD,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    window_left: int | None = None,
    sinks: int = 0,
    return_lse: bool = False,
    config=None,
    backend: str = "auto",
):
    """Paged attention of new tokens after cached ones (chunked prefill, append).

    Request c's new tokens are rows [qo_indptr[c], qo_indptr[c + 1]) of q; they are the last of
    its kv_lens[c] keys, whose K/V (new ones included) are in the pool: row i of request c sits
    at position kv_lens[c] - len_c + i and sees keys up to it (bottom-right causal, plus the
    window and sinks of `decode_attention`). Rows at or past qo_indptr[C] are padding:
    o = 0, lse = -inf. Key t of request c lives at page page_table[c, t // P], row t % P.

    Returns o [N, H_q, D] in q.dtype, or (o, lse f32[N, H_q]) with return_lse.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [N, H_q, D]; got shape {q.shape}")
    C = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    if kv_lens.ndim != 1 or qo_indptr.shape != (C + 1,):
        raise ValueError(f"kv_lens must be [C] and qo_indptr [C + 1]; got {kv_lens.shape} and {qo_indptr.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != C:
        raise ValueError(f"page_table must be [C={C}, W]; got shape {page_table.shape}")
    for name, x in (("qo_indptr", qo_indptr), ("kv_lens", kv_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer; got {x.dtype}")
    if _is_concrete(qo_indptr, kv_lens):
        indptr, lens = np.asarray(qo_indptr), np.asarray(kv_lens)
        new = np.diff(indptr)
        if indptr[0] != 0 or np.any(new < 0) or indptr[-1] > q.shape[0]:
            raise ValueError(f"qo_indptr={indptr.tolist()} must start at 0, not decrease and end at most at N={q.shape[0]}")
        if np.any(lens < new):
            raise ValueError(f"kv_lens={lens.tolist()} is smaller than the new tokens {new.tolist()} of a request")
    _validate_paged_args(q, k_pages, v_pages, page_table, kv_lens, None, layout, lens_name="kv_lens")
    D = q.shape[-1]
    key = dispatch.DispatchKey.from_call(q, k_pages, layout=layout, page_table=page_table, phase="append", q_len=q.shape[0],
                                         soft_cap=soft_cap, window_left=window_left, sinks=sinks, backend=backend)
    o, lse = dispatch.backend(dispatch.select(key).backend).run(
        "append_attention", q, k_pages, v_pages, page_table.astype(jnp.int32), qo_indptr.astype(jnp.int32),
        kv_lens.astype(jnp.int32), layout=layout, sm_scale=float(D**-0.5 if sm_scale is None else sm_scale),
        soft_cap=soft_cap, mask=DecodeMask(window_left, sinks), config=config,
    )
    return (o, lse) if return_lse else o


def _append_xla(q, k_pages, v_pages, page_table, qo_indptr, kv_lens, *, layout, sm_scale, soft_cap, mask, config):
    """Each new token as a decode row of its request: its position + 1 keys through the reference."""
    del config
    req, within, live = packed_rows(qo_indptr, q.shape[0])
    position = kv_lens[req] - (qo_indptr[req + 1] - qo_indptr[req]) + within
    o, lse = reference.paged_decode(q, k_pages, v_pages, page_table, jnp.where(live, position + 1, 0), layout=layout,
                                    cache_batch_idx=req, sm_scale=sm_scale, soft_cap=soft_cap, mask=mask)
    return o.astype(q.dtype), lse


def _append_pallas(q, k_pages, v_pages, page_table, qo_indptr, kv_lens, *, layout, sm_scale, soft_cap, mask, config, interpret):
    from pallas_kernels import append_attention as kernel

    return kernel.paged_append(q, k_pages, v_pages, page_table, qo_indptr, kv_lens, layout=layout, sm_scale=sm_scale,
                               soft_cap=None if soft_cap is None else float(soft_cap), mask=mask,
                               config=kernel.AppendConfig() if config is None else config, interpret=interpret)


def merge_states(o: jax.Array, lse: jax.Array, *, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Merges S partial states per row, EMPTY-aware (lse = -inf is EMPTY).

    Args:
      o: [..., S, D] partial outputs (normalized).
      lse: [..., S] their natural-log LSE.
      backend: "auto" or one of `backends()`.

    Returns:
      (o [..., D] in o.dtype, lse f32[...]); an all-EMPTY row gives (0, -inf).
    """
    if o.ndim < 2:
        raise ValueError(f"o must be [..., S, D]; got shape {o.shape}")
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"lse must be o.shape[:-1] = {o.shape[:-1]}; got {lse.shape}")
    *_, S, D = o.shape
    key = _operation_key("merge_states", o.dtype, kv_len=S, heads=1, head_dim=D, layout=KVLayout.CONTIGUOUS_NHD,
                         page_size=None, backend=backend)
    return dispatch.backend(dispatch.select(key).backend).run("merge_states", o, lse)


def _merge_xla(o, lse):
    """`split_state.merge_lse_along` over the slot axis as one variadic reduction: every slot is the
    triple (max m, weight sum l, weighted sum acc) = (lse_s, 1, o_s), or the identity (-inf, 0, 0)
    when EMPTY, and two triples combine by rescaling both to the larger max. It is the XLA
    backend's `merge_states`, for any number of slots (a decode call's few slots merge slot by
    slot, `_merge_slot_by_slot`). The algebra's max, weight sum and weighted sum are three
    reductions; in this form a Mosaic decode call launched 9 kernels instead of 12 at B 1 and 10
    instead of 13 at B 8 (H200 traces, twelfth session)."""
    o32, lse32 = o.astype(jnp.float32), lse.astype(jnp.float32)
    live = (lse32 > -jnp.inf)[..., None]
    triples = (jnp.broadcast_to(lse32[..., None], o.shape), jnp.broadcast_to(live.astype(jnp.float32), o.shape),
               jnp.where(live, o32, 0.0))  # an EMPTY slot's o is never read as data

    def combine(a, b):
        (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
        m = jnp.maximum(m_a, m_b)
        scale_a = jnp.where(m_a > -jnp.inf, jnp.exp(m_a - m), 0.0)  # no -inf - -inf
        scale_b = jnp.where(m_b > -jnp.inf, jnp.exp(m_b - m), 0.0)
        return m, l_a * scale_a + l_b * scale_b, acc_a * scale_a + acc_b * scale_b

    identity = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0))
    m, l, acc = jax.lax.reduce(triples, identity, combine, (o.ndim - 2,))
    return _normalized(m, l, acc, o.dtype)


def _merge_slot_by_slot(o, lse):
    """`split_state.merge_lse_along` over the slot axis, written slot by slot on o's shape: the S
    static slices (a decode plan's few slots) make the merge elementwise over the merged o, so XLA
    can fuse it, with the convert to o's dtype, into one loop kernel (every slot's lse is broadcast
    over D first, so that each element computes its own weights). On the H200 it ran as one kernel
    of 2.3 us at B 1, T 32,768 (16 slots) and 1.7 us at B 8, T 8,192 (2 slots), where the variadic
    reduction (`_merge_xla`) ran as a reduction kernel and a convert kernel (2.5 + 0.9 us at B 1)."""
    slots = range(o.shape[-2])
    lse32 = [jnp.broadcast_to(lse[..., s, None].astype(jnp.float32), o.shape[:-2] + o.shape[-1:]) for s in slots]
    live = [x > -jnp.inf for x in lse32]
    peak = functools.reduce(jnp.maximum, lse32)
    valid = peak > -jnp.inf
    safe_peak = jnp.where(valid, peak, 0.0)
    weights = [jnp.where(ok, jnp.exp(jnp.where(ok, x, 0.0) - safe_peak), 0.0) for ok, x in zip(live, lse32)]
    total = functools.reduce(jnp.add, weights)
    acc = functools.reduce(jnp.add, (w * jnp.where(ok, o[..., s, :].astype(jnp.float32), 0.0)  # EMPTY o is never data
                                     for s, ok, w in zip(slots, live, weights)))
    return _normalized(peak, total, acc, o.dtype)


def _normalized(peak, total, acc, dtype) -> tuple[jax.Array, jax.Array]:
    """A merged state whose max, weight sum and weighted sum (f32) each have o's shape [..., D] (every
    element computes its own) -> (o [..., D] in dtype, lse [...]); a row without weight (every slot
    EMPTY) gives (0, -inf)."""
    valid = total > 0
    safe_total = jnp.where(valid, total, 1.0)
    merged_o = jnp.where(valid, acc / safe_total, 0.0)
    merged_lse = jnp.where(valid, peak + jnp.log(safe_total), -jnp.inf)[..., 0]
    return merged_o.astype(dtype), merged_lse


def _merge_pallas(o, lse, *, interpret):
    from pallas_kernels import merge_states as merge_kernel

    return merge_kernel.merge_states(o, lse, out_dtype=o.dtype, interpret=interpret)


def gather_pages(
    pages: jax.Array,
    page_table: jax.Array,  # i32[B_c, W]
    seq_lens: jax.Array,  # i32[B]
    *,
    layout: KVLayout = KVLayout.PAGED_NHD,
    cache_batch_idx: jax.Array | None = None,
    max_len: int | None = None,
    backend: str = "auto",
) -> jax.Array:
    """The visible rows of a paged pool as [B, max_len, H_kv, D] (default max_len W * P), zeros past seq_len."""
    num_pages, P, H_kv, D = addressing.pool_geometry(pages, layout)
    if seq_lens.ndim != 1 or page_table.ndim != 2:
        raise ValueError(f"seq_lens must be [B] and page_table [B_c, W]; got {seq_lens.shape}, {page_table.shape}")
    _check_table_values(page_table, seq_lens, cache_batch_idx, page_size=P, num_pages=num_pages, row_elements=H_kv * D)
    max_len = page_table.shape[1] * P if max_len is None else max_len
    key = _operation_key("gather_pages", pages.dtype, kv_len=max_len, heads=H_kv, head_dim=D, layout=layout,
                         page_size=P, backend=backend)
    return dispatch.backend(dispatch.select(key).backend).run(
        "gather_pages", pages, page_table, seq_lens, layout=layout, cache_batch_idx=cache_batch_idx, max_len=max_len
    )


def _gather_pallas(pages, page_table, seq_lens, *, layout, cache_batch_idx, max_len, interpret):
    from pallas_kernels import page_gather

    B = seq_lens.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32) if cache_batch_idx is None else cache_batch_idx.astype(jnp.int32)
    return page_gather.gather_pages(
        pages, page_table.astype(jnp.int32), seq_lens.astype(jnp.int32), rows, layout=layout, max_len=max_len, interpret=interpret
    )


# Each backend's implementation of each operation (`dispatch.Backend.run` looks them up here).
IMPLEMENTATIONS = {
    "xla": {"attention": _attention_xla, "append_attention": _append_xla, "merge_states": _merge_xla,
            "gather_pages": reference.gather_pages},
    "pallas_triton": {
        "attention": functools.partial(_attention_pallas, interpret=False),
        "append_attention": functools.partial(_append_pallas, interpret=False),
        "merge_states": functools.partial(_merge_pallas, interpret=False),
        "gather_pages": functools.partial(_gather_pallas, interpret=False),
    },
    "pallas_mosaic_gpu": {"attention": functools.partial(_attention_pallas, interpret=False, mosaic=True)},
    "pallas_mosaic_gpu_interpret": {"attention": functools.partial(_attention_pallas, interpret=True, mosaic=True)},
    "pallas_triton_interpret": {
        "attention": functools.partial(_attention_pallas, interpret=True),
        "append_attention": functools.partial(_append_pallas, interpret=True),
        "merge_states": functools.partial(_merge_pallas, interpret=True),
        "gather_pages": functools.partial(_gather_pallas, interpret=True),
    },
}
