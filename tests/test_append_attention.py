"""Paged append attention (chunked prefill): packed new tokens after cached ones, bottom-right causal.

The oracle is a float64 loop written here: for each request, each new row's softmax over the
keys it sees, gathered through the page table. The Pallas kernel runs in interpret mode on CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decodejax
from decodejax import masks

POISON = np.nan  # every slot no request sees


def make_append_problem(rng, *, prefix, new, q_heads, kv_heads, head_dim, page_size, padding=3):
    """Requests with `prefix[c]` cached and `new[c]` new tokens; K/V of all of them in permuted pages."""
    kv_lens = np.asarray(prefix) + np.asarray(new)
    pages_per = -(-kv_lens // page_size)
    width = int(pages_per.max()) + 1
    num_pages = int(pages_per.sum()) + 2  # + null page + one unused
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(new), width), np.int32)
    k = np.full((num_pages, page_size, kv_heads, head_dim), POISON, np.float32)
    v = np.full_like(k, POISON)
    used = 0
    for c, n_pages in enumerate(pages_per):
        table[c, :n_pages] = perm[used : used + n_pages]
        used += n_pages
        t = np.arange(kv_lens[c])
        k[table[c, t // page_size], t % page_size] = rng.standard_normal((kv_lens[c], kv_heads, head_dim), np.float32)
        v[table[c, t // page_size], t % page_size] = rng.standard_normal((kv_lens[c], kv_heads, head_dim), np.float32)
    indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    q = rng.standard_normal((int(indptr[-1]) + padding, q_heads, head_dim), np.float32)
    return {"q": q, "k_pages": k, "v_pages": v, "page_table": table, "qo_indptr": indptr, "kv_lens": kv_lens.astype(np.int32)}


def oracle(p, *, sm_scale=None, soft_cap=None, window_left=None, sinks=0):
    q, k, v, table, indptr, kv_lens = (p[n] for n in ("q", "k_pages", "v_pages", "page_table", "qo_indptr", "kv_lens"))
    N, H_q, D = q.shape
    P, H_kv = k.shape[1], k.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    o, lse = np.zeros((N, H_q, D)), np.full((N, H_q), -np.inf)
    for c in range(len(kv_lens)):
        t = np.arange(kv_lens[c])
        keys = k[table[c, t // P], t % P].astype(np.float64)  # [T, H_kv, D]
        vals = v[table[c, t // P], t % P].astype(np.float64)
        new = indptr[c + 1] - indptr[c]
        for i in range(new):
            row, pos = indptr[c] + i, kv_lens[c] - new + i
            seen = np.asarray(masks.visible(pos, t, kv_lens[c], masks.DecodeMask(window_left, sinks)))
            for h in range(H_q):
                s = keys[:, h // (H_q // H_kv)] @ q[row, h].astype(np.float64) * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                s = np.where(seen, s, -np.inf)
                m = s.max()
                w = np.exp(s - m)
                o[row, h] = w @ vals[:, h // (H_q // H_kv)] / w.sum()
                lse[row, h] = m + np.log(w.sum())
    return o, lse


CASES = [
    # (prefix per request, new per request, H_q, H_kv, D, P, options)
    ((0, 5, 40), (7, 1, 19), 8, 2, 64, 16, {}),  # group 4: 16 tokens per tile
    ((3, 0), (70, 33), 4, 4, 64, 5, {}),  # MHA: 64 tokens per tile, so 70 new rows span two tiles
    ((17, 64), (9, 12), 6, 2, 128, 1, {"soft_cap": 20.0}),  # group 3 (padded to 4), page size 1
    ((30, 2), (25, 4), 16, 2, 64, 8, {"window_left": 6, "sinks": 2}),  # group 8: 8 tokens per tile
    ((50,), (20,), 8, 8, 64, 32, {"window_left": 9, "sm_scale": 0.3}),  # window without sinks skips blocks
]


ON_GPU = pytest.param("pallas_triton", marks=[pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])


@pytest.mark.parametrize("backend", ["xla", "pallas_triton_interpret", ON_GPU])
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"case{i}")
def test_append_matches_a_float64_loop(case, backend):
    prefix, new, H_q, H_kv, D, P, options = CASES[case]
    p = make_append_problem(np.random.default_rng(case), prefix=prefix, new=new, q_heads=H_q, kv_heads=H_kv, head_dim=D, page_size=P)
    o, lse = decodejax.append_attention(**{n: jnp.asarray(x) for n, x in p.items()}, return_lse=True, backend=backend, **options)
    ref_o, ref_lse = oracle(p, **options)
    live = np.arange(len(p["q"])) < p["qo_indptr"][-1]
    np.testing.assert_allclose(np.asarray(o)[live], ref_o[live], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[live], ref_lse[live], atol=1e-5, rtol=1e-5)
    assert not np.asarray(o)[~live].any() and np.all(np.asarray(lse)[~live] == -np.inf)  # padding rows
    assert not np.isnan(np.asarray(o)).any()  # the poisoned slots were never read


@pytest.mark.parametrize("backend", ["xla", "pallas_triton_interpret"])
def test_keys_outside_every_rows_window_are_never_read(backend):
    """M1: with a window, keys no new row sees (past the sinks, left of the first row's window) hold
    NaN; a load of any of them would put NaN in the output through P @ V."""
    window, sinks = 6, 2
    p = make_append_problem(np.random.default_rng(11), prefix=(70, 3), new=(5, 4), q_heads=4, kv_heads=2, head_dim=64, page_size=8)
    ref_o, ref_lse = oracle(p, window_left=window, sinks=sinks)
    poisoned = dict(p, k_pages=p["k_pages"].copy(), v_pages=p["v_pages"].copy())
    first_pos = p["kv_lens"][0] - 5
    t = np.arange(sinks, first_pos - window)  # request 0's keys no row of it sees
    rows = p["page_table"][0, t // 8], t % 8
    poisoned["k_pages"][rows] = np.nan
    poisoned["v_pages"][rows] = np.nan
    o, lse = decodejax.append_attention(**{n: jnp.asarray(x) for n, x in poisoned.items()}, window_left=window, sinks=sinks,
                                        return_lse=True, backend=backend)
    live = np.arange(len(p["q"])) < p["qo_indptr"][-1]
    assert len(t) > 40 and not np.isnan(np.asarray(o)).any()
    np.testing.assert_allclose(np.asarray(o)[live], ref_o[live], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[live], ref_lse[live], atol=1e-5, rtol=1e-5)


def test_append_bf16_kernel_within_tolerance_of_the_oracle():
    p = make_append_problem(np.random.default_rng(7), prefix=(12, 40), new=(30, 9), q_heads=8, kv_heads=2, head_dim=128, page_size=16)
    args = {n: jnp.asarray(x, jnp.bfloat16 if n in ("q", "k_pages", "v_pages") else None) for n, x in p.items()}
    o = decodejax.append_attention(**args, backend="pallas_triton_interpret")
    rounded = dict(p, **{n: np.asarray(args[n], np.float32) for n in ("q", "k_pages", "v_pages")})
    ref_o, _ = oracle(rounded)
    live = np.arange(len(p["q"])) < p["qo_indptr"][-1]
    assert o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o, np.float32)[live], ref_o[live], atol=2e-2, rtol=2e-2)


def test_a_request_alone_or_in_a_batch_gets_the_same_rows():
    """Tiles never straddle requests, so a request's rows do not depend on its neighbours."""
    p = make_append_problem(np.random.default_rng(3), prefix=(5, 20, 0), new=(13, 22, 4), q_heads=4, kv_heads=2, head_dim=64,
                            page_size=16, padding=0)
    batch = np.asarray(decodejax.append_attention(**{n: jnp.asarray(x) for n, x in p.items()}, backend="pallas_triton_interpret"))
    lo, hi = p["qo_indptr"][1], p["qo_indptr"][2]
    alone = dict(p, q=p["q"][lo:hi], page_table=p["page_table"][1:2], qo_indptr=np.array([0, hi - lo], np.int32), kv_lens=p["kv_lens"][1:2])
    single = np.asarray(decodejax.append_attention(**{n: jnp.asarray(x) for n, x in alone.items()}, backend="pallas_triton_interpret"))
    np.testing.assert_array_equal(batch[lo:hi], single)


@pytest.mark.parametrize("change, match", [
    (lambda p: dict(p, qo_indptr=p["qo_indptr"][::-1].copy()), "qo_indptr="),
    (lambda p: dict(p, kv_lens=p["kv_lens"] - 20), "kv_lens="),
    (lambda p: dict(p, qo_indptr=p["qo_indptr"][:-1]), "qo_indptr"),
    (lambda p: dict(p, page_table=p["page_table"] + 1000), "page"),
    (lambda p: dict(p, q=p["q"][:, :3]), "H_q=3"),
])
def test_bad_append_input_names_the_parameter(change, match):
    p = make_append_problem(np.random.default_rng(0), prefix=(4, 9), new=(6, 3), q_heads=4, kv_heads=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match=match):
        decodejax.append_attention(**{n: jnp.asarray(x) for n, x in change(p).items()}, backend="xla")


def test_append_is_selected_by_phase_and_lowered_with_its_kernel_name():
    from decodejax import dispatch

    p = make_append_problem(np.random.default_rng(1), prefix=(4,), new=(6,), q_heads=4, kv_heads=2, head_dim=64, page_size=16)
    args = [jnp.asarray(p[n]) for n in ("q", "k_pages", "v_pages", "page_table", "qo_indptr", "kv_lens")]
    with dispatch.recording() as selections:
        decodejax.append_attention(*args)
    on_cpu = jax.default_backend() == "cpu"
    assert selections[-1].key.phase == "append" and selections[-1].backend == ("xla" if on_cpu else "pallas_triton")
    with dispatch.targeting("gpu", "9.0"):
        key = dispatch.DispatchKey.from_call(args[0], args[1], layout=decodejax.KVLayout.PAGED_NHD, page_table=args[3],
                                             phase="append", q_len=10)
        assert dispatch.select(key).backend == "pallas_triton"
        lowered = jax.jit(lambda *a: decodejax.append_attention(*a, backend="pallas_triton")).trace(*args).lower(lowering_platforms=("cuda",))
    assert "decodejax_paged_append" in lowered.as_text()
