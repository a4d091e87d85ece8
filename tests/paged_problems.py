"""Random paged decode problems that are hard to pass (STYLE 9), shared by CPU and GPU tests.

Lengths mix the edges {0, 1, P-1, P, P+1, split boundary +-1, max} with random draws; page
tables are random permutations; cache rows are remapped; every slot that no visible token
occupies (page tails, unused pages, the null page 0) holds `poison`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Spec:
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    width: int  # pages per table row
    remap: bool = False

    @property
    def max_len(self):
        return self.width * self.page_size

    def __str__(self):
        return f"B={self.batch}_Hq={self.q_heads}_Hkv={self.kv_heads}_D={self.head_dim}_P={self.page_size}_W={self.width}"


def edge_lengths(spec: Spec, num_splits: int = 4) -> list[int]:
    P, T = spec.page_size, spec.max_len
    split = -(-T // num_splits)
    edges = [0, 1, P - 1, P, P + 1, split - 1, split, split + 1, T - 1, T]
    return sorted({min(max(x, 0), T) for x in edges})


def make_layout(spec: Spec, rng: np.random.Generator, lengths=None, num_pages=None) -> dict:
    """Lengths, a page table dealt from a random permutation of the pool, and cache rows (numpy).

    num_pages: pool size (default: the pages in use + the null page + 3 unused); a fixed size
    keeps one compiled shape across draws.
    """
    B, P = spec.batch, spec.page_size
    if lengths is None:
        edges = edge_lengths(spec)
        lengths = np.where(rng.random(B) < 0.5, rng.choice(edges, B), rng.integers(0, spec.max_len + 1, B))
    lens = np.asarray(lengths, np.int32)
    pages_per_row = -(-lens // P)
    needed = int(pages_per_row.sum()) + 1 + 3  # + null page + 3 unused pages
    if num_pages is not None and num_pages < needed:
        raise ValueError(f"num_pages={num_pages} < the {needed} pages these lengths need")
    num_pages = num_pages or needed
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    cache_rows = rng.permutation(B).astype(np.int32) if spec.remap else np.arange(B, dtype=np.int32)
    table = np.zeros((B, spec.width), np.int32)  # unused columns point at the null page
    first_page = np.concatenate([[0], np.cumsum(pages_per_row)])
    for b in range(B):
        table[cache_rows[b], : pages_per_row[b]] = perm[first_page[b] : first_page[b + 1]]
    return {"page_table": table, "seq_lens": lens, "cache_batch_idx": cache_rows, "num_pages": num_pages}


def make_problem(spec: Spec, rng: np.random.Generator, poison=np.nan, lengths=None, num_pages=None):
    """Returns numpy float32 q [B, H_q, D], pools [num_pages, P, H_kv, D] (NHD), table, lens, cache_rows.

    The layout is `make_layout`'s; unused pages hold `poison` like every invisible slot.
    """
    layout = make_layout(spec, rng, lengths, num_pages)
    shape = (layout.pop("num_pages"), spec.page_size, spec.kv_heads, spec.head_dim)
    k = np.full(shape, poison, np.float32)
    v = np.full_like(k, poison)
    # Every visible token at once: fresh data in its (page, row) slot.
    pages, rows = visible_token_slots(layout["page_table"], layout["seq_lens"], layout["cache_batch_idx"], spec.page_size)
    k[pages, rows] = rng.standard_normal((len(pages), spec.kv_heads, spec.head_dim), np.float32)
    v[pages, rows] = rng.standard_normal((len(pages), spec.kv_heads, spec.head_dim), np.float32)
    q = rng.standard_normal((spec.batch, spec.q_heads, spec.head_dim), np.float32)
    return {"q": q, "k_pages": k, "v_pages": v, **layout}


def draw_on_device(spec: Spec, rng: np.random.Generator, dtype, num_pages: int, poison=np.nan) -> dict:
    """`make_layout`'s problem with q and the pools drawn on the device, in `dtype`.

    Returns decode_attention arguments plus the host `seq_lens` as "host_seq_lens". For sweeps
    of GB-sized pools, where drawing them in numpy and copying them over would dominate the run.
    """
    layout = make_layout(spec, rng, num_pages=num_pages)
    table, lens, rows = layout["page_table"], layout["seq_lens"], layout["cache_batch_idx"]
    seen = seen_slots(table, lens, rows, num_pages, spec.page_size)
    key_q, key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
    shape = (num_pages, spec.page_size, spec.kv_heads, spec.head_dim)
    keep = jnp.asarray(seen)[:, :, None, None]
    return dict(
        q=jax.random.normal(key_q, (spec.batch, spec.q_heads, spec.head_dim), dtype),
        k_pages=jnp.where(keep, jax.random.normal(key_k, shape, dtype), jnp.asarray(poison, dtype)),
        v_pages=jnp.where(keep, jax.random.normal(key_v, shape, dtype), jnp.asarray(poison, dtype)),
        page_table=jnp.asarray(table),
        seq_lens=jnp.asarray(lens),
        cache_batch_idx=jnp.asarray(rows) if spec.remap else None,
        host_seq_lens=lens,
    )


def visible_token_slots(table, lens, cache_rows, page_size) -> tuple[np.ndarray, np.ndarray]:
    """(page, row) of every visible token, request by request in position order."""
    req = np.repeat(np.arange(len(lens)), lens)
    t = np.arange(len(req)) - np.repeat(np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return table[cache_rows[req], t // page_size], t % page_size


def with_poison(problem, poison):
    """The same problem with every invisible slot holding `poison` instead."""
    out = dict(problem)
    for name in ("k_pages", "v_pages"):
        x = problem[name].copy()
        x[~visible_slots(problem)] = poison
        out[name] = x
    return out


def visible_slots(problem) -> np.ndarray:
    """bool[num_pages, P]: slots some request of `problem` can see."""
    num_pages, page_size = problem["k_pages"].shape[:2]
    return seen_slots(problem["page_table"], problem["seq_lens"], problem["cache_batch_idx"], num_pages, page_size)


def seen_slots(table, lens, cache_rows, num_pages: int, page_size: int) -> np.ndarray:
    """bool[num_pages, page_size]: the slots that hold some request's visible token."""
    seen = np.zeros((num_pages, page_size), bool)
    seen[visible_token_slots(table, lens, cache_rows, page_size)] = True
    return seen
