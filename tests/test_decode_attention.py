"""Paged split-KV decode attention against the oracle (S1-S3, P1, A1-A4 inside the kernel).

`DecodeAttentionCases` is the shared test body; this module runs it in Pallas interpret mode
on CPU, `test_decode_attention_gpu.py` runs it (and a 10,000-row sweep) on the GPU.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decodejax
from benchmarks import cases as bench_cases
from conftest import TOLERANCES
from decodejax import KVLayout, reference
from decodejax.masks import DecodeMask
from paged_problems import Spec, make_problem, with_poison
from pallas_kernels.decode_attention import DecodeConfig

LSE_ATOL = 3e-3
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def to_device(problem, dtype, layout=KVLayout.PAGED_NHD):
    """The problem as decode_attention arguments; unremapped problems pass cache_batch_idx=None."""
    k, v = problem["k_pages"], problem["v_pages"]
    rows = problem["cache_batch_idx"]
    if layout == KVLayout.PAGED_HND:
        k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    return dict(
        q=jnp.asarray(problem["q"], dtype),
        k_pages=jnp.asarray(k, dtype),
        v_pages=jnp.asarray(v, dtype),
        page_table=jnp.asarray(problem["page_table"]),
        seq_lens=jnp.asarray(problem["seq_lens"]),
        cache_batch_idx=None if np.array_equal(rows, np.arange(len(rows))) else jnp.asarray(rows),
    )


def oracle(args, layout, **options):
    """Reference in float32 on the same (rounded) inputs."""
    a = {k: (v.astype(jnp.float32) if v is not None and v.dtype in (jnp.bfloat16, jnp.float16) else v) for k, v in args.items()}
    mask = DecodeMask(options.get("window_left"), options.get("sinks", 0))
    return reference.paged_decode(
        a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["seq_lens"], layout=layout,
        cache_batch_idx=a["cache_batch_idx"], sm_scale=options.get("sm_scale"), soft_cap=options.get("soft_cap"), mask=mask,
    )


def assert_matches_oracle(o, lse, ref_o, ref_lse, dtype_name, lens):
    atol, rtol = TOLERANCES[dtype_name]
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    ref_o, ref_lse = np.asarray(ref_o), np.asarray(ref_lse)
    assert not np.any(np.isnan(o)) and not np.any(np.isnan(lse))
    bad = np.abs(o - ref_o) > atol + rtol * np.abs(ref_o)
    assert not bad.any(), f"{int(bad.any(axis=(1, 2)).sum())} rows out of tolerance; max err {np.abs(o - ref_o).max()}"
    live = np.asarray(lens) > 0
    np.testing.assert_allclose(lse[live], ref_lse[live], atol=LSE_ATOL, rtol=0)
    # S1: padded rows give o = 0 exactly and lse = -inf.
    assert np.all(o[~live] == 0) and np.all(lse[~live] == -np.inf)


SPECS = [
    Spec(batch=6, q_heads=8, kv_heads=2, head_dim=64, page_size=16, width=6, remap=True),
    Spec(batch=4, q_heads=4, kv_heads=4, head_dim=64, page_size=1, width=40),
    Spec(batch=3, q_heads=8, kv_heads=1, head_dim=64, page_size=128, width=2, remap=True),
    Spec(batch=4, q_heads=6, kv_heads=2, head_dim=128, page_size=7, width=5),
]
# The Mosaic GPU kernel's shapes: pages a multiple of 8, groups up to 8, D 64/128/256.
MOSAIC_SPECS = [
    SPECS[0],
    SPECS[2],
    Spec(batch=4, q_heads=4, kv_heads=4, head_dim=128, page_size=8, width=20),
    Spec(batch=3, q_heads=6, kv_heads=2, head_dim=256, page_size=32, width=4, remap=True),
]
OPTIONS = [
    {},
    {"soft_cap": 5.0, "window_left": 20, "sinks": 3},
    {"sm_scale": 0.3, "num_splits": 8},  # more splits than pages for the small tables
]


class DecodeAttentionCases:
    """The shared test body; subclasses set `backend` (and may shrink the problems)."""

    backend: str
    spec = SPECS[0]  # the problem of the layout, poison, rerun and partial-state tests
    deterministic_spec = Spec(batch=5, q_heads=8, kv_heads=2, head_dim=64, page_size=16, width=160)
    deterministic_lengths = (2500, 7, 0, 1024, 1025)
    deterministic_rows = (0, 3, 4)  # rows run again alone

    def run(self, args, layout=KVLayout.PAGED_NHD, **options):
        return decodejax.decode_attention(**args, layout=layout, return_lse=True, backend=self.backend, **options)

    @pytest.mark.parametrize("spec", SPECS, ids=str)
    @pytest.mark.parametrize("dtype_name", list(DTYPES))
    def test_matches_oracle(self, spec, dtype_name):
        self.check_oracle(spec, dtype_name, OPTIONS[SPECS.index(spec) % len(OPTIONS)])

    def check_oracle(self, spec, dtype_name, options):
        rng = np.random.default_rng(hash((str(spec), dtype_name)) % 2**32)
        problem = make_problem(spec, rng)
        args = to_device(problem, DTYPES[dtype_name])
        kernel_options = {k: v for k, v in options.items()}
        o, lse = self.run(args, **kernel_options)
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD, **options)
        assert_matches_oracle(o, lse, ref_o, ref_lse, dtype_name, problem["seq_lens"])

    def same_arithmetic_on_both_layouts(self) -> dict:
        """Options under which an NHD and an HND pool run the same arithmetic: the defaults."""
        return {}

    def test_hnd_layout_matches_nhd(self):
        problem = make_problem(self.spec, np.random.default_rng(5))
        options = self.same_arithmetic_on_both_layouts()
        o_nhd, lse_nhd = self.run(to_device(problem, jnp.bfloat16), **options)
        o_hnd, lse_hnd = self.run(to_device(problem, jnp.bfloat16, KVLayout.PAGED_HND), layout=KVLayout.PAGED_HND, **options)
        np.testing.assert_array_equal(np.asarray(o_nhd, np.float32), np.asarray(o_hnd, np.float32))
        np.testing.assert_array_equal(np.asarray(lse_nhd), np.asarray(lse_hnd))

    @pytest.mark.parametrize("poison", [np.inf, -np.inf, 65504.0])
    def test_A2_poison_leaves_output_bit_identical(self, poison):
        problem = make_problem(self.spec, np.random.default_rng(6), poison=0.0)
        clean = self.run(to_device(problem, jnp.float16))
        dirty = self.run(to_device(with_poison(problem, poison), jnp.float16))
        nan = self.run(to_device(with_poison(problem, np.nan), jnp.float16))
        for got in (dirty, nan):
            for a, b in zip(clean, got):
                np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert not np.any(np.isnan(np.asarray(nan[0], np.float32)))

    def test_S2_rerun_is_bitwise_identical(self):
        problem = make_problem(self.spec, np.random.default_rng(7))
        args = to_device(problem, jnp.bfloat16)
        first, second = self.run(args, num_splits=3), self.run(args, num_splits=3)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def test_S2_deterministic_mode_is_batch_invariant(self):
        rng = np.random.default_rng(8)
        problem = make_problem(self.deterministic_spec, rng, lengths=list(self.deterministic_lengths))
        args = to_device(problem, jnp.bfloat16)
        o_all, lse_all = self.run(args, deterministic=True)
        rows = jnp.arange(self.deterministic_spec.batch) if args["cache_batch_idx"] is None else args["cache_batch_idx"]
        for b in self.deterministic_rows:
            alone = {k: v[b : b + 1] if k in ("q", "seq_lens") else v for k, v in args.items()}
            alone["cache_batch_idx"] = rows[b : b + 1]
            o_b, lse_b = self.run(alone, deterministic=True)
            np.testing.assert_array_equal(np.asarray(o_b[0], np.float32), np.asarray(o_all[b], np.float32))
            np.testing.assert_array_equal(np.asarray(lse_b[0]), np.asarray(lse_all[b]))

    def test_S3_partial_states_merge_to_the_output(self):
        problem = make_problem(self.spec, np.random.default_rng(9))
        args = to_device(problem, jnp.bfloat16)
        o, lse, parts = decodejax.decode_attention(**args, return_lse=True, return_partial_states=True, num_splits=4, backend=self.backend)
        assert parts.o.shape[:3] == (self.spec.batch, self.spec.q_heads, 4)
        merged = decodejax.split_state.merge_lse_along(parts, axis=2)
        np.testing.assert_allclose(np.asarray(merged.o), np.asarray(o, np.float32), atol=2e-2)
        np.testing.assert_allclose(np.asarray(merged.lse), np.asarray(lse), atol=1e-5)

    # Long enough that the auto plan's split counts follow the batch's total (the Triton kernel's:
    # 85 blocks of 128 against a target of 66 splits; the Mosaic kernel's: 44 units of 256 against
    # 33): a kernel that summed the lengths wrongly would differ.
    plan_spec = Spec(batch=4, q_heads=16, kv_heads=8, head_dim=64, page_size=16, width=200)
    plan_lengths = (3200, 3100, 2900, 1500)
    plan_adapts_to_batch = True  # plan_spec's auto plan: split counts from the batch's total (test_P1 checks it)

    def kernel_items(self, spec: Spec):
        """(config, K/V heads, head dim) of the backend's kernel's work items on spec's NHD pool: its default
        tiling and the geometry its plan's alignment and split target follow (`_ops.kernel_items`)."""
        kernel = decodejax.dispatch.decode_kernel(self.backend)
        return decodejax._ops.kernel_items(kernel, None, spec.head_dim, spec.kv_heads, spec.q_heads // spec.kv_heads,
                                           KVLayout.PAGED_NHD, batch=spec.batch)

    @pytest.mark.parametrize("plan_options", [{}, {"num_splits": 3}, {"deterministic": True}, {"max_split_tokens": 128}],
                             ids=["auto", "splits=3", "deterministic", "auto_capped"])
    def test_P1_every_slot_holds_its_planned_range(self, plan_options, monkeypatch):
        """Slot s of request b is the attention state of keys [start, end) of `plan.bounds`, the
        planning contract, whichever side computes the bounds (the Triton kernel does it itself).
        auto_capped: a split cap of one block binds (25 one-block splits where the batch's total
        alone gives 13), so the kernel's bounds must apply it too."""
        plan_options = dict(plan_options)  # the parameter is shared by every class that runs this body
        if "max_split_tokens" in plan_options:
            monkeypatch.setattr(decodejax.planning, "MAX_SPLIT_TOKENS", plan_options.pop("max_split_tokens"))
        spec = self.plan_spec
        problem = make_problem(spec, np.random.default_rng(12), lengths=list(self.plan_lengths))
        args = to_device(problem, jnp.bfloat16)
        _, _, parts = decodejax.decode_attention(**args, return_lse=True, return_partial_states=True, backend=self.backend,
                                                 **plan_options)
        config, item_heads, item_dim = self.kernel_items(spec)
        plan = decodejax._ops.decode_plan(spec.batch, item_heads, spec.width * spec.page_size, config,
                                          num_splits=plan_options.get("num_splits"),
                                          deterministic=plan_options.get("deterministic", False), head_dim=item_dim)
        start, end = plan.bounds(np.asarray(problem["seq_lens"]))
        assert parts.lse.shape == (spec.batch, spec.q_heads, plan.capacity)
        if not plan_options and self.plan_adapts_to_batch:  # the cases the kernel's batch sum serves
            assert plan.adapts_to_batch
            # The bounds without the rule under test (the cap where it binds, else the batch's total) differ.
            capped = decodejax.planning.MAX_SPLIT_TOKENS <= config.split_align
            without = dataclasses.replace(plan, max_split_blocks=None) if capped else dataclasses.replace(
                plan, target_splits=None, max_split_blocks=None)
            assert not np.array_equal(without.bounds(np.asarray(problem["seq_lens"]))[1], end)
        gathered = {name: np.asarray(decodejax.gather_pages(args[name], args["page_table"], args["seq_lens"], backend="xla",
                                                            cache_batch_idx=args["cache_batch_idx"]), np.float32)
                    for name in ("k_pages", "v_pages")}
        q = np.asarray(args["q"], np.float32).reshape(spec.batch, spec.kv_heads, -1, spec.head_dim)
        scores = np.einsum("bhgd,bthd->bhgt", q, gathered["k_pages"]) * spec.head_dim**-0.5
        t = np.arange(scores.shape[-1])
        in_slot = (t >= start[..., None]) & (t < end[..., None])  # [B, S, T]
        masked = np.where(in_slot[:, None, None], scores[:, :, :, None], -np.inf)  # [B, H_kv, G, S, T]
        peak = np.max(masked, axis=-1, keepdims=True)
        weights = np.exp(masked - np.where(np.isfinite(peak), peak, 0))
        total = weights.sum(-1)
        want_lse = np.where(total > 0, np.log(np.where(total > 0, total, 1)) + peak[..., 0], -np.inf)
        want_o = np.einsum("bhgst,bthd->bhgsd", weights / np.where(total > 0, total, 1)[..., None], gathered["v_pages"])
        got_lse = np.asarray(parts.lse).reshape(want_lse.shape)
        got_o = np.asarray(parts.o).reshape(want_o.shape)
        empty = np.broadcast_to((end <= start)[:, None, None], want_lse.shape)
        assert np.all(got_lse[empty] == -np.inf) and np.all(np.isfinite(got_lse[~empty]))
        np.testing.assert_allclose(got_lse[~empty], want_lse[~empty], atol=LSE_ATOL, rtol=0)
        np.testing.assert_allclose(got_o, np.where(empty[..., None], 0, want_o), atol=2e-2, rtol=2e-2)


class TritonDecodeAttentionCases(DecodeAttentionCases):
    """The shared body, and what only the Triton kernel has: its slots merged by a second launch
    (the default) or in its own (`DecodeConfig.fused_merge`)."""

    def test_S3_the_merge_in_the_launch_matches_the_merge_launch(self):
        """Every program's partial state reaches the program that merges (64 splits: most of
        them EMPTY, and up to 64 programs of a (request, head) finishing in any order); a rerun
        is bitwise the same whichever program merged."""
        problem = make_problem(self.spec, np.random.default_rng(10))
        args = to_device(problem, jnp.bfloat16)
        fused = DecodeConfig(fused_merge=True)
        for splits in (3, 64):
            o, lse = self.run(args, num_splits=splits, config=fused)
            o_launched, lse_launched = self.run(args, num_splits=splits)
            np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_launched, np.float32), atol=1e-2, rtol=0)
            np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_launched), atol=1e-5, rtol=0)
            ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
            assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])
            again = self.run(args, num_splits=splits, config=fused)
            np.testing.assert_array_equal(np.asarray(again[0], np.float32), np.asarray(o, np.float32))
            np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(lse))

    def test_a_batch_that_fills_the_gpu_runs_64_token_blocks_in_one_slot(self, monkeypatch):
        """Where the batch's own programs fill the GPU (`planning.batch_fills_gpu`: here on one SM,
        so that four requests of two K/V heads do) the default tiling is 64-token blocks and the
        plan one slot; the output is the oracle's for lengths that end inside a block, on a
        block's edge, past a 128-token block's edge, and at 0. A GPU of 132 SMs keeps 128-token
        blocks for the same batch, and so does a deterministic call, whose row is then bitwise
        that row run alone (a batch that does not fill the GPU)."""
        spec = Spec(batch=4, q_heads=8, kv_heads=2, head_dim=128, page_size=16, width=12)
        kernel = decodejax.dispatch.decode_kernel(self.backend)

        def config_on(sms):
            monkeypatch.setattr(decodejax._ops, "_num_sms", lambda: sms)
            return decodejax._ops.kernel_items(kernel, None, spec.head_dim, spec.kv_heads, spec.q_heads // spec.kv_heads,
                                               KVLayout.PAGED_NHD, batch=spec.batch)[0]

        assert config_on(132).block_k == 128
        config = config_on(1)
        assert config.block_k == 64
        plan = decodejax._ops.decode_plan(spec.batch, spec.kv_heads, spec.max_len, config, num_splits=None, deterministic=False)
        assert plan.capacity == 1
        problem = make_problem(spec, np.random.default_rng(14), lengths=[100, 64, 129, 0])
        args = to_device(problem, jnp.bfloat16)
        o, lse = self.run(args)
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
        assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])
        o_all, lse_all = self.run(args, deterministic=True)
        o_one, lse_one = self.run({k: v[:1] if k in ("q", "seq_lens") else v for k, v in args.items()}, deterministic=True)
        np.testing.assert_array_equal(np.asarray(o_one[0], np.float32), np.asarray(o_all[0], np.float32))
        np.testing.assert_array_equal(np.asarray(lse_one[0]), np.asarray(lse_all[0]))

    @pytest.mark.parametrize("lengths", [(3200, 0, 2900, 700), (2000,) * 4], ids=["uneven", "equal"])
    @pytest.mark.parametrize("plan_options", [{}, {"num_splits": 3}, {"deterministic": True}], ids=["auto", "splits=3", "deterministic"])
    def test_the_longest_first_deal_changes_no_bit(self, plan_options, lengths):
        """`DecodeConfig.longest_first` changes which program computes an item, not what it
        computes: the output and every slot's partial state are bitwise those of launch order,
        on a batch of unequal lengths (one of them 0) and on one of equal lengths (which skips
        the ranking), with several slots."""
        problem = make_problem(self.plan_spec, np.random.default_rng(13), lengths=list(lengths))
        args = to_device(problem, jnp.bfloat16)
        dealt, launch_order = DecodeConfig(longest_first=True), DecodeConfig(longest_first=False)
        for partials in (False, True):
            got = self.run(args, config=dealt, return_partial_states=partials, **plan_options)
            want = self.run(args, config=launch_order, return_partial_states=partials, **plan_options)
            for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


class TestDecodeAttentionInterpret(TritonDecodeAttentionCases):
    backend = "pallas_triton_interpret"


class MosaicDecodeAttentionCases(DecodeAttentionCases):
    """The shared body on the Mosaic GPU kernel's shapes."""

    # Two K/V heads an item (D 64, H_kv 8: four pairs of D 128) halve the items, and the auto plan
    # adapts only where they outnumber the SMs: five requests in a 1,600-token table (7 slots of
    # 4 pairs; 54 units of 128 tokens against a target of 33 splits, 28 of them used).
    plan_spec = Spec(batch=5, q_heads=16, kv_heads=8, head_dim=64, page_size=16, width=100)
    plan_lengths = (1600, 1550, 1450, 750, 1200)

    @pytest.mark.parametrize("spec", MOSAIC_SPECS, ids=str)
    @pytest.mark.parametrize("dtype_name", list(DTYPES))
    def test_matches_oracle(self, spec, dtype_name):
        self.check_oracle(spec, dtype_name, OPTIONS[MOSAIC_SPECS.index(spec) % len(OPTIONS)])

    @pytest.mark.parametrize("compute_warpgroups,stages", [(1, 2), (3, 3)])
    def test_other_warpgroup_counts_match_oracle(self, compute_warpgroups, stages):
        """The end-of-split hand-off merges every compute warpgroup's state, empty ones too (the
        default has two warpgroups); the shorter request leaves a third warpgroup without a block."""
        from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

        spec = Spec(batch=2, q_heads=4, kv_heads=1, head_dim=64, page_size=16, width=14)
        problem = make_problem(spec, np.random.default_rng(7), lengths=(224, 70))  # one split: 4 and 2 blocks of 64
        args = to_device(problem, jnp.bfloat16)
        o, lse = self.run(args, config=MosaicDecodeConfig(64, stages, compute_warpgroups), num_splits=1)
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
        assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])

    @pytest.mark.parametrize("programs,compute_warpgroups,stages", [(1, 2, 4), (3, 1, 2), (4, 3, 3)])
    def test_programs_walking_several_items_match_oracle(self, programs, compute_warpgroups, stages):
        """A persistent program streams its work items' blocks back to back: a slot refilled with
        the next item's block, a query tile reused, EMPTY items (the empty request, unused split
        slots) between full ones, and item streams that start on either warpgroup's turn."""
        from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

        spec = Spec(batch=4, q_heads=4, kv_heads=2, head_dim=64, page_size=16, width=14)
        problem = make_problem(spec, np.random.default_rng(11), lengths=(224, 0, 70, 129))
        args = to_device(problem, jnp.bfloat16)
        o, lse = self.run(args, config=MosaicDecodeConfig(64, stages, compute_warpgroups, programs=programs), num_splits=3)
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
        assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])

    @pytest.mark.parametrize("q_heads,kv_heads,lengths", [(4, 2, (0, 150)), (2, 2, (70, 0, 129, 1))], ids=["G2", "G1"])
    @pytest.mark.parametrize("num_splits", [1, 2])
    def test_items_sharing_a_query_tile_match_oracle(self, q_heads, kv_heads, lengths, num_splits):
        """Groups dividing the 8-row tile read q's rows in place: an item's G rows sit at offset
        (b H_kv + h) G mod 8 of its tile, and its output and lse rows are taken from there. (At
        D 64 with H_kv 2 an item is the pair of heads, `pairable_heads`: 2G rows at offset b 2G mod 8.) With
        one slot the kernel writes the call's output (bf16) and the empty request's (0, -inf)
        itself; with two it writes partial states that the wrapper masks and merges."""
        spec = Spec(batch=len(lengths), q_heads=q_heads, kv_heads=kv_heads, head_dim=64, page_size=16, width=10)
        problem = make_problem(spec, np.random.default_rng(17), lengths=lengths)
        args = to_device(problem, jnp.bfloat16)
        o, lse = self.run(args, num_splits=num_splits)
        assert o.dtype == jnp.bfloat16
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
        assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])

    def test_one_request_in_several_slots_matches_oracle(self):
        """A single request's splits are taken in index order (no ranking), a longer first split
        and an EMPTY last slot among them."""
        spec = Spec(batch=1, q_heads=4, kv_heads=1, head_dim=128, page_size=16, width=48)
        problem = make_problem(spec, np.random.default_rng(19), lengths=(700,))
        args = to_device(problem, jnp.bfloat16)
        o, lse, parts = self.run(args, num_splits=7, return_partial_states=True)
        # 700 tokens in 6 aligned units of 128: splits of 2, 1, 1, 1, 1 (ending at 700) and 1 unit, then EMPTY
        np.testing.assert_array_equal(np.asarray(parts.valid[0, 0]), [True] * 6 + [False])
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
        assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])
        np.testing.assert_array_equal(np.asarray(parts.o[0, :, 6]), 0.0)  # EMPTY reads (0, -inf)

    @pytest.mark.parametrize("lengths, programs, target", [((1536, 700), 8, 8), ((700,), None, 4)],
                             ids=["batch_one_item_a_program", "one_request"])
    def test_a_plan_whose_items_fit_the_sms_is_split_by_each_length_in_the_kernel(self, lengths, programs, target, monkeypatch):
        """Where every work item has an SM, the auto plan does not adapt (`_ops.decode_plan`), and
        the kernel, given no bounds, splits each request by its own length: with 4 slots (1,536-token
        tables, a target of 8 splits for two requests, 4 for one) 700 tokens are 6 units of 128 in
        splits of 2, 2, 1 and 1, every slot live. The adaptive count would have left slots EMPTY:
        the second request's last two (the batch's 18 units over 8 splits, 3 a split), the single
        request's last (6 units over 4, 2 a split). Two requests with a program for each item, or
        one request whose four items two interpreted programs take in turn."""
        from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

        monkeypatch.setattr(decodejax.planning, "decode_target_splits", lambda *args, **kwargs: target)
        spec = Spec(batch=len(lengths), q_heads=4, kv_heads=1, head_dim=128, page_size=16, width=96)
        config = MosaicDecodeConfig(programs=programs)
        plan = decodejax._ops.decode_plan(spec.batch, spec.kv_heads, spec.width * spec.page_size, config, num_splits=None,
                                          deterministic=False, head_dim=spec.head_dim)
        assert plan.capacity == 4 and not plan.adapts_to_batch
        problem = make_problem(spec, np.random.default_rng(31), lengths=lengths)
        args = to_device(problem, jnp.bfloat16)
        o, lse, parts = self.run(args, config=config, return_partial_states=True)
        np.testing.assert_array_equal(np.asarray(parts.valid[:, 0]), [[True] * 4] * len(lengths))
        start, end = plan.bounds(np.asarray(problem["seq_lens"]))
        np.testing.assert_array_equal(end[-1] - start[-1], [256, 256, 128, 60])
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
        assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])

    @pytest.mark.parametrize("compute_warpgroups,stages,lengths", [(2, 4, (1100, 1, 1025)), (2, 4, (1174, 100, 1025)),
                                                                  (3, 3, (1100, 1, 1025))],
                             ids=["2-4", "2-4-mergers_alternate", "3-3"])
    def test_partial_states_do_not_depend_on_the_items_before(self, compute_warpgroups, stages, lengths):
        """Batch invariance of the persistent kernel: one program walks every item, and request
        1's odd block count shifts where request 2's items start in the stream. Their float32
        partial states must still equal those of request 2 alone, bit for bit (the warpgroups'
        states merge in one order whatever the shift; a*b + c*d contracted to an FMA is not
        symmetric, so swapping them showed as a last-bit change). With two compute warpgroups
        the one that folds an item's last block merges it: the second lengths' items (blocks 16,
        16, 3, 2, 1 in the stream, longest first) have each warpgroup merge right after it handed
        over, which the interpreter's barrier checks follow phase by phase."""
        from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

        spec = Spec(batch=3, q_heads=2, kv_heads=1, head_dim=64, page_size=16, width=80)
        args = to_device(make_problem(spec, np.random.default_rng(8), lengths=lengths), jnp.bfloat16)
        config = MosaicDecodeConfig(64, stages, compute_warpgroups, programs=1)
        run = lambda a: self.run(a, deterministic=True, config=config, return_partial_states=True)[2]
        together = run(args)
        rows = jnp.arange(spec.batch) if args["cache_batch_idx"] is None else args["cache_batch_idx"]
        alone = run({k: v[2:] if k in ("q", "seq_lens") else v for k, v in args.items()} | {"cache_batch_idx": rows[2:]})
        np.testing.assert_array_equal(np.asarray(together.o[2:]), np.asarray(alone.o))
        np.testing.assert_array_equal(np.asarray(together.lse[2:]), np.asarray(alone.lse))

    def same_arithmetic_on_both_layouts(self) -> dict:
        """One K/V head an item on both: an NHD pool at D 64 runs two heads an item by default
        (`pairable_heads`), which an HND pool cannot (the paired kernel is checked against the oracle)."""
        from pallas_kernels.decode_attention_mgpu import default_config

        return {"config": default_config(self.spec.head_dim, pairable=False)}

    @pytest.mark.parametrize("q_heads,lengths,num_splits", [(8, (150, 0, 37), 1), (6, (70, 129), 2)],
                             ids=["G4-one_slot", "G3-padded_rows-two_slots"])
    def test_paired_kv_heads_match_oracle(self, q_heads, lengths, num_splits):
        """Two K/V heads an item (D 64, NHD, H_kv 2): the block-diagonal query tile and each head's
        quarter of the output. G 4 fills the 8-row tile with the pair's rows; G 3's 6 rows are padded
        to a tile of their own. One slot writes the call's output in bf16 (an empty request's too),
        two write f32 partial states (the short request's second slot EMPTY) that the wrapper merges.
        (G 1 and G 2, whose pairs share a tile with other items', are
        `test_items_sharing_a_query_tile_match_oracle`'s.)"""
        from pallas_kernels.decode_attention_mgpu import default_config, item_geometry

        spec = Spec(batch=len(lengths), q_heads=q_heads, kv_heads=2, head_dim=64, page_size=16, width=10, remap=True)
        assert item_geometry(default_config(64, pairable=True), 64, 2, q_heads // 2, KVLayout.PAGED_NHD) == (1, 128)
        problem = make_problem(spec, np.random.default_rng(23), lengths=lengths)
        args = to_device(problem, jnp.bfloat16)
        o, lse = self.run(args, num_splits=num_splits)
        ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
        assert_matches_oracle(o, lse, ref_o, ref_lse, "bfloat16", problem["seq_lens"])


class TestMosaicDecodeAttentionInterpret(MosaicDecodeAttentionCases):
    """Mosaic GPU interpret mode: out-of-bounds reads raise and shared-memory races are detected.

    The interpreter runs each program's three warpgroups as threads (about 2 s a program on
    the CI machine), so its problems have few programs: one K/V head (or one pair), few requests.
    Pairs of K/V heads run in the tests whose problems have two (`test_paired_kv_heads_match_oracle`,
    `test_items_sharing_a_query_tile_match_oracle`); the GPU class's spec is a pair too."""

    backend = "pallas_mosaic_gpu_interpret"
    spec = Spec(batch=3, q_heads=4, kv_heads=1, head_dim=64, page_size=16, width=6, remap=True)
    deterministic_spec = Spec(batch=3, q_heads=2, kv_heads=1, head_dim=64, page_size=16, width=80)
    deterministic_lengths = (1100, 0, 1025)
    deterministic_rows = (0, 2)
    plan_spec = Spec(batch=2, q_heads=2, kv_heads=1, head_dim=128, page_size=16, width=12)  # auto: 2 slots of 128 tokens
    plan_lengths = (150, 64)
    plan_adapts_to_batch = False

    @pytest.mark.parametrize("spec,options", [
        (Spec(batch=3, q_heads=8, kv_heads=1, head_dim=64, page_size=16, width=6, remap=True),
         {"soft_cap": 5.0, "window_left": 20, "sinks": 3}),
        (Spec(batch=2, q_heads=2, kv_heads=1, head_dim=128, page_size=8, width=20), {"num_splits": 3}),
        (Spec(batch=2, q_heads=3, kv_heads=1, head_dim=64, page_size=128, width=2, remap=True), {}),
    ], ids=lambda x: str(x) if isinstance(x, Spec) else "-".join(x) or "defaults")
    def test_matches_oracle(self, spec, options):
        self.check_oracle(spec, "bfloat16", options)

    @pytest.mark.parametrize("poison", [np.inf])
    def test_A2_poison_leaves_output_bit_identical(self, poison):
        super().test_A2_poison_leaves_output_bit_identical(poison)


@pytest.mark.parametrize("case", bench_cases.SMALL_CASES, ids=lambda c: c.name)
def test_benchmark_small_cases_match_reference(case):
    """STYLE 10: the benchmark's own case builder, small, checked for correctness in CI."""
    data = bench_cases.make_case(case)
    args = [jnp.asarray(data[k], jnp.bfloat16) for k in ("q", "k_pages", "v_pages")]
    table, lens = jnp.asarray(data["page_table"]), jnp.asarray(data["seq_lens"])
    o = decodejax.decode_attention(*args, table, lens, backend="pallas_triton_interpret")
    ref_o, _ = reference.paged_decode(*(a.astype(jnp.float32) for a in args), table, lens)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ref_o), atol=2e-2, rtol=2e-2)


BAD_INPUTS = [
    ("H_q=6 is not a multiple of H_kv=4", dict(q=(2, 6, 64), k=(9, 16, 4, 64))),
    ("dtype mismatch", dict(q_dtype=jnp.float16)),
    ("q must be", dict(q=(2, 8))),
    ("k_pages must be rank 4", dict(k=(9, 16, 64))),
    ("page id 9 of row b=0 is outside the pool of 9 pages", dict(table=[[9, 0, 0], [1, 0, 0]])),
    (r"seq_lens\[1\]=49 is outside \[0, page table width 3", dict(lens=[3, 49])),
    ("backend='cuda' is not one of", dict(backend="cuda")),
]


@pytest.mark.parametrize("match,change", BAD_INPUTS, ids=[m[:24] for m, _ in BAD_INPUTS])
def test_bad_input_raises_value_error_naming_the_value(match, change):
    q = jnp.zeros(change.get("q", (2, 8, 64)), change.get("q_dtype", jnp.bfloat16))
    k = jnp.zeros(change.get("k", (9, 16, 2, 64)), jnp.bfloat16)
    table = jnp.asarray(change.get("table", [[1, 2, 0], [3, 0, 0]]), jnp.int32)
    lens = jnp.asarray(change.get("lens", [20, 5]), jnp.int32)
    with pytest.raises(ValueError, match=match):
        decodejax.decode_attention(q, k, k, table, lens, backend=change.get("backend", "pallas_triton_interpret"))


def test_merge_states_backends_match_algebra_and_ignore_empty_slots():
    rng = np.random.default_rng(10)
    o = rng.normal(size=(3, 5, 20, 64)).astype(np.float32)
    lse = (rng.normal(size=(3, 5, 20)) * 5).astype(np.float32)
    lse[0, 0] = -np.inf  # an all-EMPTY row
    lse[1, :, 7:] = -np.inf
    o[1, :, 7:] = np.nan  # EMPTY slots' outputs are never read as data
    got_o, got_lse = decodejax.merge_states(jnp.asarray(o), jnp.asarray(lse), backend="pallas_triton_interpret")
    want_o, want_lse = decodejax.merge_states(jnp.asarray(o), jnp.asarray(lse), backend="xla")
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got_o)[0, 0] == 0) and np.asarray(got_lse)[0, 0] == -np.inf
    # The XLA backend (one variadic reduction) against the algebra's three reductions.
    algebra = decodejax.split_state.merge_lse_along(
        decodejax.split_state.LseState(valid=jnp.asarray(lse) > -jnp.inf, lse=jnp.asarray(lse), o=jnp.asarray(o)), axis=-1)
    np.testing.assert_allclose(np.asarray(want_o), np.asarray(algebra.o), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(want_lse), np.asarray(algebra.lse), atol=1e-6, rtol=1e-6)
    assert np.all(np.asarray(want_o)[0, 0] == 0) and np.asarray(want_lse)[0, 0] == -np.inf
    # Appending EMPTY slots changes no bit.
    more_o = np.concatenate([o, np.zeros((3, 5, 4, 64), np.float32)], axis=2)
    more_lse = np.concatenate([lse, np.full((3, 5, 4), -np.inf, np.float32)], axis=2)
    again = decodejax.merge_states(jnp.asarray(more_o), jnp.asarray(more_lse), backend="pallas_triton_interpret")
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(got_o))


def test_the_mosaic_paths_slot_by_slot_merge_matches_the_algebra():
    """The Mosaic path's merge, one slot at a time on o's shape: the algebra's result, EMPTY slots
    (their o NaN) weighing nothing, an all-EMPTY row giving (0, -inf), and a row of one live slot
    its own state exactly."""
    from decodejax._ops import _merge_slot_by_slot

    rng = np.random.default_rng(12)
    o = rng.normal(size=(3, 5, 16, 64)).astype(np.float32)
    lse = (rng.normal(size=(3, 5, 16)) * 5).astype(np.float32)
    lse[0, 0] = -np.inf
    lse[1, :, 7:] = -np.inf
    o[1, :, 7:] = np.nan
    lse[2, 1, 1:] = -np.inf
    got_o, got_lse = jax.jit(_merge_slot_by_slot)(jnp.asarray(o), jnp.asarray(lse))
    algebra = decodejax.split_state.merge_lse_along(
        decodejax.split_state.LseState(valid=jnp.asarray(lse) > -jnp.inf, lse=jnp.asarray(lse), o=jnp.asarray(o)), axis=-1)
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(algebra.o), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(algebra.lse), atol=1e-6, rtol=1e-6)
    assert np.all(np.asarray(got_o)[0, 0] == 0) and np.asarray(got_lse)[0, 0] == -np.inf
    np.testing.assert_array_equal(np.asarray(got_o)[2, 1], o[2, 1, 0])
    np.testing.assert_array_equal(np.asarray(got_lse)[2, 1], lse[2, 1, 0])
    bf16_o, _ = _merge_slot_by_slot(jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse))
    assert bf16_o.dtype == jnp.bfloat16


@pytest.mark.parametrize("block_s", [8, None])
def test_merge_kernel_folds_its_steps_in_order_and_all_empty_steps_change_no_bit(block_s):
    """The Pallas merge over several steps (20 slots in steps of 8; 70 slots at D 128 in the
    default's steps of 64) matches the XLA merge, and EMPTY slots appended past the last filled
    one, into a step of their own, leave every bit of (o, lse) as it was."""
    from pallas_kernels.merge_states import MergeConfig, merge_states

    rng = np.random.default_rng(12)
    slots, d = (20, 64) if block_s else (70, 128)
    o = rng.normal(size=(2, 3, slots, d)).astype(np.float32)
    lse = (rng.normal(size=(2, 3, slots)) * 5).astype(np.float32)
    lse[0, :, -3:] += 20.0  # the last step raises the running max: the earlier steps are rescaled
    lse[1, :, 5:] = -np.inf  # filled slots in the first step only
    o[1, :, 5:] = np.nan
    config = MergeConfig(block_s=block_s)
    got_o, got_lse = merge_states(jnp.asarray(o), jnp.asarray(lse), config=config, interpret=True)
    want_o, want_lse = decodejax.merge_states(jnp.asarray(o), jnp.asarray(lse), backend="xla")
    np.testing.assert_allclose(np.asarray(got_o), np.asarray(want_o), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=1e-5, rtol=1e-5)
    extra = config.slots_per_step(d)  # at least one whole step of EMPTY slots
    more_o = np.concatenate([o, np.full((2, 3, extra, d), np.nan, np.float32)], axis=2)
    more_lse = np.concatenate([lse, np.full((2, 3, extra), -np.inf, np.float32)], axis=2)
    again_o, again_lse = merge_states(jnp.asarray(more_o), jnp.asarray(more_lse), config=config, interpret=True)
    np.testing.assert_array_equal(np.asarray(again_o), np.asarray(got_o))
    np.testing.assert_array_equal(np.asarray(again_lse), np.asarray(got_lse))


@pytest.mark.parametrize("layout", [KVLayout.PAGED_NHD, KVLayout.PAGED_HND])
def test_gather_pages_kernel_matches_reference(layout):
    problem = make_problem(SPECS[0], np.random.default_rng(11))
    args = to_device(problem, jnp.bfloat16, layout)
    common = dict(layout=layout, cache_batch_idx=args["cache_batch_idx"])
    got = decodejax.gather_pages(args["k_pages"], args["page_table"], args["seq_lens"], backend="pallas_triton_interpret", **common)
    want = decodejax.gather_pages(args["k_pages"], args["page_table"], args["seq_lens"], backend="xla", **common)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.any(np.isnan(np.asarray(got, np.float32)))


def decode_shapes():
    """(q, k_pages, page_table, seq_lens) shapes of a small bf16 decode call, for lowering."""
    return (jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64, 16, 8, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))


def test_lowered_decode_step_contains_the_named_kernels():
    """A silent fallback to XLA would drop these names from the lowered GPU module."""
    q, k, table, lens = decode_shapes()
    with decodejax.dispatch.targeting("gpu", "9.0"):
        for config, merge_launch in ((None, True), (DecodeConfig(fused_merge=True), False)):
            step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, num_splits=4, config=config))
            text = step.trace(q, k, k, table, lens).lower(lowering_platforms=("cuda",)).as_text()
            assert "decodejax_paged_decode" in text and ("decodejax_merge_states" in text) == merge_launch
        gather = jax.jit(lambda p, t, l: decodejax.gather_pages(p, t, l))
        assert "decodejax_gather_pages" in gather.trace(k, table, lens).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("num_splits,fused_merge,kernels,others", [
    (None, False, 2, {"reshape"}),
    (None, True, 1, {"reshape", "constant", "broadcast_in_dim"}),  # the merge counter's zeros
    (1, False, 1, {"reshape"}),
], ids=["auto", "auto_fused_merge", "one_slot"])
def test_triton_decode_call_is_its_kernels_alone(num_splits, fused_merge, kernels, others):
    """Every XLA op around the kernels is a launch and host work per call (the H200 profile
    counted 7-8 launches per call when the bounds, a row iota and output slices ran in XLA):
    the program is the kernel (with the merge unless it is its own launch), free reshapes and,
    with several slots merged in the kernel, the zeros of the merge counter."""
    q, k, table, lens = decode_shapes()
    with decodejax.dispatch.targeting("gpu", "9.0"):
        step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, num_splits=num_splits,
                                                                        config=DecodeConfig(fused_merge=fused_merge)))
        text = step.trace(q, k, k, table, lens).lower(lowering_platforms=("cuda",)).as_text()
    ops = re.findall(r"= stablehlo\.([a-z_]+)", text)
    assert ops.count("custom_call") == kernels and set(ops) == {"custom_call"} | others, sorted(set(ops))


def test_lowered_mosaic_decode_contains_its_named_kernel_and_warns_nothing():
    import warnings

    q, k, table, lens = decode_shapes()
    jax.clear_caches()  # the kernel's body is traced here, not taken from an earlier test's trace
    with decodejax.dispatch.targeting("gpu", "9.0"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, backend="pallas_mosaic_gpu"))
        text = step.trace(q, k, k, table, lens).lower(lowering_platforms=("cuda",)).as_text()
    assert "decodejax_paged_decode_mgpu" in text
    # e.g. jax 0.11's deprecation of plgpu.load's separate index, raised at the kernel's own line
    ours = [f"{w.category.__name__}: {w.message}" for w in caught if w.filename.endswith("decode_attention_mgpu.py")]
    assert not ours, ours


def hopper_decode_key(head_dim: int):
    """The dispatch key of a bf16 decode call on an H100/H200: H_q 32, H_kv 8, 16-token NHD pages."""
    return decodejax.dispatch.DispatchKey(
        device_type="gpu", compute_capability="9.0", operation="attention", phase="decode", q_dtype="bfloat16",
        kv_dtype="bfloat16", q_len=1, kv_len=4096, num_q_heads=32, num_kv_heads=8, head_dim_qk=head_dim, head_dim_v=head_dim,
        cache_layout=KVLayout.PAGED_NHD.value, page_size=16)


@pytest.mark.parametrize("change,reason", [
    (dict(page_size=7), "page_size=7 is not a positive multiple of 8"),
    (dict(cache_layout=KVLayout.CONTIGUOUS_NHD.value, page_size=None), "paged layouts only"),
    (dict(page_size=24), "neither divides the other"),
    (dict(num_q_heads=128), "group size 16 > 8"),
    (dict(q_dtype="float32", kv_dtype="float32"), "bf16/fp16 only"),
    (dict(compute_capability="8.0"), "compute capability 8.0 < 9.0"),
    (dict(phase="append", q_len=4), "decode (one query row) only"),
])
def test_mosaic_admission_names_what_it_cannot_run(change, reason):
    key = hopper_decode_key(head_dim=128)
    mosaic = decodejax.dispatch.backend("pallas_mosaic_gpu")
    assert mosaic.reasons(key) == []
    assert any(reason in r for r in mosaic.reasons(dataclasses.replace(key, **change))), mosaic.reasons(dataclasses.replace(key, **change))


def test_a_config_for_the_other_kernel_is_refused_by_name():
    args = to_device(make_problem(SPECS[0], np.random.default_rng(15)), jnp.bfloat16)
    with pytest.raises(ValueError, match="config=DecodeConfig.*MosaicDecodeConfig"):
        decodejax.decode_attention(**args, config=DecodeConfig(), backend="pallas_mosaic_gpu_interpret")


def test_mosaic_configs_must_fit_shared_memory():
    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig, default_config, supports

    for d in (64, 128, 256):
        assert supports(16, d, 4, jnp.bfloat16, default_config(d)) == []
    too_big = supports(16, 128, 4, jnp.bfloat16, MosaicDecodeConfig(block_k=128, num_stages=4, compute_warpgroups=2))
    assert len(too_big) == 1 and "bytes of shared memory" in too_big[0]
    assert supports(16, 128, 4, jnp.bfloat16, MosaicDecodeConfig(programs=0)) == ["programs=0 must be >= 1 (or None: at most one per SM)"]


def test_mosaic_staged_output_takes_its_tiles_from_the_query_buffers_before_going_unstaged():
    """The staged output's tiles (64 rows and 8, in its dtype) fit beside two query tiles at D 128 in
    bf16, beside one in f32 (the partial states of several slots), and not at D 256, whose output
    goes out unstaged through the state tile; admission counts the unstaged kernel."""
    from pallas_kernels.decode_attention_mgpu import SHARED_MEMORY_BUDGET, default_config

    d128, d256 = default_config(128), default_config(256)
    assert d128.staged_output_fits(128, 2, 2) and d128.q_buffers(128, 2, 2) == 2
    assert d128.staged_output_fits(128, 2, 4) and d128.q_buffers(128, 2, 4) == 1
    assert d128._bytes(128, 2, 2, 4) > SHARED_MEMORY_BUDGET >= d128._bytes(128, 2, 1, 4)
    assert not d256.staged_output_fits(256, 2, 2) and d256.shared_memory_bytes(256, 2) <= SHARED_MEMORY_BUDGET
    # 64 x 128 f32 states + their m and l, two query tiles, four slots of K and V: 64-token blocks
    assert d128.shared_memory_bytes(128, 2) == 32768 + 512 + 2 * 16384 + 2 * 4 * 16384


def test_mosaic_pairs_kv_heads_only_where_the_pool_allows():
    """Two K/V heads an item need D 64 in an NHD pool (a pair's rows contiguous), an even H_kv and
    the pair's 2G query rows in one 8-row tile; the op's plan then counts pairs of D 128, and
    admission checks the paired tiles."""
    from pallas_kernels import decode_attention_mgpu as mgpu

    nhd, hnd = KVLayout.PAGED_NHD, KVLayout.PAGED_HND
    assert mgpu.pairable_heads(64, 8, 4, nhd)
    assert not any([mgpu.pairable_heads(64, 8, 4, hnd), mgpu.pairable_heads(64, 7, 1, nhd), mgpu.pairable_heads(64, 4, 8, nhd),
                    mgpu.pairable_heads(128, 8, 4, nhd)])
    paired = mgpu.default_config(64, pairable=True)
    assert paired == dataclasses.replace(mgpu.default_config(128), pair_heads=True)
    assert mgpu.item_geometry(paired, 64, 8, 4, nhd) == (4, 128)
    assert mgpu.item_geometry(paired, 64, 8, 4, hnd) == (8, 64)  # asked for, but the pool cannot
    assert mgpu.item_geometry(mgpu.default_config(64), 64, 8, 4, nhd) == (8, 64)  # not asked for
    assert decodejax._ops.kernel_items(mgpu, None, 64, 8, 4, nhd) == (paired, 4, 128)
    assert decodejax._ops.kernel_items(mgpu, None, 64, 8, 4, hnd) == (mgpu.default_config(64), 8, 64)
    key = hopper_decode_key(head_dim=64)
    mosaic = decodejax.dispatch.backend("pallas_mosaic_gpu")
    for change in ({}, dict(num_q_heads=64), dict(cache_layout=hnd.value)):  # paired; G 8 and HND one head an item
        assert mosaic.reasons(dataclasses.replace(key, **change)) == [], change
    assert any("page_size=24" in r for r in mosaic.reasons(dataclasses.replace(key, page_size=24)))
    # The call lowers to the paired kernel: its launch takes the pool as 4 heads of 128 (a silent
    # fall back to one head an item would pass every oracle test); the HND pool's stays 8 of 64.
    q, table, lens = (jax.ShapeDtypeStruct(s, t) for s, t in (((4, 32, 64), jnp.bfloat16), ((4, 16), jnp.int32), ((4,), jnp.int32)))
    for layout, pool, kernel_pool in ((nhd, (65, 16, 8, 64), "65x16x4x128"), (hnd, (65, 8, 16, 64), "65x8x16x64")):
        k = jax.ShapeDtypeStruct(pool, jnp.bfloat16)
        with decodejax.dispatch.targeting("gpu", "9.0"):
            step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, layout=layout, backend="pallas_mosaic_gpu"))
            text = step.trace(q, k, k, table, lens).lower(lowering_platforms=("cuda",)).as_text()
        operands = re.search(r"stablehlo\.custom_call @mosaic_gpu\w*\(.*?\) .*?: \((.*?)\) ->", text).group(1)
        assert operands.split(", ")[1:3] == [f"tensor<{kernel_pool}xbf16>"] * 2, operands


def test_mosaic_programs_are_the_fewest_that_keep_the_rounds():
    """Each H200 case's program count; then, for every item count up to 4 rounds of 132: the count
    takes the items in the rounds 132 programs would, and one program fewer would need another."""
    from pallas_kernels.decode_attention_mgpu import balanced_programs

    assert [balanced_programs(n, 132) for n in (1, 128, 132, 133, 256, 264, 512, 1024)] == [1, 128, 132, 67, 128, 132, 128, 128]
    ceil = lambda a, b: -(-a // b)
    for n in range(1, 4 * 132 + 1):
        programs = balanced_programs(n, 132)
        assert programs <= 132 and ceil(n, programs) == ceil(n, 132), n
        assert programs == 1 or ceil(n, programs - 1) > ceil(n, 132), n


def test_triton_programs_take_every_item_once_longest_split_first():
    """deal_longest_first maps the (B, H_kv, S) grid onto itself one to one; in launch order the
    programs take the request with the longest first split first, the requests of one key
    together in launch order (slot, head, request), and a batch of equal keys keeps launch order."""
    from pallas_kernels.decode_attention import deal_longest_first

    batch, kv_heads, slots = 5, 3, 2
    launch_order = [(b, h, s) for s in range(slots) for h in range(kv_heads) for b in range(batch)]

    def dealt(keys):
        deal = jax.jit(lambda b, h, s: deal_longest_first(jnp.array(keys, jnp.int32), b, h, s, batch=batch,
                                                          kv_heads=kv_heads, slots=slots))
        return [tuple(int(x) for x in deal(*program)) for program in launch_order]

    got = dealt([128, 0, 512, 128, 384, -1, -1, -1])  # padded to 8 lanes
    assert sorted(got) == sorted(launch_order)
    alone = lambda b: [(b, h, s) for s in range(slots) for h in range(kv_heads)]
    assert got == alone(2) + alone(4) + [(b, h, s) for s in range(slots) for h in range(kv_heads) for b in (0, 3)] + alone(1)
    assert dealt([256] * batch + [-1] * 3) == launch_order


def test_mosaic_call_ranks_the_splits_of_a_batch_only():
    """The split slots of a batch with more work items than programs are ranked by an argsort, from
    bounds XLA builds (B 8: 8 x 8 x 4 items for 132 programs). Those of one request are not (its
    balanced splits differ by at most a block), nor those of a batch with at most one item a
    program (B 4: 128 items): the kernel finds their bounds itself, and its launch takes q
    (reshaped in place), the pool, the table and the lengths, nothing XLA computed."""
    q, k, table, lens = decode_shapes()
    with decodejax.dispatch.targeting("gpu", "9.0"):
        step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, num_splits=4, backend="pallas_mosaic_gpu"))
        for batch, sorts, computed in ((8, 1, 4), (4, 0, 1), (1, 0, 1)):  # computed operands: q's reshape (+ bounds, order)
            first = lambda x: jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype)  # the first `batch` requests
            text = step.trace(first(q), k, k, first(table), first(lens)).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("stablehlo.sort") == sorts, batch
            operands = re.search(r"stablehlo\.custom_call @mosaic_gpu\w*\(([^)]*)\)", text).group(1).split(", ")
            assert [x for x in operands if not x.startswith("%arg")] == operands[:1] + operands[5:], operands
            assert len(operands) == 4 + computed, operands


def test_mosaic_splits_are_dealt_longest_first():
    from pallas_kernels.decode_attention_mgpu import split_order

    start = jnp.array([[0, 64, 0], [0, 300, 300]], jnp.int32)
    end = jnp.array([[64, 100, 0], [300, 300, 300]], jnp.int32)  # blocks of 64: [[1, 1, 0], [5, 0, 0]]
    np.testing.assert_array_equal(np.asarray(split_order(start, end, 64)), [3, 0, 1, 2, 4, 5])


@pytest.mark.parametrize("head_dim,config", [
    (64, None), (128, None), (256, None), (128, (64, 5, 1)), (128, (64, 3, 3)), (64, (128, 6, 2)), (256, (64, 2, 1))])
def test_admitted_mosaic_configs_lower_within_shared_memory(head_dim, config):
    """Mosaic GPU's lowering adds its own shared memory to the kernel's scratch and refuses a
    kernel over the device's 227 KiB (this check runs on CPU too); every config admission lets
    through must pass it. The default at D 256, five slots of one warpgroup at D 128 and six
    128-token slots at D 64 are within 2 KiB of the limit (an H200 run at 1a6e5ea failed at D 256
    by 96 bytes)."""
    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig, default_config, supports

    config = default_config(head_dim) if config is None else MosaicDecodeConfig(*config)
    assert supports(16, head_dim, 4, jnp.bfloat16, config) == []
    k = jax.ShapeDtypeStruct((64, 16, 2, head_dim), jnp.bfloat16)
    # One slot: the output tile in bf16 where it fits; several: f32 partial states, whose bounds
    # the kernel finds itself for a batch of at most one item a program (B 4: 16 items) and for
    # one request (fixed or adaptive, the auto plan), and XLA builds, with their order, for a batch
    # of more items than programs (B 16 in 8 slots: 256 items for 132).
    with decodejax.dispatch.targeting("gpu", "9.0"):
        for batch, num_splits in ((4, 1), (4, 2), (16, 8), (1, 2), (1, None)):
            q = jax.ShapeDtypeStruct((batch, 8, head_dim), jnp.bfloat16)
            table, lens = jax.ShapeDtypeStruct((batch, 16), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)
            step = jax.jit(lambda q, k, v, t, l: decodejax.decode_attention(q, k, v, t, l, config=config, num_splits=num_splits,
                                                                           backend="pallas_mosaic_gpu"))
            step.trace(q, k, k, table, lens).lower(lowering_platforms=("cuda",))


def test_backends_and_auto_choice_on_this_platform():
    assert {"xla", "pallas_triton", "pallas_triton_interpret", "cudnn"} <= set(decodejax.backends())
    problem = make_problem(SPECS[0], np.random.default_rng(12))
    args = to_device(problem, jnp.bfloat16)
    key = decodejax.dispatch.DispatchKey.from_call(args["q"], args["k_pages"], layout=KVLayout.PAGED_NHD, page_table=args["page_table"])
    assert decodejax.select(key).backend == ("pallas_triton" if jax.default_backend() == "gpu" else "xla")


def test_dense_mask_runs_on_the_xla_backend_and_is_refused_by_the_kernel():
    problem = make_problem(SPECS[0], np.random.default_rng(13))
    args = to_device(problem, jnp.float32)
    dense = jnp.asarray(np.random.default_rng(14).random((6, SPECS[0].max_len)) > 0.3)
    o, lse = decodejax.decode_attention(**args, dense_mask=dense, return_lse=True)
    ref_o, ref_lse = oracle(args, KVLayout.PAGED_NHD)
    masked = reference.paged_decode(args["q"], args["k_pages"], args["v_pages"], args["page_table"], args["seq_lens"],
                                    cache_batch_idx=args["cache_batch_idx"], dense_mask=dense)
    np.testing.assert_allclose(np.asarray(o), np.asarray(masked[0]), atol=1e-6)
    assert not np.allclose(np.asarray(o), np.asarray(ref_o), atol=1e-3)  # the mask changed the result
    with pytest.raises(decodejax.dispatch.AdmissionError, match="mask_kind=dense_custom"):
        decodejax.decode_attention(**args, dense_mask=dense, backend="pallas_triton_interpret")
