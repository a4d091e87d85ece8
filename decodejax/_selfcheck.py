"""`python -m decodejax selfcheck`: recomputes the seed fixtures in float64 and prints them."""

from __future__ import annotations

import numpy as np

from decodejax import addressing, fixtures, planning, split_state


def _state(split):
    import jax.numpy as jnp

    allowed = split.get("allowed", [True] * len(split["scores"]))
    return split_state.summarize(
        jnp.asarray(split["scores"], jnp.float64),
        jnp.asarray(split["values"], jnp.float64),
        jnp.asarray(allowed),
    )


def run(tolerance: float = 1e-12) -> list[tuple[str, bool, str]]:
    """Returns (fixture name, passed, what was computed) rows."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    rows = []

    fx = fixtures.WORKED_EMPTY_MIDDLE
    states = [_state(s) for s in fx["splits"]]
    merged = states[0]
    for s in states[1:]:
        merged = split_state.merge(merged, s)
    o, lse = split_state.finalize(merged)
    want = fx["expected_merged"]
    ok = (
        all(bool(s.valid) == e["valid"] for s, e in zip(states, fx["expected_splits"]))
        and all(
            np.allclose(float(s.l), e["l"], rtol=0, atol=tolerance)
            and np.allclose(np.asarray(s.u), e["u"], rtol=0, atol=tolerance)
            for s, e in zip(states, fx["expected_splits"])
        )
        and np.allclose(np.asarray(o), want["o"], rtol=0, atol=tolerance)
        and abs(float(lse) - want["lse"]) <= tolerance
        and abs(float(merged.l) - want["l"]) <= tolerance
    )
    rows.append(("worked_empty_middle", ok, f"O={np.asarray(o).tolist()} LSE={float(lse)!r}"))

    fx = fixtures.AVERAGING_FAILURE
    lse_states = [split_state.to_lse(_state(s)) for s in fx["splits"]]
    exact = split_state.merge_lse(*lse_states).o[0]
    naive = sum(float(s.o[0]) for s in lse_states) / len(lse_states)
    ok = abs(float(exact) - fx["exact_output"]) < 1e-10 and naive == fx["naive_average"]
    rows.append(("averaging_failure", ok, f"exact={float(exact):.10f} naive average={naive}"))

    fx = fixtures.SPLIT_LENGTHS
    start, end = planning.balanced_split_bounds(np.array([fx["T"]]), fx["S"])
    lengths = (end - start)[0].tolist()
    rows.append(("balanced_split_lengths", lengths == fx["lengths"], f"T={fx['T']} S={fx['S']} -> {lengths}"))

    fx = fixtures.ADDRESS
    lens = np.full(fx["B_c"], fx["T_c"])
    common = dict(num_q_heads=fx["H_q"], num_kv_heads=fx["H_kv"], head_dim=fx["d"], seq_lens=lens,
                  token_capacity=fx["T_c"], num_cache_rows=fx["B_c"])
    nhd = addressing.KVTranslator(addressing.KVLayout.CONTIGUOUS_NHD, **common)
    hnd = addressing.KVTranslator(addressing.KVLayout.CONTIGUOUS_HND, **common)
    c, t, h, x = fx["cache_row"], fx["t"], fx["h_q"], fx["x"]
    offs = (nhd.offset(c, t, h, x).offset, hnd.offset(c, t, h, x).offset)
    segs = list(addressing.page_segments(fx["req_a_table"], *fx["split"], fx["page_size"]))
    ok = offs == (fx["nhd_offset"], fx["hnd_offset"]) and segs == fx["segments"]
    rows.append(("address_translation", ok, f"NHD={offs[0]} HND={offs[1]} segments={segs}"))

    fx = fixtures.LEDGERS
    call = fx["call"]
    n_states = call["B"] * call["H_q"] * call["S"]
    mlu = planning.workspace_bytes(n_states, call["d"], abi="mlu")
    lse_o = planning.workspace_bytes(n_states, call["d"], abi="lse_o", vector_dtype="bfloat16")
    traffic = planning.traffic_ledger(call["T"], call["H_q"], call["H_kv"], call["d"], call["d"])
    cap = fx["capacity"]
    counts = planning.owner_counts(planning.SplitPlan(cap["S"], cap["capacity"]), cap["T"], cap["H_q"])
    pad = fx["padded"]
    padded = planning.workspace_bytes(pad["states"], pad["d_v"], alignment=pad["alignment"])
    got = (mlu.bytes_per_state, mlu.logical_bytes, lse_o.bytes_per_state, lse_o.logical_bytes,
           traffic.unique_kv_bytes, traffic.q_head_demand_bytes,
           counts["owners"], counts["active"], counts["empty"], padded.logical_bytes, padded.allocated_bytes)
    want = (fx["mlu_bytes_per_state"], fx["mlu_bytes"], fx["lse_o_bytes_per_state"], fx["lse_o_bytes"],
            fx["unique_kv_bytes"], fx["q_head_demand_bytes"], cap["owners"], cap["active"], cap["empty"],
            pad["logical"], pad["allocated"])
    rows.append(("ledgers", got == want, "mlu {}B/{}B lse_o {}B/{}B kv unique {} demand {} owners {}/{}/{} padded {}/{}".format(*got)))
    return rows


def main() -> int:
    rows = run()
    for name, ok, text in rows:
        print(f"{'PASS' if ok else 'FAIL'}  {name:24s} {text}")
    failed = sum(not ok for _, ok, _ in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0
