"""Decode-attention benchmark cases, shared by the benchmark, its peers and the tests.

`make_case` builds identical numpy data for a spec in any process (JAX or PyTorch), so every
peer runs on the same shapes and data: q [B, H_q, D], a PAGED_NHD pool [num_pages, P, H_kv, D]
with randomly permuted pages (page 0 is the null page, never used), the page table and lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Every timed figure of the decode benchmark and its peers: SAMPLES samples, each of REPS
# back-to-back calls. Long runs leave out what one run pays once (the host's first dispatch,
# the final sync), as a decode loop does.
SAMPLES, REPS = 30, 50


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    max_len: int  # T for uniform cases, the upper bound of the draw for ragged ones
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    ragged: bool = False
    tags: tuple[str, ...] = ()


CASES = (
    Case("B1_T32768", 1, 32768, tags=("target",)),
    Case("B8_T8192", 8, 8192, tags=("target",)),
    Case("B32_T4096", 32, 4096, tags=("target",)),
    Case("B64_T2048", 64, 2048, tags=("target",)),
    Case("B128_T1024", 128, 1024, tags=("target",)),
    Case("ragged_B32_T1-16384", 32, 16384, ragged=True),
    Case("mha_B32_T4096", 32, 4096, q_heads=32, kv_heads=32),
    Case("d64_B32_T4096", 32, 4096, head_dim=64),
    # the llama3-8b engine's B 1 steps (issue 6): short contexts, where a call's latency counts
    Case("B1_T2048", 1, 2048, tags=("e2e",)),
    Case("B1_T8192", 1, 8192, tags=("e2e",)),
)

# Small versions of the same specs: CI runs them in interpret mode for correctness.
SMALL_CASES = (
    Case("small_B2_T200", 2, 200, q_heads=8, kv_heads=2, head_dim=64, page_size=16, tags=("ci",)),
    Case("small_ragged_B4_T1-300", 4, 300, q_heads=4, kv_heads=4, head_dim=64, page_size=8, ragged=True, tags=("ci",)),
)


def selected(names: str) -> list[Case]:
    """The CASES named in `names` (comma-separated), in CASES order; all of them for ""."""
    wanted = set(filter(None, names.split(",")))
    return [case for case in CASES if not wanted or case.name in wanted]


def lengths(case: Case, seed: int = 0) -> np.ndarray:
    if not case.ragged:
        return np.full(case.batch, case.max_len, np.int32)
    return np.random.default_rng(seed + 1).integers(1, case.max_len + 1, case.batch).astype(np.int32)


def make_case(case: Case, seed: int = 0):
    """Returns dict(q, k_pages, v_pages, page_table, seq_lens) as float32/int32 numpy arrays."""
    rng = np.random.default_rng(seed)
    lens = lengths(case, seed)
    P = case.page_size
    width = -(-case.max_len // P)
    pages_per_row = -(-lens // P)
    num_pages = int(pages_per_row.sum()) + 1
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    table = np.zeros((case.batch, width), np.int32)
    offsets = np.concatenate([[0], np.cumsum(pages_per_row)])
    for b in range(case.batch):
        table[b, : pages_per_row[b]] = perm[offsets[b] : offsets[b + 1]]
    pool_shape = (num_pages, P, case.kv_heads, case.head_dim)
    # Uniform draws are much cheaper than normals at 10^8 elements and just as non-trivial.
    k = rng.random(pool_shape, dtype=np.float32) * 2 - 1
    v = rng.random(pool_shape, dtype=np.float32) * 2 - 1
    q = rng.random((case.batch, case.q_heads, case.head_dim), dtype=np.float32) * 2 - 1
    return {"q": q, "k_pages": k, "v_pages": v, "page_table": table, "seq_lens": lens}


def kv_bytes(case: Case, seed: int = 0, dtype_bytes: int = 2) -> int:
    """Unique K/V bytes a decode call must read: sum_b T_b * H_kv * D * 2 (K and V) * dtype bytes."""
    return int(lengths(case, seed).sum()) * case.kv_heads * case.head_dim * 2 * dtype_bytes
