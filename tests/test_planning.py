"""Invariants P1-P2: split bounds, plans, the split-count heuristic and the ledgers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodejax import KVLayout, fixtures, planning
from decodejax.planning import PlanMismatch, SplitPlan
from pallas_kernels.decode_attention import DecodeConfig


def assert_exact_cover(lengths, start, end):
    """P1: per request, non-empty ranges are disjoint, in order, and cover [0, T_b)."""
    for b, t in enumerate(lengths):
        covered = np.zeros(t, int)
        for s, e in zip(start[b], end[b]):
            assert 0 <= s <= e <= t
            covered[s:e] += 1
        assert np.all(covered == 1)


@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=8), splits=st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_P1_balanced_bounds_cover_exactly(lengths, splits):
    start, end = planning.balanced_split_bounds(np.array(lengths), splits)
    assert_exact_cover(lengths, start, end)
    sizes = end - start
    assert np.all(sizes.max(1) - sizes.min(1) <= 1)


@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=8), chunk=st.integers(1, 700))
@settings(max_examples=60, deadline=None)
def test_P1_fixed_chunk_bounds_cover_exactly(lengths, chunk):
    start, end = planning.fixed_chunk_bounds(np.array(lengths), chunk)
    assert_exact_cover(lengths, start, end)


def test_P1_bounds_run_under_jit_and_match_host():
    lengths = np.array([3587, 4096, 0, 5])
    host = planning.balanced_split_bounds(lengths, 8)
    dev = jax.jit(lambda t: planning.balanced_split_bounds(t, 8))(jnp.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(dev[0]), host[0])
    np.testing.assert_array_equal(np.asarray(dev[1]), host[1])


@pytest.mark.parametrize("plan,whole", [(SplitPlan(1, 1, align=128), True), (SplitPlan(1, 2, align=128), False),
                                        (SplitPlan(2, 2, align=128), False)])
def test_whole_request_plans_bound_each_request_by_its_length(plan, whole):
    """`whole_requests` (a kernel then takes [0, T_b) from the lengths, with no bounds built) holds
    exactly where the plan's bounds are that."""
    lengths = np.array([0, 1, 127, 128, 129, 5000])
    start, end = plan.bounds(lengths)
    assert plan.whole_requests == whole
    assert (np.array_equal(start, np.zeros((6, 1))) and np.array_equal(end, lengths[:, None])) == whole


def test_seed_fixture_split_lengths():
    fx = fixtures.SPLIT_LENGTHS
    start, end = planning.balanced_split_bounds(np.array([fx["T"]]), fx["S"])
    assert (end - start)[0].tolist() == fx["lengths"]


def test_P1_capacity_slots_are_empty_and_counted():
    fx = fixtures.LEDGERS["capacity"]
    plan = SplitPlan(num_splits=fx["S"], capacity=fx["capacity"])
    start, end = plan.bounds(np.array(fx["T"]))
    assert start.shape == (2, 8)
    assert (end - start)[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert np.all(end[1] == start[1])
    counts = planning.owner_counts(plan, fx["T"], fx["H_q"])
    assert (counts["owners"], counts["active"], counts["empty"], counts["reducers"]) == (64, 12, 52, 8)


def test_P2_plan_rejects_mismatched_run_naming_fields():
    plan = SplitPlan(num_splits=4, capacity=8)
    plan.check_run(num_splits=4, capacity=8)
    with pytest.raises(PlanMismatch, match="num_splits: plan has 4, run has 2.*capacity: plan has 8, run has 16"):
        plan.check_run(num_splits=2, capacity=16)


def test_P2_plan_validation_errors():
    with pytest.raises(ValueError, match="capacity=2 is smaller than num_splits=4"):
        SplitPlan(4, 2)
    with pytest.raises(ValueError, match="chunk=None"):
        SplitPlan(1, 4, policy="fixed_chunk")
    with pytest.raises(ValueError, match="max_split_blocks=8 needs target_splits"):
        SplitPlan(4, 4, max_split_blocks=8)
    with pytest.raises(ValueError, match="max_split_blocks=0 needs"):
        SplitPlan(4, 4, target_splits=4, max_split_blocks=0)
    with pytest.raises(PlanMismatch, match="exceed capacity 2 x chunk 10"):
        SplitPlan(1, 2, policy="fixed_chunk", chunk=10).bounds(np.array([25]))


def test_P2_fixed_chunk_plan_is_batch_invariant():
    plan = SplitPlan(num_splits=1, capacity=6, policy="fixed_chunk", chunk=100)
    alone = plan.bounds(np.array([437]))
    batched = plan.bounds(np.array([12, 437, 599]))
    np.testing.assert_array_equal(alone[0][0], batched[0][1])
    np.testing.assert_array_equal(alone[1][0], batched[1][1])


def test_choose_num_splits_heuristic():
    # Enough programs to fill 80% of the SMs: one split.
    assert planning.choose_num_splits(64, 8, 64, 132, 64) == 1
    # One request, 8 heads, 132 SMs: the best is S = 33 (two full waves, efficiency 1.0);
    # S = 14 reaches 112/132 = 0.848 < 0.85, S = 15 reaches 120/132 = 0.909.
    assert planning.choose_num_splits(1, 8, 2048, 132, 64) == 15
    # Never more splits than K/V blocks.
    assert planning.choose_num_splits(1, 1, 3, 132, 64) == 3
    # Counts that do not change blocks per split are skipped (4 blocks: 3 -> ceil 2 like 2).
    s = planning.choose_num_splits(1, 40, 4, 132, 64)
    assert s in (1, 2, 4) and s != 3


def test_seed_fixture_ledgers():
    fx = fixtures.LEDGERS
    call = fx["call"]
    n = call["B"] * call["H_q"] * call["S"]
    mlu = planning.workspace_bytes(n, call["d"], abi="mlu")
    assert (mlu.bytes_per_state, mlu.logical_bytes) == (fx["mlu_bytes_per_state"], fx["mlu_bytes"])
    lse_o = planning.workspace_bytes(n, call["d"], abi="lse_o", vector_dtype="bfloat16")
    assert (lse_o.bytes_per_state, lse_o.logical_bytes) == (fx["lse_o_bytes_per_state"], fx["lse_o_bytes"])
    t = planning.traffic_ledger(call["T"], call["H_q"], call["H_kv"], call["d"], call["d"], workspace=mlu)
    assert (t.unique_kv_bytes, t.q_head_demand_bytes) == (fx["unique_kv_bytes"], fx["q_head_demand_bytes"])
    assert t.workspace_round_trip_bytes == 2 * fx["mlu_bytes"]
    pad = fx["padded"]
    w = planning.workspace_bytes(pad["states"], pad["d_v"], alignment=pad["alignment"])
    assert (w.logical_bytes, w.allocated_bytes) == (pad["logical"], pad["allocated"])


@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=6), splits=st.integers(1, 20), align=st.sampled_from([1, 16, 64]))
@settings(max_examples=60, deadline=None)
def test_P1_block_aligned_plan_covers_exactly(lengths, splits, align):
    start, end = SplitPlan(splits, splits + 2, align=align).bounds(np.array(lengths))
    assert_exact_cover(lengths, start, end)
    inner = start[end > start]
    assert np.all(inner % align == 0)


def test_auto_split_counts_match_the_h200_measurements():
    """Splits per request of the auto plan (`_ops.decode_plan`, H_kv = 8, 132 SMs, block 128) at
    the benchmark shapes: the fastest S of the committed H200 split sweep, except B = 1 (32 is
    3% behind 64); D = 64 keeps the two splits its earlier auto plan ran at. A full-length
    uniform batch leaves no slot EMPTY: the capacity is what it uses (one slot: one launch)."""
    from decodejax import _ops

    expected = {(1, 32768, 128): 32, (8, 8192, 128): 4, (32, 4096, 128): 1, (64, 2048, 128): 1, (128, 1024, 128): 1, (32, 4096, 64): 2}
    for (batch, length, d), best in expected.items():
        plan = _ops.decode_plan(batch, 8, length, DecodeConfig(block_k=128), num_splits=None, deterministic=False, head_dim=d)
        start, end = plan.bounds(np.full(batch, length))
        assert np.all((end > start).sum(1) == best), (batch, length, d)
        assert plan.capacity == best, (batch, length, d)
    assert planning.decode_split_capacity(1, 8, 100, 128, 132) == 1  # never a split under a block
    assert planning.decode_split_capacity(1, 1, 10**6, 128, 132) == 64  # capped
    assert planning.decode_split_capacity(32, 8, 16384, 128, 132) == 16384 // planning.MAX_SPLIT_TOKENS  # room for the cap


def test_auto_plan_adapts_only_where_its_items_outnumber_the_sms():
    """One round (B x H_kv x S items no more than the SMs' items_per_sm each): the plan's splits
    are each request's own, so a kernel finding bounds reads no other lengths; beyond it they
    adapt to the batch's total. At the benchmark shapes (H_kv 8, 132 SMs): the Mosaic kernel
    (one item an SM) at B 1 and 8 has 128 items, the Triton kernel (two) 256 of 264; the ragged
    batch's (B 32, 16,384-token tables) 1,024 items adapt for both, and so does B 8 in a
    65,536-token table, whose split cap gives it more items than SMs."""
    from decodejax import _ops
    from pallas_kernels.decode_attention_mgpu import MosaicDecodeConfig

    plan = lambda batch, length, config: _ops.decode_plan(batch, 8, length, config, num_splits=None, deterministic=False)
    for config in (MosaicDecodeConfig(), DecodeConfig(block_k=128)):
        for batch, length in ((1, 32768), (8, 8192)):
            p = plan(batch, length, config)
            assert batch * 8 * p.capacity <= 132 * config.items_per_sm and not p.adapts_to_batch, (config, batch)
        p = plan(32, 16384, config)
        assert 32 * 8 * p.capacity > 132 * config.items_per_sm and p.adapts_to_batch, config
    wide = plan(8, 65536, MosaicDecodeConfig())
    assert 8 * 8 * wide.capacity > 132 and wide.adapts_to_batch


def test_a_batch_that_fills_the_gpu_gets_no_slots_for_the_split_cap():
    """An engine's tables are as wide as its longest context (8,238 tokens in e2e_decode.py). At
    B 64 and 128 the batch's own programs fill the GPU (3 per SM), so the capacity is one slot
    (one launch, no EMPTY programs); at B 32 the cap's slots stay for ragged batches."""
    cap_slots = -(-8238 // planning.MAX_SPLIT_TOKENS)
    assert [planning.decode_split_capacity(b, 8, 8238, 128, 132) for b in (32, 49, 50, 64, 128)] == [cap_slots, cap_slots, 1, 1, 1]
    assert planning.decode_split_capacity(64, 8, 8238, 128, 132, head_dim=64) == cap_slots  # D 64: 6 programs per SM


def test_the_triton_kernel_takes_64_token_blocks_where_the_batch_fills_the_gpu():
    """The same threshold (132 SMs, H_kv 8): from B 50 at D 128 the default tiling halves its
    K/V blocks, which keeps the one-slot plan; at D 64 the threshold doubles and the halved tile
    is the 128-token block it already had; ungrouped queries (H_q = H_kv = 32, filling the GPU
    from B 13) and a call whose batch is not known keep the default."""
    from decodejax import _ops
    from pallas_kernels import decode_attention as triton_kernel

    def block(batch, d=128, kv_heads=8, group=4):
        return _ops.kernel_items(triton_kernel, None, d, kv_heads, group, KVLayout.PAGED_NHD, batch=batch)[0].block_k

    assert [block(b) for b in (1, 32, 49, 50, 64, 128)] == [128, 128, 128, 64, 64, 64]
    assert [block(b, d=64) for b in (64, 99, 128)] == [128, 128, 128]
    assert planning.batch_fills_gpu(32, 32, 132) and block(32, kv_heads=32, group=1) == 128
    assert _ops.kernel_items(triton_kernel, None, 128, 8, 4, KVLayout.PAGED_NHD)[0].block_k == 128
    for batch in (50, 128):
        config = _ops.kernel_items(triton_kernel, None, 128, 8, 4, KVLayout.PAGED_NHD, batch=batch)[0]
        assert _ops.decode_plan(batch, 8, 8238, config, num_splits=None, deterministic=False).capacity == 1


def test_auto_plan_caps_its_splits_at_max_split_tokens():
    """The ragged shape (B 32, 16,384-token tables): a 16,384-token request beside 8,192-token
    ones. The batch's total alone would cut ~8k-token splits (the total over the split target);
    the cap cuts none over MAX_SPLIT_TOKENS, and a uniform full-length 4,096-token batch of the
    same shapes still runs one split per request."""
    from decodejax import _ops

    plan = _ops.decode_plan(32, 8, 16384, DecodeConfig(block_k=128), num_splits=None, deterministic=False)
    lengths = np.array([16384] + [8192] * 31)
    start, end = plan.bounds(lengths)
    assert_exact_cover(lengths, start, end)
    assert (end - start).max() == planning.MAX_SPLIT_TOKENS
    assert (end > start)[0].sum() == 16384 // planning.MAX_SPLIT_TOKENS
    u_start, u_end = dataclasses.replace(plan, max_split_blocks=None).bounds(lengths)
    assert (u_end - u_start).max() == 8192
    start, end = plan.bounds(np.full(32, 4096))
    assert np.all((end > start).sum(1) == 1)


def test_adaptive_splits_follow_the_lengths_not_the_static_bound():
    """A runtime's table width bounds lengths statically; a short batch still gets its splits."""
    plan = SplitPlan(64, 64, align=128, target_splits=planning.decode_target_splits(8, 132))
    start, end = plan.bounds(np.array([2048]))  # a 2,048-token request under a 32k-token bound
    assert (end > start).sum() == 16  # one 128-token block each: 128 programs over 8 heads
    start, end = plan.bounds(np.array([0, 5, 4000, 300]))  # mixed: every active split non-empty
    assert_exact_cover([0, 5, 4000, 300], start, end)


@given(lengths=st.lists(st.integers(0, 20000), min_size=1, max_size=8), splits=st.integers(1, 64),
       target=st.integers(1, 300), align=st.sampled_from([1, 16, 128]), cap=st.one_of(st.none(), st.integers(1, 64)))
@settings(max_examples=60, deadline=None)
def test_P1_adaptive_plan_covers_exactly_and_never_exceeds_its_slots(lengths, splits, target, align, cap):
    lengths = np.array(lengths)
    plan = SplitPlan(splits, splits, align=align, target_splits=target, max_split_blocks=cap)
    start, end = plan.bounds(lengths)
    assert_exact_cover(lengths, start, end)
    active = (end > start).sum(1)
    blocks = -(-lengths // align)
    assert np.all(active <= np.minimum(splits, np.maximum(blocks, 1)))
    if cap is None:  # splits beyond the target appear only because a request needs at least one
        assert active.sum() <= max(target, 0) + len(lengths)
    else:  # a request with a slot to spare has no split over the cap
        spare = active < splits
        assert np.all(np.where(spare[:, None], -(-(end - start) // align), 0) <= cap)
    j_start, j_end = jax.jit(plan.bounds)(jnp.asarray(lengths))
    np.testing.assert_array_equal(np.asarray(j_start), start)
    np.testing.assert_array_equal(np.asarray(j_end), end)
