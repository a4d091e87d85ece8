"""Parity with Hugging Face transformers (PyTorch, CPU) on tiny random configs of each family."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from decodejax.cache import CacheGroup, CacheGroupRouter, KVPool, Leaf  # noqa: E402
from decodejax.engine import Engine, EngineConfig  # noqa: E402
from decodejax.metadata import DecodeBuffers, DecodeRow, ExtendInputs, ForwardContext, build_extend_metadata, pack_decode_batch, refresh_decode_metadata_jit  # noqa: E402
from decodejax.sampling import SamplingParams  # noqa: E402
from models import llama  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None)
FAMILIES = {
    "llama3": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama2_tied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(head_dim=16)),
}


@pytest.fixture(autouse=True)
def _float32_matmuls():
    """fp32 parity means fp32 matmuls: on a GPU, XLA would otherwise run them in TF32."""
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    cls, cfg_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = cls(cfg_cls(**COMMON, **extra)).eval()
    if request.param == "qwen2":  # biases start at zero: make them matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, llama.from_pretrained(str(path))


def test_logits_over_prefill_and_16_decode_steps(pair):
    hf, ours = pair
    c = ours.config
    P, blocks = 8, [1, 2, 3, 4, 5]
    router = CacheGroupRouter((CacheGroup("main", P, len(blocks)),), (Leaf("full", "main", P),))
    pool = KVPool.create(c.num_layers, 8, P, c.num_kv_heads, c.head_dim, jnp.float32)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, c.vocab_size, 11)]
    ctx = build_extend_metadata(router, ours.layer_leaves, inputs=ExtendInputs((len(prompt),), (0,), (0,), tuple(prompt), {"main": [blocks]}))
    logits, pool = ours(pool, ctx)
    ours_logits = [np.asarray(logits[:, 0])]
    tokens = prompt + [int(np.argmax(ours_logits[0][-1]))]
    buffers = DecodeBuffers.create(router, 1, 1)
    for _ in range(16):
        row = DecodeRow(0, len(tokens) - 1, (tokens[-1],), {"main": blocks})
        batch = pack_decode_batch([row], bs=1, router=router, window=1, vocab_size=c.vocab_size)
        buffers = refresh_decode_metadata_jit(buffers, batch, bs=1, router=router)
        step_logits, pool = ours(pool, ForwardContext.for_decode(buffers, 1, ours.layer_leaves))
        ours_logits.append(np.asarray(step_logits[:, 0]))
        tokens.append(int(np.argmax(ours_logits[-1][0])))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens[:-1])[None]).logits[0].numpy()
    np.testing.assert_allclose(np.concatenate(ours_logits), ref, atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(pair):
    hf, ours = pair
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, ours.config.vocab_size, n)] for i, n in enumerate((3, 17, 9))]
    engine = Engine(ours, EngineConfig(max_batch=4, max_context=64, page_size=8))
    got = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, result in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor(prompt)[None], do_sample=False, max_new_tokens=12, min_new_tokens=12)[0, len(prompt):]
        assert result.token_ids == want.tolist()
