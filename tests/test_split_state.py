"""Invariants S1-S3: the split-state algebra, its identities, laws and seed fixtures."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TOLERANCES, x64
from decodejax import fixtures, split_state
from decodejax.split_state import LseState, SplitState

N_ROWS, N_KEYS, D = 3, 6, 4
seeds = st.integers(0, 2**31 - 1)


def random_state(seed, dtype=np.float64, p_empty=0.3, extreme=False):
    """A SplitState over N_ROWS rows built by `summarize` from random scores and masks."""
    r = np.random.default_rng(seed)
    scale = 1e4 if extreme else 3.0
    scores = r.uniform(-scale, scale, (N_ROWS, N_KEYS))
    if extreme:
        scores[r.random(scores.shape) < 0.2] = -np.inf
    allowed = r.random((N_ROWS, N_KEYS)) > 0.4
    allowed[r.random(N_ROWS) < p_empty] = False
    values = r.normal(size=(N_ROWS, N_KEYS, D))
    return split_state.summarize(jnp.asarray(scores, dtype), jnp.asarray(values, dtype), jnp.asarray(allowed))


def assert_bitwise(a, b):
    chex.assert_trees_all_equal(a, b)


def assert_close(a, b, dtype):
    atol, rtol = TOLERANCES[dtype]
    chex.assert_trees_all_close(a, b, atol=atol, rtol=rtol)


def assert_finite_policy(state: SplitState):
    """S1: no NaN anywhere; -inf only as the m of EMPTY rows."""
    for leaf in (state.l, state.u):
        assert np.all(np.isfinite(np.asarray(leaf)))
    m = np.asarray(state.m)
    valid = np.asarray(state.valid)
    assert np.all(np.isfinite(m[valid])) and np.all(m[~valid] == -np.inf)


merge_variants = pytest.mark.parametrize("merge_fn", [split_state.merge, jax.jit(split_state.merge)], ids=["eager", "jit"])


@merge_variants
@given(seed=seeds)
@settings(max_examples=25, deadline=None)
def test_S1_empty_is_identity_bitwise_on_both_sides(merge_fn, seed):
    with x64():
        s = random_state(seed)
        e = split_state.empty((N_ROWS,), D, jnp.float64)
        assert_bitwise(merge_fn(e, s), s)
        assert_bitwise(merge_fn(s, e), s)


@merge_variants
def test_S1_empty_merged_with_empty_is_empty(merge_fn):
    e = split_state.empty((N_ROWS,), D)
    out = merge_fn(e, e)
    assert_bitwise(out, e)
    o, lse = split_state.finalize(out)
    assert np.all(np.asarray(o) == 0) and np.all(np.asarray(lse) == -np.inf)


@merge_variants
@given(seed=seeds)
@settings(max_examples=25, deadline=None)
def test_S2_merge_is_commutative_bitwise(merge_fn, seed):
    with x64():
        a, b = random_state(seed), random_state(seed + 1)
        assert_bitwise(merge_fn(a, b), merge_fn(b, a))


@given(seed=seeds)
@settings(max_examples=25, deadline=None)
def test_S2_merge_is_associative_float64(seed):
    with x64():
        a, b, c = (random_state(seed + i) for i in range(3))
        left = split_state.merge(split_state.merge(a, b), c)
        right = split_state.merge(a, split_state.merge(b, c))
        assert_close(split_state.finalize(left), split_state.finalize(right), "float64")


@given(seed=seeds)
@settings(max_examples=25, deadline=None)
def test_S2_merge_is_associative_float32(seed):
    a, b, c = (random_state(seed + i, np.float32) for i in range(3))
    left = split_state.merge(split_state.merge(a, b), c)
    right = split_state.merge(a, split_state.merge(b, c))
    assert_close(split_state.finalize(left), split_state.finalize(right), "float32")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(seed=seeds, cuts=st.lists(st.integers(0, 24), min_size=0, max_size=6))
@settings(max_examples=30, deadline=None)
def test_S2_partition_invariance(dtype, seed, cuts):
    """Any partition of the key axis, merged in any tree, equals the unsplit summary."""
    r = np.random.default_rng(seed)
    n = 24
    scores = r.normal(size=(2, n)) * 4
    values = r.normal(size=(2, n, D))
    allowed = r.random((2, n)) > 0.3
    bounds = sorted({0, n, *cuts})
    with x64():
        dt = getattr(jnp, dtype)
        full = split_state.summarize(jnp.asarray(scores, dt), jnp.asarray(values, dt), jnp.asarray(allowed))
        parts = [
            split_state.summarize(
                jnp.asarray(scores[:, s:e], dt), jnp.asarray(values[:, s:e], dt), jnp.asarray(allowed[:, s:e])
            )
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
        sequential = parts[0]
        for p in parts[1:]:
            sequential = split_state.merge(sequential, p)
        permuted = [parts[i] for i in r.permutation(len(parts))]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *permuted)
        nary = split_state.merge_along(stacked, axis=1)
        for merged in (sequential, nary):
            assert_close(split_state.finalize(merged), split_state.finalize(full), dtype)


@given(seed=seeds)
@settings(max_examples=25, deadline=None)
def test_S3_two_abis_agree(seed):
    with x64():
        a, b = random_state(seed), random_state(seed + 7)
        via_mlu = split_state.to_lse(split_state.merge(a, b))
        via_lse = split_state.merge_lse(split_state.to_lse(a), split_state.to_lse(b))
        assert_close(via_mlu, via_lse, "float64")
        roundtrip = split_state.to_lse(split_state.from_lse(split_state.to_lse(a)))
        assert_close(roundtrip, split_state.to_lse(a), "float64")
        stacked = jax.tree.map(lambda *x: jnp.stack(x, 1), split_state.to_lse(a), split_state.to_lse(b))
        assert_close(split_state.merge_lse_along(stacked, axis=1), via_lse, "float64")


@given(seed=seeds)
@settings(max_examples=25, deadline=None)
def test_S3_lse_merge_identity_and_commutativity_bitwise(seed):
    with x64():
        a = split_state.to_lse(random_state(seed))
        b = split_state.to_lse(random_state(seed + 3))
        e = split_state.to_lse(split_state.empty((N_ROWS,), D, jnp.float64))
        assert_bitwise(split_state.merge_lse(e, a), a)
        assert_bitwise(split_state.merge_lse(a, e), a)
        assert_bitwise(split_state.merge_lse(a, b), split_state.merge_lse(b, a))


@pytest.mark.parametrize("use_jit", [False, True])
@given(seed=seeds)
@settings(max_examples=20, deadline=None)
def test_S1_extreme_scores_never_produce_nan_or_inf(use_jit, seed):
    merge = jax.jit(split_state.merge) if use_jit else split_state.merge
    a = random_state(seed, np.float32, extreme=True)
    b = random_state(seed + 1, np.float32, extreme=True, p_empty=1.0)  # all rows EMPTY
    for s in (a, b, merge(a, b), merge(b, b)):
        assert_finite_policy(s)
        o, lse = split_state.finalize(s)
        assert np.all(np.isfinite(np.asarray(o)))
        assert not np.any(np.isnan(np.asarray(lse)))
        assert np.all((np.asarray(lse) == -np.inf) == ~np.asarray(s.valid))


def test_S1_all_minus_inf_scores_are_empty():
    s = split_state.summarize(jnp.full((2, 3), -jnp.inf), jnp.full((2, 3, D), jnp.nan), jnp.ones((2, 3), bool))
    assert not np.any(np.asarray(s.valid))
    o, lse = split_state.finalize(s)
    assert np.all(np.asarray(o) == 0) and np.all(np.asarray(lse) == -np.inf)


def test_S1_masked_poison_never_reaches_the_state():
    scores = jnp.array([[1.0, jnp.nan, jnp.inf]])
    values = jnp.array([[[1.0], [jnp.nan], [jnp.inf]]])
    s = split_state.summarize(scores, values, jnp.array([[True, False, False]]))
    np.testing.assert_array_equal(np.asarray(s.u), [[1.0]])
    np.testing.assert_array_equal(np.asarray(s.l), [1.0])


def test_seed_fixture_worked_empty_middle_float64():
    fx = fixtures.WORKED_EMPTY_MIDDLE
    with x64():
        states = [
            split_state.summarize(
                jnp.asarray(s["scores"], jnp.float64), jnp.asarray(s["values"], jnp.float64), jnp.asarray(s["allowed"])
            )
            for s in fx["splits"]
        ]
        for state, want in zip(states, fx["expected_splits"]):
            assert bool(state.valid) == want["valid"]
            assert float(state.m) == want["m"]
            np.testing.assert_allclose(float(state.l), want["l"], rtol=0, atol=1e-12)
            np.testing.assert_allclose(np.asarray(state.u), want["u"], rtol=0, atol=1e-12)
        # Merging split 0 with the EMPTY middle leaves it unchanged, bit for bit.
        assert_bitwise(split_state.merge(states[0], states[1]), states[0])
        merged = split_state.merge(split_state.merge(states[0], states[1]), states[2])
        o, lse = split_state.finalize(merged)
        want = fx["expected_merged"]
        assert float(merged.m) == want["m"]
        np.testing.assert_allclose(float(merged.l), want["l"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(merged.u), want["u"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(o), want["o"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(float(lse), want["lse"], rtol=0, atol=1e-12)


def test_seed_fixture_averaging_failure():
    fx = fixtures.AVERAGING_FAILURE
    with x64():
        outs = [
            split_state.to_lse(
                split_state.summarize(
                    jnp.asarray(s["scores"], jnp.float64), jnp.asarray(s["values"], jnp.float64), jnp.ones(2, bool)
                )
            )
            for s in fx["splits"]
        ]
        naive = float(np.mean([float(s.o[0]) for s in outs]))
        exact = float(split_state.merge_lse(*outs).o[0])
    assert naive == fx["naive_average"]
    np.testing.assert_allclose(exact, fx["exact_output"], atol=1e-10)


def test_seed_fixture_float16_reduction_order():
    """S2: exact associativity is not a bitwise float16 promise (0x02H)."""
    fx = fixtures.FLOAT16_ORDER_SENSITIVITY
    v = np.array(fx["values"], np.float16)

    def sequential(xs):
        acc = np.float16(0)
        for x in xs:
            acc = np.float16(acc + x)
        return float(acc) / len(xs)

    balanced = float(np.float16(np.float16(v[0] + v[1]) + np.float16(v[2] + v[3]))) / 4
    assert sequential(v) == fx["float16_sequential"]
    assert balanced == fx["float16_balanced"]
    assert sequential(v[fx["permutation"]]) == fx["float16_permuted"]
    assert math.isclose(float(np.sum(v.astype(np.float64))) / 4, fx["exact_output"])


def test_lse_base2_roundtrip():
    lse = jnp.array([0.0, 1.0, -3.5])
    np.testing.assert_allclose(np.asarray(split_state.lse_from_base2(split_state.lse_to_base2(lse))), np.asarray(lse), rtol=1e-7)
    np.testing.assert_allclose(float(split_state.lse_to_base2(jnp.log(8.0))), 3.0, rtol=1e-6)


def test_S2_fixed_merge_is_deterministic_run_to_run():
    a, b = random_state(1, np.float32), random_state(2, np.float32)
    f = jax.jit(split_state.merge)
    assert_bitwise(f(a, b), f(a, b))
