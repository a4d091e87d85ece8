"""The continuous-batching engine on a tiny random Llama (CPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decodejax.engine import POOL_HEADROOM_BYTES, Engine, EngineConfig, RequestError, weights_dtype
from decodejax.metadata import ForwardContext
from decodejax.sampling import SamplingParams
from models import llama

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def model():
    return llama.random("tiny", seed=1)


@pytest.fixture(scope="module")
def reference_outputs(model):
    """Each prompt alone, greedy, roomy engine: what every other schedule must reproduce."""
    engine = Engine(model, EngineConfig(max_batch=4, max_context=128))
    return {p: engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS}


PROMPTS = ["hello", "the quick brown fox jumps over the lazy dog, twice over", "x", "paged attention"]


def test_generate_batch_matches_each_prompt_alone_and_returns_pages(model, reference_outputs):
    engine = Engine(model, EngineConfig(max_batch=4, max_context=128))
    start = engine.allocator.num_free
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == [reference_outputs[p] for p in PROMPTS]
    assert all(r.finish_reason in ("length", "stop") and isinstance(r.text, str) for r in results)
    assert engine.allocator.num_free == start and sorted(engine.free_slots) == list(range(4))


def test_chunked_prefill_and_out_of_pages_waiting_give_the_same_tokens(model, reference_outputs):
    # 16-token prefill chunks; a pool too small for all requests at once: they wait for pages.
    engine = Engine(model, EngineConfig(max_batch=4, max_context=128, prefill_token_budget=16, num_pages=9))
    start = engine.allocator.num_free
    results = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == [reference_outputs[p] for p in PROMPTS]
    assert engine.allocator.num_free == start


def test_stream_yields_the_generated_tokens_in_order(model, reference_outputs):
    engine = Engine(model, EngineConfig(max_batch=2, max_context=128))
    got = {0: [], 1: []}
    for index, token in engine.stream(PROMPTS[:2], GREEDY):
        got[index].append(token)
    assert got == {0: reference_outputs[PROMPTS[0]], 1: reference_outputs[PROMPTS[1]]}


@pytest.mark.parametrize(
    "prompt,params,match",
    [("", GREEDY, "empty prompt"), ([], GREEDY, "empty prompt"), ([5, 300], GREEDY, r"token ids \[300\] outside the vocabulary of 258"),
     ("y" * 130, GREEDY, "exceeds the context of 128"), ("ok", {"temperature": -1.0}, "SamplingParams.temperature=-1.0"),
     ("ok", {"top_q": 0.5}, "invalid sampling parameters")],
)
def test_bad_requests_fail_alone_and_before_device_work(model, reference_outputs, prompt, params, match):
    engine = Engine(model, EngineConfig(max_batch=2, max_context=128))
    good = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, params)
    assert len(engine.waiting) + len(engine.running) == 1  # nothing queued for the bad request
    while good not in engine.finished:
        engine.step()
    assert engine.finished[good].generated == reference_outputs[PROMPTS[0]]


def test_generate_names_the_bad_prompt_and_runs_nothing(model):
    engine = Engine(model, EngineConfig(max_batch=2, max_context=128))
    with pytest.raises(RequestError, match="prompt 1: empty prompt"):
        engine.generate(["fine", ""], GREEDY)
    assert not engine.waiting and not engine.running


def test_abort_returns_pages_and_slot(model):
    engine = Engine(model, EngineConfig(max_batch=2, max_context=128))
    start = engine.allocator.num_free
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.allocator.num_free < start
    engine.abort(rid)
    assert engine.finished[rid].finish_reason == "abort" and engine.allocator.num_free == start and len(engine.free_slots) == 2


def test_stop_tokens_and_seeded_sampling(model):
    engine = Engine(model, EngineConfig(max_batch=2, max_context=128))
    first = engine.generate(["seed me"], SamplingParams(temperature=1.0, seed=7, max_new_tokens=8))[0].token_ids
    again = engine.generate(["seed me"], SamplingParams(temperature=1.0, seed=7, max_new_tokens=8))[0].token_ids
    assert first == again
    stopped = engine.generate(["seed me"], SamplingParams(temperature=1.0, seed=7, max_new_tokens=8, stop_token_ids=(first[2],)))[0]
    assert stopped.token_ids == first[: first.index(first[2]) + 1] and stopped.finish_reason == "stop"


def test_eos_finishes_a_request_unless_ignore_eos(model, reference_outputs):
    greedy = reference_outputs["hello"]
    eos = greedy[3]
    same_weights = llama.random(dataclasses.replace(llama.PRESETS["tiny"], eos_token_id=eos), seed=1)
    engine = Engine(same_weights, EngineConfig(max_batch=2, max_context=128))
    stopped, ignored = engine.generate(["hello", "hello"], [GREEDY, dataclasses.replace(GREEDY, ignore_eos=True)])
    assert stopped.token_ids == greedy[: greedy.index(eos) + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


MIXED = [GREEDY, SamplingParams(temperature=1.0, seed=3, max_new_tokens=12), SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=7),
         dataclasses.replace(GREEDY, max_new_tokens=1)]


@pytest.mark.parametrize("pages", [None, 6], ids=["roomy", "preempting"])
def test_overlapped_decode_gives_the_tokens_of_step_by_step_decode(model, pages):
    """With one step in flight, continuing rows read their token on the device and finished
    requests' rows are dropped; tokens, finish reasons and free pages must match the engine
    that reads every step's tokens before dispatching the next."""
    outs, preempted = {}, {}
    for overlap in (False, True):
        engine = Engine(model, EngineConfig(max_batch=4, max_context=128, prefill_token_budget=16, num_pages=pages, overlap_decode=overlap))
        count, preempt = [0], engine._preempt
        engine._preempt = lambda req: (count.__setitem__(0, count[0] + 1), preempt(req))  # noqa: B023
        start = engine.allocator.num_free
        stop = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(12,))
        results = engine.generate(PROMPTS, MIXED) + engine.generate(PROMPTS[:2], [stop, GREEDY])
        outs[overlap] = [(r.token_ids, r.finish_reason) for r in results]
        preempted[overlap] = count[0]
        assert engine.allocator.num_free == start and sorted(engine.free_slots) == list(range(4))
    assert outs[True] == outs[False]
    assert (preempted[True] > 0) == (pages is not None)  # the tight pool does preempt


def test_abort_with_a_step_in_flight_drops_its_row_and_the_rest_go_on(model, reference_outputs):
    engine = Engine(model, EngineConfig(max_batch=2, max_context=128))
    start = engine.allocator.num_free
    doomed = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=50))
    kept = engine.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None  # the next step is already dispatched
    engine.abort(doomed)
    while kept not in engine.finished:
        engine.step()
    assert engine.finished[kept].generated == reference_outputs[PROMPTS[0]]
    assert engine.finished[doomed].finish_reason == "abort" and engine.allocator.num_free == start


def test_a_request_larger_than_the_whole_pool_is_refused_not_left_waiting(model):
    engine = Engine(model, EngineConfig(max_batch=2, max_context=128, num_pages=3))  # 2 usable pages of 16
    with pytest.raises(RequestError, match="needs 3 pages; the pool has 2"):
        engine.add_request(list(range(30)), SamplingParams(max_new_tokens=3))
    assert not engine.waiting


def test_engine_without_config_fits_the_model_and_gives_the_same_tokens(model, reference_outputs):
    memory_stats = jax.devices()[0].memory_stats()  # None on a CPU: the small-model defaults
    engine = Engine(model)
    assert engine.config == EngineConfig.for_model(model.config, jnp.float32, memory_stats)
    assert (engine.config.max_context, engine.runner.pool.dtype) == (min(512, model.config.max_position_embeddings), jnp.float32)
    start = engine.allocator.num_free
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [reference_outputs[p] for p in PROMPTS]
    assert engine.allocator.num_free == start


def test_weights_dtype_is_the_dtype_of_most_parameter_bytes():
    state = llama.random("tiny", dtype=jnp.bfloat16).functional()[1]  # bf16 matrices beside an f32 RoPE table
    assert weights_dtype(state) == jnp.bfloat16
    with pytest.raises(ValueError, match="no floating-point parameters"):
        weights_dtype({"ids": np.arange(4)})


LLAMA3_8B = llama.PRESETS["llama3-8b"]
PAGE_BYTES_8B_BF16 = LLAMA3_8B.num_layers * 2 * 16 * LLAMA3_8B.num_kv_heads * LLAMA3_8B.head_dim * 2  # K and V of 16 tokens


def test_for_model_sizes_the_pool_to_the_free_device_memory():
    roomy = EngineConfig.for_model(LLAMA3_8B, jnp.bfloat16, {"bytes_limit": 200 << 30, "bytes_in_use": 16 << 30})
    assert (roomy.max_batch, roomy.max_context, roomy.kv_dtype, roomy.prefill_token_budget) == (64, 8192, "bfloat16", 2048)
    assert roomy.num_pages == roomy.max_batch * (roomy.max_context // roomy.page_size) + 1  # every slot's pages, no more

    stats = {"bytes_limit": 60 << 30, "bytes_in_use": 16 << 30}
    tight = EngineConfig.for_model(LLAMA3_8B, jnp.bfloat16, stats)
    free = stats["bytes_limit"] - stats["bytes_in_use"] - POOL_HEADROOM_BYTES
    assert tight.num_pages * PAGE_BYTES_8B_BF16 <= free < (tight.num_pages + 1) * PAGE_BYTES_8B_BF16
    assert tight.num_pages < roomy.num_pages
    in_f32 = EngineConfig.for_model(LLAMA3_8B, jnp.float32, stats)
    assert in_f32.num_pages == free // (2 * PAGE_BYTES_8B_BF16)

    with pytest.raises(ValueError, match="max_context=8192"):  # 0.5 GiB after the headroom: not one 8,192-token request
        EngineConfig.for_model(LLAMA3_8B, jnp.bfloat16, {"bytes_limit": (20 << 30) + POOL_HEADROOM_BYTES, "bytes_in_use": 19.5 * 2**30})
    no_limit = EngineConfig.for_model(LLAMA3_8B, jnp.bfloat16, {"bytes_in_use": 1})
    assert (no_limit.max_batch, no_limit.max_context, no_limit.num_pages, no_limit.prefill_token_budget) == (8, 512, None, 256)


def test_for_model_sizes_the_pool_to_the_rows_and_context_asked_for():
    """What `python -m decodejax generate` asks: one row of 4,096 tokens gets that row's pages
    and the device's prefill chunks; without a memory limit, the CPU's chunks."""
    one_row = EngineConfig.for_model(LLAMA3_8B, jnp.bfloat16, {"bytes_limit": 200 << 30, "bytes_in_use": 16 << 30},
                                     max_batch=1, max_context=4096)
    assert (one_row.max_batch, one_row.max_context, one_row.num_pages, one_row.prefill_token_budget) == (1, 4096, 4096 // 16 + 1, 2048)
    on_cpu = EngineConfig.for_model(LLAMA3_8B, jnp.float32, None, max_batch=1, max_context=4096)
    assert (on_cpu.max_batch, on_cpu.max_context, on_cpu.num_pages, on_cpu.prefill_token_budget) == (1, 4096, None, 256)
    with pytest.raises(ValueError, match="max_context=4096"):  # 100 MiB free: 50 pages, not the 257 of one 4,096-token request
        EngineConfig.for_model(LLAMA3_8B, jnp.bfloat16, {"bytes_limit": POOL_HEADROOM_BYTES + (100 << 20), "bytes_in_use": 0},
                               max_batch=1, max_context=4096)


def test_a_traced_forward_traces_one_decoder_layer_and_an_eager_one_runs_each(monkeypatch):
    """Capture traces one layer per bucket, not one per layer, and records that trace's backend
    selections, for a second engine on the same model too (its traces must not reuse the first
    engine's layer, whose backends were picked under the first trace's dispatch state); an eager
    forward, as the Hugging Face parity tests run it, calls every layer."""
    traced_calls = []
    layer_call = llama.DecoderLayer.__call__

    def counting(self, x, *args):
        traced_calls.append(isinstance(x, jax.core.Tracer))
        return layer_call(self, x, *args)

    monkeypatch.setattr(llama.DecoderLayer, "__call__", counting)
    four_layers = llama.random(dataclasses.replace(llama.PRESETS["tiny"], num_layers=4), seed=1)
    for _ in range(2):
        engine = Engine(four_layers, EngineConfig(max_batch=2, max_context=64, capture_ladder=(1, 2)))
        assert traced_calls == [True, True]
        assert all(engine.runner.selections[bs] for bs in (1, 2))
        traced_calls.clear()
    forward, state = four_layers.functional()
    runner = engine.runner
    logits, _ = forward(state, runner.pool, ForwardContext.for_decode(runner.buffers, 1, runner.layer_leaves))
    assert traced_calls == [False] * 4 and logits.shape == (1, 1, four_layers.config.vocab_size)
