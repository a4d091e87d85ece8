"""Decode metadata: persistent buffers, the one refresh path, and the forward context (R1-R3, R5, R8).

A decode step verifies a candidate window of N tokens per request. With T committed tokens in
the cache, window column j sits at position T + j, its K/V is written there, and its query
row sees [0, T + j + 1) (bottom-right causal, M2):

    cache:   0 1 ... T-1 | T    T+1 ... T+N-1
    window:              | c0   c1  ... c(N-1)     c0 = last verified token, c1.. = drafts

`refresh_decode_metadata` is the only writer of decode metadata. Eager decode (bs ==
actual_bs), bucket replay (bs = bucket > actual_bs) and capture (actual_bs = 0) all run it;
rows [actual_bs, bs) are padding: page 0, seq_len 0, write slots inside page 0 (R3).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from decodejax.cache import CacheGroupRouter

# The packed upload is int32 [1 + bs, packed_width]: row 0 is a header whose first entry is
# actual_bs; row 1 + i is [slot, committed_len, token_from_row + 1 (0: none), window ids (N),
# block table of each group ...].
_FIXED_COLUMNS = 3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBuffers:
    """Persistent decode buffers, sized by max_decode_bs and donated to every step.

    Attributes:
      slots: i32[max_bs], request slot of each row (indexes the sampling pool).
      window_ids: i32[max_bs, N], the candidate window.
      positions: i32[max_bs, N], cache position of each window column.
      seq_lens: i32[max_bs], keys visible after the window is written (T + N; 0 = padding).
      page_tables: {leaf: i32[max_bs, W_leaf]} kernel page tables.
      write_slots: {leaf: i32[max_bs * N]} token-major flat write slots.
      sampled: i32[max_bs, N + 1], sampled tokens then accept_len (the step's output).
    """

    slots: jax.Array
    window_ids: jax.Array
    positions: jax.Array
    seq_lens: jax.Array
    page_tables: dict
    write_slots: dict
    sampled: jax.Array

    @staticmethod
    def create(router: CacheGroupRouter, max_bs: int, window: int) -> "DecodeBuffers":
        zeros = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
        return DecodeBuffers(
            slots=zeros(max_bs),
            window_ids=zeros(max_bs, window),
            positions=zeros(max_bs, window),
            seq_lens=zeros(max_bs),
            page_tables={lf.name: zeros(max_bs, router.kernel_width(lf.name)) for lf in router.leaves},
            write_slots={lf.name: zeros(max_bs * window) for lf in router.leaves},
            sampled=zeros(max_bs, window + 1),
        )

    @property
    def window(self) -> int:
        return self.window_ids.shape[1]


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    """One live request of a decode batch, as the scheduler describes it (host side).

    Attributes:
      slot: request slot in [0, max_requests).
      committed_len: T, tokens already in the cache.
      window_ids: N token ids: the last verified token, then drafts.
      block_tables: {group: block ids} covering positions [0, T + N).
      token_from_row: the row of the previous decode step whose sampled token is this row's
        window column 0, read on the device (the host has not seen it yet: the step was
        dispatched before the previous one's tokens were copied back); window_ids[0] is then
        a placeholder. Only with N = 1, whose committed_len the host knows.
    """

    slot: int
    committed_len: int
    window_ids: tuple[int, ...]
    block_tables: dict
    token_from_row: int | None = None


def packed_width(router: CacheGroupRouter, window: int) -> int:
    return _FIXED_COLUMNS + window + sum(g.max_blocks for g in router.groups)


def pack_decode_batch(rows: list[DecodeRow], *, bs: int, router: CacheGroupRouter, window: int, vocab_size: int,
                      max_rows: int | None = None) -> np.ndarray:
    """Validates a decode batch (F1) and packs it into one int32 [1 + bs, packed_width] upload.

    max_rows: rows of the decode buffers, the bound of token_from_row (default bs).

    Row 0 is the header (actual_bs = len(rows)); rows [1 + len(rows), 1 + bs) are padding.

    Raises ValueError naming the offending row and value before anything is written: bs
    smaller than the batch, duplicate slots, a missing group, a window of the wrong width or
    with ids outside the vocabulary, positions beyond a table's capacity, a block table that
    does not cover the window or points at the null block.
    """
    if len(rows) > bs:
        raise ValueError(f"{len(rows)} rows do not fit bs={bs}")
    max_rows = bs if max_rows is None else max_rows
    slots = [r.slot for r in rows]
    if len(set(slots)) != len(slots):
        raise ValueError(f"duplicate request slots in batch: {sorted(slots)}")
    packed = np.zeros((1 + bs, packed_width(router, window)), np.int32)
    packed[0, 0] = len(rows)
    out = packed[1 : 1 + len(rows)]
    for i, r in enumerate(rows):
        router.check_groups(r.block_tables)
        if len(r.window_ids) != window:
            raise ValueError(f"row {i} (slot {r.slot}): window has {len(r.window_ids)} ids, expected N={window}")
        if r.committed_len < 0:
            raise ValueError(f"row {i} (slot {r.slot}): committed_len={r.committed_len} < 0")
        bad = [t for t in r.window_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"row {i} (slot {r.slot}): token ids {bad} outside the vocabulary of {vocab_size}")
        if r.token_from_row is not None and (window != 1 or not 0 <= r.token_from_row < max_rows):
            raise ValueError(f"row {i} (slot {r.slot}): token_from_row={r.token_from_row} needs N=1 (N={window}) and a row in [0, {max_rows})")
    out[:, 0], out[:, 1] = slots, [r.committed_len for r in rows]
    out[:, 2] = [0 if r.token_from_row is None else r.token_from_row + 1 for r in rows]
    out[:, _FIXED_COLUMNS : _FIXED_COLUMNS + window] = [r.window_ids for r in rows]
    end_pos = out[:, 1].astype(np.int64) + window
    col = _FIXED_COLUMNS + window
    for g in router.groups:  # every row's blocks at once: the host cost of a step at large batch
        lists = [r.block_tables.get(g.name, ()) for r in rows]
        lens = np.fromiter(map(len, lists), np.int64, len(rows))
        needed = -(-end_pos // g.block_granularity)
        for i in np.flatnonzero(needed > g.max_blocks)[:1]:
            raise ValueError(f"row {i} (slot {rows[i].slot}): position {end_pos[i] - 1} exceeds group {g.name!r} capacity "
                             f"{g.max_blocks} blocks x {g.block_granularity}")
        for i in np.flatnonzero(lens > g.max_blocks)[:1]:
            raise ValueError(f"row {i} (slot {rows[i].slot}): {lens[i]} blocks for group {g.name!r}, whose tables hold {g.max_blocks}")
        blocks = np.zeros((len(rows), g.max_blocks), np.int32)
        blocks[np.repeat(np.arange(len(rows)), lens), np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)] = (
            np.fromiter(itertools.chain.from_iterable(lists), np.int32, int(lens.sum())))
        present = np.array([g.name in r.block_tables for r in rows], bool)
        dead = ((blocks <= 0) & (np.arange(g.max_blocks)[None, :] < needed[:, None])).any(axis=1)
        for i in np.flatnonzero(present & ((lens < needed) | dead))[:1]:
            raise ValueError(f"row {i} (slot {rows[i].slot}): group {g.name!r} blocks {list(lists[i])} do not cover "
                             f"positions [0, {end_pos[i]}) with live blocks")
        out[:, col : col + g.max_blocks] = blocks
        col += g.max_blocks
    return packed


def refresh_decode_metadata(
    buffers: DecodeBuffers,
    packed: jax.Array,  # i32[1 + bs, packed_width]: header row (actual_bs), then one row per request
    *,
    bs: int,
    router: CacheGroupRouter,
) -> DecodeBuffers:
    """Writes rows [0, bs) of the decode metadata from one packed upload; pure.

    Run under jit with `buffers` donated, XLA updates them in place. actual_bs is the header's
    first entry (0 for capture over placeholder tables); rows >= actual_bs are padding
    (page 0, seq_len 0, window ids 0, write slots inside page 0). A row with a token_from_row
    takes window column 0 from `buffers.sampled` of the step before, before this step
    overwrites it.
    """
    N = buffers.window
    actual_bs, batch = packed[0, 0], packed[1:]
    live = jnp.arange(bs) < actual_bs
    live_col = live[:, None]
    committed = jnp.where(live, batch[:, 1], 0)
    positions = committed[:, None] + jnp.arange(N, dtype=jnp.int32)[None, :]
    window_ids = jnp.where(live_col, batch[:, _FIXED_COLUMNS : _FIXED_COLUMNS + N], 0)
    # A row whose token the previous step sampled reads it from that step's output, still here.
    from_row = batch[:, 2] - 1
    on_device = buffers.sampled[jnp.clip(from_row, 0, buffers.sampled.shape[0] - 1), 0]
    window_ids = window_ids.at[:, 0].set(jnp.where(live & (from_row >= 0), on_device, window_ids[:, 0]))
    block_tables, col = {}, _FIXED_COLUMNS + N
    for g in router.groups:
        block_tables[g.name] = batch[:, col : col + g.max_blocks]
        col += g.max_blocks
    page_tables, write_slots = dict(buffers.page_tables), dict(buffers.write_slots)
    for lf in router.leaves:
        table = router.kernel_table(lf.name, block_tables[lf.group], live)
        page_tables[lf.name] = buffers.page_tables[lf.name].at[:bs].set(table)
        slots = router.write_slots(lf.name, table, positions).reshape(bs * N)
        write_slots[lf.name] = buffers.write_slots[lf.name].at[: bs * N].set(slots)
    return dataclasses.replace(
        buffers,
        slots=buffers.slots.at[:bs].set(jnp.where(live, batch[:, 0], 0)),
        window_ids=buffers.window_ids.at[:bs].set(window_ids),
        positions=buffers.positions.at[:bs].set(positions),
        seq_lens=buffers.seq_lens.at[:bs].set(jnp.where(live, committed + N, 0)),
        page_tables=page_tables,
        write_slots=write_slots,
    )


@functools.partial(jax.jit, static_argnames=("bs", "router"), donate_argnums=0)
def refresh_decode_metadata_jit(buffers, packed, *, bs, router):
    """`refresh_decode_metadata` compiled, buffers donated (used alone by tests and tools)."""
    return refresh_decode_metadata(buffers, packed, bs=bs, router=router)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("window_ids", "positions", "slots", "seq_lens", "page_tables", "write_slots", "extend"),
    meta_fields=("layer_leaves",),
)
@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """What a model's forward may know about the cache: the top-level attention backend view.

    Rows are the forward's rows (bs decode rows, or the extend batch's requests).
    """

    window_ids: jax.Array  # i32[rows, N]
    positions: jax.Array  # i32[rows, N]
    slots: jax.Array  # i32[rows]
    seq_lens: jax.Array  # i32[rows]
    page_tables: dict  # {leaf: i32[rows, W_leaf]}
    write_slots: dict  # {leaf: i32[rows * N]}
    layer_leaves: tuple[str, ...]  # leaf of each layer
    extend: "ExtendChunks | None" = None  # the requests of an extend forward (None in decode)

    @property
    def mode(self) -> str:
        """"extend" when the forward carries its requests' new tokens, else "decode"."""
        return "decode" if self.extend is None else "extend"

    @staticmethod
    def for_decode(buffers: DecodeBuffers, bs: int, layer_leaves: tuple[str, ...]) -> "ForwardContext":
        N = buffers.window
        return ForwardContext(
            window_ids=buffers.window_ids[:bs],
            positions=buffers.positions[:bs],
            slots=buffers.slots[:bs],
            seq_lens=buffers.seq_lens[:bs],
            page_tables={k: v[:bs] for k, v in buffers.page_tables.items()},
            write_slots={k: v[: bs * N] for k, v in buffers.write_slots.items()},
            layer_leaves=layer_leaves,
        )

    def write_locations(self, layer: int, mode: str) -> jax.Array:
        """The only source of KV write slots: i32[rows * N], token-major (row r, column j at r * N + j)."""
        if mode != self.mode:
            raise ValueError(f"write_locations(layer={layer}, mode={mode!r}) asked of a {self.mode!r} forward")
        return self.write_slots[self.layer_leaves[layer]]

    def layer_view(self, layer: int) -> "ForwardContext":
        """This context as layer `layer` alone sees it: a one-layer context (its layer 0)."""
        return dataclasses.replace(self, layer_leaves=(self.layer_leaves[layer],))

    def attention_rows(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """(page_table i32[rows * N, W], seq_lens i32[rows * N]) with one query row per window column.

        Column j of a row sees keys [0, T + j + 1); padded rows (seq_len 0) see nothing.
        """
        table = self.page_tables[self.layer_leaves[layer]]
        N = self.window_ids.shape[1]
        row_lens = jnp.where(self.seq_lens[:, None] > 0, self.positions + 1, 0)  # [rows, N]
        return jnp.repeat(table, N, axis=0), row_lens.reshape(-1)

    def append_rows(self, layer: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """An extend forward's requests for `decodejax.append_attention`: (page_table i32[C, W],
        qo_indptr i32[C + 1], kv_lens i32[C]); the rows are the forward's packed new tokens."""
        if self.extend is None:
            raise ValueError(f"append_rows(layer={layer}) asked of a {self.mode!r} forward")
        return self.extend.page_tables[self.layer_leaves[layer]], self.extend.qo_indptr, self.extend.kv_lens


@functools.partial(jax.tree_util.register_dataclass, data_fields=("qo_indptr", "kv_lens", "page_tables"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class ExtendChunks:
    """The requests of an extend forward, padded to a fixed count (padding: no new tokens, no keys).

    Attributes:
      qo_indptr: i32[C + 1], request c's new tokens are rows [qo_indptr[c], qo_indptr[c + 1]).
      kv_lens: i32[C], its keys after this forward (cached prefix + new tokens).
      page_tables: {leaf: i32[C, W_leaf]} kernel page tables per request.
    """

    qo_indptr: jax.Array
    kv_lens: jax.Array
    page_tables: dict


@dataclasses.dataclass(frozen=True)
class ExtendInputs:
    """The one required bundle of an extend (prefill or mixed) forward; no field has a default.

    Attributes:
      extend_lens: new tokens of each request (C_b >= 1).
      prefix_lens: tokens already cached before them (T_b >= 0).
      slots: request slots.
      token_ids: the new tokens of every request, concatenated (sum C_b).
      block_tables: {group: [block ids per request]} covering [0, T_b + C_b).
    """

    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    slots: tuple[int, ...]
    token_ids: tuple[int, ...]
    block_tables: dict


def build_extend_metadata(router: CacheGroupRouter, layer_leaves: tuple[str, ...], *, inputs: ExtendInputs, pad_to: int | None = None,
                          pad_requests_to: int | None = None) -> ForwardContext:
    """Extend metadata with dynamic shapes per forward: one context row per new token.

    The new tokens are packed request-major (qo_indptr order); token i of request b sits at
    position T_b + i, is written to its slot and sees [0, T_b + i + 1). A pure decode batch
    (every request one new token after a cached prefix) is refused: it belongs to the
    bucketed decode path. `pad_to` appends padding rows (token 0, page 0, seq_len 0, write
    slots inside page 0) up to a bucketed token count; `pad_requests_to` pads the request view
    (`ForwardContext.append_rows`) with requests of no tokens, for a fixed compiled shape.
    """
    C = np.asarray(inputs.extend_lens, np.int64)
    T = np.asarray(inputs.prefix_lens, np.int64)
    if len(C) == 0 or len(C) != len(T) or len(C) != len(inputs.slots):
        raise ValueError(f"extend_lens {tuple(C)}, prefix_lens {tuple(T)} and slots {inputs.slots} must be non-empty and aligned")
    if np.any(C < 1) or np.any(T < 0):
        raise ValueError(f"extend_lens must be >= 1 and prefix_lens >= 0; got {tuple(C)}, {tuple(T)}")
    if np.all(C == 1) and np.all(T > 0):
        raise ValueError("a pure decode batch (one new token after a cached prefix in every request) goes through refresh_decode_metadata")
    if len(inputs.token_ids) != C.sum():
        raise ValueError(f"token_ids has {len(inputs.token_ids)} ids, extend_lens sum to {int(C.sum())}")
    router.check_groups(inputs.block_tables)
    total = int(C.sum())
    pad_to = total if pad_to is None else pad_to
    if pad_to < total:
        raise ValueError(f"pad_to={pad_to} is smaller than the {total} new tokens")
    num_requests = len(C) if pad_requests_to is None else pad_requests_to
    if num_requests < len(C):
        raise ValueError(f"pad_requests_to={pad_requests_to} is smaller than the {len(C)} requests")
    req = np.concatenate([np.repeat(np.arange(len(C)), C), np.zeros(pad_to - total, np.int64)])
    pos = (T[req] + np.arange(pad_to) - np.concatenate([np.repeat(np.concatenate([[0], np.cumsum(C)[:-1]]), C), np.arange(total, pad_to)])).astype(np.int32)
    live_np = np.arange(pad_to) < total
    pos = np.where(live_np, pos, np.arange(pad_to) - total).astype(np.int32)  # padding: positions 0.. inside page 0
    live = jnp.asarray(live_np)
    page_tables, write_slots, request_tables = {}, {}, {}
    live_requests = jnp.arange(num_requests) < len(C)
    for lf in router.leaves:
        g = router.group(lf.group)
        blocks = np.zeros((num_requests, g.max_blocks), np.int32)
        for b, row in enumerate(inputs.block_tables[lf.group]):
            if len(row) * g.block_granularity < T[b] + C[b]:
                raise ValueError(f"request {b}: group {g.name!r} blocks {list(row)} do not cover [0, {T[b] + C[b]})")
            blocks[b, : len(row)] = row
        request_tables[lf.name] = router.kernel_table(lf.name, jnp.asarray(blocks), live_requests)
        table = jnp.where(live[:, None], request_tables[lf.name][req], 0)  # each row its request's table
        page_tables[lf.name] = table
        write_slots[lf.name] = router.write_slots(lf.name, table, jnp.asarray(pos)[:, None]).reshape(-1)
    qo_indptr = np.full(num_requests + 1, total, np.int32)
    qo_indptr[: len(C) + 1] = np.concatenate([[0], np.cumsum(C)])
    kv_lens = np.zeros(num_requests, np.int32)
    kv_lens[: len(C)] = T + C
    tokens = np.zeros(pad_to, np.int32)
    tokens[:total] = inputs.token_ids
    return ForwardContext(
        window_ids=jnp.asarray(tokens)[:, None],
        positions=jnp.asarray(pos)[:, None],
        slots=jnp.asarray(np.where(live_np, np.asarray(inputs.slots, np.int32)[req], 0)),
        seq_lens=jnp.asarray(np.where(live_np, pos + 1, 0)),
        page_tables=page_tables,
        write_slots=write_slots,
        layer_leaves=layer_leaves,
        extend=ExtendChunks(qo_indptr=jnp.asarray(qo_indptr), kv_lens=jnp.asarray(kv_lens), page_tables=request_tables),
    )
