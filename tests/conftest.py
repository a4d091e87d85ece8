"""Shared test helpers: float64 context, tolerance table, seeded data."""

import jax
import numpy as np
import pytest

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
