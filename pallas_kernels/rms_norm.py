"""RMSNorm, optionally after a residual add, in one launch per call.

A decoder layer's norms each took three XLA kernels on the H200 (the residual add, the mean of
squares, the scaling): 65 norms cost about 0.26 ms of a batch-1 llama3-8b step, mostly launch
latency and tails (benchmarks/README.md, end to end). One program owns one row of D (a power of
two): it adds, rounds the sum to the input dtype (as the unfused model does), and normalizes
that rounded sum. The pure-jnp twin is `decodejax.reference.rms_norm`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _rms_norm_kernel(*refs, eps: float, with_residual: bool):
    # x_ref, residual_ref: [1, D] one row; w_ref: [D]; normed_ref, sum_ref: [1, D]
    if with_residual:
        x_ref, residual_ref, w_ref, normed_ref, sum_ref = refs
        total = (x_ref[...].astype(jnp.float32) + residual_ref[...].astype(jnp.float32)).astype(x_ref.dtype)
        sum_ref[...] = total
    else:
        x_ref, w_ref, normed_ref = refs
        total = x_ref[...]
    t32 = total.astype(jnp.float32)
    scaled = (t32 * jax.lax.rsqrt(jnp.mean(t32 * t32, axis=-1, keepdims=True) + eps)).astype(total.dtype)
    # Both factors are exact in f32, so one rounding gives the input dtype's own product.
    normed_ref[...] = (w_ref[...].astype(jnp.float32)[None, :] * scaled.astype(jnp.float32)).astype(normed_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(
    x: jax.Array,  # [N, D]
    weight: jax.Array,  # [D]
    residual: jax.Array | None = None,  # [N, D]
    *,
    eps: float,
    interpret: bool = False,
):
    """normed [N, D], or (normed, x + residual) with a residual; x's dtype throughout.

    normed = weight * (s * rsqrt(mean(s^2) + eps)) with s = x (+ residual) rounded to x.dtype,
    the product rounded to x.dtype after each factor is.
    """
    N, D = x.shape
    if D & (D - 1):
        raise ValueError(f"D={D} must be a power of two for the Pallas RMSNorm")
    row = pl.BlockSpec((1, D), lambda i: (i, 0))
    operands, in_specs = (x, weight), [row, pl.BlockSpec((D,), lambda i: (0,))]
    out_shape, out_specs = [jax.ShapeDtypeStruct((N, D), x.dtype)], [row]
    if residual is not None:
        operands, in_specs = (x, residual, weight), [row, row, in_specs[1]]
        out_shape.append(jax.ShapeDtypeStruct((N, D), x.dtype))
        out_specs.append(row)
    out = pl.pallas_call(
        functools.partial(_rms_norm_kernel, eps=eps, with_residual=residual is not None),
        grid=(N,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4 if D <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="decodejax_rms_norm",
    )(*operands)
    return tuple(out) if residual is not None else out[0]
