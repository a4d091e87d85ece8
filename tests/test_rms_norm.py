"""decodejax.rms_norm: the fused residual add + RMSNorm against its jnp definition (interpret mode
on CPU; the `gpu` marker runs the compiled kernel on the H200)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decodejax
from decodejax import reference

ON_GPU = jax.default_backend() == "gpu"


def operands(shape, dtype, seed=0):
    kx, kr, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (jax.random.normal(kx, shape) * 3).astype(dtype)
    residual = (jax.random.normal(kr, shape) * 20).astype(dtype)  # a residual stream larger than its update
    weight = (1 + 0.1 * jax.random.normal(kw, shape[-1:])).astype(dtype)
    return x, residual, weight


def check_against_reference(backend, shape, dtype):
    x, residual, weight = operands(shape, dtype)
    normed, total = decodejax.rms_norm(x, weight, eps=1e-5, residual=residual, backend=backend)
    want_normed, want_total = reference.rms_norm(x, weight, residual, eps=1e-5)
    # The sum is one rounding of an exact f32 sum in both: bit-identical.
    np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(want_total, np.float32))
    # The mean's summation order differs (XLA's tree against the kernel's): a rounding of the
    # normalized value can differ by one unit of x.dtype, scaled by the weight (~1.1).
    ulp = {jnp.float32: 1e-6, jnp.bfloat16: 2**-7, jnp.float16: 2**-10}[dtype]
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(want_normed, np.float32), rtol=1.2 * ulp, atol=1e-6)
    plain = decodejax.rms_norm(x, weight, eps=1e-5, backend=backend)
    np.testing.assert_allclose(np.asarray(plain, np.float32), np.asarray(reference.rms_norm(x, weight, eps=1e-5), np.float32),
                               rtol=1.2 * ulp, atol=1e-6)
    assert normed.dtype == total.dtype == plain.dtype == dtype and normed.shape == shape


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 64), (2, 2, 256)], ids=["rows", "batched"])
def test_interpret_kernel_matches_the_definition(shape, dtype):
    check_against_reference("pallas_triton_interpret", shape, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 4096), (128, 4096), (5, 2, 128), (3, 8192)], ids=["B1", "B128", "heads", "wide"])
def test_gpu_kernel_matches_the_definition(shape, dtype):
    check_against_reference("pallas_triton", shape, dtype)


def test_auto_picks_the_kernel_on_a_gpu_for_powers_of_two_and_xla_otherwise():
    with decodejax.dispatch.targeting("gpu", "9.0"):
        x = jax.ShapeDtypeStruct((4, 4096), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
        text = jax.jit(lambda x, w: decodejax.rms_norm(x, w, eps=1e-6, residual=x)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert "decodejax_rms_norm" in text
        odd = jax.ShapeDtypeStruct((4, 896), jnp.bfloat16)  # Qwen2-0.5B's hidden size
        text = jax.jit(lambda x, w: decodejax.rms_norm(x, w, eps=1e-6)).trace(odd, jax.ShapeDtypeStruct((896,), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "decodejax_rms_norm" not in text and "rsqrt" in text


@pytest.mark.parametrize("change,match", [
    (dict(weight=jnp.ones(32)), r"weight must be \[D\] = \(64,\)"),
    (dict(weight=jnp.ones(64, jnp.bfloat16)), "weight dtype bfloat16 != x dtype float32"),
    (dict(residual=jnp.ones((2, 64))), r"residual must match x \(3, 64\)"),
])
def test_bad_operands_raise_naming_them(change, match):
    args = dict(x=jnp.ones((3, 64)), weight=jnp.ones(64), residual=None) | change
    with pytest.raises(ValueError, match=match):
        decodejax.rms_norm(args["x"], args["weight"], eps=1e-5, residual=args["residual"])
