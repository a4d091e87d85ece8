"""Invariants A1-A4: one translator, every layout, unique payload ids, poisoned tails."""

import itertools

import numpy as np
import pytest

from decodejax import addressing, fixtures
from decodejax.addressing import AddressingError, KVLayout, KVTranslator

LENS = np.array([10, 7, 5])
H_Q, H_KV, D, P = 4, 2, 4, 4
CACHE_ROWS = np.array([2, 0, 3])  # active row b -> cache row c; req-A (b = 0) lives in row 2
POISON = -1


def make_translators():
    """The same three requests in every layout."""
    r = np.random.default_rng(0)
    common = dict(num_q_heads=H_Q, num_kv_heads=H_KV, head_dim=D, seq_lens=LENS)
    T_c, B_c = 12, 4
    num_pages = 16
    table = np.zeros((B_c, 3), np.int32)
    pages = r.permutation(np.arange(1, num_pages))
    n = 0
    for b, c in enumerate(CACHE_ROWS):
        for j in range(-(-LENS[b] // P)):
            table[c, j] = pages[n]
            n += 1
    indptr_tokens = np.concatenate([[0], np.cumsum(LENS)])
    csr_indptr, csr_indices, last = addressing.dense_to_csr(table, LENS, P, cache_batch_idx=CACHE_ROWS)
    return {
        KVLayout.CONTIGUOUS_NHD: KVTranslator(KVLayout.CONTIGUOUS_NHD, cache_batch_idx=CACHE_ROWS, token_capacity=T_c, num_cache_rows=B_c, **common),
        KVLayout.CONTIGUOUS_HND: KVTranslator(KVLayout.CONTIGUOUS_HND, cache_batch_idx=CACHE_ROWS, token_capacity=T_c, num_cache_rows=B_c, **common),
        KVLayout.RAGGED_NHD: KVTranslator(KVLayout.RAGGED_NHD, indptr=indptr_tokens, **common),
        KVLayout.PAGED_NHD: KVTranslator(KVLayout.PAGED_NHD, cache_batch_idx=CACHE_ROWS, page_size=P, page_table=table, num_pages=num_pages, **common),
        KVLayout.PAGED_HND: KVTranslator(KVLayout.PAGED_HND, cache_batch_idx=CACHE_ROWS, page_size=P, page_table=table, num_pages=num_pages, **common),
        KVLayout.PAGED_CSR_NHD: KVTranslator(KVLayout.PAGED_CSR_NHD, indptr=csr_indptr, page_indices=csr_indices, page_size=P, num_pages=num_pages, **common),
    }, last


def payload_id(b, t, h_kv, x, tensor):
    return (((b * 16 + t) * H_KV + h_kv) * D + x) * 2 + (tensor == "V")


def visible_coords():
    for b in range(len(LENS)):
        for t, h_q, x in itertools.product(range(LENS[b]), range(H_Q), range(D)):
            yield b, t, h_q, x


@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda l: l.value)
def test_A1_A2_unique_payload_roundtrip_every_layout(layout):
    translators, _ = make_translators()
    tr = translators[layout]
    stores = {"K": np.full(tr.storage_elements(), POISON), "V": np.full(tr.storage_elements(), POISON)}
    written = {}
    for b, t, h_q, x in visible_coords():
        if h_q % tr.group_size:
            continue  # one writer per K/V head
        for tensor in "KV":
            addr = tr.offset(b, t, h_q, x, tensor)
            key = (addr.tensor, addr.offset)
            ident = payload_id(b, t, tr.kv_head(h_q), x, tensor)
            assert written.setdefault(key, ident) == ident, f"collision at {key}"
            stores[tensor][addr.offset] = ident
    assert len(written) == 2 * int(LENS.sum()) * H_KV * D  # 176 per tensor, as in the seed
    mismatches = 0
    for b, t, h_q, x in visible_coords():
        for tensor in "KV":
            addr = tr.offset(b, t, h_q, x, tensor)
            got = stores[tensor][addr.offset]
            assert got != POISON, "a visible read reached a poisoned (unwritten) element"
            mismatches += got != payload_id(b, t, h_q // (H_Q // H_KV), x, tensor)
    assert mismatches == 0


def test_A2_dense_and_csr_agree_on_every_visible_block():
    translators, last = make_translators()
    dense, csr = translators[KVLayout.PAGED_NHD], translators[KVLayout.PAGED_CSR_NHD]
    for b in range(len(LENS)):
        for t in range(LENS[b]):
            assert dense.page(b, t) == csr.page(b, t)
    np.testing.assert_array_equal(last, [(n - 1) % P + 1 for n in LENS])
    back = addressing.csr_to_dense(*addressing.dense_to_csr(dense.page_table, LENS, P, CACHE_ROWS)[:2], width=3)
    np.testing.assert_array_equal(back, dense.page_table[CACHE_ROWS])


def test_A2_tokens_past_seq_len_are_not_addressable():
    tr = make_translators()[0][KVLayout.PAGED_NHD]
    with pytest.raises(AddressingError, match="t=7 is not visible"):
        tr.offset(1, 7, 0, 0)


def test_seed_fixture_offsets_and_segments():
    fx = fixtures.ADDRESS
    lens = np.full(fx["B_c"], fx["T_c"])
    common = dict(num_q_heads=fx["H_q"], num_kv_heads=fx["H_kv"], head_dim=fx["d"], seq_lens=lens, token_capacity=fx["T_c"], num_cache_rows=fx["B_c"])
    remap = np.array([fx["cache_row"], 0, 1, 3])  # active row 0 (req-A) -> cache row 2
    nhd = KVTranslator(KVLayout.CONTIGUOUS_NHD, cache_batch_idx=remap, **common)
    hnd = KVTranslator(KVLayout.CONTIGUOUS_HND, cache_batch_idx=remap, **common)
    assert nhd.kv_head(fx["h_q"]) == fx["h_kv"]
    assert nhd.offset(0, fx["t"], fx["h_q"], fx["x"]).offset == fx["nhd_offset"]
    assert hnd.offset(0, fx["t"], fx["h_q"], fx["x"]).offset == fx["hnd_offset"]
    segs = list(addressing.page_segments(fx["req_a_table"], *fx["split"], fx["page_size"]))
    assert segs == fx["segments"]


@pytest.mark.parametrize("granularity,kernel_page", [(16, 4), (8, 8), (64, 1), (32, 16)])
def test_A3_write_slots_identical_after_expansion(granularity, kernel_page):
    r = np.random.default_rng(3)
    blocks = r.permutation(np.arange(1, 40))[:12].reshape(3, 4).astype(np.int32)
    rows = np.repeat(np.arange(3), 20)
    positions = r.integers(0, 4 * granularity, size=60)
    raw = addressing.write_slots(blocks, rows, positions, granularity)
    expanded = addressing.expand_block_table(blocks, granularity, kernel_page)
    np.testing.assert_array_equal(addressing.write_slots(expanded, rows, positions, kernel_page), raw)


def test_A3_expansion_rejects_non_dividing_page():
    with pytest.raises(AddressingError, match="kernel_page_size=6"):
        addressing.expand_block_table(np.ones((1, 2), np.int32), 16, 6)


def _validate(table, lens, num_pages=8, page_size=4, row_elements=8):
    addressing.validate_page_table(np.asarray(table), np.asarray(lens), page_size=page_size, num_pages=num_pages, row_elements=row_elements)


def test_A4_errors_name_the_offending_value():
    with pytest.raises(AddressingError, match="page id 9 of row b=0 is outside the pool of 8"):
        _validate([[1, 9]], [5])
    with pytest.raises(AddressingError, match="visible block 1 of row b=0 points at the null page"):
        _validate([[1, 0]], [5])
    with pytest.raises(AddressingError, match=r"seq_lens\[0\]=9 is outside \[0, page table width 2"):
        _validate([[1, 2]], [9])
    with pytest.raises(AddressingError, match="overflows int32"):
        _validate([[1, 2]], [5], num_pages=2**20, page_size=64, row_elements=1024)
    # Blocks past the visible history are never read, so they are not checked.
    _validate([[1, 0, 77]], [4])
