"""Invariant D1: frozen keys with canonical digests, complete rejection vectors, selection, plans."""

import dataclasses
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import decodejax
from decodejax import KVLayout, dispatch
from decodejax.dispatch import AdmissionError, DecodePlan, DispatchKey, MalformedCall, StalePlan, select

BASE = DispatchKey(
    device_type="gpu", compute_capability="9.0", operation="attention", phase="decode", q_dtype="float16",
    kv_dtype="float16", q_len=1, kv_len=4096, num_q_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_v=128,
    cache_layout=KVLayout.PAGED_NHD.value, page_size=16, bucket_mode=True,
)


def changed(**fields):
    return dataclasses.replace(BASE, **fields)


def test_D1_canonical_json_and_digest_change_with_every_field():
    assert BASE.canonical_json() == changed().canonical_json()
    assert '"head_dim_qk":128' in BASE.canonical_json() and ", " not in BASE.canonical_json()
    alternatives = {
        "device_type": "cpu", "compute_capability": "8.0", "operation": "gather_pages", "phase": "prefill",
        "q_dtype": "bfloat16", "kv_dtype": "bfloat16", "q_len": 2, "kv_len": 4097, "num_q_heads": 16, "num_kv_heads": 4,
        "head_dim_qk": 64, "head_dim_v": 64, "cache_layout": KVLayout.PAGED_HND.value, "page_size": 32,
        "last_dim_contiguous": False, "mask_kind": "dense_custom", "soft_cap": 30.0, "window_left": 128, "sinks": 4,
        "requires_deterministic": True, "bucket_mode": False, "backend_request": "xla",
    }
    assert set(alternatives) == {f.name for f in dataclasses.fields(DispatchKey)}
    digests = {BASE.digest()} | {changed(**{k: v}).digest() for k, v in alternatives.items()}
    assert len(digests) == len(alternatives) + 1


@pytest.mark.parametrize(
    "fields,match",
    [({"num_q_heads": 30}, "H_q=30 is not a multiple of H_kv=8"), ({"q_len": 0}, "q_len=0"),
     ({"head_dim_v": 0}, "d_v=0"), ({"page_size": None}, "paged but page_size=None"),
     ({"cache_layout": KVLayout.CONTIGUOUS_NHD.value}, "contiguous but page_size=16")],
)
def test_D1_malformed_calls_fail_before_admission(fields, match):
    with pytest.raises(MalformedCall, match=match):
        changed(**fields)


# The seed's seven-case matrix rebuilt with decodejax's backends (0x07D).
def test_D1_matrix_base_paged_decode_selects_the_pallas_kernel():
    s = select(BASE)
    assert s.backend == "pallas_triton" and not s.rejected_above and not s.fallback


def test_D1_matrix_dense_custom_mask_falls_back_to_the_reference():
    s = select(changed(mask_kind="dense_custom", bucket_mode=False))
    assert s.backend == "xla" and s.fallback
    rejected = dict(s.rejected_above)
    assert any("mask_kind=dense_custom" in r for r in rejected["pallas_triton"])


def test_D1_matrix_head_dim_80_lists_both_dimensions():
    s = select(changed(head_dim_qk=80, head_dim_v=80, bucket_mode=False))
    assert s.backend == "xla" and s.fallback
    reasons = dict(s.rejected_above)["pallas_triton"]
    assert "head_dim_qk=80 unsupported (64, 128, 256)" in reasons and "head_dim_vo=80 unsupported (64, 128, 256)" in reasons


def test_D1_matrix_forced_fast_path_with_dense_mask_is_an_error():
    with pytest.raises(AdmissionError, match="mask_kind=dense_custom") as err:
        select(changed(mask_kind="dense_custom", bucket_mode=False, backend_request="pallas_triton"))
    assert list(err.value.reasons) == ["pallas_triton"]


def test_D1_matrix_prefill_with_contiguous_kv_changes_the_domain():
    s = select(changed(phase="prefill", q_len=128, cache_layout=KVLayout.CONTIGUOUS_NHD.value, page_size=None, bucket_mode=False))
    names = [n for n, _ in s.candidates]
    assert "pallas_triton" not in names and s.backend == "cudnn" and not s.fallback


def test_D1_matrix_cpu_decode_leaves_gpu_backends_out():
    s = select(changed(device_type="cpu", compute_capability=None, cache_layout=KVLayout.CONTIGUOUS_NHD.value, page_size=None, bucket_mode=False))
    names = [n for n, _ in s.candidates]
    assert names == ["xla", "pallas_triton_interpret", "pallas_mosaic_gpu_interpret"] and s.backend == "xla"


def test_D1_matrix_dense_mask_under_bucket_mode_has_reasons_everywhere():
    with pytest.raises(AdmissionError) as err:
        select(changed(mask_kind="dense_custom"))
    assert set(err.value.reasons) == {"pallas_triton", "pallas_mosaic_gpu", "cudnn", "xla", "pallas_triton_interpret",
                                      "pallas_mosaic_gpu_interpret"}
    assert all(err.value.reasons.values())


def test_D1_every_failed_predicate_is_listed_not_just_the_first():
    reasons = dict(select(changed(head_dim_qk=80, head_dim_v=96, q_dtype="float32", mask_kind="dense_custom", bucket_mode=False)).rejected_above)["pallas_triton"]
    assert len(reasons) >= 5  # two dims, d_qk != d_v, dtype mismatch, mask


def test_D1_missing_package_is_a_reason(monkeypatch):
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: None)
    s = select(BASE)
    assert s.backend == "cudnn" or s.backend == "xla"
    assert "package jax.experimental.pallas.triton is not installed" in dict(s.rejected_above)["pallas_triton"]


def test_D1_unknown_forced_backend_is_malformed():
    with pytest.raises(MalformedCall, match="backend='fast' is not one of"):
        select(changed(backend_request="fast"))


def test_preferring_tries_the_named_backends_first_where_they_admit_a_call():
    """Inside `preferring`, automatic selection takes the Mosaic GPU kernel for paged decode, falls
    back by priority where it refuses a call (page size 8 is fine, 24 is not: neither divides the
    other with its 64-token blocks) or where the operation is outside its domain (append), and
    forgets the preference after the block. An unknown name is refused before any selection."""
    with dispatch.preferring("pallas_mosaic_gpu"):
        assert select(BASE).backend == "pallas_mosaic_gpu" and not select(BASE).fallback
        refused = select(changed(page_size=24))
        assert refused.backend == "pallas_triton" and refused.fallback
        assert refused.rejected_above[0][0] == "pallas_mosaic_gpu"
        assert select(changed(phase="append", q_len=4)).backend == "pallas_triton"
    assert select(BASE).backend == "pallas_triton"
    with pytest.raises(MalformedCall, match="'mosaic'"):
        with dispatch.preferring("mosaic"):
            pass


def test_explain_prints_candidates_reasons_and_winner(capsys):
    fields = dataclasses.asdict(changed(head_dim_qk=80, head_dim_v=80, bucket_mode=False))
    outcome = decodejax.explain(**fields)
    text = capsys.readouterr().out
    assert outcome.backend == "xla"
    assert "pallas_triton" in text and "head_dim_qk=80 unsupported" in text and "selected xla (fallback)" in text


def test_explain_cli():
    out = subprocess.run([sys.executable, "-m", "decodejax", "explain", "--device", "gpu", "--shape", "4,4096,32,8,80,16"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "head_dim_qk=80 unsupported" in out.stdout and "selected xla" in out.stdout


def test_selection_is_recorded_once_per_trace_not_per_call():
    q, k = jnp.zeros((2, 4, 64), jnp.float32), jnp.zeros((5, 16, 2, 64), jnp.float32)
    table, lens = jnp.array([[1], [2]], jnp.int32), jnp.array([3, 4], jnp.int32)
    import jax

    f = jax.jit(lambda *a: decodejax.decode_attention(*a))
    with dispatch.recording() as seen:
        for _ in range(5):
            f(q, k, k, table, lens)
    assert len(seen) == 1 and seen[0].backend == "xla"


def _plan_args(batch=2, width=4, dtype=jnp.bfloat16):
    q = jnp.zeros((batch, 8, 64), dtype)
    k = jnp.zeros((9, 16, 2, 64), dtype)
    return q, k, jnp.zeros((batch, width), jnp.int32)


def test_P2_plan_static_fields_are_pinned_and_dynamic_ones_reuse_it():
    assert DecodePlan.STATIC_FIELDS == ("platform", "layout", "page_size", "batch", "num_q_heads", "num_kv_heads",
                                        "head_dim", "q_dtype", "kv_dtype", "table_width", "bucket_mode")
    q, k, table = _plan_args()
    plan = DecodePlan.create(q, k, table)
    assert plan.backend == "xla" and len(plan.digest()) == 64
    rng = np.random.default_rng(0)
    for lens in ([3, 40], [0, 64]):  # new lengths and tables: same plan
        t = jnp.asarray(rng.permutation(np.arange(1, 9))[:8].reshape(2, 4), jnp.int32)
        out = plan.run(jnp.asarray(rng.normal(size=q.shape), q.dtype), k, k, t, jnp.asarray(lens, jnp.int32))
        assert out.shape == q.shape
    with pytest.raises(StalePlan, match="batch: plan 2, run 3.*table_width: plan 4, run 5"):
        plan.run(*_plan_args(batch=3, width=5)[:2], k, _plan_args(batch=3, width=5)[2], jnp.zeros(3, jnp.int32))
    with pytest.raises(StalePlan, match="q_dtype: plan 'bfloat16', run 'float16'"):
        q16, k16, t16 = _plan_args(dtype=jnp.float16)
        plan.run(q16, k16, k16, t16, jnp.zeros(2, jnp.int32))


def test_a_plan_takes_the_split_capacity_of_its_kernels_own_auto_plan():
    """The Mosaic kernel aims at one work item per SM and the Triton kernel at two, so one request
    of 32,768 tokens over 8 K/V heads gets 16 and 32 slots; a plan carries its backend's."""
    from decodejax import _ops
    from pallas_kernels import decode_attention, decode_attention_mgpu

    q, k, table = jnp.zeros((1, 32, 128), jnp.bfloat16), jnp.zeros((4, 16, 8, 128), jnp.bfloat16), jnp.zeros((1, 2048), jnp.int32)
    for backend, kernel, slots in (("pallas_mosaic_gpu_interpret", decode_attention_mgpu, 16),
                                   ("pallas_triton_interpret", decode_attention, 32)):
        own = _ops.decode_plan(1, 8, 2048 * 16, kernel.default_config(128), num_splits=None, deterministic=False, head_dim=128)
        plan = DecodePlan.create(q, k, table, backend=backend)
        assert plan.backend == backend and plan.split_capacity == own.capacity == slots, (backend, plan.split_capacity)
    # At D 64 the Mosaic kernel's items are pairs of K/V heads of D 128 (`item_geometry`): one request
    # of 2,048 tokens is 16 units of 128 for 4 pairs (8 of 256 for 8 heads one at a time).
    q64, k64 = jnp.zeros((1, 32, 64), jnp.bfloat16), jnp.zeros((4, 16, 8, 64), jnp.bfloat16)
    assert DecodePlan.create(q64, k64, table[:, :128], backend="pallas_mosaic_gpu_interpret").split_capacity == 16


def test_backends_are_small_objects_that_run_operations():
    q, k = jnp.ones((1, 2, 64), jnp.float32), jnp.ones((3, 4, 2, 64), jnp.float32)
    table, lens = jnp.array([[1, 2]], jnp.int32), jnp.array([6], jnp.int32)
    out = dispatch.backend("xla").run("gather_pages", k, table, lens, layout=KVLayout.PAGED_NHD, cache_batch_idx=None, max_len=8)
    assert out.shape == (1, 8, 2, 64) and float(out[0, 6:].sum()) == 0.0
    with pytest.raises(NotImplementedError, match="'cudnn' has no 'attention' implementation"):
        dispatch.backend("cudnn").run("attention", q, k)
    with pytest.raises(KeyError, match="no backend 'fast'"):
        dispatch.backend("fast")
