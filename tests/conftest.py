"""Shared test helpers: float64 context, tolerance table, seeded data."""

import jax
import numpy as np
import pytest

# Interpret-mode kernels run each warpgroup as a thread whose barrier waits block inside XLA:CPU
# callbacks. With async dispatch, those callbacks could occupy every thread of the CPU client's
# pool (two on the CI machine's two cores) while the warpgroup that would release them waited
# for one: a Mosaic test with four warpgroups hung there, in two full runs of its file.
jax.config.update("jax_cpu_enable_async_dispatch", False)

# One tolerance table (absolute, relative) per dtype, declared before any test runs.
TOLERANCES = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-5, 1e-5),
    "bfloat16": (2e-2, 2e-2),
    "float16": (1e-3, 1e-3),
}


def x64():
    """Context manager enabling float64 (jax.enable_x64 on both supported jax versions)."""
    return jax.enable_x64(True)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _interpret_backends_run_on_the_host(request):
    """A test parametrized with an interpret-mode backend runs on the CPU device.

    Interpret mode emulates a kernel with ordinary XLA ops; on a GPU machine those would run on
    the GPU, whose default f32 matmul precision (TF32) is not what the CPU tolerances assume.
    """
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend") if callspec else None
    if isinstance(backend, str) and "interpret" in backend:
        with jax.default_device(jax.devices("cpu")[0]):
            yield
    else:
        yield
