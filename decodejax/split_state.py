"""The split-state algebra of split-KV ("flash-decoding") attention (invariants S1-S3).

A split owns a disjoint range of key positions for one query row. It summarizes the
positions of that range that survive the mask as a partial state, and partial states merge
into the state of the union. Two equivalent encodings ("ABIs") exist:

  SplitState(valid, m, l, u)   m = max score, l = sum exp(s - m), u = sum exp(s - m) v
  LseState(valid, lse, o)      lse = m + log(l), o = u / l

All logarithms and exponentials are natural (base e); FlashInfer and some Triton kernels
store base-2 LSE: convert with `lse_to_base2` / `lse_from_base2`.

Every merge branches on validity before any exponential, so EMPTY is an exact identity and
EMPTY merged with EMPTY is EMPTY: no `-inf - -inf`, no NaN. A row whose every split is
empty finalizes to o = 0 and lse = -inf (the all-masked policy).

Shapes: `...` is any batch shape (e.g. [B, H_q] or [B, H_q, S]); D is the value width.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

LOG2_E = math.log2(math.e)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitState:
    """Unnormalized partial state of one allowed set of key positions.

    Attributes:
      valid: bool[...], True iff the allowed set is non-empty.
      m: float[...], the maximum score (-inf when not valid).
      l: float[...], sum of exp(score - m) (0 when not valid).
      u: float[..., D], sum of exp(score - m) * value (0 when not valid).
    """

    valid: jax.Array
    m: jax.Array
    l: jax.Array
    u: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LseState:
    """Normalized partial state: the partial output and its log-partition.

    Attributes:
      valid: bool[...], True iff the allowed set is non-empty.
      lse: float[...], natural-log sum-exp of the allowed scores (-inf when not valid).
      o: float[..., D], the partial softmax-weighted value (0 when not valid).
    """

    valid: jax.Array
    lse: jax.Array
    o: jax.Array


def empty(batch_shape: tuple[int, ...], d: int, dtype=jnp.float32) -> SplitState:
    """The EMPTY state (False, -inf, 0, 0) of shape `batch_shape` with value width d."""
    return SplitState(
        valid=jnp.zeros(batch_shape, bool),
        m=jnp.full(batch_shape, -jnp.inf, dtype),
        l=jnp.zeros(batch_shape, dtype),
        u=jnp.zeros((*batch_shape, d), dtype),
    )


def summarize(scores: jax.Array, values: jax.Array, allowed: jax.Array) -> SplitState:
    """Summarizes the allowed positions of one split.

    Args:
      scores: float[..., N], scores of the N key positions of the split.
      values: float[..., N, D], their values (broadcastable against scores[..., None]).
      allowed: bool[..., N], which positions survive the mask.

    Returns:
      The SplitState over the key axis N. Positions not allowed contribute nothing, even
      when their scores or values are NaN or infinite; an allowed score of -inf has zero
      weight, so it counts as masked.

    Equivalent to, for a non-empty allowed set A:
      m = max(scores[A]); w = exp(scores[A] - m); l = sum(w); u = w @ values[A]
    """
    allowed = allowed & (scores > -jnp.inf)
    valid = jnp.any(allowed, axis=-1)
    m = jnp.max(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    safe_m = jnp.where(valid, m, 0.0)
    w = jnp.where(allowed, jnp.exp(jnp.where(allowed, scores, 0.0) - safe_m[..., None]), 0.0)
    l = jnp.sum(w, axis=-1)
    clean_values = jnp.where(allowed[..., None], values, 0.0)
    u = jnp.sum(w[..., None] * clean_values, axis=-2)
    return SplitState(valid=valid, m=jnp.where(valid, m, -jnp.inf), l=l, u=u)


def merge(a: SplitState, b: SplitState) -> SplitState:
    """The EMPTY-aware binary merge: the state of the union of two disjoint allowed sets.

    Exact identity (bit-exact) when either side is EMPTY. The state with the larger m is
    the frame (weight exactly 1) and the other is scaled by exp(m_lo - m_hi) <= 1, so the
    arithmetic does not depend on argument order: commutative bit for bit, also when a
    compiler fuses the multiply-adds.
    """
    both = a.valid & b.valid
    swap = b.m > a.m
    hi = jax.tree.map(lambda x, y: _pick(swap, y, x), a, b)
    lo = jax.tree.map(lambda x, y: _pick(swap, x, y), a, b)
    # The exponent is taken only where both sides are valid; elsewhere the valid side passes through.
    scale = jnp.exp(jnp.where(both, lo.m - hi.m, 0.0))
    l = jnp.where(both, hi.l + scale * lo.l, jnp.where(a.valid, a.l, b.l))
    u = jnp.where(both[..., None], hi.u + scale[..., None] * lo.u, jnp.where(a.valid[..., None], a.u, b.u))
    return SplitState(valid=a.valid | b.valid, m=jnp.maximum(a.m, b.m), l=l, u=u)


def _pick(cond, x, y):
    """where(cond, x, y) with cond broadcast over trailing axes of x (e.g. the D of u)."""
    return jnp.where(cond.reshape(cond.shape + (1,) * (x.ndim - cond.ndim)), x, y)


def merge_along(states: SplitState, axis: int) -> SplitState:
    """Merges all states along a batch axis in one n-ary step (global max, then sums).

    Args:
      states: a SplitState whose batch shape has the split axis at `axis` (counted on
        the batch shape, i.e. not the trailing D axis of u).
      axis: the split axis.

    Returns:
      The merged SplitState with that axis removed. EMPTY slots contribute exactly zero.
    """
    axis = axis % states.m.ndim
    valid = jnp.any(states.valid, axis=axis)
    m = jnp.max(jnp.where(states.valid, states.m, -jnp.inf), axis=axis)
    safe_m = jnp.expand_dims(jnp.where(valid, m, 0.0), axis)
    scale = jnp.where(states.valid, jnp.exp(jnp.where(states.valid, states.m, 0.0) - safe_m), 0.0)
    l = jnp.sum(scale * jnp.where(states.valid, states.l, 0.0), axis=axis)
    u = jnp.sum(scale[..., None] * jnp.where(states.valid[..., None], states.u, 0.0), axis=axis)
    return SplitState(valid=valid, m=jnp.where(valid, m, -jnp.inf), l=l, u=u)


def finalize(state: SplitState) -> tuple[jax.Array, jax.Array]:
    """Returns (o: float[..., D], lse: float[...]); an EMPTY row gives o = 0, lse = -inf."""
    safe_l = jnp.where(state.valid, state.l, 1.0)
    o = jnp.where(state.valid[..., None], state.u / safe_l[..., None], 0.0)
    lse = jnp.where(state.valid, state.m + jnp.log(safe_l), -jnp.inf)
    return o, lse


def to_lse(state: SplitState) -> LseState:
    """(valid, m, l, u) -> (valid, lse, o)."""
    o, lse = finalize(state)
    return LseState(valid=state.valid, lse=lse, o=o)


def from_lse(state: LseState) -> SplitState:
    """(valid, lse, o) -> (valid, m = lse, l = 1, u = o): the same allowed-set summary."""
    return SplitState(
        valid=state.valid,
        m=jnp.where(state.valid, state.lse, -jnp.inf),
        l=jnp.where(state.valid, 1.0, 0.0).astype(state.o.dtype),
        u=jnp.where(state.valid[..., None], state.o, 0.0),
    )


def merge_lse(a: LseState, b: LseState) -> LseState:
    """The EMPTY-aware merge of two normalized states through their LSE (never an average).

    With hi the state of larger lse and s = exp(lse_lo - lse_hi) <= 1:
    lse = lse_hi + log1p(s), o = (o_hi + s o_lo) / (1 + s). Order-free like `merge`.
    """
    both = a.valid & b.valid
    swap = b.lse > a.lse
    hi = jax.tree.map(lambda x, y: _pick(swap, y, x), a, b)
    lo = jax.tree.map(lambda x, y: _pick(swap, x, y), a, b)
    s = jnp.exp(jnp.where(both, lo.lse - hi.lse, 0.0))
    lse = jnp.where(both, hi.lse + jnp.log1p(s), jnp.where(a.valid, a.lse, b.lse))
    o = jnp.where(
        both[..., None],
        (hi.o + s[..., None] * lo.o) / (1.0 + s[..., None]),
        jnp.where(a.valid[..., None], a.o, b.o),
    )
    return LseState(valid=a.valid | b.valid, lse=lse, o=o)


def merge_lse_along(states: LseState, axis: int) -> LseState:
    """Merges normalized states along a batch axis in one n-ary step.

    Equivalent to folding `merge_lse` along `axis`; EMPTY slots (valid False or
    lse = -inf) weigh exactly zero, and an all-EMPTY row gives o = 0, lse = -inf.
    """
    axis = axis % states.lse.ndim
    slot_valid = states.valid & (states.lse > -jnp.inf)
    valid = jnp.any(slot_valid, axis=axis)
    p = jnp.max(jnp.where(slot_valid, states.lse, -jnp.inf), axis=axis)
    safe_p = jnp.expand_dims(jnp.where(valid, p, 0.0), axis)
    weight = jnp.where(slot_valid, jnp.exp(jnp.where(slot_valid, states.lse, 0.0) - safe_p), 0.0)
    total = jnp.sum(weight, axis=axis)
    safe_total = jnp.where(valid, total, 1.0)
    o = jnp.sum(weight[..., None] * jnp.where(slot_valid[..., None], states.o, 0.0), axis=axis)
    o = jnp.where(valid[..., None], o / safe_total[..., None], 0.0)
    lse = jnp.where(valid, p + jnp.log(safe_total), -jnp.inf)
    return LseState(valid=valid, lse=lse, o=o)


def lse_to_base2(lse: jax.Array) -> jax.Array:
    """Natural-log LSE -> base-2 LSE (log2 sum 2^(s log2 e)), as FlashInfer stores it."""
    return lse * LOG2_E


def lse_from_base2(lse2: jax.Array) -> jax.Array:
    """Base-2 LSE -> natural-log LSE."""
    return lse2 / LOG2_E


def rescale_base2(m: jax.Array, m_new: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernels' running base-2 state (max m, -inf while EMPTY) moving to max m_new: (m_safe,
    scale). m_safe is what new exponents subtract (0 while still EMPTY, so no -inf - -inf) and
    scale = exp2(m - m_safe) rescales what came before (exactly 0 after EMPTY)."""
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    return m_safe, jnp.exp2(m - m_safe)
