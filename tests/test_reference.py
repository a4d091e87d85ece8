"""The oracle against an independent float64 loop, and paged == contiguous (A2, M2)."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import x64
from decodejax import KVLayout, reference
from decodejax.masks import DecodeMask, visible, visible_range


def loop_attention(q, k, v, kv_lens, sm_scale, soft_cap, window_left, sinks):
    """Per-row softmax in float64 with explicit loops: the oracle's own oracle."""
    B, C, H_q, D = q.shape
    H_kv = k.shape[2]
    o = np.zeros((B, C, H_q, v.shape[-1]))
    lse = np.full((B, C, H_q), -np.inf)
    for b in range(B):
        T = kv_lens[b]
        for i in range(C):
            qp = T - C + i
            keys = [
                j for j in range(T)
                if j <= qp and (window_left is None or j >= qp - window_left or j < sinks)
            ]
            for h in range(H_q):
                if not keys:
                    continue
                g = h // (H_q // H_kv)
                s = np.array([q[b, i, h] @ k[b, j, g] for j in keys]) * sm_scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                mx = s.max()
                w = np.exp(s - mx)
                o[b, i, h] = (w[:, None] * v[b, keys, g]).sum(0) / w.sum()
                lse[b, i, h] = mx + np.log(w.sum())
    return o, lse


CASES = [
    dict(C=1, H_q=4, H_kv=4, soft_cap=None, window_left=None, sinks=0),
    dict(C=1, H_q=8, H_kv=2, soft_cap=None, window_left=None, sinks=0),
    dict(C=1, H_q=6, H_kv=2, soft_cap=5.0, window_left=3, sinks=2),
    dict(C=3, H_q=4, H_kv=1, soft_cap=None, window_left=None, sinks=0),
    dict(C=4, H_q=4, H_kv=2, soft_cap=2.0, window_left=2, sinks=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "_".join(f"{k}={v}" for k, v in c.items()))
def test_M2_reference_matches_loop_oracle(case):
    r = np.random.default_rng(1)
    B, T, D = 3, 9, 8
    C = case["C"]
    q = r.normal(size=(B, C, case["H_q"], D))
    k = r.normal(size=(B, T, case["H_kv"], D))
    v = r.normal(size=(B, T, case["H_kv"], D))
    kv_lens = np.array([9, C, 5])
    kv_lens[1] = max(C, 1)
    scale = 0.7
    with x64():
        o, lse = reference.attention(
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_lens),
            sm_scale=scale, soft_cap=case["soft_cap"],
            mask=DecodeMask(case["window_left"], case["sinks"]), dtype=jnp.float64,
        )
    want_o, want_lse = loop_attention(q, k, v, kv_lens, scale, case["soft_cap"], case["window_left"], case["sinks"])
    np.testing.assert_allclose(np.asarray(o), want_o, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-12)


def test_S1_padded_rows_give_zero_output_and_minus_inf_lse():
    q = jnp.ones((2, 4, 8))
    k = jnp.full((2, 5, 2, 8), jnp.nan)  # never read: both rows have length 0
    o, lse = reference.decode(q, k, k, jnp.array([0, 0]))
    assert np.all(np.asarray(o) == 0) and np.all(np.asarray(lse) == -np.inf)


def test_M2_bottom_right_causality():
    """Row i of C new rows after T committed rows sees exactly [0, T + i + 1)."""
    T, C = 5, 3
    q_pos = T + np.arange(C)
    vis = np.asarray(visible(q_pos[:, None], np.arange(T + C)[None, :], T + C))
    for i in range(C):
        assert vis[i].tolist() == [j < T + i + 1 for j in range(T + C)]


@pytest.mark.parametrize("mask", [DecodeMask(), DecodeMask(window_left=0), DecodeMask(window_left=5),
                                  DecodeMask(window_left=5, sinks=3), DecodeMask(window_left=0, sinks=12), DecodeMask(sinks=4)],
                         ids=str)
def test_M1_visible_range_is_visible_as_intervals(mask):
    """Kernels test a tile of keys against (lo, hi, sink_end): the same keys as `visible` for every
    query position (inside the request and past it) and request length, keys past both ends too."""
    q_pos, kv_len, k_pos = np.meshgrid(np.arange(-1, 20), np.arange(0, 20), np.arange(-3, 24), indexing="ij")
    lo, hi, sink_end = (np.asarray(x) for x in visible_range(jnp.asarray(q_pos), jnp.asarray(kv_len), mask))
    as_intervals = ((lo <= k_pos) & (k_pos < hi)) | ((0 <= k_pos) & (k_pos < sink_end))
    np.testing.assert_array_equal(as_intervals, np.asarray(visible(q_pos, k_pos, kv_len, mask)))


@pytest.mark.parametrize("layout", [KVLayout.PAGED_NHD, KVLayout.PAGED_HND])
def test_A2_paged_reference_equals_contiguous_with_poisoned_tails(layout):
    r = np.random.default_rng(2)
    B, H_q, H_kv, D, P, W = 3, 4, 2, 8, 4, 4
    lens = np.array([13, 1, 0])
    num_pages = 20
    pool_k = np.full((num_pages, P, H_kv, D), np.nan, np.float32)
    pool_v = np.full((num_pages, P, H_kv, D), np.nan, np.float32)
    table = np.zeros((B, W), np.int32)
    perm = r.permutation(np.arange(1, num_pages))
    k = r.normal(size=(B, W * P, H_kv, D)).astype(np.float32)
    v = r.normal(size=(B, W * P, H_kv, D)).astype(np.float32)
    n = 0
    for b in range(B):
        for j in range(-(-lens[b] // P)):
            table[b, j] = perm[n]
            n += 1
            for row in range(P):
                t = j * P + row
                if t < lens[b]:
                    pool_k[table[b, j], row] = k[b, t]
                    pool_v[table[b, j], row] = v[b, t]
    if layout == KVLayout.PAGED_HND:
        pool_k, pool_v = pool_k.swapaxes(1, 2), pool_v.swapaxes(1, 2)
    q = jnp.asarray(r.normal(size=(B, H_q, D)).astype(np.float32))
    o_paged, lse_paged = reference.paged_decode(q, jnp.asarray(pool_k), jnp.asarray(pool_v), jnp.asarray(table), jnp.asarray(lens), layout=layout)
    o, lse = reference.decode(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lens))
    assert not np.any(np.isnan(np.asarray(o_paged)))
    np.testing.assert_allclose(np.asarray(o_paged), np.asarray(o), atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse_paged), np.asarray(lse), atol=1e-6)
    gathered = reference.gather_pages(jnp.asarray(pool_k), jnp.asarray(table), jnp.asarray(lens), layout=layout)
    assert np.all(np.asarray(gathered)[2] == 0) and np.all(np.asarray(gathered)[1, 1:] == 0)
