"""Merge S partial (o, lse) states per row, EMPTY-aware: the reducer of split-KV decode.

One program owns one output row (request, q head) and folds its S slots in chunks with an
online log-sum-exp. A slot with lse = -inf is EMPTY and weighs exactly zero, so rows whose
every slot is EMPTY give o = 0 and lse = -inf, and EMPTY slots never change a result bit.
Its pure-jnp twin is `decodejax.split_state.merge_lse_along`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from decodejax.split_state import LOG2_E, rescale_base2



@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """block_s: slots folded per step (None: `default_block_s` of the head dim); num_warps:
    Triton warps per program."""

    block_s: int | None = None
    num_warps: int = 4

    def slots_per_step(self, head_dim: int) -> int:
        return self.block_s or default_block_s(head_dim)


def default_block_s(head_dim: int) -> int:
    """Slots per step: 64 at D <= 128 (32 at D 256, 8,192 f32 values of o in 4 warps' registers).

    Each step is a dependent chain of two global loads (lse, then the filled slots' o), so the
    merge's time is mostly steps, not bytes: on the H200 an engine's B 1 call (33 slots, 16
    filled) merged in 2.91 us in three steps of 16 and in 1.54 us in one of 64; B 1, T 32,768
    (32 slots) in 2.93 and 1.63 us (benchmarks/README.md, fourteenth session). A step's slots
    past S are masked, so they read nothing. It is fixed per head dim, not per S, so that
    appending EMPTY slots keeps every bit: they add only all-EMPTY steps, which fold to the
    identity.
    """
    return max(16, min(64, 8192 // head_dim))


def fold_slots(o_ref, lse_ref, row: tuple, *, num_slots: int, block_s: int):
    """Row `row`'s merged state (o f32[D], lse f32 natural log) from its num_slots partial states
    o_ref[*row, S, D], lse_ref[*row, S] (natural-log lse, -inf for EMPTY), folded block_s slots
    a step with an online log-sum-exp, in slot order.

    An EMPTY slot's o is never read: it may hold anything, NaN included. The merge launch and
    the decode kernel's fused merge both fold with this: the same steps in the same order (not
    bit for bit: in interpret mode test S3 saw their lse differ by up to 2.4e-7).
    """
    head_dim = o_ref.shape[-1]
    lanes = jnp.arange(head_dim)[None, :]

    def body(i, carry):
        m, l, acc = carry
        slots = i * block_s + jnp.arange(block_s)
        live = slots < num_slots
        slots = jnp.minimum(slots, num_slots - 1)
        lse = plgpu.load(lse_ref.at[(*row, slots)], mask=live, other=-jnp.inf) * LOG2_E
        filled = lse > -jnp.inf
        o = plgpu.load(o_ref.at[(*row, slots[:, None], lanes)], mask=filled[:, None], other=0.0)
        m_new = jnp.maximum(m, jnp.max(lse))
        m_safe, scale = rescale_base2(m, m_new)
        w = jnp.exp2(lse - m_safe)  # exactly 0 for EMPTY slots
        return m_new, l * scale + jnp.sum(w), acc * scale + jnp.sum(w[:, None] * o, axis=0)

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros((head_dim,), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(num_slots, block_s), body, init)
    valid = l > 0
    o = jnp.where(valid, acc / jnp.where(valid, l, 1.0), 0.0)
    return o, jnp.where(valid, (m + jnp.log2(jnp.where(valid, l, 1.0))) / LOG2_E, -jnp.inf)


def _merge_kernel(o_ref, lse_ref, out_o_ref, out_lse_ref, *, num_slots: int, block_s: int):
    # o_ref:       [N, S, D] f32   partial outputs
    # lse_ref:     [N, S]    f32   natural-log LSE, -inf for EMPTY
    # out_o_ref:   [N, D]          merged output (row n)
    # out_lse_ref: [N]       f32   merged LSE
    n = pl.program_id(0)
    o, lse = fold_slots(o_ref, lse_ref, (n,), num_slots=num_slots, block_s=block_s)
    out_o_ref[n, :] = o.astype(out_o_ref.dtype)
    out_lse_ref[n] = lse


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def merge_states(
    o: jax.Array,  # [..., S, D]
    lse: jax.Array,  # [..., S] natural log, -inf for EMPTY
    *,
    out_dtype=None,
    config: MergeConfig = MergeConfig(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Merges S partial states per row: (o [..., D] in out_dtype, lse [...] f32).

    Equivalent to this jnp code (decodejax.split_state.merge_lse_along):
      w = exp(lse - max(lse)); o = sum(w * o) / sum(w); lse = max + log(sum(w))
    with EMPTY slots (lse = -inf) weighing zero and all-EMPTY rows giving (0, -inf).
    """
    if o.ndim < 2 or lse.shape != o.shape[:-1]:
        raise ValueError(f"o must be [..., S, D] and lse [..., S]; got o {o.shape}, lse {lse.shape}")
    *lead, S, D = o.shape
    if D & (D - 1):
        raise ValueError(f"D={D} must be a power of two for the Pallas merge")
    out_dtype = o.dtype if out_dtype is None else out_dtype
    N = 1
    for x in lead:
        N *= x
    kernel = functools.partial(_merge_kernel, num_slots=S, block_s=config.slots_per_step(D))
    out_o, out_lse = pl.pallas_call(
        kernel,
        grid=(N,),
        out_shape=(jax.ShapeDtypeStruct((N, D), out_dtype), jax.ShapeDtypeStruct((N,), jnp.float32)),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name="decodejax_merge_states",
    )(o.reshape(N, S, D).astype(jnp.float32), lse.reshape(N, S).astype(jnp.float32))
    return out_o.reshape(*lead, D), out_lse.reshape(lead)
