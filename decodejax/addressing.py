"""K/V address translation (invariants A1-A4).

A logical coordinate (active row b, token t, query head h_q, lane x, K or V) resolves in
this order, and each identity is distinct (A1):

    b   --cache_batch_idx-->   cache row c           (continuous batching reorders b)
    h_q --// (H_q / H_kv)-->   K/V head h_kv         (GQA)
    t   --layout-->            storage row or (page table[c, t // P], row t % P)  (A2)
                               -> element offset in the K or V tensor

Layouts (every layout is a named value, never implied by a tensor's rank):

    CONTIGUOUS_NHD  [B_c, T_c, H_kv, D]           offset ((c T_c + t) H_kv + h) D + x
    CONTIGUOUS_HND  [B_c, H_kv, T_c, D]           offset ((c H_kv + h) T_c + t) D + x
    RAGGED_NHD      [sum T_b, H_kv, D] + indptr   offset ((indptr[b] + t) H_kv + h) D + x
    PAGED_NHD       [num_pages, P, H_kv, D]       offset ((page P + t % P) H_kv + h) D + x
    PAGED_HND       [num_pages, H_kv, P, D]       offset ((page H_kv + h) P + t % P) D + x
    PAGED_CSR_NHD   PAGED_NHD storage, page = indices[indptr[b] + t // P]

Page 0 is the null page (A4): never given to a request; padded rows and placeholder tables
point at it. A visible block that points at it is an error.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator

import numpy as np

INT32_MAX = 2**31 - 1
NULL_PAGE = 0


class AddressingError(ValueError):
    """Metadata that would make a read or write leave its request's visible history."""


class KVLayout(enum.Enum):
    CONTIGUOUS_NHD = "contiguous_nhd"
    CONTIGUOUS_HND = "contiguous_hnd"
    RAGGED_NHD = "ragged_nhd"
    PAGED_NHD = "paged_nhd"
    PAGED_HND = "paged_hnd"
    PAGED_CSR_NHD = "paged_csr_nhd"

    @property
    def is_paged(self) -> bool:
        return self in (KVLayout.PAGED_NHD, KVLayout.PAGED_HND, KVLayout.PAGED_CSR_NHD)


def pool_geometry(pages, layout: KVLayout) -> tuple[int, int, int, int]:
    """(num_pages, page_size, H_kv, D) of a paged dense-table pool in `layout`."""
    if layout == KVLayout.PAGED_NHD:
        num_pages, P, H_kv, D = pages.shape
    elif layout == KVLayout.PAGED_HND:
        num_pages, H_kv, P, D = pages.shape
    else:
        raise ValueError(f"layout={layout} is not a paged dense-table layout (PAGED_NHD or PAGED_HND)")
    return num_pages, P, H_kv, D


def pool_row(page, row, kv_head, *, page_size: int, num_kv_heads: int, layout: KVLayout):
    """Row of (page, row in page, K/V head) in a paged pool viewed as [num_pages * P * H_kv, D].

    PAGED_NHD: (page P + row) H_kv + h; PAGED_HND: (page H_kv + h) P + row. Works on ints and on
    jax arrays (the kernels call it on their tile coordinates).
    """
    if layout == KVLayout.PAGED_HND:
        return (page * num_kv_heads + kv_head) * page_size + row
    return (page * page_size + row) * num_kv_heads + kv_head


@dataclasses.dataclass(frozen=True)
class KVAddress:
    """An element of the K or V tensor: which tensor, and the element offset into it."""

    tensor: str  # "K" or "V"
    offset: int


@dataclasses.dataclass(frozen=True, eq=False)
class KVTranslator:
    """The one read/write translator from logical coordinates to element offsets.

    Attributes:
      layout: the storage layout.
      num_q_heads, num_kv_heads, head_dim: H_q, H_kv, D.
      seq_lens: i32[B], visible tokens of each active row.
      cache_batch_idx: i32[B] active row -> cache row (contiguous and dense-table layouts);
        None means the identity.
      token_capacity: T_c (contiguous layouts).
      num_cache_rows: B_c (contiguous layouts).
      indptr: i32[B + 1] (RAGGED_NHD: token row pointers; PAGED_CSR_NHD: page pointers).
      page_size: P (paged layouts).
      page_table: i32[B_c, max_pages] (PAGED_NHD, PAGED_HND).
      page_indices: i32[nnz] (PAGED_CSR_NHD).
      num_pages: pages in the pool (paged layouts).
    """

    layout: KVLayout
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    seq_lens: np.ndarray
    cache_batch_idx: np.ndarray | None = None
    token_capacity: int | None = None
    num_cache_rows: int | None = None
    indptr: np.ndarray | None = None
    page_size: int | None = None
    page_table: np.ndarray | None = None
    page_indices: np.ndarray | None = None
    num_pages: int | None = None

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise AddressingError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.layout in (KVLayout.PAGED_NHD, KVLayout.PAGED_HND):
            validate_page_table(
                self.page_table,
                self.seq_lens,
                page_size=self.page_size,
                num_pages=self.num_pages,
                row_elements=self.num_kv_heads * self.head_dim,
                cache_batch_idx=self.cache_batch_idx,
            )
        if self.layout == KVLayout.PAGED_CSR_NHD:
            table = csr_to_dense(self.indptr, self.page_indices, width=_max_pages(self.seq_lens, self.page_size))
            validate_page_table(
                table,
                self.seq_lens,
                page_size=self.page_size,
                num_pages=self.num_pages,
                row_elements=self.num_kv_heads * self.head_dim,
            )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def cache_row(self, b: int) -> int:
        return int(b if self.cache_batch_idx is None else self.cache_batch_idx[b])

    def kv_head(self, h_q: int) -> int:
        return h_q // self.group_size

    def page(self, b: int, t: int) -> int:
        """Physical page of token t of active row b (paged layouts)."""
        if self.layout == KVLayout.PAGED_CSR_NHD:
            return int(self.page_indices[self.indptr[b] + t // self.page_size])
        return int(self.page_table[self.cache_row(b), t // self.page_size])

    def offset(self, b: int, t: int, h_q: int, x: int, tensor: str = "K") -> KVAddress:
        """Element offset of (active row b, token t, query head h_q, lane x) in K or V."""
        if tensor not in ("K", "V"):
            raise AddressingError(f"tensor must be 'K' or 'V', got {tensor!r}")
        if not 0 <= t < int(self.seq_lens[b]):
            raise AddressingError(f"token t={t} is not visible in row b={b} (seq_len={int(self.seq_lens[b])})")
        if not 0 <= x < self.head_dim:
            raise AddressingError(f"lane x={x} outside head_dim={self.head_dim}")
        h, H, D = self.kv_head(h_q), self.num_kv_heads, self.head_dim
        L = self.layout
        if L == KVLayout.CONTIGUOUS_NHD:
            off = ((self.cache_row(b) * self.token_capacity + t) * H + h) * D + x
        elif L == KVLayout.CONTIGUOUS_HND:
            off = ((self.cache_row(b) * H + h) * self.token_capacity + t) * D + x
        elif L == KVLayout.RAGGED_NHD:
            off = ((int(self.indptr[b]) + t) * H + h) * D + x
        else:  # paged: CSR shares the NHD storage
            storage = KVLayout.PAGED_HND if L == KVLayout.PAGED_HND else KVLayout.PAGED_NHD
            off = pool_row(self.page(b, t), t % self.page_size, h, page_size=self.page_size, num_kv_heads=H, layout=storage) * D + x
        return KVAddress(tensor, off)

    def storage_elements(self) -> int:
        """Elements of one K (or V) tensor in this layout."""
        H, D = self.num_kv_heads, self.head_dim
        if self.layout in (KVLayout.CONTIGUOUS_NHD, KVLayout.CONTIGUOUS_HND):
            return self.num_cache_rows * self.token_capacity * H * D
        if self.layout == KVLayout.RAGGED_NHD:
            return int(self.indptr[-1]) * H * D
        return self.num_pages * self.page_size * H * D


def _max_pages(seq_lens, page_size: int) -> int:
    return int(max([0, *(-(-int(n) // page_size) for n in np.asarray(seq_lens))]))


def validate_page_table(
    page_table,  # i32[B_c, max_pages]
    seq_lens,  # i32[B]
    *,
    page_size: int,
    num_pages: int,
    row_elements: int,
    cache_batch_idx=None,  # i32[B]
    lens_name: str = "seq_lens",
) -> None:
    """Raises AddressingError unless every visible block maps to a live page in the pool.

    `lens_name` is the caller's name for seq_lens, used in the messages.

    Checks, for each active row: seq_len fits the table width times page_size; every visible
    block's page is in [1, num_pages) (page 0 is the null page); and the pool's element
    offsets fit int32 addressing (num_pages * page_size * row_elements <= 2**31 - 1).
    Blocks past a row's visible history are not read and not checked.
    """
    table = np.asarray(page_table)
    lens = np.asarray(seq_lens)
    if page_size < 1:
        raise AddressingError(f"page_size must be >= 1, got {page_size}")
    if num_pages * page_size * row_elements > INT32_MAX:
        raise AddressingError(
            f"pool of num_pages={num_pages} x page_size={page_size} x {row_elements} elements per row "
            f"= {num_pages * page_size * row_elements} overflows int32 element offsets"
        )
    rows = np.arange(len(lens)) if cache_batch_idx is None else np.asarray(cache_batch_idx)
    if len(rows) and (rows.min() < 0 or rows.max() >= table.shape[0]):
        raise AddressingError(f"cache_batch_idx={rows.tolist()} outside the table's {table.shape[0]} rows")
    width = table.shape[1]
    for b, (c, n) in enumerate(zip(rows, lens)):
        if n < 0 or n > width * page_size:
            raise AddressingError(
                f"{lens_name}[{b}]={int(n)} is outside [0, page table width {width} x page_size {page_size}]"
            )
        blocks = table[c, : -(-int(n) // page_size)]
        bad = blocks[(blocks < 0) | (blocks >= num_pages)]
        if bad.size:
            raise AddressingError(f"page id {int(bad[0])} of row b={b} is outside the pool of {num_pages} pages")
        if np.any(blocks == NULL_PAGE):
            j = int(np.argmax(blocks == NULL_PAGE))
            raise AddressingError(f"visible block {j} of row b={b} points at the null page {NULL_PAGE}")


def dense_to_csr(page_table, seq_lens, page_size: int, cache_batch_idx=None):
    """Dense table -> (page_indptr i32[B + 1], page_indices i32[nnz], last_page_len i32[B]).

    Only visible blocks are kept. A non-empty row has last_page_len in [1, P]; an empty row 0.
    """
    table = np.asarray(page_table)
    lens = np.asarray(seq_lens)
    rows = np.arange(len(lens)) if cache_batch_idx is None else np.asarray(cache_batch_idx)
    counts = [-(-int(n) // page_size) for n in lens]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = np.concatenate([table[c, :k] for c, k in zip(rows, counts)] or [np.zeros(0)]).astype(np.int32)
    last = np.array([(int(n) - 1) % page_size + 1 if n > 0 else 0 for n in lens], np.int32)
    return indptr, indices, last


def csr_to_dense(page_indptr, page_indices, width: int, fill: int = NULL_PAGE) -> np.ndarray:
    """CSR page lists -> a dense [B, width] table, padded with `fill` (the null page)."""
    indptr = np.asarray(page_indptr)
    indices = np.asarray(page_indices)
    out = np.full((len(indptr) - 1, width), fill, np.int32)
    for r in range(len(indptr) - 1):
        row = indices[indptr[r] : indptr[r + 1]]
        if len(row) > width:
            raise AddressingError(f"row {r} has {len(row)} pages, more than width={width}")
        out[r, : len(row)] = row
    return out


def page_segments(table_row, start: int, end: int, page_size: int) -> Iterator[tuple[int, int, int]]:
    """Yields (page, first row in page, count) covering logical tokens [start, end) in order."""
    if not 0 <= start <= end:
        raise AddressingError(f"invalid token range [{start}, {end})")
    position = start
    while position < end:
        block = position // page_size
        seg_end = min(end, (block + 1) * page_size)
        yield int(table_row[block]), position % page_size, seg_end - position
        position = seg_end


def write_slots(page_table, cache_rows, positions, page_size: int):
    """Flat slot of each new token: table[c, pos // P] * P + pos % P (A3).

    Works on numpy and jax arrays (so it runs inside jit). The slot indexes the pool viewed
    as [num_pages * P, H_kv, D] (PAGED_NHD).
    """
    return page_table[cache_rows, positions // page_size] * page_size + positions % page_size


def expand_block_table(block_table, granularity: int, kernel_page_size: int):
    """Scheduler blocks of `granularity` tokens -> kernel pages of `kernel_page_size` (P | G).

    Block id g becomes kernel pages g * (G / P) + i, i in [0, G / P), so the write slot of
    every position is unchanged (A3). Works on numpy and jax arrays.
    """
    if granularity % kernel_page_size:
        raise AddressingError(
            f"kernel_page_size={kernel_page_size} does not divide block granularity={granularity}"
        )
    ratio = granularity // kernel_page_size
    expanded = block_table[:, :, None] * ratio + np.arange(ratio)[None, None, :]
    return expanded.reshape(block_table.shape[0], block_table.shape[1] * ratio)
