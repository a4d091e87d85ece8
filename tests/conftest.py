"""Shared test helpers: float64 context, tolerance table, seeded data."""

import importlib.util
import os

import jax
import numpy as np
import pytest

# Mosaic GPU's interpret mode runs each warpgroup as a thread whose barrier waits block inside
# XLA:CPU callbacks. With XLA:CPU's concurrency-optimized scheduling those callbacks can take
# every thread of its pool while the warpgroup that would release them waits for one: a test with
# four warpgroups (test_programs_walking_several_items_match_oracle[4-3-3]) hung in 3 of 4 runs of
# its file on a two-core machine like CI's, and on one core every time; without that scheduler it
# passed on one core. Set only where no CUDA plugin is installed, where the interpret tests run
# (the flag is jaxlib 0.10.2's; XLA stops at a flag it does not know).
if importlib.util.find_spec("jax_cuda12_plugin") is None and importlib.util.find_spec("jax_cuda13_plugin") is None:
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                      "--xla_cpu_enable_concurrency_optimized_scheduler=false"]))

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
