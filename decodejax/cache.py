"""The paged K/V cache: pool, host page allocator, cache groups and their router (R5, A3, A4).

Scheduler and kernels see pages at different granularities. A request holds one *block
table* per cache group, in scheduler blocks of `block_granularity` tokens. Each attention
*leaf* (a kind of layer) consumes one group through kernel pages of `kernel_page_size`
tokens (P divides G); the router expands block tables into kernel page tables:

    block table (G = 32):   [ 5 | 9 | 0 ... ]
    kernel table (P = 16):  [10 11 | 18 19 | 0 0 ... ]      block g -> pages g*G/P + i

Page 0 is the null page: the allocator never hands it out, padded rows and column tails
point at it, and only padded rows write to it (a one-row write does; `KVPool.write`'s scatter drops them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from decodejax import addressing


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request; nothing was allocated."""


class PageAllocator:
    """Host-side free list over pages [1, num_pages); page 0 (the null page) is never handed out."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` distinct pages, or OutOfPages with the free list unchanged."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count > len(self._free):
            raise OutOfPages(f"asked for {count} pages, {len(self._free)} free of {self.num_pages - 1}")
        return [self._free.pop() for _ in range(count)]

    def free(self, pages) -> None:
        pages = [int(p) for p in pages]
        bad = [p for p in pages if not 0 < p < self.num_pages]
        if bad:
            raise ValueError(f"cannot free pages {bad}: outside [1, {self.num_pages})")
        if len(set(pages)) != len(pages) or set(pages) & set(self._free):
            raise ValueError(f"double free among pages {sorted(pages)}")
        self._free.extend(reversed(pages))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """K and V pages in the decode kernel's PAGED_NHD layout, one array per layer.

    One array per layer (not one [L, ...] array) so that a kernel reads a layer's pages where
    they are: a kernel is a custom call, which XLA hands whole buffers, so a layer sliced out
    of a stacked pool could be materialized as a copy of the layer, every layer, every step.

    Attributes:
      k: L arrays [num_pages, P, H_kv, D].
      v: L arrays [num_pages, P, H_kv, D].
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @staticmethod
    def create(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype=jnp.bfloat16) -> "KVPool":
        shape = (num_pages, page_size, kv_heads, head_dim)
        return KVPool(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                      v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def layer_view(self, layer: int) -> "KVPool":
        """Layer `layer`'s pages as a one-layer pool (its layer 0)."""
        return KVPool(k=(self.k[layer],), v=(self.v[layer],))

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """[num_pages, P, H_kv, D] of every layer."""
        return tuple(self.k[0].shape)

    @property
    def dtype(self):
        return self.k[0].dtype

    @property
    def num_pages(self) -> int:
        return self.page_shape[0]

    @property
    def page_size(self) -> int:
        return self.page_shape[1]

    def write(self, layer: int, slots: jax.Array, k_new: jax.Array, v_new: jax.Array) -> "KVPool":
        """Writes rows k_new/v_new [n, H_kv, D] at flat slots i32[n] (page * P + row) of one layer.

        One scatter per tensor into the layer's [num_pages * P, H_kv, D] view (a bitcast), or
        one dynamic-update-slice for a single row, so a donated pool is updated in place.

        A scatter drops the rows whose slot is in the null page (page 0): those are padded rows
        (A4), and several of them share a slot there. Every other slot is one live token's, so
        the scatter's indices are unique, and XLA is told so: on the H200 its GPU scatter then
        took a layer's two writes in 2.2 against 3.0 us at 8 rows, 3.4 against 4.2 at 128
        (benchmarks/README.md, thirty-seventh session).
        """
        N, P, H, D = self.page_shape
        one_row = slots.shape[0] == 1
        # The scatter's indices, the same for K and V: a null-page slot goes out of bounds, where "drop" skips it.
        live = None if one_row else jnp.where(slots // P != addressing.NULL_PAGE, slots, N * P)

        def scatter(pages, rows):
            rows = rows.astype(pages.dtype)
            if one_row:
                # XLA rewrites a one-row scatter as a dynamic-update-slice guarded by a bounds
                # check that reads the old row, and duplicated a flat-view update for its 4-D
                # readers; either copies the whole layer every step (CPU-compiled HLO: a 164 MB
                # pool's bs = 1 step went from 186 to 43 ms). Slots are validated in bounds, so
                # one unguarded 4-D update is exact.
                return jax.lax.dynamic_update_slice(pages, rows[None], (slots[0] // P, slots[0] % P, 0, 0))
            return pages.reshape(N * P, H, D).at[live].set(rows, unique_indices=True, mode="drop").reshape(N, P, H, D)

        k, v = list(self.k), list(self.v)
        k[layer], v[layer] = scatter(k[layer], k_new), scatter(v[layer], v_new)
        return KVPool(k=tuple(k), v=tuple(v))


@dataclasses.dataclass(frozen=True)
class CacheGroup:
    """Geometry of one cache group.

    Attributes:
      name: the group's name (the scheduler keys block tables by it).
      block_granularity: G, tokens per scheduler block.
      max_blocks: block-table width per request.
      sliding_window: retention: a leaf of this group only needs the last `sliding_window`
        tokens (informational for the scheduler; visibility is the kernel's mask).
    """

    name: str
    block_granularity: int
    max_blocks: int
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An attention leaf: which group it consumes, through which kernel page size."""

    name: str
    group: str
    kernel_page_size: int


@dataclasses.dataclass(frozen=True)
class CacheGroupRouter:
    """Turns per-group block tables into each leaf's kernel page table; owns write-slot math.

    Frozen and hashable, so compiled steps take it as a static argument.
    """

    groups: tuple[CacheGroup, ...]
    leaves: tuple[Leaf, ...]

    def __post_init__(self):
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate cache group names {names}")
        for leaf in self.leaves:
            if leaf.group not in names:
                raise ValueError(f"leaf {leaf.name!r} consumes unknown group {leaf.group!r}")
            G = self.group(leaf.group).block_granularity
            if G % leaf.kernel_page_size:
                raise ValueError(f"leaf {leaf.name!r}: kernel_page_size={leaf.kernel_page_size} does not divide G={G}")

    def group(self, name: str) -> CacheGroup:
        return next(g for g in self.groups if g.name == name)

    def leaf(self, name: str) -> Leaf:
        for lf in self.leaves:
            if lf.name == name:
                return lf
        raise KeyError(f"unknown leaf {name!r}; leaves are {[lf.name for lf in self.leaves]}")

    def kernel_width(self, leaf: str) -> int:
        """Kernel page-table width of a leaf: max_blocks * G / P."""
        lf = self.leaf(leaf)
        g = self.group(lf.group)
        return g.max_blocks * g.block_granularity // lf.kernel_page_size

    def check_groups(self, group_tables: dict) -> None:
        """A batch that omits a group some leaf consumes is an error."""
        missing = sorted({lf.group for lf in self.leaves} - set(group_tables))
        if missing:
            raise ValueError(f"batch has no block table for group(s) {missing} consumed by leaves "
                             f"{sorted(lf.name for lf in self.leaves if lf.group in missing)}")

    def kernel_table(self, leaf: str, block_table, live_rows):
        """i32[rows, kernel_width]: expanded table; rows where live_rows is False are all page 0.

        Args:
          leaf: leaf name.
          block_table: i32[rows, max_blocks] of the leaf's group; unused blocks are 0.
          live_rows: bool[rows].
        """
        lf = self.leaf(leaf)
        G = self.group(lf.group).block_granularity
        table = addressing.expand_block_table(block_table, G, lf.kernel_page_size)
        # Block 0 (unused) expands to pages 0..G/P-1 of the null block: point them all at page 0.
        unused = jnp.repeat(block_table == 0, G // lf.kernel_page_size, axis=1)
        return jnp.where(live_rows[:, None] & ~unused, table, 0).astype(jnp.int32)

    def write_slots(self, leaf: str, kernel_table, positions):
        """Flat write slots table[row, pos // P] * P + pos % P for positions i32[rows, n]."""
        P = self.leaf(leaf).kernel_page_size
        rows = jnp.arange(kernel_table.shape[0])[:, None]
        return addressing.write_slots(kernel_table, rows, positions, P)
