"""The unified decode runtime (R1-R8, F1, A3-A4) with the toy model on CPU."""

import dataclasses
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decodejax import addressing
from decodejax.cache import CacheGroup, CacheGroupRouter, KVPool, Leaf, OutOfPages, PageAllocator
from decodejax.metadata import (
    DecodeBuffers,
    DecodeRow,
    ExtendInputs,
    ForwardContext,
    build_extend_metadata,
    pack_decode_batch,
    packed_width,
    refresh_decode_metadata_jit,
)
from decodejax.runner import (
    CONCURRENT_COMMAND_BUFFERS,
    CUBLASLT_GEMMS,
    CUBLASLT_MIN_BS,
    AttentionLeafBackend,
    BackendNode,
    CaptureError,
    DecodeRunner,
    GraphDebugError,
    RebindError,
    RunnerConfig,
    compile_events,
    default_step_xla_options,
)
from decodejax.sampling import SamplingParams, SamplingPool, needs_order_statistics, sample_window
from models import toy

CFG = toy.ToyConfig()
G, P, MAX_BLOCKS, NUM_BLOCKS = 16, 8, 6, 40  # blocks of 16 tokens, kernel pages of 8
ROUTER = CacheGroupRouter((CacheGroup("main", G, MAX_BLOCKS),), (Leaf("full", "main", P),))
NUM_PAGES = NUM_BLOCKS * G // P


def make_runner(config=RunnerConfig(max_decode_bs=12, max_capture_bs=8, capture_ladder=(1, 2, 4, 8)), params=None, backends=None, forward=None):
    pool = KVPool.create(CFG.num_layers, NUM_PAGES, P, CFG.kv_heads, CFG.head_dim, jnp.float32)
    backends = backends or [AttentionLeafBackend("full", (0, 1), P, CFG.kv_heads, CFG.head_dim, "float32")]
    return DecodeRunner(
        forward or functools.partial(toy.forward, CFG), params or toy.init_params(CFG), pool, ROUTER, CFG.layer_leaves,
        backends, config, vocab_size=CFG.vocab_size, max_requests=32,
    )


def random_rows(rng, n, min_token=0):
    """n rows with distinct slots, disjoint blocks from one allocator and random lengths."""
    alloc = PageAllocator(NUM_BLOCKS)
    rows = []
    for slot in rng.permutation(32)[:n]:
        committed = int(rng.integers(0, MAX_BLOCKS * G - 1))
        blocks = alloc.allocate(-(-(committed + 1) // G))
        rows.append(DecodeRow(int(slot), committed, (int(rng.integers(min_token, CFG.vocab_size)),), {"main": blocks}))
    return rows


# -- cache and router ------------------------------------------------------------------------

def test_A4_allocator_never_hands_out_the_null_page_and_oom_changes_nothing():
    alloc = PageAllocator(9)
    pages = alloc.allocate(8)
    assert sorted(pages) == list(range(1, 9)) and alloc.num_free == 0
    with pytest.raises(OutOfPages, match="asked for 1 pages, 0 free"):
        alloc.allocate(1)
    alloc.free(pages[:3])
    with pytest.raises(OutOfPages):
        alloc.allocate(4)
    assert alloc.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        alloc.free([pages[0]])
    with pytest.raises(ValueError, match=r"cannot free pages \[0\]"):
        alloc.free([0])


def test_R5_router_expands_blocks_zeroes_padding_and_keeps_write_slots():
    blocks = jnp.array([[5, 9, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0], [7, 8, 0, 0, 0, 0]], jnp.int32)
    live = jnp.array([True, True, False])
    table = np.asarray(ROUTER.kernel_table("full", blocks, live))
    assert table.shape == (3, MAX_BLOCKS * G // P)
    assert table[0].tolist()[:4] == [10, 11, 18, 19] and not table[0, 4:].any()  # tails page 0
    assert not table[2].any()  # padded row: page 0
    positions = jnp.array([[0, 17, 31], [15, 3, 9], [0, 1, 2]])
    raw = addressing.write_slots(np.asarray(blocks[:2]), np.arange(2)[:, None], np.asarray(positions[:2]), G)
    np.testing.assert_array_equal(np.asarray(ROUTER.write_slots("full", jnp.asarray(table), positions))[:2], raw)


def test_R5_a_batch_missing_a_consumed_group_raises():
    with pytest.raises(ValueError, match=r"no block table for group\(s\) \['main'\] consumed by leaves \['full'\]"):
        ROUTER.check_groups({"other": [1]})


# -- sampling --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "field,value,match",
    [("temperature", float("nan"), "finite"), ("temperature", -1.0, ">= 0"), ("top_p", 0.0, r"\(0, 1\]"),
     ("top_p", float("inf"), "finite"), ("min_p", 1.0, r"\[0, 1\)"), ("top_k", -2, "int >= 0"),
     ("max_new_tokens", 0, ">= 1"), ("seed", -1, r"int in \[0, 2\*\*32\)"), ("stop_token_ids", (3, -1), "ints >= 0")],
)
def test_R8_sampling_params_rejects_bad_values_naming_them(field, value, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=.*{match}"):
        SamplingParams(**{field: value})


def test_R8_greedy_is_normalized_to_top_k_1():
    p = SamplingParams(temperature=0.0, top_k=40)
    assert (p.top_k, p.temperature) == (1, 1.0)


def _pool_for(params_by_slot):
    pool = SamplingPool.create(8)
    for slot, p in params_by_slot.items():
        pool = pool.set(slot, p)
    return pool


def test_R8_top_k_1_equals_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 1, 50))
    pool = _pool_for({s: SamplingParams(temperature=0.0, seed=s) for s in range(6)})
    tokens, accept = sample_window(logits, jnp.zeros((6, 1), jnp.int32), jnp.arange(6)[:, None], jnp.arange(6), pool)
    np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.argmax(np.asarray(logits[:, 0]), axis=-1))
    assert np.all(np.asarray(accept) == 1)


def test_R8_window_of_one_equals_plain_sampling_and_seeds_reproduce():
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, 1, 30)) * 3
    pool = _pool_for({s: SamplingParams(temperature=0.8, top_p=0.9, seed=100 + s) for s in range(4)})
    positions = jnp.array([[5], [9], [2], [7]])
    tokens, _ = sample_window(logits, jnp.zeros((4, 1), jnp.int32), positions, jnp.arange(4), pool)
    for r in range(4):
        key = jax.random.fold_in(jax.random.PRNGKey(100 + r), int(positions[r, 0]))
        from decodejax.sampling import _filter_logits

        filt = _filter_logits(logits[r], pool.temperature[r : r + 1], pool.top_k[r : r + 1], pool.top_p[r : r + 1], pool.min_p[r : r + 1])
        assert int(tokens[r, 0]) == int(jax.random.categorical(key, filt[0]))
    # The same request alone, in another row, gives the same token.
    alone, _ = sample_window(logits[2:3], jnp.zeros((1, 1), jnp.int32), positions[2:3], jnp.array([2]), pool)
    assert int(alone[0, 0]) == int(tokens[2, 0])


def test_R8_rows_that_need_no_sort_filter_the_same_alone_and_beside_rows_that_do():
    """A greedy, plain or min-p row's kept set must not depend on whether its neighbours ask for
    a top-k > 1 or a top-p < 1 (an order statistic of the sorted logits)."""
    from decodejax.sampling import _filter_logits

    logits = jax.random.normal(jax.random.PRNGKey(3), (5, 200)) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(min_p=0.05),
              SamplingParams(temperature=1.3, min_p=0.2), SamplingParams(top_p=0.8, top_k=20)]
    pool = _pool_for(dict(enumerate(params)))
    args = lambda rows: (logits[rows], pool.temperature[rows], pool.top_k[rows], pool.top_p[rows], pool.min_p[rows])  # noqa: E731
    together = np.asarray(_filter_logits(*args(np.arange(5))))
    for r in range(4):
        np.testing.assert_array_equal(np.asarray(_filter_logits(*args(np.array([r]))))[0], together[r])
    assert np.isfinite(together[0]).sum() == 1 and np.isfinite(together[1]).all()  # greedy: the max; plain: all
    assert 0 < np.isfinite(together[4]).sum() <= 20  # the sorted row's filters applied


def test_the_compiled_decode_step_holds_no_conditional():
    """XLA decides a conditional on the host: a step holding one waits, at dispatch, for the
    device to compute the predicate, so the engine's next step could not overlap this one (on
    the H200 the sampling's sort-or-not branch left the GPU idle 2 to 5 ms per step)."""
    step, resample = make_runner()._compile(4)
    for text in (step.as_text(), resample.as_text()):
        assert "custom_call" in text or "fusion" in text  # a compiled step, not an empty module
        assert "conditional(" not in text


def test_R8_the_step_sorts_nothing_and_its_resample_sorts():
    """The sort (up to about a millisecond per step on the H200) runs only in resample_step,
    which the runner adds when a live row needs top-k > 1 or top-p < 1."""
    step, resample = make_runner()._compile(4)
    assert " sort(" not in step.as_text() and " sort(" in resample.as_text()
    assert not needs_order_statistics(SamplingParams(temperature=0.0))
    assert not needs_order_statistics(SamplingParams(temperature=0.7, min_p=0.1, top_k=0))
    assert needs_order_statistics(SamplingParams(top_k=2)) and needs_order_statistics(SamplingParams(top_p=0.95))


@pytest.mark.parametrize("eager", [False, True], ids=["bucketed", "eager"])
def test_R8_runner_tokens_equal_the_sorting_sampler_on_the_steps_logits(eager):
    """Greedy, temperature, min-p, top-k and top-p rows in one batch: the runner's tokens equal
    sample_window (with the sort) on the logits of the step's own forward, row by row."""
    config = RunnerConfig(max_decode_bs=12, max_capture_bs=8, capture_ladder=(1, 2, 4, 8), enforce_eager=eager)
    runner = make_runner(config)
    runner.capture(progress=None)
    rows = random_rows(np.random.default_rng(11), 6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1), SamplingParams(min_p=0.3, seed=2),
              SamplingParams(top_k=3, seed=3), SamplingParams(top_p=0.5, seed=4), SamplingParams(top_k=5, top_p=0.8, temperature=1.5, seed=5)]
    for steps, batch in enumerate((rows[:3], rows)):  # first greedy/plain/min-p only (no resample), then all six
        for row, p in zip(batch, params):
            runner.set_sampling(row.slot, p)
        out = runner.step(batch)
        bs = runner.bucket_for(len(batch))
        ctx = ForwardContext.for_decode(runner.buffers, bs, CFG.layer_leaves)
        # The step already wrote this step's K/V; writing the same values again changes nothing.
        logits, _ = toy.forward(CFG, toy.init_params(CFG), runner.pool, ctx)
        tokens, accept = sample_window(logits, ctx.window_ids, ctx.positions, ctx.slots, runner.sampling)
        np.testing.assert_array_equal(out[:, 0], np.asarray(tokens)[: len(batch), 0], err_msg=f"batch {steps}")
        np.testing.assert_array_equal(out[:, 1], np.asarray(accept)[: len(batch)])


def test_R8_top_p_1_keeps_every_token_even_when_the_rounded_mass_reaches_1_early():
    from decodejax.sampling import _filter_logits

    logits = jnp.concatenate([jnp.array([30.0]), -30.0 - jnp.arange(999) / 1000])[None]  # tail mass ~1e-26 each, no ties
    one = lambda x: jnp.array([x])  # noqa: E731
    for top_k in (0, 5):  # without and with the sort
        kept = np.isfinite(np.asarray(_filter_logits(logits, one(1.0), one(top_k), one(1.0), one(0.0))))
        assert kept.sum() == (1000 if top_k == 0 else 5)


def test_R8_verify_accepts_leading_matching_drafts():
    logits = jnp.full((2, 3, 5), -5.0).at[0, 0, 2].set(5).at[0, 1, 4].set(5).at[0, 2, 1].set(5)
    logits = logits.at[1, 0, 3].set(5).at[1, 1, 0].set(5).at[1, 2, 0].set(5)
    pool = _pool_for({0: SamplingParams(temperature=0.0), 1: SamplingParams(temperature=0.0)})
    window = jnp.array([[7, 2, 4], [7, 1, 0]])  # row 0: both drafts match; row 1: first draft wrong
    tokens, accept = sample_window(logits, window, jnp.zeros((2, 3), jnp.int32), jnp.arange(2), pool)
    assert np.asarray(tokens).tolist() == [[2, 4, 1], [3, 0, 0]]
    assert np.asarray(accept).tolist() == [3, 1]


# -- metadata --------------------------------------------------------------------------------

BAD_BATCHES = [
    ("duplicate request slots", [DecodeRow(1, 3, (1,), {"main": [1]}), DecodeRow(1, 3, (1,), {"main": [2]})]),
    (r"token ids \[64\] outside the vocabulary of 64", [DecodeRow(1, 3, (64,), {"main": [1]})]),
    ("exceeds group 'main' capacity 6 blocks x 16", [DecodeRow(1, 96, (1,), {"main": [1, 2, 3, 4, 5, 6]})]),
    (r"blocks \[1\] do not cover positions \[0, 20\)", [DecodeRow(1, 19, (1,), {"main": [1]})]),
    (r"blocks \[0\] do not cover", [DecodeRow(1, 2, (1,), {"main": [0]})]),
    (r"no block table for group", [DecodeRow(1, 2, (1,), {})]),
    ("window has 2 ids, expected N=1", [DecodeRow(1, 2, (1, 2), {"main": [1]})]),
    (r"token_from_row=4 needs N=1 \(N=1\) and a row in \[0, 4\)", [DecodeRow(1, 2, (0,), {"main": [1]}, token_from_row=4)]),
]


@pytest.mark.parametrize("match,rows", BAD_BATCHES, ids=[m[:20] for m, _ in BAD_BATCHES])
def test_F1_bad_batches_are_rejected_before_any_write(match, rows):
    with pytest.raises(ValueError, match=match):
        pack_decode_batch(rows, bs=4, router=ROUTER, window=1, vocab_size=CFG.vocab_size)


@pytest.mark.parametrize("slot", [-1, 32])
def test_F1_a_slot_outside_the_sampling_pool_is_rejected_before_any_write(slot):
    runner = make_runner(RunnerConfig(max_decode_bs=12, max_capture_bs=8, enforce_eager=True))  # max_requests 32
    pool, buffers = runner.pool, runner.buffers
    with pytest.raises(ValueError, match=rf"request slots \[{slot}\] outside \[0, max_requests=32\)"):
        runner.submit([DecodeRow(1, 3, (1,), {"main": [1]}), DecodeRow(slot, 3, (1,), {"main": [2]})])
    assert runner.pool is pool and runner.buffers is buffers


def test_a_row_reading_its_token_on_the_device_matches_the_host_upload(rng):
    """token_from_row: the next step takes the token the previous step sampled in that row, with
    no host round trip; the result equals uploading that token from the host."""
    rows = random_rows(rng, 3)
    tokens = []
    for on_device in (False, True):
        runner = make_runner()
        first = runner.fetch(runner.submit(rows))[:, 0]
        nxt = [DecodeRow(r.slot, r.committed_len + 1, (0 if on_device else int(first[j]),), r.block_tables,
                         token_from_row=j if on_device else None) for j, r in enumerate(rows)][::-1]  # rows move
        nxt = [dataclasses.replace(r, block_tables={"main": r.block_tables["main"] + [NUM_BLOCKS - 1 - i]}) for i, r in enumerate(nxt)]
        pending = runner.submit(nxt)
        tokens.append(runner.fetch(pending)[:, 0])
        np.testing.assert_array_equal(np.asarray(runner.buffers.window_ids[:3, 0]), first[::-1])
    np.testing.assert_array_equal(tokens[0], tokens[1])


def _live_fields(buffers, n, N=1):
    return {
        "slots": np.asarray(buffers.slots[:n]), "window": np.asarray(buffers.window_ids[:n]),
        "positions": np.asarray(buffers.positions[:n]), "seq_lens": np.asarray(buffers.seq_lens[:n]),
        "table": np.asarray(buffers.page_tables["full"][:n]), "slots_w": np.asarray(buffers.write_slots["full"][: n * N]),
    }


def test_R1_eager_and_padded_replay_refresh_agree_on_live_rows():
    rng = np.random.default_rng(0)
    ladder = (1, 2, 4, 8)
    for actual in range(1, 12):
        rows = random_rows(rng, actual)
        bucket = next((b for b in ladder if b >= actual), actual)
        results = []
        for bs in (actual, bucket):
            buffers = DecodeBuffers.create(ROUTER, 12, 1)
            batch = pack_decode_batch(rows, bs=bs, router=ROUTER, window=1, vocab_size=CFG.vocab_size)
            buffers = refresh_decode_metadata_jit(buffers, batch, bs=bs, router=ROUTER)
            results.append(buffers)
        eager, replay = (_live_fields(b, actual) for b in results)
        for k in eager:
            np.testing.assert_array_equal(eager[k], replay[k], err_msg=k)
        # R3: padded rows point at page 0 with seq_len 0 and write inside page 0.
        padded = slice(actual, bucket)
        assert not np.asarray(results[1].page_tables["full"][padded]).any()
        assert not np.asarray(results[1].seq_lens[padded]).any()
        assert np.all(np.asarray(results[1].write_slots["full"][actual:bucket]) < P)


def test_R1_capture_refresh_over_placeholder_tables():
    buffers = DecodeBuffers.create(ROUTER, 8, 1)
    buffers = refresh_decode_metadata_jit(buffers, np.zeros((9, packed_width(ROUTER, 1)), np.int32), bs=8, router=ROUTER)  # header: actual_bs 0
    assert not np.asarray(buffers.page_tables["full"]).any() and not np.asarray(buffers.seq_lens).any()
    assert np.all(np.asarray(buffers.write_slots["full"]) < P)


def test_kv_pool_write_lands_at_its_slots_in_one_layer_and_in_place():
    pool = KVPool.create(3, 4, 2, 2, 3, jnp.float32)
    before = [a.unsafe_buffer_pointer() for a in pool.k + pool.v]
    rows = jnp.arange(2 * 2 * 3, dtype=jnp.float32).reshape(2, 2, 3) + 1
    write = jax.jit(lambda p, s, k, v: p.write(1, s, k, v), donate_argnums=(0,))
    pool = write(pool, jnp.array([3, 6], jnp.int32), rows, -rows)  # page 1 row 1, page 3 row 0
    k, v = np.stack(pool.k), np.stack(pool.v)
    np.testing.assert_array_equal(k[1, 1, 1], rows[0])
    np.testing.assert_array_equal(v[1, 3, 0], -rows[1])
    assert np.count_nonzero(k) == np.count_nonzero(v) == 2 * rows[0].size  # nothing else, no other layer
    # One row takes the dynamic-update-slice path: same placement, nothing else touched.
    pool = write(pool, jnp.array([7], jnp.int32), rows[:1] * 10, rows[:1] * 10)  # page 3 row 1
    k = np.stack(pool.k)
    np.testing.assert_array_equal(k[1, 3, 1], rows[0] * 10)
    np.testing.assert_array_equal(k[1, 1, 1], rows[0])
    assert np.count_nonzero(k) == 3 * rows[0].size
    # Rows aimed at the null page (padded rows, several to one slot) are dropped; the others land.
    pool = write(pool, jnp.array([0, 5, 0, 1], jnp.int32), jnp.ones((4, 2, 3)) * 7, jnp.ones((4, 2, 3)) * 7)  # page 2 row 1
    k = np.stack(pool.k)
    assert not k[1, 0].any()
    np.testing.assert_array_equal(k[1, 2, 1], np.full((2, 3), 7.0))
    assert np.count_nonzero(k) == 4 * rows[0].size
    # Donated per-layer buffers are updated in place: a step never copies the cache.
    assert [a.unsafe_buffer_pointer() for a in pool.k + pool.v] == before


def test_R5_write_locations_is_mode_checked():
    buffers = DecodeBuffers.create(ROUTER, 4, 1)
    ctx = ForwardContext.for_decode(buffers, 4, CFG.layer_leaves)
    assert ctx.write_locations(0, "decode").shape == (4,)
    with pytest.raises(ValueError, match="mode='extend'.* 'decode' forward"):
        ctx.write_locations(0, "extend")


def test_extend_metadata_is_request_major_and_refuses_pure_decode():
    inputs = ExtendInputs(extend_lens=(3, 2), prefix_lens=(0, 17), slots=(4, 9), token_ids=(1, 2, 3, 4, 5), block_tables={"main": [[2], [5, 6]]})
    ctx = build_extend_metadata(ROUTER, CFG.layer_leaves, inputs=inputs)
    assert np.asarray(ctx.positions[:, 0]).tolist() == [0, 1, 2, 17, 18]
    expected = [2 * G + 0, 2 * G + 1, 2 * G + 2, 6 * G + 1, 6 * G + 2]
    assert np.asarray(ctx.write_locations(0, "extend")).tolist() == expected
    assert np.asarray(ctx.slots).tolist() == [4, 4, 4, 9, 9]
    with pytest.raises(ValueError, match="pure decode batch"):
        build_extend_metadata(ROUTER, CFG.layer_leaves, inputs=dataclasses.replace(inputs, extend_lens=(1, 1), prefix_lens=(5, 17), token_ids=(1, 2)))
    with pytest.raises(TypeError):
        build_extend_metadata(ROUTER, CFG.layer_leaves, inputs)  # the bundle is keyword-only


def test_extend_metadata_request_view_for_append_attention():
    inputs = ExtendInputs(extend_lens=(3, 2), prefix_lens=(0, 17), slots=(4, 9), token_ids=(1, 2, 3, 4, 5), block_tables={"main": [[2], [5, 6]]})
    ctx = build_extend_metadata(ROUTER, CFG.layer_leaves, inputs=inputs, pad_to=8, pad_requests_to=4)
    table, qo_indptr, kv_lens = ctx.append_rows(0)
    assert np.asarray(qo_indptr).tolist() == [0, 3, 5, 5, 5] and np.asarray(kv_lens).tolist() == [3, 19, 0, 0]
    # Kernel pages of P = 8 from blocks of G = 16: block g -> pages 2g, 2g + 1; padding requests see the null page.
    assert np.asarray(table)[:, :4].tolist() == [[4, 5, 0, 0], [10, 11, 12, 13], [0, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="pad_requests_to=1"):
        build_extend_metadata(ROUTER, CFG.layer_leaves, inputs=inputs, pad_requests_to=1)
    decode_ctx = ForwardContext.for_decode(DecodeBuffers.create(ROUTER, 4, 1), 2, CFG.layer_leaves)
    with pytest.raises(ValueError, match="append_rows"):
        decode_ctx.append_rows(0)


# -- the runner ------------------------------------------------------------------------------

def test_R2_above_ladder_decode_matches_eager(caplog):
    rng = np.random.default_rng(1)
    rows = random_rows(rng, 11)
    bucketed = make_runner()
    bucketed.capture(progress=None)
    eager = make_runner(RunnerConfig(max_decode_bs=12, max_capture_bs=8, capture_ladder=(1, 2, 4, 8), enforce_eager=True))
    for params in ({r.slot: SamplingParams(temperature=0.0) for r in rows}).items():
        bucketed.set_sampling(*params)
        eager.set_sampling(*params)
    assert bucketed.bucket_for(11) == 11
    with caplog.at_level(logging.WARNING, logger="decodejax.runner"):
        np.testing.assert_array_equal(bucketed.step(rows), eager.step(rows))
        bucketed.step(rows)
    assert caplog.text.count("11 rows is above the capture ladder") == 1  # announced once per size
    # Page 0 differs by design: capture ran padded rows, which write there.
    np.testing.assert_allclose(np.stack(bucketed.pool.k)[:, 1:], np.stack(eager.pool.k)[:, 1:], atol=1e-6)


def test_R2_sizes_between_the_ladder_top_and_max_capture_bs_run_at_their_exact_size():
    runner = make_runner(RunnerConfig(max_decode_bs=12, max_capture_bs=11))  # default ladder (1, 2, 4, 8)
    assert runner.config.ladder == (1, 2, 4, 8)
    assert [runner.bucket_for(n) for n in (3, 8, 9, 11, 12)] == [4, 8, 9, 11, 12]


def test_R4_no_trace_or_compile_after_warmup_over_1000_steps(monkeypatch):
    monkeypatch.setenv("DECODEJAX_GRAPH_DEBUG", "1")
    runner = make_runner()
    runner.capture(progress=None)
    rng = np.random.default_rng(2)
    batches = [random_rows(rng, n) for n in rng.integers(1, 9, 20)]
    before = compile_events()
    for i in range(1000):
        runner.step(batches[i % len(batches)])
    assert compile_events() == before


def test_R4_guard_names_a_rebound_leaf_by_its_path(monkeypatch):
    monkeypatch.setenv("DECODEJAX_GRAPH_DEBUG", "1")
    runner = make_runner()
    runner.capture(progress=None)
    rows = random_rows(np.random.default_rng(3), 3)
    runner.step(rows)
    runner.buffers = dataclasses.replace(runner.buffers, seq_lens=jnp.array(np.asarray(runner.buffers.seq_lens)))
    with pytest.raises(GraphDebugError, match=r"buffers\.seq_lens"):
        runner.step(rows)


def test_R3_padded_rows_with_nan_activations_never_touch_live_pages():
    params = toy.init_params(CFG)
    params["embed"] = params["embed"].at[0].set(jnp.nan)  # padded rows carry token 0: NaN activations
    rng = np.random.default_rng(4)
    rows = random_rows(rng, 5, min_token=1)
    # Multi-row buckets only: bucket 1's capture would write its padded row's NaN K/V into page 0
    # (a one-row write is a dynamic-update-slice, which writes every row it is given).
    padded = make_runner(params=params, config=RunnerConfig(max_decode_bs=12, max_capture_bs=8, capture_ladder=(4, 8)))
    padded.capture(progress=None)
    exact = make_runner(params=params, config=RunnerConfig(max_decode_bs=12, max_capture_bs=8, enforce_eager=True))
    assert padded.bucket_for(5) == 8
    out_padded, out_exact = padded.step(rows), exact.step(rows)
    np.testing.assert_array_equal(out_padded, out_exact)
    k_pad, k_exact = np.stack(padded.pool.k), np.stack(exact.pool.k)
    live_pages = np.arange(1, NUM_PAGES)
    np.testing.assert_allclose(k_pad[:, live_pages].sum(), k_exact[:, live_pages].sum(), rtol=1e-6)
    assert not np.isnan(k_pad[:, live_pages]).any()
    assert not k_pad[:, 0].any() and not k_exact[:, 0].any()  # a multi-row write drops the padded rows' null-page slots
    # ... though those rows did run on NaN: the step's logits for them are NaN.
    step, _ = padded.executable(8)
    packed = pack_decode_batch(rows, bs=8, router=padded.router, window=1, vocab_size=CFG.vocab_size)
    padded.pool, padded.buffers, _, logits = step(padded.param_leaves, padded.pool, padded.buffers, padded.sampling, packed)
    assert np.isnan(np.asarray(logits)[5:]).all() and not np.isnan(np.asarray(logits)[:5]).any()


def test_R1_a_bucket_reused_with_100_table_sets_matches_eager_every_step():
    # float32 matmuls: at XLA's default precision (which allows TF32 on a GPU) the captured and
    # the eager step's K rows differed by up to 2.07e-4 on the H200, and matched at float32
    # (benchmarks/README.md, forty-first session); this test is about which pages a reused
    # bucket reads and writes, not about GEMM rounding.
    with jax.default_matmul_precision("float32"):
        runner = make_runner()
        runner.capture(progress=None)
        eager = make_runner(RunnerConfig(max_decode_bs=12, max_capture_bs=8, enforce_eager=True))
        rng = np.random.default_rng(5)
        for step in range(100):
            rows = random_rows(rng, int(rng.integers(5, 9)))  # bucket 8 every step
            np.testing.assert_array_equal(runner.step(rows), eager.step(rows), err_msg=f"step {step}")
    np.testing.assert_allclose(np.stack(runner.pool.k)[:, 1:], np.stack(eager.pool.k)[:, 1:], atol=1e-5)


class NoBuckets(BackendNode):
    supports_buckets = {"decode": False, "prefill": False}


def test_R6_bucket_support_is_and_composed_and_culprits_logged(caplog):
    leaf = AttentionLeafBackend("full", (0, 1), P, CFG.kv_heads, CFG.head_dim, "float32")
    with caplog.at_level(logging.WARNING, logger="decodejax.runner"):
        runner = make_runner(backends=[leaf, NoBuckets()])
    assert not runner.bucketed and "NoBuckets" in caplog.text
    assert runner.capture(progress=None) == {} and runner.bucket_for(3) == 3


def test_R6_capture_failure_is_fatal():
    def broken(params, pool, ctx):
        raise RuntimeError("no kernel for this bucket")

    runner = make_runner(forward=broken)
    with pytest.raises(CaptureError, match="bs=1"):
        runner.capture(progress=None)


def test_step_xla_options_reach_each_buckets_compile():
    """The policy is asked once per bucket and its options reach that bucket's compile: an
    option XLA refuses fails the capture at that bucket, naming the option. Every bucket is
    lowered before the first compile's result is read, and a failed compile leaves no bucket
    captured."""
    asked = []

    def options(bs):
        asked.append(bs)
        return {"xla_no_such_option": True} if bs == 4 else {}

    runner = make_runner(config=RunnerConfig(max_decode_bs=12, max_capture_bs=8, capture_ladder=(1, 4, 8), step_xla_options=options))
    with pytest.raises(CaptureError, match=r"bs=4.*xla_no_such_option"):
        runner.capture(progress=None)
    assert asked == [1, 4, 8] and runner.capture_seconds == {} and not runner._executables


def test_capture_lowers_the_next_buckets_while_one_thread_compiles(monkeypatch):
    """Bucket 1's compile waits until the last bucket is lowered: capture finishes only if
    lowering runs ahead of compiling. Compiles run on one thread other than this one, and the
    per-bucket seconds sum to no more than the capture's wall time."""
    runner = make_runner()
    lower, compile_lowered = runner._lower, runner._compile_lowered
    last_lowered, compile_threads = threading.Event(), set()

    def lower_and_signal(bs):
        lowered = lower(bs)
        if bs == runner.config.ladder[-1]:
            last_lowered.set()
        return lowered

    def compile_after_the_last_lowering(*args):
        assert last_lowered.wait(timeout=120), "compiling waited for a lowering that never came"
        compile_threads.add(threading.get_ident())
        return compile_lowered(*args)

    monkeypatch.setattr(runner, "_lower", lower_and_signal)
    monkeypatch.setattr(runner, "_compile_lowered", compile_after_the_last_lowering)
    t0 = time.perf_counter()
    seconds = runner.capture(progress=None)
    wall = time.perf_counter() - t0
    assert sorted(seconds) == list(runner.config.ladder) == [1, 2, 4, 8]
    assert len(compile_threads) == 1 and threading.get_ident() not in compile_threads
    assert all(s > 0 for s in seconds.values()) and sum(seconds.values()) <= wall
    rows = random_rows(np.random.default_rng(7), 3)
    eager = make_runner(RunnerConfig(max_decode_bs=12, max_capture_bs=8, enforce_eager=True))
    np.testing.assert_array_equal(runner.step(rows), eager.step(rows))


def test_default_step_xla_options_add_cublaslt_from_its_bucket_up():
    below, at = default_step_xla_options(CUBLASLT_MIN_BS - 1), default_step_xla_options(CUBLASLT_MIN_BS)
    assert below == dict(CONCURRENT_COMMAND_BUFFERS)
    assert at == dict(CONCURRENT_COMMAND_BUFFERS + CUBLASLT_GEMMS) == default_step_xla_options(2 * CUBLASLT_MIN_BS)
    assert RunnerConfig().step_xla_options is default_step_xla_options


def test_R7_rejected_rebind_changes_nothing_accepted_rebind_publishes():
    runner = make_runner()
    runner.capture(progress=None)
    runner.step(random_rows(np.random.default_rng(6), 2))
    pool_before, buffers_before = runner.pool, runner.buffers
    wrong = KVPool.create(CFG.num_layers, NUM_PAGES, 16, CFG.kv_heads, CFG.head_dim, jnp.float32)
    with pytest.raises(RebindError, match=r"pool pages \[P=16"):
        runner.rebind_pool(wrong)
    assert runner.pool is pool_before and runner.buffers is buffers_before and runner._executables
    bigger = KVPool.create(CFG.num_layers, 2 * NUM_PAGES, P, CFG.kv_heads, CFG.head_dim, jnp.float32)
    runner.rebind_pool(bigger)
    assert runner.pool is bigger and not runner._executables


def test_capture_uses_the_persistent_compilation_cache(tmp_path):
    """In a fresh process (the cache directory is process-global): capture fills the cache."""
    import subprocess
    import sys

    script = f"""
import functools, jax.numpy as jnp
from decodejax.cache import CacheGroup, CacheGroupRouter, KVPool, Leaf
from decodejax.runner import AttentionLeafBackend, DecodeRunner, RunnerConfig
from models import toy
cfg = toy.ToyConfig()
router = CacheGroupRouter((CacheGroup("main", 16, 4),), (Leaf("full", "main", 8),))
pool = KVPool.create(cfg.num_layers, 32, 8, cfg.kv_heads, cfg.head_dim, jnp.float32)
runner = DecodeRunner(functools.partial(toy.forward, cfg), toy.init_params(cfg), pool, router, cfg.layer_leaves,
    [AttentionLeafBackend("full", (0, 1), 8, cfg.kv_heads, cfg.head_dim, "float32")],
    RunnerConfig(max_decode_bs=2, max_capture_bs=2, compilation_cache_dir={str(tmp_path)!r}), vocab_size=cfg.vocab_size, max_requests=4)
print(sorted(runner.capture(progress=None)))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[1, 2]" in out.stdout
    assert any(tmp_path.iterdir()), "no compiled executable was written to the cache"
