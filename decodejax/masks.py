"""Visibility of a key position to a query row (invariants M1-M2).

Positions are request-local. A request has `kv_len` committed-plus-new key positions and its
C query rows are the last C of them (bottom-right causal):

    keys:     0 1 2 ... T-1 | T  T+1 ... T+C-1        (kv_len = T + C)
    query i:                  sees [0, T + i + 1)

`DecodeMask` is the declarative pattern; `visible` is the one predicate the reference, the
kernels and the tests evaluate. The kernels call it on their tile coordinates, so a pattern
is defined once.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DecodeMask:
    """A causal mask with an optional left sliding window and attention sinks.

    Attributes:
      window_left: if set, query position q sees keys in [q - window_left, q] (plus sinks);
        None means unbounded on the left.
      sinks: the first `sinks` key positions stay visible to every query at or after them,
        whatever the window.
    """

    window_left: int | None = None
    sinks: int = 0

    def __post_init__(self):
        if self.window_left is not None and self.window_left < 0:
            raise ValueError(f"window_left must be >= 0 or None, got {self.window_left}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")


def visible(q_pos, k_pos, kv_len, mask: DecodeMask = DecodeMask()):
    """Whether key `k_pos` is visible to the query at `q_pos` (arrays broadcast).

    Args:
      q_pos: int[...], the query's request-local position (kv_len - C + i for row i).
      k_pos: int[...], the key's request-local position.
      kv_len: int[...], keys of the request (committed plus new); k_pos >= kv_len is never
        visible, whatever it holds.
      mask: the pattern.
    """
    causal = (k_pos <= q_pos) & (k_pos < kv_len) & (k_pos >= 0)
    if mask.window_left is None:
        return causal
    in_window = k_pos >= q_pos - mask.window_left
    return causal & (in_window | (k_pos < mask.sinks))


def visible_range(q_pos, kv_len, mask: DecodeMask = DecodeMask()):
    """`visible` as intervals, for a kernel that tests a tile of keys against scalars: key k is
    visible to the query at q_pos iff lo <= k < hi or 0 <= k < sink_end.

    Returns (lo, hi, sink_end): hi = min(q_pos + 1, kv_len); lo = max(0, q_pos - window_left),
    0 without a window; sink_end = min(sinks, hi) with a window, else 0 (without one the sinks
    are inside [0, hi) already). An empty interval has lo >= hi.
    """
    hi = jnp.minimum(q_pos + 1, kv_len)
    if mask.window_left is None:
        return jnp.zeros_like(hi), hi, jnp.zeros_like(hi)
    return jnp.maximum(q_pos - mask.window_left, 0), hi, jnp.minimum(mask.sinks, hi)


def segment_of(starts, index):
    """The segment holding each index, for sorted starts i32[S + 1] (each segment's start, then the
    end); indices at or past the end map to the last segment (callers mask them)."""
    return jnp.clip(jnp.searchsorted(starts, index, side="right").astype(jnp.int32) - 1, 0, starts.shape[0] - 2)


def packed_rows(qo_indptr, num_rows: int):
    """Rows of new tokens packed request-major: (request, index within it, live) of each row
    [0, num_rows); rows at or past qo_indptr[-1] are padding (live False)."""
    n = jnp.arange(num_rows, dtype=jnp.int32)
    request = segment_of(qo_indptr, n)
    return request, n - qo_indptr[request], n < qo_indptr[-1]
