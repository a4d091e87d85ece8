"""Benchmark tools: profile_summary (GPU stream events summed by name), hopper_compile (kernel IR extraction), ncu_decode (Nsight Compute exports) and mosaic_timeline (the Mosaic kernel's profiler traces)."""

import json
from types import SimpleNamespace as NS

import numpy as np
import pytest

from benchmarks.profile_summary import program_spans, stream_timeline, summarize_planes


def _line(name, *events):
    return NS(name=name, events=[NS(name=n, duration_ns=d) for n, d in events])


def _timed_line(name, *events):
    return NS(name=name, events=[NS(name=n, start_ns=t, duration_ns=d) for n, t, d in events])


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


def test_stream_timeline_splits_the_span_into_busy_and_idle_and_sums_host_work_by_thread():
    planes = [
        NS(name="/host:CPU", lines=[
            _timed_line("python3", ("$bench.py:10 loop", 0, 90_000), ("PjitFunction(decode)", 0, 6_000), ("PjitFunction(decode)", 50_000, 4_000)),
            _timed_line("worker", ("ExecuteHelper", 1_000, 2_000)),
        ]),
        NS(name="/device:GPU:0", lines=[
            # two streams: the copy on stream 14 overlaps the first kernel (a negative gap)
            _timed_line("Stream #13(Compute)", ("decodejax_paged_decode", 10_000, 20_000), ("decodejax_paged_decode", 40_000, 20_000)),
            _timed_line("Stream #14(MemcpyD2D)", ("memcpy", 25_000, 10_000)),
            _timed_line("XLA Ops", ("fusion.1", 0, 99_000)),
        ]),
    ]
    t = stream_timeline(planes, steps=2)
    assert t["gpu_events"] == 3
    assert t["span_us_per_step"] == pytest.approx(25.0)  # 10..60 us over 2 steps
    assert t["busy_us_per_step"] == pytest.approx(25.0)  # (20 + 20 + 10) us over 2 steps
    assert t["idle_us_per_step"] == pytest.approx(0.0)  # span 50 us: 10..60, all of it counted busy
    assert t["gaps_us"] == {"median": pytest.approx(5.0), "p90": pytest.approx(5.0), "max": pytest.approx(5.0)}  # -5 and 5
    assert t["host_us_per_step"] == {"python3": {"PjitFunction(decode)": pytest.approx(5.0)},
                                     "worker": {"ExecuteHelper": pytest.approx(1.0)}}


def test_program_spans_cut_the_trace_into_runs_of_one_program_and_leave_the_gaps_between_them_out():
    # two runs of a program of 2 calls (a kernel and a merge each): run 1 from 0 to 50 us, run 2
    # from 80 to 120 us; the 30 us between them (the host's dispatch) counts in neither
    stream = _timed_line("Stream #13(Compute)", ("k", 0, 20_000), ("m", 20_000, 5_000), ("k", 25_000, 20_000), ("m", 45_000, 5_000),
                         ("k", 80_000, 15_000), ("m", 95_000, 5_000), ("k", 100_000, 15_000), ("m", 115_000, 5_000))
    planes = [NS(name="/device:GPU:0", lines=[stream, _timed_line("XLA Ops", ("fusion.1", 0, 200_000))]),
              NS(name="/host:CPU", lines=[_timed_line("python3", ("PjitFunction(program)", 60_000, 10_000))])]
    assert program_spans(planes, runs=2, calls=2) == [pytest.approx(25.0), pytest.approx(20.0)]
    with pytest.raises(ValueError, match="runs=3"):  # 8 events are not 3 runs of one program
        program_spans(planes, runs=3, calls=2)


def test_hopper_compile_reads_each_kernels_triton_ir_from_the_cuda_lowering():
    """benchmarks.hopper_compile's extraction (its compile step needs the optional triton package)."""
    from benchmarks.hopper_compile import lowered_cases, triton_kernels

    cases = dict(lowered_cases())
    decode = triton_kernels(cases["decode_attention B=8 T=4096 H_q=32 H_kv=8 D=128 P=16 bf16"])
    assert [(k["name"], k["num_warps"], k["num_stages"]) for k in decode] == [("decodejax_paged_decode", 4, 3), ("decodejax_merge_states", 4, 1)]
    ttir = decode[0]["ttir"]
    assert "tt.func public @decodejax_paged_decode" in ttir and "tt.dot" in ttir and "loc(" not in ttir and "tt.atomic_rmw" not in ttir
    fused = triton_kernels(cases["decode_attention B=8 T=4096 H_q=32 H_kv=8 D=128 P=16 bf16 fused_merge"])
    assert [k["name"] for k in fused] == ["decodejax_paged_decode"]
    assert "tt.atomic_rmw" in fused[0]["ttir"] and "gpu.barrier" in fused[0]["ttir"]  # the merge counter, after a block barrier
    launch_order = triton_kernels(cases["decode_attention B=8 T=4096 H_q=32 H_kv=8 D=128 P=16 bf16 launch_order"])
    assert [k["name"] for k in launch_order] == ["decodejax_paged_decode", "decodejax_merge_states"]
    assert "scf.if" in decode[0]["ttir"] and "scf.if" not in launch_order[0]["ttir"]  # the default's ranking, behind its equal-lengths skip
    merge = triton_kernels(next(v for k, v in cases.items() if k.startswith("merge_states")))
    assert [(k["name"], k["num_warps"], k["num_stages"]) for k in merge] == [("decodejax_merge_states", 4, 1)]
    append = triton_kernels(next(v for k, v in cases.items() if k.startswith("append_attention")))
    assert [k["name"] for k in append] == ["decodejax_paged_append"]


def test_plan_probe_patches_the_planner_rules_and_restores_them():
    """mosaic_probes `plans`: under the patches, the ragged batch's auto plan gets a doubled split
    target and a 2,048-token split cap (so twice the slots), and the planner is itself again after."""
    from benchmarks.mosaic_probes import patched, plan_patches
    from decodejax import _ops, planning
    from pallas_kernels.decode_attention import DecodeConfig

    def ragged_plan():  # B 32, 8 K/V heads, 16,384-token tables, block_k 128 (the benchmark's ragged case)
        return _ops.decode_plan(32, 8, 16384, DecodeConfig(block_k=128), num_splits=None, deterministic=False)

    rules = (planning.decode_target_splits, planning.MAX_SPLIT_TOKENS)
    before = ragged_plan()
    with patched(plan_patches(target_scale=2, max_split_tokens=2048)):
        during = ragged_plan()
    assert (before.capacity, before.target_splits, before.max_split_blocks) == (4, 33, 32)
    assert (during.capacity, during.target_splits, during.max_split_blocks) == (8, 66, 16)
    assert (planning.decode_target_splits, planning.MAX_SPLIT_TOKENS) == rules and ragged_plan() == before


def test_compiler_probe_patches_reach_the_mosaic_kernel(monkeypatch):
    """mosaic_probes `compiler`: the patched CompilerParams is the one the Mosaic kernel lowers
    with (approximate math on, the kernel's own reduction_scratch_bytes=0 kept), on CUDA here."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    import decodejax
    from benchmarks.mosaic_probes import _compiler_params, patched

    params, kernel = [], plgpu.kernel
    monkeypatch.setattr(plgpu, "kernel", lambda *a, **kw: params.append(kw["compiler_params"]) or kernel(*a, **kw))
    q = jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((16, 16, 2, 64), jnp.bfloat16)
    table, lens = jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    with patched(_compiler_params(approx_math=True)), decodejax.dispatch.targeting("gpu", "9.0"):
        step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, backend="pallas_mosaic_gpu"))
        step.trace(q, k, k, table, lens).lower(lowering_platforms=("cuda",))
    assert [(p.approx_math, p.reduction_scratch_bytes) for p in params] == [(True, 0)]
    assert plgpu.CompilerParams().approx_math is False  # restored


def test_mosaic_timeline_config_turns_the_kernels_profiler_on_with_room_for_its_scopes(monkeypatch, tmp_path):
    """MosaicDecodeConfig.profile_dir (benchmarks/mosaic_timeline.py): the kernel's CompilerParams
    carry the directory and room for every scope a program enters (two, and four per work item);
    without it, no profiler."""
    import dataclasses

    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.decode_attention_mgpu import default_config

    params, kernel = [], plgpu.kernel
    monkeypatch.setattr(plgpu, "kernel", lambda *a, **kw: params.append(kw["compiler_params"]) or kernel(*a, **kw))
    profiled = dataclasses.replace(default_config(128), profile_dir=str(tmp_path))
    for config in (profiled, dataclasses.replace(profiled, programs=4), None):
        _traced_mosaic_call(config=config, num_splits=2)  # traced only: the profiler's dump does not lower on a CPU host
    # 16 items (B 4 x H_kv 2 x 2 slots): one a program, then four for each of 4 programs; then unprofiled
    assert [(p.profile_space, p.profile_dir) for p in params] == [(12, str(tmp_path)), (24, str(tmp_path)), (0, "")]


def test_mosaic_timeline_chain_gives_each_call_a_kernel_and_a_trace_of_its_own(monkeypatch, tmp_path):
    """mosaic_timeline --chain: the chained program's calls take their configs in call order, so each
    lowers a kernel with its own profile directory (its own trace), and every call is a Mosaic kernel."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    import decodejax
    from benchmarks.mosaic_timeline import chained_profiled_program
    from pallas_kernels.decode_attention_mgpu import default_config

    params, kernel = [], plgpu.kernel
    monkeypatch.setattr(plgpu, "kernel", lambda *a, **kw: params.append(kw["compiler_params"]) or kernel(*a, **kw))
    dirs = [str(tmp_path / f"call{i}") for i in range(3)]
    program = chained_profiled_program([dataclasses.replace(default_config(128), profile_dir=d) for d in dirs])
    q = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((64, 16, 2, 128), jnp.bfloat16)
    table, lens = jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
    jax.clear_caches()
    with decodejax.dispatch.targeting("gpu", "9.0"):
        program.trace([q] * 3, k, k, table, lens)  # traced only: the profiler's dump does not lower on a CPU host
    assert [p.profile_dir for p in params] == dirs


def _traced_mosaic_call(**options):
    """The public op's Mosaic path (B 4, H_q 8, H_kv 2, D 128, a 16-page table), traced afresh under
    whatever patches the caller holds, for a Hopper GPU: the traced call."""
    import jax
    import jax.numpy as jnp

    import decodejax

    q = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((64, 16, 2, 128), jnp.bfloat16)
    table, lens = jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
    jax.clear_caches()  # traced again with the caller's patches
    with decodejax.dispatch.targeting("gpu", "9.0"):
        step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, backend="pallas_mosaic_gpu", **options))
        return step.trace(q, k, k, table, lens)


def _lowered_mosaic_call(**options) -> str:
    """`_traced_mosaic_call` lowered for CUDA on this host: the lowered text."""
    return _traced_mosaic_call(**options).lower(lowering_platforms=("cuda",)).as_text()


def test_bottleneck_probe_patches_lower_for_cuda():
    """mosaic_probes `bottleneck`: the kernel with its MMAs, its softmax or both replaced still lowers
    for CUDA (the replacements keep the helpers' signatures and layouts)."""
    import jax

    from benchmarks.mosaic_probes import _without, patched

    for parts in (("mma",), ("softmax",), ("mma", "softmax")):
        with patched(_without(*parts)):
            assert "decodejax_paged_decode_mgpu" in _lowered_mosaic_call(num_splits=2)
    jax.clear_caches()


def test_ab_mosaic_body_traces_the_other_versions_body():
    """benchmarks.ab_mosaic_body: a kernel file loaded as its own module (its dataclasses included)
    lends its `_decode_body` to this tree's wrapper, and that body is the one traced and lowered."""
    import jax

    from benchmarks.ab_mosaic_body import load_module
    from benchmarks.mosaic_probes import patched
    from pallas_kernels import decode_attention_mgpu as current

    base = load_module(current.__file__)
    assert base is not current and base.MosaicDecodeConfig is not current.MosaicDecodeConfig
    traced = []

    def base_body(*args, **kwargs):
        traced.append(kwargs["programs"])
        return base._decode_body(*args, **kwargs)

    with patched({(current, "_decode_body"): base_body}):
        assert "decodejax_paged_decode_mgpu" in _lowered_mosaic_call(num_splits=1)
    jax.clear_caches()
    assert traced == [8]  # B 4 x H_kv 2 items in one slot: 8 programs


def test_ab_mosaic_body_whole_module_puts_the_other_versions_wrapper_in_place():
    """benchmarks.ab_mosaic_body --whole-module: the public op's Mosaic path (admission, config and
    wrapper) runs the loaded module's `paged_decode_partials`, not this tree's."""
    import jax

    from benchmarks.ab_mosaic_body import base_patches, load_module
    from benchmarks.mosaic_probes import patched
    from pallas_kernels import decode_attention_mgpu as current

    base = load_module(current.__file__)
    called = []
    wrapper = base.paged_decode_partials
    base.paged_decode_partials = lambda *args, **kwargs: called.append(type(kwargs["config"])) or wrapper(*args, **kwargs)
    with patched(base_patches(base, whole_module=True)):
        assert "decodejax_paged_decode_mgpu" in _lowered_mosaic_call()
    jax.clear_caches()
    assert called == [base.MosaicDecodeConfig]


def test_deal_probe_deals_in_index_order_and_leaves_every_output_as_it_was():
    """mosaic_probes `deal`: the patched order is what the Mosaic kernel is traced with (interpret
    mode here), it differs from longest first on this batch, and an item's state does not depend
    on which program takes it, so the outputs are bit for bit the longest-first run's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import decodejax
    from benchmarks.mosaic_probes import _deal_variants, patched
    from pallas_kernels import decode_attention_mgpu as kernel
    from tests.paged_problems import Spec, make_problem

    spec = Spec(batch=3, q_heads=4, kv_heads=2, head_dim=64, page_size=16, width=12)
    problem = make_problem(spec, np.random.default_rng(3), lengths=(180, 7, 64))
    args = {name: jnp.asarray(x, jnp.bfloat16 if x.dtype == np.float32 else x.dtype) for name, x in problem.items()}
    variants = _deal_variants(None, None)
    deal = variants["mgpu/index_order"][3][(kernel, "split_order")]
    config, item_heads, item_dim = decodejax._ops.kernel_items(kernel, None, 64, 2, 2, decodejax.KVLayout.PAGED_NHD)  # a pair
    plan = decodejax._ops.decode_plan(3, item_heads, spec.width * spec.page_size, config, num_splits=2, deterministic=False,
                                      head_dim=item_dim)
    start, end = (jnp.asarray(x) for x in plan.bounds(problem["seq_lens"]))
    np.testing.assert_array_equal(np.asarray(deal(start, end, 64)), np.arange(6))
    assert not np.array_equal(np.asarray(kernel.split_order(start, end, 64)), np.arange(6))  # blocks [2, 1, 1, 0, 1, 0]
    used, outputs = [], {}
    for name, (options, *_, patches) in variants.items():
        order = patches.get((kernel, "split_order"), kernel.split_order)
        with patched({(kernel, "split_order"): lambda *a, order=order: used.append(order) or order(*a)}):
            jax.clear_caches()  # traced again with the patch
            outputs[name] = decodejax.decode_attention(**args, num_splits=2, return_lse=True,
                                                       backend=options["backend"] + "_interpret")
    assert used == [kernel.split_order, deal]
    for a, b in zip(outputs["mgpu/longest_first"], outputs["mgpu/index_order"]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_decode_benchmark_compares_gpu_time_with_flashinfers_events_and_host_clock_with_host_clock():
    """Our traced GPU span meets FlashInfer's CUDA events, our in-program span its CUDA graph's, and our
    host-clock samples its host-clock ones."""
    from benchmarks.decode_attention import comparisons, gpu_time_table, in_program_table

    stats = lambda median: {"median_us": median, "min_us": median - 1, "tbps_median": 1.0}
    variants = {
        "decodejax/nhd/auto": stats(135.0) | {"gpu_span": stats(129.0)},
        "jax_builtin_pallas/k_splits=1": stats(250.0) | {"gpu_span": stats(240.0)},
        "jax_builtin_pallas/k_splits=2": stats(245.0) | {"gpu_span": stats(246.0)},  # faster by host clock only
        "flashinfer/tensor_cores=True": stats(127.0),  # CUDA events
        "flashinfer_wall/tensor_cores=True": stats(128.0),
    }
    variants["decodejax/nhd/auto"]["in_program"] = stats(125.0)
    variants["jax_builtin_pallas/k_splits=2"]["in_program"] = stats(238.0)  # the best back to back, then in one program
    variants["flashinfer/tensor_cores=True"]["in_program"] = stats(126.0)  # its CUDA graph
    # B 1: host-bound under the trace (span above the untraced host-clock time): no GPU time
    starved = {"decodejax/nhd/auto": stats(60.0) | {"gpu_span": stats(72.0), "in_program": stats(39.0)},
               "flashinfer/tensor_cores=True": stats(42.0) | {"in_program": stats(41.0)}}
    results = {"machine": {"device": "H200"}, "method": {"reps_per_sample": 50},
               "cases": {"B32_T4096": {"case": {"tags": ["target"]}, "variants": variants},
                         "B1_T32768": {"case": {"tags": ["target"]}, "variants": starved}}}
    c = comparisons(results)
    assert c["host_clock"]["flashinfer"]["ratios"] == {"B32_T4096": pytest.approx(127 / 135), "B1_T32768": pytest.approx(42 / 60)}
    assert c["host_clock"]["jax_builtin_pallas"]["ratios"] == {"B32_T4096": pytest.approx(245 / 135)}
    assert c["gpu_time"]["flashinfer"]["ratios"] == {"B32_T4096": pytest.approx(127 / 129)}
    assert c["gpu_time"]["jax_builtin_pallas"]["ratios"] == {"B32_T4096": pytest.approx(240 / 129)}
    assert "flashinfer_wall" not in c["gpu_time"]
    assert c["in_program"]["flashinfer"]["ratios"] == {"B32_T4096": pytest.approx(126 / 125), "B1_T32768": pytest.approx(41 / 39)}
    assert c["in_program"]["jax_builtin_pallas"]["ratios"] == {"B32_T4096": pytest.approx(238 / 125)}
    rows = gpu_time_table(results)
    assert rows[-2].startswith("| B32_T4096 | 129.0 / 128.0 |") and rows[-2].endswith("| 1.86x | 0.98x |")
    assert rows[-1].startswith("| B1_T32768 | (72.0) |") and rows[-1].endswith("| 42.0 | n/a | n/a |")
    rows = in_program_table(results)
    assert "CUDA graph" in rows[-4] and rows[-2].startswith("| B32_T4096 | 125.0 / 124.0 |") and rows[-2].endswith("| 238.0 | n/a | 126.0 | 1.90x | 1.01x |")
    assert rows[-1].startswith("| B1_T32768 | 39.0 / 38.0 |") and rows[-1].endswith("| 41.0 | n/a | 1.05x |")


def test_decode_benchmark_judges_each_default_path_against_issue_3s_bars_inside_one_program():
    """Each path's in-program time against FlashInfer's CUDA graph and the builtin kernel's best, and
    its TB/s where the bar applies (B >= 32 at D 128); a bar just missed reads MISSED."""
    from benchmarks.decode_attention import targets_table

    stats = lambda median, tbps=1.0: {"median_us": median, "min_us": median - 1, "tbps_median": tbps}
    b8 = {"decodejax/nhd/auto": {"in_program": stats(67.0, 4.01)}, "decodejax/mgpu-nhd/auto": {"in_program": stats(68.5, 3.92)},
          "jax_builtin_pallas/k_splits=4": {"in_program": stats(122.0)}, "jax_builtin_pallas/k_splits=1": {"in_program": stats(130.0)},
          "flashinfer/tensor_cores=True": {"in_program": stats(71.0)}}
    b32 = {"decodejax/nhd/auto": {"in_program": stats(131.0, 4.09)}, "decodejax/mgpu-nhd/auto": {"in_program": stats(124.0, 4.33)},
           "jax_builtin_pallas/k_splits=1": {"in_program": stats(231.0)}, "flashinfer/tensor_cores=False": {"in_program": stats(126.0)}}
    results = {"cases": {"B8_T8192": {"case": {"batch": 8, "head_dim": 128}, "variants": b8},
                         "B32_T4096": {"case": {"batch": 32, "head_dim": 128}, "variants": b32}}}
    rows = targets_table(results)
    assert rows[-4:] == [
        "| B8_T8192 | Triton (auto) | 67.0 | 1.060x met | 1.821x met | 4.010 (no bar) |",
        "| B8_T8192 | Mosaic GPU | 68.5 | 1.036x met | 1.781x MISSED | 3.920 (no bar) |",
        "| B32_T4096 | Triton (auto) | 131.0 | 0.962x MISSED | 1.763x MISSED | 4.090 MISSED |",
        "| B32_T4096 | Mosaic GPU | 124.0 | 1.016x met | 1.863x met | 4.330 met |",
    ]
    assert targets_table({"cases": {"B8_T8192": {"case": {}, "variants": {"decodejax/nhd/auto": stats(70.0)}}}}) == []


def test_decode_benchmark_report_renders_a_recorded_result_and_leaves_its_file_as_it_was(tmp_path, capsys):
    """`--report` prints a recorded run's tables and leaves its JSON byte for byte as it was (it used to
    write the file back with recomputed comparisons)."""
    from benchmarks.decode_attention import main

    stats = lambda median: {"median_us": median, "min_us": median - 1, "tbps_median": 1.0}
    results = {"machine": {"device": "H200", "jax": "0.11.2", "python": "3.12"}, "date": "2026-12-02",
               "method": {"samples": 30, "reps_per_sample": 50},
               "cases": {"B32_T4096": {"case": {"tags": ["target"]}, "variants": {
                   "decodejax/nhd/auto": stats(135.0), "jax_builtin_pallas/k_splits=1": stats(250.0)}}}}
    path = tmp_path / "recorded.json"
    path.write_text(json.dumps(results))
    before = path.read_bytes()
    main(["--report", str(path)])
    assert path.read_bytes() == before
    assert "| B32_T4096 | 135.0 / 134.0 |" in capsys.readouterr().out


def test_decode_benchmark_table_has_a_split_sweep_only_when_the_run_swept():
    """A --no-sweep run (one device call) renders no empty sweep table; a swept run renders its row.
    The deal's table appears when the launch-order variant was timed in one program."""
    from benchmarks.decode_attention import render_table

    stats = lambda median: {"median_us": median, "min_us": median - 1, "tbps_median": 1.0}
    results = {"machine": {"device": "H200", "jax": "0.11.2", "python": "3.12"}, "date": "2026-11-30",
               "method": {"samples": 30, "reps_per_sample": 50},
               "cases": {"B32_T4096": {"case": {"tags": ["target"]}, "variants": {"decodejax/nhd/auto": stats(135.0)}}}}
    assert "Split-count sweep" not in render_table(results) and "longest split first" not in render_table(results)
    variants = results["cases"]["B32_T4096"]["variants"]
    variants["decodejax/nhd/auto"]["in_program"] = stats(128.0)
    variants["decodejax/nhd/auto/launch_order"] = stats(131.0) | {"in_program": stats(124.0)}
    assert "| B32_T4096 | 135.0 | 128.0 | 131.0 | 124.0 |" in render_table(results)
    results["cases"]["B32_T4096"]["variants"]["decodejax/nhd/splits=2"] = stats(140.0)
    table = render_table(results)
    assert "Split-count sweep" in table and "| B32_T4096 | nan | 140.0 |" in table


def test_decode_benchmark_case_checks_every_variant_first_then_times_the_ones_that_ran():
    """On CPU the GPU variants fail their reference check and are recorded as errors, with no
    samples; the XLA reference is checked, then timed (SAMPLES samples) with the others' turns."""
    from benchmarks import cases as bench_cases
    from benchmarks.decode_attention import OURS, run_case

    results = {"cases": {}}
    case = bench_cases.SMALL_CASES[0]
    run_case(case, results, sweep=False)
    variants = results["cases"][case.name]["variants"]
    assert "AdmissionError" in variants[OURS]["error"] and "samples_us" not in variants[OURS]
    reference = variants["xla_gather_reference"]
    assert len(reference["samples_us"]) == bench_cases.SAMPLES and reference["max_abs_err_vs_reference"] < 1e-2


def test_e2e_step_timing_splits_each_step_into_submit_and_fetch_and_restores_the_runner():
    """benchmarks.e2e_decode.timed_steps wraps the runner's submit and fetch for the timed steps
    only: each step's parts are its own, and the runner's methods are its own again afterwards."""
    import time

    from benchmarks.e2e_decode import timed_steps

    class Runner:
        def submit(self, rows):
            time.sleep(0.002)
            return rows

        def fetch(self, pending):
            time.sleep(0.004)
            return pending

    class Engine:
        runner = Runner()

        def step(self):
            return self.runner.fetch(self.runner.submit([1, 2]))

    engine = Engine()
    parts = timed_steps(engine, batch=2, steps=3)
    assert len(parts["step"]) == len(parts["submit"]) == len(parts["fetch"]) == 3
    for step, submit, fetch in zip(parts["step"], parts["submit"], parts["fetch"]):
        assert submit >= 2.0 and fetch >= 4.0 and submit + fetch <= step
    assert "submit" not in vars(engine.runner) and "fetch" not in vars(engine.runner)
    with pytest.raises(RuntimeError, match="produced 2 tokens for a batch of 3"):
        timed_steps(engine, batch=3, steps=1)
    assert "submit" not in vars(engine.runner) and "fetch" not in vars(engine.runner)


def test_e2e_peer_ratio_uses_the_peers_fastest_generate_and_keeps_each_generates_own():
    """benchmarks.e2e_decode.attach_peer_ratios: the headline ratio takes the peer's fastest
    generate less its fastest prefill; beside it, the peer's step as each generate alone puts it and
    our speedup over each; shapes that either side did not measure get nothing."""
    from benchmarks.e2e_decode import attach_peer_ratios

    ours = [{"batch": 1, "context": 2048, "step_ms_median": 4.0, "tokens_per_s": 250.0},
            {"batch": 8, "context": 2048, "step_ms_median": 5.0, "tokens_per_s": 1600.0},
            {"batch": 64, "context": 8192, "skipped": "pool"}]
    peer = {"steps": 10, "rows": [
        # 11-token generates of 168, 148 and 160 ms, 1-token ones of 70, 68 and 69 ms: steps of
        # 10.0, 8.0 and 9.2 ms; the fastest pair gives 8.0 ms, 125 tokens/s
        {"batch": 1, "context": 2048, "prefill_s_samples": [0.070, 0.068, 0.069], "total_s_samples": [0.168, 0.148, 0.160],
         "step_ms": 8.0, "tokens_per_s": 125.0},
        {"batch": 8, "context": 2048, "not_run": "deadline of 400 s passed"},
        {"batch": 64, "context": 8192, "error": "OutOfMemoryError"}]}
    attach_peer_ratios(ours, peer)
    b1, b8, b64 = ours
    assert b1["speedup_vs_transformers"] == pytest.approx(2.0)
    assert b1["transformers_step_ms_per_generate"] == pytest.approx([8.0, 9.2, 10.0])
    assert b1["speedup_vs_transformers_per_generate"] == pytest.approx([2.0, 2.3, 2.5])
    assert "speedup_vs_transformers_median_step" not in b1  # this peer did not stamp its steps
    for row in (b8, b64):
        assert not any(key.startswith(("speedup", "transformers")) for key in row)


def test_e2e_peer_median_step_ratio_sets_the_two_sides_median_steps_side_by_side():
    from benchmarks.e2e_decode import attach_peer_ratios

    ours = [{"batch": 1, "context": 512, "step_ms_median": 4.0, "tokens_per_s": 250.0}]
    peer = {"steps": 3, "rows": [{"batch": 1, "context": 512, "prefill_s_samples": [0.070], "total_s_samples": [0.094],
                                  "step_ms": 8.0, "tokens_per_s": 125.0,
                                  "step_ms_samples": [[7.0, 9.0, 11.0]], "step_ms_median": 9.0}]}
    attach_peer_ratios(ours, peer)
    assert ours[0]["transformers_step_ms_median"] == 9.0
    assert ours[0]["speedup_vs_transformers_median_step"] == pytest.approx(2.25)
    assert ours[0]["speedup_vs_transformers"] == pytest.approx(2.0)


def test_peer_token_clock_times_each_decode_step_of_a_generate():
    """benchmarks.peers.hf_generate: a generate of n tokens streams the prompt and then n tokens to
    the clock, so it gives n - 1 decode steps, which fit inside the generate's own time."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from benchmarks.peers.hf_generate import TokenClock, timed_generate

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    clock = TokenClock()
    total_s = timed_generate(model, torch.randint(0, 64, (2, 5)), 6, clock)
    steps_ms = clock.decode_step_ms()
    assert len(clock.stamps) == 1 + 6 and len(steps_ms) == 5
    assert all(ms > 0 for ms in steps_ms)
    assert sum(steps_ms) < total_s * 1e3


def test_peer_gpu_kernel_time_counts_only_the_traces_kernels():
    """benchmarks.peers.hf_generate: the GPU's share of a peer step sums the complete "kernel" events
    of a Chrome trace (not the runtime calls that launched them, copies or instant markers); on a
    CPU-only build a profiled generate records no kernels, so the step's GPU time reads 0."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from benchmarks.peers.hf_generate import gpu_kernel_time_per_step, kernel_time_in_trace

    events = [{"cat": "kernel", "ph": "X", "name": "gemm", "dur": 1500.0},
              {"cat": "kernel", "ph": "X", "name": "rmsnorm", "dur": 250.0},
              {"cat": "cuda_runtime", "ph": "X", "name": "cudaGraphLaunch", "dur": 9000.0},
              {"cat": "gpu_memcpy", "ph": "X", "name": "Memcpy DtoH", "dur": 40.0},
              {"cat": "kernel", "ph": "i", "name": "marker"},
              {"ph": "M", "name": "process_name"}]
    assert kernel_time_in_trace(events) == (pytest.approx(1.75), 2)
    assert kernel_time_in_trace([]) == (0.0, 0)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    row = gpu_kernel_time_per_step(transformers.LlamaForCausalLM(config).eval(), torch.randint(0, 64, (2, 5)), 4)
    if not torch.cuda.is_available():
        assert row == {"gpu_kernel_ms_per_step": 0.0, "kernels_per_step": 0.0, "profiled_kernel_ms": {"5_tokens": 0.0, "3_tokens": 0.0}}


def test_peer_gpu_kernel_time_per_step_cancels_the_prefill_and_the_slow_first_step(monkeypatch):
    """The per-step figure differences two generate lengths that both hold the prefill and the
    first decode step (20 to 30 ms longer than the rest on the GPU machine), so neither enters it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from benchmarks.peers import hf_generate

    def fake_profile(model, ids, new_tokens):  # prefill 90 ms / 400 kernels, first step +25 ms, 7 ms / 800 a step
        return 90.0 + 25.0 * (new_tokens > 1) + 7.0 * (new_tokens - 1), 400 + 800 * (new_tokens - 1)

    monkeypatch.setattr(hf_generate, "profiled_kernel_time", fake_profile)
    row = hf_generate.gpu_kernel_time_per_step(None, None, 30)
    assert row["gpu_kernel_ms_per_step"] == pytest.approx(7.0)
    assert row["kernels_per_step"] == pytest.approx(800.0)
    assert row["profiled_kernel_ms"] == {"31_tokens": pytest.approx(325.0), "16_tokens": pytest.approx(220.0)}


def test_e2e_pool_noise_takes_each_layers_pages_in_place():
    """benchmarks.e2e_decode.fill_pool_with_noise donates every layer's old pages (jit drops an
    unused argument, donated or not, and a pool kept alive beside its noise needs twice its memory:
    on the H200 a 64.7 GiB pool ran out while filling) and publishes noise of the same shapes."""
    from benchmarks.e2e_decode import fill_pool_with_noise
    from decodejax.cache import KVPool

    class Runner:
        pool = KVPool.create(num_layers=3, num_pages=5, page_size=4, kv_heads=2, head_dim=8)

        def rebind_pool(self, pool):
            self.pool = pool

    engine = NS(runner=Runner())
    old = engine.runner.pool
    fill_pool_with_noise(engine, seed=1)
    new = engine.runner.pool
    assert all(a.is_deleted() for a in old.k + old.v)
    assert [a.shape for a in new.k + new.v] == [a.shape for a in old.k + old.v]
    arrays = [np.asarray(a, np.float32) for a in new.k + new.v]
    values = np.concatenate([a.ravel() for a in arrays])
    assert np.isfinite(values).all() and 0.5 < values.std() < 1.5
    assert all(not np.array_equal(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])  # a key per array


def test_decode_benchmark_merges_runs_of_one_commit_only():
    """benchmarks.decode_attention.merge_runs joins runs over disjoint cases that share the machine,
    the method and the commit measured, and refuses a run of another commit."""
    from benchmarks.decode_attention import merge_runs

    def run(date, case, commit):
        return {"date": date, "machine": {"device": "H200"}, "method": {"samples": 30}, "source_commit": commit,
                "cases": {case: {"kv_bytes": 1, "variants": {}}}}

    merged = merge_runs([run("d1", "B1", "a" * 40), run("d2", "B8", "a" * 40)])
    assert merged["source_commit"] == "a" * 40 and sorted(merged["cases"]) == ["B1", "B8"]
    assert merged["merged_from_dates"] == ["d1", "d2"]
    with pytest.raises(ValueError, match="source commit"):
        merge_runs([run("d1", "B1", "a" * 40), run("d2", "B8", "b" * 40)])


def test_ncu_exports_are_read_per_launch_with_their_stall_reasons(tmp_path):
    """ncu_decode.summarize: the details page's rows go to their launch by ID (notes before the
    table skipped), the raw page's stall reasons (its second row holds units) are ranked, and a
    value ncu could not read (n/a) is left out."""
    import json

    from benchmarks import ncu_decode

    (tmp_path / "r.details.csv").write_text(
        "==PROF== a note\n"
        '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
        '"0","decodejax_paged_decode","GPU Speed Of Light Throughput","DRAM Throughput","%","85.10"\n'
        '"0","decodejax_paged_decode","Launch Statistics","Registers Per Thread","register/thread","210"\n'
        '"1","decodejax_merge_states","GPU Speed Of Light Throughput","Duration","us","3.10"\n'
        '"1","decodejax_merge_states","Some Section","Unlisted Metric","","7"\n')
    stall = lambda reason: f"{ncu_decode.STALL_PREFIX}{reason}{ncu_decode.STALL_SUFFIX}"
    (tmp_path / "r.raw.csv").write_text(
        f'"ID","Kernel Name","{stall("long_scoreboard")}","{stall("barrier")}","smsp__other.ratio"\n'
        '"","","","",""\n'
        '"1","decodejax_merge_states","n/a","0.50","9"\n'
        '"0","decodejax_paged_decode","3.85","1,002.5","9"\n')
    summary = ncu_decode.summarize(str(tmp_path / "s.json"), [str(tmp_path / "r")])
    assert json.loads((tmp_path / "s.json").read_text()) == summary
    kernel, merge = summary["r"]
    assert kernel == {"kernel": "decodejax_paged_decode", "dram_throughput_pct": "85.10 %",
                      "registers_per_thread": "210 register/thread",
                      "top_stalls_per_issued_instruction": {"barrier": 1002.5, "long_scoreboard": 3.85}}
    assert merge == {"kernel": "decodejax_merge_states", "duration": "3.10 us",
                     "top_stalls_per_issued_instruction": {"barrier": 0.5}}


def test_mosaic_timeline_summary_reads_scopes_per_entry_and_last_events_per_sm():
    from benchmarks.mosaic_timeline import summarize_trace

    def scope(sm, name, begin, end, start=100.0):  # one trace per SM; times after a common start
        return [{"name": name, "ph": "B", "ts": start + begin, "pid": 1 + sm, "tid": 1 + sm},
                {"name": name, "ph": "E", "ts": start + end, "pid": 1 + sm, "tid": 1 + sm}]

    events = (scope(0, "blocks", 0, 10) + scope(0, "merge_write", 10, 12) + scope(1, "blocks", 0.5, 11)
              + scope(1, "merge_write", 11, 13) + scope(2, "blocks", 0, 6) + scope(2, "blocks", 6, 9)
              + scope(3, "blocks", 0, 8) + scope(4, "blocks", 0, 5) + scope(5, "blocks", 0, 5.5))
    s = summarize_trace(events)
    assert s["span"] == 13
    assert s["last_event_by_sm"] == {"0": 12, "1": 13, "2": 9, "3": 8, "4": 5, "5": 5.5}
    assert s["scopes"]["blocks#0/end"]["n"] == 6 and s["scopes"]["blocks#0/end"]["median"] == 7  # 5, 5.5, 6, 8, 10, 11
    assert s["scopes"]["blocks#1/begin"] == {"n": 1, "min": 6, "median": 6, "p90": 6, "max": 6}  # SM 2's second item
    assert s["scopes"]["merge_write/duration"]["max"] == 2 and s["scopes"]["blocks/duration"]["n"] == 7
    assert s["scopes"]["blocks#1/duration"]["median"] == 3 and s["scopes"]["blocks#0/duration"]["n"] == 6
    assert s["last_event_spread_share"] == pytest.approx((13 - 5) / 13)
    assert s["tail_share"] == pytest.approx((13 - 8.5) / 13)  # past the median SM's 8.5
    assert s["tpc_pair_correlation"] == pytest.approx(np.corrcoef([12, 9, 5], [13, 8, 5.5])[0, 1])


def test_dense_ceiling_out_in_layout_holds_the_same_weights_and_computes_the_same_step():
    """`fused_nk` stores each weight [out, in]: the exact transposes of `fused`'s, contracted on their
    last axis, so its step's logits and K/V sum are `fused`'s."""
    import jax
    import jax.numpy as jnp

    from benchmarks.dense_ceiling import dense_step, random_weights
    from models.llama import PRESETS

    config = PRESETS["tiny"]
    in_out = random_weights(config, True, jnp.float32)
    out_in = random_weights(config, True, jnp.float32, out_in=True)
    for a, b in zip(jax.tree.leaves(in_out), jax.tree.leaves(out_in)):
        np.testing.assert_array_equal(np.asarray(a).T, np.asarray(b))
    x = jax.random.normal(jax.random.key(1), (3, config.hidden_size), jnp.float32)
    logits, kv_sum = dense_step(in_out, x)
    logits_t, kv_sum_t = dense_step(out_in, x, out_in=True)
    assert logits.shape == (3, config.vocab_size)
    np.testing.assert_allclose(np.asarray(logits_t), np.asarray(logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(kv_sum_t), float(kv_sum), rtol=1e-5, atol=1e-5)


def test_e2e_replay_rate_leaves_out_what_each_run_pays_once():
    """benchmarks.e2e_decode.steady_per_call_ms: a run's once-only cost (a first dispatch the device
    waits for, the final sync) cancels in the difference of a short and a long run; one run's time
    over its calls would charge it to every call."""
    import time

    from benchmarks.e2e_decode import steady_per_call_ms

    once_ms, per_call_ms = 60.0, 5.0

    def run(calls):
        time.sleep((once_ms + calls * per_call_ms) / 1e3)

    rate = steady_per_call_ms(run, short=2, long=12, idle_s=0.0)
    assert 3.5 < rate < 7.0, rate  # one run's time over its 12 calls would read 10 ms


def test_e2e_replay_rate_starts_each_run_after_the_last_one_has_drained():
    """A run can return while the device still works for it (here: 80 ms more; on an H100 a run
    ended on the step's donated buffers returned 0.6 to 0.8 ms before its tokens). The next run then
    waits for that first; unless the runs are idle-separated, the short run, timed right after the
    long one, absorbs the long run's tail and the rate reads low."""
    import time

    from benchmarks.e2e_decode import steady_per_call_ms

    per_call_ms, tail_ms, device_free_at = 5.0, 80.0, [0.0]

    def run(calls):
        time.sleep(max(0.0, device_free_at[0] - time.perf_counter()))  # the previous run's tail first
        time.sleep(calls * per_call_ms / 1e3)
        device_free_at[0] = time.perf_counter() + tail_ms / 1e3  # returns before the device is done

    leaky = steady_per_call_ms(run, short=2, long=12, idle_s=0.0)
    time.sleep(tail_ms / 1e3)
    drained = steady_per_call_ms(run, short=2, long=12, idle_s=2 * tail_ms / 1e3)
    assert leaky < 1.0, leaky  # (60 - (80 + 10)) / 10
    assert 4.0 < drained < 6.5, drained


def test_engine_defaults_streams_each_prompt_and_counts_the_weights_the_prefill_multiplies(tmp_path):
    """benchmarks.engine_defaults on the tiny preset (CPU): the defaults it recorded, one row per
    prompt length with its timed samples, every page free again (it raises otherwise); and its
    prefill FLOPs hold the model's own layer matrices, counted from the weights."""
    import json

    import jax

    from benchmarks.engine_defaults import main, prefill_flops
    from models import llama

    out = tmp_path / "defaults.json"
    main(["--model", "tiny", "--dtype", "float32", "--prompt-lengths", "5,40", "--new-tokens", "3", "--samples", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert (result["config"]["kv_dtype"], result["config"]["max_batch"], result["pool_pages"]) == ("float32", 8, 8 * 32 + 1)
    assert [r["prompt_len"] for r in result["rows"]] == [5, 40]
    for r in result["rows"]:
        assert len(r["samples"]) == 2 and all(s["ttft_s"] > 0 and s["ms_per_token_after_first"] > 0 for s in r["samples"])
        assert r["free_pages_after"] == result["pool_pages"] - 1

    model = llama.random("tiny")
    c = model.config
    matrices = sum(x.size for layer in model.layers for x in jax.tree.leaves((layer.attn.wqkv, layer.attn.wo, layer.w_gate_up, layer.w_down)))
    head_on_last_token = 2 * c.hidden_size * c.vocab_size
    attention_one_token = 2 * 2 * c.num_layers * c.num_heads * c.head_dim  # one (query, key) pair a layer
    assert prefill_flops(c, 1) == 2 * matrices + attention_one_token + head_on_last_token


def test_l2_prefetch_kernel_lowers_to_tma_prefetches_of_the_rows_asked_for_and_runs_where_asked():
    """benchmarks.l2_prefetch: the prefetch kernel lowers for CUDA to the bulk tensor prefetch into
    L2, once per layer of the `beside` program (placed after the flushing matmul, before the o
    matmul that adds its zeros) and not at all without a prefetch; rows that TMA boxes do not tile,
    or whose tiles do not split evenly over the programs, are refused before any lowering."""
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks import l2_prefetch as probe

    S = jax.ShapeDtypeStruct
    x = S((1, probe.HIDDEN), jnp.bfloat16)
    flush_ws = [S((probe.HIDDEN, probe.FLUSH_N), jnp.bfloat16)] * 2
    o_ws = [S((probe.HIDDEN, probe.HIDDEN), jnp.bfloat16)] * 2

    def lowered(prefetch):
        fn = functools.partial(probe.layers, prefetch=prefetch)
        return jax.jit(fn).trace(x, flush_ws, o_ws).lower(lowering_platforms=("cuda",)).as_text()

    for prefetch in probe.PREFETCH_ROWS:
        text = lowered(prefetch)
        assert text.count("stablehlo.custom_call @mosaic_gpu") == len(o_ws), prefetch
        assert "cp.async.bulk.prefetch.tensor.2d.L2.global" in text
    assert "mosaic_gpu" not in lowered(None)
    with pytest.raises(ValueError, match="rows=100"):
        probe.prefetch_rows_to_l2(jnp.zeros((512, 512), jnp.bfloat16), jnp.zeros((8,), jnp.bfloat16), rows=100)
    with pytest.raises(ValueError, match="4 tiles do not split"):
        probe.prefetch_rows_to_l2(jnp.zeros((512, 512), jnp.bfloat16), jnp.zeros((8,), jnp.bfloat16), rows=512)


def test_l2_prefetch_chains_multiply_layer_by_layer_and_hot_reads_one_matrix():
    """benchmarks.l2_prefetch: the cold chain is x @ w_1 / 2 @ w_2 / 2 ... over its matrices, and
    the hot chain is that chain over one matrix passed once (one buffer, so L2 can keep it)."""
    import jax
    import jax.numpy as jnp

    from benchmarks import l2_prefetch as probe

    x = jax.random.normal(jax.random.key(0), (1, probe.HIDDEN), jnp.float32)
    ws = [jax.random.normal(jax.random.key(k), (probe.HIDDEN, probe.HIDDEN), jnp.float32) * probe.HIDDEN**-0.5
          for k in (1, 2, 3)]
    expected = np.asarray(x, np.float64)
    for w in ws:
        expected = expected @ np.asarray(w, np.float64) * 0.5
    np.testing.assert_allclose(np.asarray(probe.chain_cold(x, ws)), expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
    hot_program = jax.jit(probe.chain_hot).lower(x, ws[0]).as_text()
    dots = [line for line in hot_program.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == probe.LAYERS and all("%arg1" in line for line in dots)  # every layer reads the one argument
