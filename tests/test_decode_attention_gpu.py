"""The decode kernel on the GPU (`pytest -m gpu`): the shared test body plus a >= 10,000-row sweep per dtype."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decodejax
from decodejax import KVLayout
from paged_problems import Spec, draw_on_device
from test_decode_attention import DTYPES, LSE_ATOL, TOLERANCES, MosaicDecodeAttentionCases, TritonDecodeAttentionCases, oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU"),
]


class TestDecodeAttentionGPU(TritonDecodeAttentionCases):
    backend = "pallas_triton"


class TestMosaicDecodeAttentionGPU(MosaicDecodeAttentionCases):
    backend = "pallas_mosaic_gpu"


# A handful of compiled shapes; every call draws new lengths, tables and data (a case is a row).
SWEEP = [
    (Spec(256, 32, 8, 128, 16, 64, remap=True), {}),
    (Spec(256, 32, 32, 64, 1, 700), {"window_left": 300, "sinks": 4}),
    (Spec(256, 16, 2, 256, 128, 8), {"soft_cap": 30.0}),
    (Spec(256, 24, 4, 128, 5, 200, remap=True), {"num_splits": 7}),
    (Spec(256, 8, 8, 128, 32, 40), {"deterministic": True}),
    (Spec(256, 64, 8, 64, 64, 20), {"sm_scale": 0.05, "num_splits": 64}),
    (Spec(8, 32, 8, 128, 16, 256), {}),  # the auto plan's 4 slots in one round: each request split by its own length
    (Spec(8, 32, 8, 128, 16, 2048), {}),  # 8 slots, 512 items: split counts from the batch's lengths, ranked
    (Spec(1, 32, 8, 128, 16, 2048), {}),  # one request, up to 32,768 tokens: the auto plan's slots, unranked
]
# The same options on the Mosaic kernel's shapes (pages a multiple of 8).
MOSAIC_SWEEP = [
    (Spec(256, 32, 8, 128, 16, 64, remap=True), {}),
    (Spec(256, 32, 32, 64, 8, 100), {"window_left": 300, "sinks": 4}),
    (Spec(256, 16, 2, 256, 128, 8), {"soft_cap": 30.0}),
    (Spec(256, 24, 4, 128, 32, 40, remap=True), {"num_splits": 7}),
    (Spec(256, 8, 8, 128, 32, 40), {"deterministic": True}),
    (Spec(256, 64, 8, 64, 64, 20), {"sm_scale": 0.05, "num_splits": 64}),
    (Spec(8, 32, 8, 128, 16, 256), {}),  # 2 slots in one round: the kernel finds the bounds itself
    (Spec(8, 32, 8, 128, 16, 2048), {}),  # 8 slots, 512 items: adaptive bounds and their order from XLA
    (Spec(1, 32, 8, 128, 16, 2048), {}),  # one request: the kernel finds its slots' bounds itself
    (Spec(256, 16, 4, 64, 16, 60, remap=True), {"soft_cap": 20.0, "window_left": 500}),  # G 4 at D 64: two K/V heads an item
]
DRAWS = 7  # (6 shapes x 256 rows + 2 x 8 rows + 1 row) x 7 draws = 10,871 rows per dtype; the Mosaic sweep's
# paired G 4 shape adds 1,792 (MHA at D 64 pairs too, at G 1)


@pytest.mark.parametrize("backend,sweep", [("pallas_triton", SWEEP), ("pallas_mosaic_gpu", MOSAIC_SWEEP)], ids=["triton", "mosaic"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_ten_thousand_rows_per_dtype(dtype_name, backend, sweep):
    atol, rtol = TOLERANCES[dtype_name]
    rows = out_of_tol = lse_out = nans = 0
    worst = 0.0
    for i, (spec, options) in enumerate(sweep):
        step = jax.jit(lambda a: decodejax.decode_attention(**a, return_lse=True, backend=backend, **options))
        ref = jax.jit(lambda a: oracle(a, KVLayout.PAGED_NHD, **{k: v for k, v in options.items() if k in ("sm_scale", "soft_cap", "window_left", "sinks")}))
        for draw in range(DRAWS):
            # Pools of up to 1.7 GB a draw: drawn on the device, or numpy would take most of the run.
            args = draw_on_device(spec, np.random.default_rng(1000 * i + draw), DTYPES[dtype_name], num_pages=spec.batch * spec.width + 4)
            live = args.pop("host_seq_lens") > 0
            o, lse = (np.asarray(x, np.float32) for x in step(args))
            ref_o, ref_lse = (np.asarray(x) for x in ref(args))
            err = np.abs(o - ref_o) - (atol + rtol * np.abs(ref_o))
            out_of_tol += int((err > 0).any(axis=(1, 2)).sum())
            lse_err = np.abs(np.where(live[:, None], lse, 0) - np.where(live[:, None], ref_lse, 0))
            lse_out += int((lse_err > LSE_ATOL).any(axis=1).sum())
            nans += int(np.isnan(o).any(axis=(1, 2)).sum())
            out_of_tol += int((o[~live] != 0).any(axis=(1, 2)).sum() + (lse[~live] != -np.inf).any(axis=1).sum())
            worst = max(worst, float(np.abs(o - ref_o).max()))
            rows += spec.batch
    summary = {"backend": backend, "dtype": dtype_name, "rows": rows, "out_of_tolerance": out_of_tol, "lse_out_of_tolerance": lse_out, "rows_with_nan": nans, "max_abs_err": worst}
    print(json.dumps(summary))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gpu_sweep_{backend}_{dtype_name}.json"), "w") as f:
            json.dump(summary, f)
    assert rows >= 10_000 and out_of_tol == 0 and lse_out == 0 and nans == 0, summary
