"""Worked fixtures of the decode-kernels source document (seed 002), as data.

They are test oracles: `python -m decodejax selfcheck` recomputes each one and the tests pin
them in float64 to 1e-12. Inputs and expected values are the document's; nothing here is
computed.
"""

import math

# 0x02G: three splits of one query row, the middle one fully masked (its values are poison).
WORKED_EMPTY_MIDDLE = {
    "splits": [
        {"scores": [4.0, -1.0], "values": [[1.0, 0.0], [0.0, 2.0]], "allowed": [True, True]},
        {"scores": [0.0, 0.0], "values": [[99.0, 99.0], [-99.0, -99.0]], "allowed": [False, False]},
        {"scores": [3.0, -2.0, 1.0], "values": [[2.0, 3.0], [-1.0, 4.0], [4.0, -2.0]], "allowed": [True, True, True]},
    ],
    "expected_splits": [
        {"valid": True, "m": 4.0, "l": 1.0067379469990854, "u": [1.0, 0.013475893998170934]},
        {"valid": False, "m": -math.inf, "l": 0.0, "u": [0.0, 0.0]},
        {"valid": True, "m": 3.0, "l": 1.142073230235698, "u": [2.5346031859473657, 2.7562812215231167]},
    ],
    "expected_merged": {
        "m": 4.0,
        "l": 1.4268832087150578,
        "u": [1.9324284036376742, 1.0274550894834356],
        "o": [1.3543003322450418, 0.7200695075868776],
        "lse": 4.355492491217523,
    },
}

# 0x02F: averaging normalized partial outputs fails; merging through LSE does not.
AVERAGING_FAILURE = {
    "splits": [
        {"scores": [10.0, 10.0], "values": [[1.0], [1.0]]},
        {"scores": [0.0, 0.0], "values": [[100.0], [100.0]]},
    ],
    "exact_output": 1.0044943890,
    "naive_average": 50.5,
}

# 0x02H: four equal scores, scalar values; float16 round-after-operation sums.
FLOAT16_ORDER_SENSITIVITY = {
    "values": [2048.0, 1.0, -2048.0, 1.0],
    "exact_output": 0.5,
    "float16_sequential": 0.25,
    "float16_balanced": 0.25,
    "float16_permuted": 0.5,
    "permutation": [0, 2, 1, 3],
}

# 0x04B / 0x04E: address translation.
ADDRESS = {
    "B_c": 4, "T_c": 12, "H_q": 4, "H_kv": 2, "d": 4,
    "cache_row": 2, "t": 3, "h_q": 3, "h_kv": 1, "x": 2,
    "nhd_offset": 222, "hnd_offset": 254,
    "req_a_table": [7, 3, 9], "page_size": 4, "split": (3, 9),
    "segments": [(7, 3, 1), (3, 0, 4), (9, 0, 1)],
}

# 0x03B: balanced split lengths.
SPLIT_LENGTHS = {"T": 3587, "S": 8, "lengths": [449, 449, 449, 448, 448, 448, 448, 448]}

# 0x03D-0x03G: workspace, traffic and capacity ledgers.
LEDGERS = {
    "call": {"B": 2, "H_q": 8, "H_kv": 2, "T": [4096, 3587], "d": 128, "S": 8},
    "mlu_bytes_per_state": 521, "mlu_bytes": 66_688,
    "lse_o_bytes_per_state": 261, "lse_o_bytes": 33_408,
    "unique_kv_bytes": 7_867_392, "q_head_demand_bytes": 31_469_568,
    "capacity": {"B": 2, "H_q": 4, "T": [3, 0], "S": 5, "capacity": 8,
                 "owners": 64, "active": 12, "empty": 52},
    "padded": {"states": 32, "d_v": 80, "alignment": 32, "logical": 10_528, "allocated": 12_576},
}
