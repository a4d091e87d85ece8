"""Split planning and the storage/traffic ledgers (invariants P1-P2).

Split bounds are per request and half-open; they are disjoint and cover exactly [0, T_b).
Slots beyond a request's splits (up to the plan's capacity) are EMPTY: start == end.

    request b:  [0 ............................................ T_b)
    splits:     [s0      )[s1      )[s2     )[s3     )  (empty)(empty)
                 q+1       q+1       q        q        capacity - S slots

Bounds functions work on numpy and jax arrays: the Mosaic kernel receives them as i32[B, S]
inputs, and the Triton kernel evaluates `SplitPlan.slot_bounds` (the same elementwise formula)
for its own slot.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


class PlanMismatch(ValueError):
    """A run whose static fields differ from its plan's."""


def _xp(x):
    """numpy for host arrays, jax.numpy otherwise (so the bounds run inside jit)."""
    if isinstance(x, (np.ndarray, list, tuple, int)):
        return np
    import jax.numpy as jnp

    return jnp


def balanced_split_bounds(lengths, num_splits: int, active=None):
    """Balanced quotient/remainder bounds: split s of request b gets q_b + [s < r_b] tokens.

    Args:
      lengths: i32[B], T_b.
      num_splits: S >= 1 slots per request.
      active: i32[B], the splits request b uses (1..S; default S): T_b is balanced over its
        first active_b slots and the rest are EMPTY (start == end == T_b).

    Returns:
      (start, end), each i32[B, S].
    """
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    xp = _xp(lengths)
    t = xp.asarray(lengths).astype(xp.int32)[:, None]
    s = xp.arange(num_splits, dtype=xp.int32)[None, :]
    n = num_splits if active is None else xp.clip(xp.asarray(active).astype(xp.int32), 1, num_splits)[:, None]
    return _balanced_slot(xp, t, s, n)


def _balanced_slot(xp, t, s, n):
    """Elementwise (start, end) of slot s of t units balanced over the first n slots; s >= n is EMPTY."""
    q, r = t // n, t % n
    used = s < n
    start = xp.where(used, s * q + xp.minimum(s, r), t)
    end = xp.where(used, start + q + (s < r).astype(xp.int32), t)
    return start, end


def adaptive_split_counts(blocks, num_splits: int, target_splits: int, max_split_blocks: int | None = None):
    """Splits per request so the batch has about `target_splits` in all: i32[B] in [1, S].

    Every split gets c = ceil(sum(blocks) / target_splits) blocks (at least one, at most
    max_split_blocks), so request b uses ceil(blocks_b / c) splits, capped at S. A short batch
    then runs short splits on many SMs, and a long one runs few long splits, whatever the static
    capacity S allows; the cap keeps a long batch's splits short enough to balance over the SMs
    when the requests' lengths differ.
    """
    xp = _xp(blocks)
    blocks = xp.asarray(blocks).astype(xp.int32)
    return _adaptive_count(xp, blocks, xp.sum(blocks), num_splits, target_splits, max_split_blocks)


def _adaptive_count(xp, blocks, total_blocks, num_splits: int, target_splits: int, max_split_blocks: int | None = None):
    """Elementwise splits of a request of `blocks` blocks in a batch of `total_blocks` in all."""
    chunk = xp.maximum(1, -(-total_blocks // max(1, target_splits)))
    if max_split_blocks is not None:
        chunk = xp.minimum(chunk, max_split_blocks)
    return xp.clip(-(-blocks // chunk), 1, num_splits).astype(xp.int32)


def fixed_chunk_bounds(lengths, chunk: int, num_splits: int | None = None):
    """Fixed-width chunks [s C, (s + 1) C) clipped to T_b; the last chunk may be short.

    Args:
      lengths: i32[B].
      chunk: C >= 1 tokens per split.
      num_splits: slots per request; default ceil(max T / C) (needs host lengths).

    Returns:
      (start, end), each i32[B, num_splits]; slots past T_b are EMPTY (start == end == T_b).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    xp = _xp(lengths)
    t = xp.asarray(lengths).astype(xp.int32)
    if num_splits is None:
        num_splits = max(1, -(-int(np.max(t, initial=0)) // chunk))
    return _chunk_slot(xp, t[:, None], xp.arange(num_splits, dtype=xp.int32)[None, :], chunk)


def _chunk_slot(xp, t, s, chunk: int):
    """Elementwise (start, end) of chunk s of t tokens: [s C, (s + 1) C) clipped to t."""
    return xp.minimum(s * chunk, t), xp.minimum((s + 1) * chunk, t)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """One static split schedule: binds the producer grid, workspace shapes and reducer range.

    Attributes:
      num_splits: S, the splits a request is cut into (balanced policy).
      capacity: S_capacity >= S, the workspace slots per (request, head); the reducer reads
        all of them and slots >= S hold EMPTY.
      policy: "balanced" (S splits per request) or "fixed_chunk" (splits of `chunk` tokens,
        up to capacity; batch-invariant since a request's bounds ignore its neighbours).
      chunk: tokens per split for "fixed_chunk".
      align: "balanced" bounds fall on multiples of `align` tokens (a kernel's block), so
        no block is shared by two splits; the last split ends at T_b.
      target_splits: "balanced" only: when set, request b uses
        `adaptive_split_counts(blocks, num_splits, target_splits)[b]` of its num_splits slots
        (the rest EMPTY), so the split count follows the batch's actual lengths, not the
        static maximum the shapes allow. Bounds then depend on the whole batch.
      max_split_blocks: with target_splits: no split is longer than this many blocks (as far
        as num_splits slots allow), whatever the batch's total.
    """

    num_splits: int
    capacity: int
    policy: str = "balanced"
    chunk: int | None = None
    align: int = 1
    target_splits: int | None = None
    max_split_blocks: int | None = None

    def __post_init__(self):
        if self.policy not in ("balanced", "fixed_chunk"):
            raise ValueError(f"policy must be 'balanced' or 'fixed_chunk', got {self.policy!r}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.capacity < self.num_splits:
            raise ValueError(f"capacity={self.capacity} is smaller than num_splits={self.num_splits}")
        if (self.policy == "fixed_chunk") != (self.chunk is not None):
            raise ValueError(f"chunk={self.chunk} is required by, and only by, policy 'fixed_chunk'")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.align < 1:
            raise ValueError(f"align must be >= 1, got {self.align}")
        if self.target_splits is not None and (self.policy != "balanced" or self.target_splits < 1):
            raise ValueError(f"target_splits={self.target_splits} needs policy 'balanced' and a value >= 1")
        if self.max_split_blocks is not None and (self.target_splits is None or self.max_split_blocks < 1):
            raise ValueError(f"max_split_blocks={self.max_split_blocks} needs target_splits and a value >= 1")

    def bounds(self, lengths):
        """(start, end), each i32[B, capacity]; EMPTY slots have start == end."""
        xp = _xp(lengths)
        t = xp.asarray(lengths).astype(xp.int32)
        if self.policy == "fixed_chunk" and xp is np and np.any(t > self.capacity * self.chunk):
            # A request longer than capacity chunks would lose tokens: fail loudly on host.
            raise PlanMismatch(f"lengths up to {int(np.max(t))} exceed capacity {self.capacity} x chunk {self.chunk}")
        slots = xp.arange(self.capacity, dtype=xp.int32)[None, :]
        return self.slot_bounds(xp, t[:, None], slots, self.total_blocks(xp, t))

    @property
    def whole_requests(self) -> bool:
        """Whether the plan's one slot is each request whole, [0, T_b) (balanced, capacity 1): a
        kernel can take its bounds from the lengths, with nothing to build them."""
        return self.policy == "balanced" and self.capacity == 1

    @property
    def adapts_to_batch(self) -> bool:
        """Whether a request's bounds depend on the batch's lengths (balanced with target_splits
        and more than one split: a single split is the whole request whatever its neighbours)."""
        return self.policy == "balanced" and self.target_splits is not None and self.num_splits > 1

    def total_blocks(self, xp, lengths):
        """The batch's blocks of `align` tokens in all, which adaptive split counts divide up
        (None unless `adapts_to_batch`: then no slot depends on its neighbours)."""
        if not self.adapts_to_batch:
            return None
        return xp.sum(-(-lengths // self.align))

    def slot_bounds(self, xp, lengths, slots, total_blocks):
        """(start, end) of split slot `slots` of requests of `lengths` tokens, elementwise over
        their broadcast: `bounds` for all slots at once, or a kernel program for its own slot
        (xp = jax.numpy on traced scalars). total_blocks: `self.total_blocks` of the batch."""
        if self.policy == "fixed_chunk":
            return _chunk_slot(xp, lengths, slots, self.chunk)
        blocks = -(-lengths // self.align)
        active = (self.num_splits if total_blocks is None
                  else _adaptive_count(xp, blocks, total_blocks, self.num_splits, self.target_splits, self.max_split_blocks))
        # Slots past num_splits (capacity padding) are past `active` too: EMPTY at T_b.
        start, end = _balanced_slot(xp, blocks, slots, active)
        return xp.minimum(start * self.align, lengths), xp.minimum(end * self.align, lengths)

    def producer_grid(self, batch: int, kv_heads: int) -> tuple[int, int, int]:
        """(B, H_kv, S_capacity): one program per (request, K/V head, split slot)."""
        return (batch, kv_heads, self.capacity)

    def workspace_shapes(self, batch: int, q_heads: int, d_v: int) -> dict[str, tuple[int, ...]]:
        """Partial-state workspace shapes of the (LSE, O) ABI, both float32."""
        return {"o": (batch, q_heads, self.capacity, d_v), "lse": (batch, q_heads, self.capacity)}

    def check_run(self, **static_fields) -> None:
        """Raises PlanMismatch naming every static field that differs from this plan's."""
        diffs = [
            f"{k}: plan has {getattr(self, k)!r}, run has {v!r}"
            for k, v in static_fields.items()
            if getattr(self, k) != v
        ]
        if diffs:
            raise PlanMismatch("run does not match its plan: " + "; ".join(diffs))


def owner_counts(plan: SplitPlan, lengths, q_heads: int) -> dict[str, int]:
    """Producer owners (B x H_q x capacity), how many own a non-empty range, how many are EMPTY."""
    start, end = plan.bounds(np.asarray(lengths))
    active = int(np.sum(end > start)) * q_heads
    total = len(lengths) * q_heads * plan.capacity
    return {"owners": total, "active": active, "empty": total - active, "reducers": len(lengths) * q_heads}


def choose_num_splits(batch: int, kv_heads: int, num_kv_blocks: int, num_sms: int, max_splits: int) -> int:
    """FlashAttention's split-KV heuristic.

    With batch x kv_heads programs already filling >= 80% of the SMs, one split. Otherwise,
    for S = 1..min(max_splits, num_sms, num_kv_blocks), wave efficiency is
    n_waves / ceil(n_waves) with n_waves = batch * kv_heads * S / num_sms; S values that do
    not change ceil(num_kv_blocks / S) are skipped; the answer is the smallest S whose
    efficiency reaches 85% of the best.
    """
    programs = batch * kv_heads
    if programs >= 0.8 * num_sms:
        return 1
    limit = max(1, min(max_splits, num_sms, num_kv_blocks))

    def eligible(s):
        return s == 1 or -(-num_kv_blocks // s) != -(-num_kv_blocks // (s - 1))

    def efficiency(s):
        waves = programs * s / num_sms
        return waves / math.ceil(waves)

    effs = {s: efficiency(s) for s in range(1, limit + 1) if eligible(s)}
    best = max(effs.values())
    return min(s for s, e in effs.items() if e >= 0.85 * best)


# The longest split an adaptive plan cuts: on the H200 one 4,096-token split per (request,
# K/V head) ran at 4.1 TB/s (B 32, T 4096), while a ragged batch whose splits reached ~8k tokens
# ran 14% behind fixed 1,024-token splits (benchmarks/README.md).
MAX_SPLIT_TOKENS = 4096

# Decode programs resident per SM at head_dim 128 (the Triton kernel's 74 KB of shared memory and
# 168 registers per thread allow three; benchmarks/results/hopper_compile_cpu.json).
PROGRAMS_PER_SM = 3


def decode_split_capacity(
    batch: int,
    kv_heads: int,
    max_len: int,
    block_k: int,
    num_sms: int,
    head_dim: int = 128,
    *,
    items_per_sm: int = 2,
    max_splits: int = 64,
) -> int:
    """Split capacity S of the paged decode kernel: the slots per request its grid has.

    The splits an adaptive plan (`decode_target_splits`, splits capped at MAX_SPLIT_TOKENS)
    gives a batch of max_len-token requests: enough for every request to keep its splits under
    the cap, and for a full-length batch to fill the GPU. No more: a slot a request does not use
    is an EMPTY program, and any capacity above one costs a second launch (the merge); on the
    H200 at B 32, T 4096 one slot ran 135.5 us against 142.1 us for two, one of them EMPTY.
    The price: a short batch whose total would ask for more splits than the slots hold (one
    long request among short ones, say) runs them in S splits.

    A batch whose own programs fill every program slot of the GPU (the Triton kernel holds
    three per SM at D 128) gets no slots for the split cap: the cap balances a ragged batch
    whose longest requests would otherwise run alone at its end, but a table as wide as a
    server's longest context made every short batch pay EMPTY programs and the merge for it
    (H200, B 128 of 512-token requests in an 8,238-token table: 89.5 us of GPU time in three
    slots against 71.0 in one, benchmarks/results/probe_table_width.json). The price: one
    long request among many short ones at such a batch runs in one split.
    """
    blocks = -(-max_len // block_k)
    target = decode_target_splits(kv_heads, num_sms, head_dim, items_per_sm)
    cap = None if batch_fills_gpu(batch, kv_heads, num_sms, head_dim) else split_cap_blocks(block_k)
    return int(_adaptive_count(np, blocks, batch * blocks, max_splits, target, cap))


def batch_fills_gpu(batch: int, kv_heads: int, num_sms: int, head_dim: int = 128) -> bool:
    """Whether a decode batch's (request, K/V head) programs alone fill every program slot of the
    GPU: PROGRAMS_PER_SM per SM at D 128, scaled by 128 / head_dim. Such a batch gets no split cap
    (`decode_split_capacity`) and, with grouped queries, the Triton kernel's smaller tiles
    (`pallas_kernels.decode_attention.default_config`)."""
    return batch * kv_heads >= PROGRAMS_PER_SM * num_sms * 128 // head_dim


def split_cap_blocks(block_k: int) -> int:
    """MAX_SPLIT_TOKENS in blocks of block_k tokens (at least one)."""
    return max(1, MAX_SPLIT_TOKENS // block_k)


def decode_target_splits(kv_heads: int, num_sms: int, head_dim: int = 128, items_per_sm: int = 2) -> int:
    """Splits a decode batch should have in all (summed over requests), per K/V head.

    About `items_per_sm` work items per SM at head_dim 128, scaled by 128 / head_dim so an item
    streams about the same bytes whatever D. Two suit the Triton kernel, whose SMs hold several
    programs at once (`pallas_kernels.decode_attention.DecodeConfig.items_per_sm`); on the H200:
    S = 4 was fastest at B = 8, T = 8192 (D = 128); one split was fastest at B = 32, T = 4096
    (D = 128), where two splits were fastest at D = 64 (benchmarks/README.md). The persistent
    Mosaic kernel takes one (`MosaicDecodeConfig.items_per_sm`).
    """
    programs = max(1, items_per_sm * num_sms * 128 // head_dim)
    return max(1, programs // kv_heads)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1, "int32": 4}


def _bytes(dtype) -> int:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _DTYPE_BYTES[name]


@dataclasses.dataclass(frozen=True)
class WorkspaceLedger:
    """Bytes of a partial-state workspace: logical payload vs allocation envelope."""

    bytes_per_state: int
    logical_bytes: int
    allocated_bytes: int


def workspace_bytes(
    num_states: int,
    d_v: int,
    *,
    abi: str = "mlu",
    vector_dtype="float32",
    scalar_dtype="float32",
    valid_bytes: int = 1,
    alignment: int | None = None,
    capacity_states: int | None = None,
) -> WorkspaceLedger:
    """Workspace of `num_states` partial states.

    abi "mlu": per state d_v vector elements + m + l + validity; "lse_o": d_v + lse + validity.
    `alignment` pads d_v to a multiple (elements) in the allocation envelope, which also counts
    `capacity_states` (default num_states).
    """
    scalars = {"mlu": 2, "lse_o": 1}
    if abi not in scalars:
        raise ValueError(f"abi must be 'mlu' or 'lse_o', got {abi!r}")
    fixed = scalars[abi] * _bytes(scalar_dtype) + valid_bytes
    per_state = d_v * _bytes(vector_dtype) + fixed
    d_alloc = d_v if alignment is None else -(-d_v // alignment) * alignment
    cap = num_states if capacity_states is None else capacity_states
    return WorkspaceLedger(
        bytes_per_state=per_state,
        logical_bytes=num_states * per_state,
        allocated_bytes=cap * (d_alloc * _bytes(vector_dtype) + fixed),
    )


@dataclasses.dataclass(frozen=True)
class TrafficLedger:
    """Logical bytes of one split decode call (not measured DRAM traffic).

    unique_kv_bytes: every visible K and V row once per K/V head.
    q_head_demand_bytes: what per-query-head loads would request (unique x H_q / H_kv).
    workspace_round_trip_bytes: partial states written once and read once.
    """

    unique_kv_bytes: int
    q_head_demand_bytes: int
    workspace_round_trip_bytes: int


def traffic_ledger(
    lengths, q_heads: int, kv_heads: int, d_qk: int, d_v: int, cache_dtype="bfloat16", workspace: WorkspaceLedger | None = None
) -> TrafficLedger:
    total = int(np.sum(np.asarray(lengths)))
    b = _bytes(cache_dtype)
    unique = total * kv_heads * (d_qk + d_v) * b
    return TrafficLedger(
        unique_kv_bytes=unique,
        q_head_demand_bytes=total * q_heads * (d_qk + d_v) * b,
        workspace_round_trip_bytes=0 if workspace is None else 2 * workspace.logical_bytes,
    )
