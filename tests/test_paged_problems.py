"""The problem generators the kernel tests trust: poison exactly where no request can see."""

import jax.numpy as jnp
import numpy as np

from paged_problems import Spec, draw_on_device, make_layout, make_problem

SPEC = Spec(6, 8, 2, 32, 4, 5, remap=True)
NUM_PAGES = 40


def seen_by_walking_each_request(layout) -> np.ndarray:
    """bool[num_pages, P], token by token: request b's token t is in page table[rows[b], t // P], row t % P."""
    seen = np.zeros((NUM_PAGES, SPEC.page_size), bool)
    for b, length in enumerate(layout["seq_lens"]):
        for t in range(length):
            seen[layout["page_table"][layout["cache_batch_idx"][b], t // SPEC.page_size], t % SPEC.page_size] = True
    return seen


def test_device_draw_has_the_layout_of_its_seed_and_poison_in_every_invisible_slot():
    args = draw_on_device(SPEC, np.random.default_rng(4), jnp.bfloat16, num_pages=NUM_PAGES)
    layout = make_layout(SPEC, np.random.default_rng(4), num_pages=NUM_PAGES)
    for name in ("page_table", "seq_lens", "cache_batch_idx"):
        np.testing.assert_array_equal(np.asarray(args[name]), layout[name], err_msg=name)
    np.testing.assert_array_equal(args["host_seq_lens"], layout["seq_lens"])
    seen = seen_by_walking_each_request(layout)
    assert 0 < seen.sum() < seen.size
    for name in ("k_pages", "v_pages"):
        pool = np.asarray(args[name], np.float32)
        assert args[name].dtype == jnp.bfloat16 and pool.shape == (NUM_PAGES, 4, 2, 32)
        assert np.isfinite(pool[seen]).all() and np.isnan(pool[~seen]).all(), name
    assert args["q"].shape == (6, 8, 32) and np.isfinite(np.asarray(args["q"], np.float32)).all()


def test_host_problem_poisons_every_invisible_slot_and_only_those():
    problem = make_problem(SPEC, np.random.default_rng(4), num_pages=NUM_PAGES)
    seen = seen_by_walking_each_request(problem)
    for name in ("k_pages", "v_pages"):
        assert np.isfinite(problem[name][seen]).all() and np.isnan(problem[name][~seen]).all(), name
