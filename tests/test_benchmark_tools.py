"""Benchmark tools: profile_summary (GPU stream events summed by name) and hopper_compile (kernel IR extraction)."""

from types import SimpleNamespace as NS

import pytest

from benchmarks.profile_summary import summarize_planes


def _line(name, *events):
    return NS(name=name, events=[NS(name=n, duration_ns=d) for n, d in events])


def test_gpu_stream_events_are_summed_per_step_by_name():
    planes = [
        NS(name="/host:CPU", lines=[_line("python", ("decode_step", 10_000_000))]),
        NS(name="/device:GPU:0", lines=[
            _line("Stream #13(Compute)", ("decodejax_paged_decode", 3000), ("gemm", 5000), ("decodejax_paged_decode", 1000)),
            _line("XLA Ops", ("fusion.1", 99_000)),  # an op-level view of the same time: not a stream line
        ]),
    ]
    s = summarize_planes(planes, steps=2, top=1)
    assert s["lines_read"] == ["/device:GPU:0 Stream #13(Compute)"]
    assert s["device_us_per_step"] == pytest.approx(4.5) and s["launches_per_step"] == 1.5
    assert s["top"] == [{"name": "gemm", "us_per_step": 2.5, "launches_per_step": 0.5, "share": pytest.approx(5 / 9)}]


def test_hopper_compile_reads_each_kernels_triton_ir_from_the_cuda_lowering():
    """benchmarks.hopper_compile's extraction (its compile step needs the optional triton package)."""
    from benchmarks.hopper_compile import lowered_cases, triton_kernels

    cases = dict(lowered_cases())
    decode = triton_kernels(cases["decode_attention B=8 T=4096 H_q=32 H_kv=8 D=128 P=16 bf16"])
    assert [(k["name"], k["num_warps"], k["num_stages"]) for k in decode] == [("decodejax_paged_decode", 4, 3), ("decodejax_merge_states", 4, 1)]
    assert "tt.func public @decodejax_paged_decode" in decode[0]["ttir"] and "tt.dot" in decode[0]["ttir"] and "loc(" not in decode[0]["ttir"]
    append = triton_kernels(next(v for k, v in cases.items() if k.startswith("append_attention")))
    assert [k["name"] for k in append] == ["decodejax_paged_append"]


def test_plan_probe_patches_the_planner_rules_and_restores_them():
    """mosaic_probes `plans`: under the patches, the ragged batch's auto plan gets a doubled split
    target and a 2,048-token split cap (so twice the slots), and the planner is itself again after."""
    from benchmarks.mosaic_probes import patched, plan_patches
    from decodejax import _ops, planning

    def ragged_plan():  # B 32, 8 K/V heads, 16,384-token tables, block_k 128 (the benchmark's ragged case)
        return _ops.decode_plan(32, 8, 16384, 128, num_splits=None, deterministic=False)

    rules = (planning.decode_target_splits, planning.MAX_SPLIT_TOKENS)
    before = ragged_plan()
    with patched(plan_patches(target_scale=2, max_split_tokens=2048)):
        during = ragged_plan()
    assert (before.capacity, before.target_splits, before.max_split_blocks) == (4, 33, 32)
    assert (during.capacity, during.target_splits, during.max_split_blocks) == (8, 66, 16)
    assert (planning.decode_target_splits, planning.MAX_SPLIT_TOKENS) == rules and ragged_plan() == before
