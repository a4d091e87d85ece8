"""Llama-family decoders (Flax NNX) on the paged cache: Llama 2/3, Mistral, Qwen2, Qwen3.

Family differences are configuration: RoPE with optional llama3 frequency scaling; Mistral's
sliding window; Qwen2's q/k/v biases; Qwen3's per-head q/k RMSNorm; tied or untied embeddings.
The model touches the cache only through `ForwardContext` (write slots, page tables, lengths)
and `decodejax.decode_attention`; it never computes a slot, a page or a padding rule.

    tokens [rows, N] -> embed -> L x (norm -> attention on the paged cache -> norm -> SwiGLU MLP)
                     -> norm -> logits [rows, N, V]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import decodejax
from decodejax.cache import KVPool
from decodejax.metadata import ForwardContext


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # llama3 scaling as (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry biases
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # Mistral: a key is visible iff q_pos - k_pos < sliding_window
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @staticmethod
    def from_hf(hf: dict) -> "LlamaConfig":
        """From a Hugging Face config.json dict (LlamaForCausalLM, Mistral, Qwen2, Qwen3)."""
        arch = (hf.get("architectures") or [""])[0]
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        llama3 = None
        if scaling.get("rope_type", scaling.get("type")) == "llama3":
            llama3 = (float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
                      int(scaling["original_max_position_embeddings"]))
        theta = hf.get("rope_theta", scaling.get("rope_theta", 10000.0))
        eos = hf.get("eos_token_id")
        window = hf.get("sliding_window") if arch.startswith("Mistral") or hf.get("use_sliding_window") else None
        return LlamaConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=float(theta), rope_llama3=llama3,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", arch.startswith("Qwen2")),
            qk_norm=arch.startswith("Qwen3"), sliding_window=window,
            bos_token_id=hf.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


PRESETS = {
    # A byte-level vocabulary (256 bytes + BOS 256 + EOS 257) so `tiny` runs with no tokenizer files.
    "tiny": LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, max_position_embeddings=512, bos_token_id=256, eos_token_id=257),
    "llama3-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                             head_dim=64, rope_theta=500000.0, rope_llama3=(32.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
                             tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                             head_dim=128, rope_theta=500000.0, rope_llama3=(8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
                             bos_token_id=128000, eos_token_id=128001),
    "qwen2-0.5b": LlamaConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                              head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                              tie_word_embeddings=True, attention_bias=True, eos_token_id=151643),
}


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies f32[head_dim / 2], with llama3 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if config.rope_llama3 is None:
        return inv.astype(np.float32)
    factor, low, high, old_len = config.rope_llama3
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [..., H, D] at positions [...] (rotate-half convention, as Hugging Face Llama)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[..., None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[..., None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return (self.weight[...] * (x.astype(jnp.float32) * self._row_scale(x)).astype(x.dtype)).astype(x.dtype)

    def project(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """self(x) @ w [..., N] in float32: ((weight * x) @ w) * rsqrt(mean(x^2) + eps), each row's
        scale applied to the product instead of to x (a row's scale commutes with the matmul). XLA
        then computes the weight multiply in the norm's reduction kernel and the scale in whatever
        consumes the product, where normalizing first cost a multiply kernel before each matmul.

        On the H200 (llama3-8b, bf16, T 2,048, benchmarks/README.md) the step's GPU time went from
        4,457 to 4,377 us at B 1 and from 14,456 to 13,793 at B 128. The product stays in x's dtype:
        asked for in float32, XLA's matmuls before these norms' consumers ran slower (B 1: 4,617 us)."""
        return (self.weight[...] * x) @ w * self._row_scale(x)

    def _row_scale(self, x):
        """rsqrt(mean(x^2) + eps) f32[..., 1], in float32 whatever x's dtype."""
        x32 = x.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)


# A layer sees the cache and the metadata through one-layer views (`KVPool.layer_view`,
# `ForwardContext.layer_view`), in which its own layer is this index.
VIEW_LAYER = 0


def _dense(rngs: nnx.Rngs, n_in: int, n_out: int, dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), (n_in, n_out), jnp.float32) * n_in**-0.5).astype(dtype))


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        # q, k and v in one [hidden, (H_q + 2 H_kv) D] matrix: one matmul reads all three. At
        # decode a step is weight-bound, and one wide GEMM streams the weights faster than three
        # narrow ones (benchmarks/results/dense_ceiling.json).
        self.wqkv = _dense(rngs, c.hidden_size, self.qkv_width, dtype)
        self.wo = _dense(rngs, c.num_heads * c.head_dim, c.hidden_size, dtype)
        if c.attention_bias:
            self.bqkv = nnx.Param(jnp.zeros((self.qkv_width,), dtype))
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)

    @property
    def qkv_width(self) -> int:
        c = self.config
        return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim

    def __call__(self, x, norm: RMSNorm, pool: KVPool, ctx: ForwardContext, inv_freq):
        """x: the residual stream [rows, N, hidden], which `norm` normalizes for the projections.

        pool and ctx are this layer's one-layer views (`KVPool.layer_view`, `ForwardContext.layer_view`):
        a layer knows no index, so every layer of a model traces alike."""
        c = self.config
        rows, N, _ = x.shape
        qkv = norm.project(x, self.wqkv[...])
        if c.attention_bias:
            qkv = qkv + self.bqkv[...]
        heads = qkv.astype(x.dtype).reshape(rows, N, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        q, k, v = jnp.split(heads, [c.num_heads, c.num_heads + c.num_kv_heads], axis=2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, ctx.positions, inv_freq), apply_rope(k, ctx.positions, inv_freq)
        flat = lambda t: t.reshape(rows * N, *t.shape[2:])  # noqa: E731
        pool = pool.write(VIEW_LAYER, ctx.write_locations(VIEW_LAYER, ctx.mode), flat(k), flat(v))
        window = None if c.sliding_window is None else c.sliding_window - 1
        k_pages, v_pages = pool.k[VIEW_LAYER], pool.v[VIEW_LAYER]
        if ctx.mode == "extend":  # prefill / chunked prefill: tiles of new tokens share each K/V load
            table, qo_indptr, kv_lens = ctx.append_rows(VIEW_LAYER)
            o = decodejax.append_attention(flat(q).astype(pool.dtype), k_pages, v_pages, table, qo_indptr, kv_lens, window_left=window)
        else:
            table, lens = ctx.attention_rows(VIEW_LAYER)
            o = decodejax.decode_attention(flat(q).astype(pool.dtype), k_pages, v_pages, table, lens, window_left=window)
        return o.reshape(rows, N, c.num_heads * c.head_dim).astype(x.dtype) @ self.wo[...], pool


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.attn = Attention(c, dtype, rngs)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.w_gate_up = _dense(rngs, c.hidden_size, 2 * c.intermediate_size, dtype)  # [gate | up]: one matmul
        self.w_down = _dense(rngs, c.intermediate_size, c.hidden_size, dtype)

    def __call__(self, x, pool, ctx, inv_freq):
        h, pool = self.attn(x, self.input_norm, pool, ctx, inv_freq)
        x = x + h
        gate, up = jnp.split(self.post_attn_norm.project(x, self.w_gate_up[...]), 2, axis=-1)
        return x + (jax.nn.silu(gate) * up).astype(x.dtype) @ self.w_down[...], pool


class Llama(nnx.Module):
    """The decoder. Call with (pool, ctx) -> (logits f32[rows, N, V], pool)."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config, self.dtype = c, dtype
        self.embed = nnx.Param((jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32) * 0.02).astype(dtype))
        self.layers = nnx.List([DecoderLayer(c, dtype, rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _dense(rngs, c.hidden_size, c.vocab_size, dtype)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_frequencies(c)))

    @property
    def layer_leaves(self) -> tuple[str, ...]:
        return ("full",) * self.config.num_layers

    def functional(self):
        """(forward, state) for the runtime: forward(state, pool, ctx) is pure and hashable."""
        return functional(self)

    def __call__(self, pool: KVPool, ctx: ForwardContext):
        x = self.embed[...][ctx.window_ids]
        run_layer = _layer_runner(traced=isinstance(x, jax.core.Tracer))
        k, v = list(pool.k), list(pool.v)
        for i, layer in enumerate(self.layers):
            x, k[i], v[i] = run_layer(layer, x, pool.layer_view(i), ctx.layer_view(i), self.inv_freq[...])
        pool = KVPool(tuple(k), tuple(v))
        head = self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return self.norm.project(x, head), pool


def _call_layer(layer: "DecoderLayer", x, pool: KVPool, ctx: ForwardContext, inv_freq):
    """One decoder layer on its one-layer views: (x, its K pages, its V pages)."""
    x, pool = layer(x, pool, ctx, inv_freq)
    return x, pool.k[VIEW_LAYER], pool.v[VIEW_LAYER]


def _layer_runner(traced: bool):
    """How a forward runs its layers: under a trace (a jitted or lowered step), through one
    jax.jit made for that trace, so that the layers, which trace alike, are traced and lowered
    once and called L times; XLA inlines the calls, so the compiled step is the same. Made per
    trace so that the layer's trace sees that trace's dispatch state (bucket mode, preferred
    backends) and its backend selections are recorded with it. Outside a trace (the runner's
    eager mode, a notebook's forward), each layer runs op by op, as before."""
    if not traced:
        return _call_layer

    # A new function each trace: jax keys its trace cache on the function, so a jit of one
    # module-level function would hand a later trace the first one's layer, backends and all.
    def run_layer_of_this_trace(graphdef, state, *args):
        return _call_layer(nnx.merge(graphdef, state), *args)

    traced_layer = jax.jit(run_layer_of_this_trace, static_argnums=0)
    return lambda layer, *args: traced_layer(*nnx.split(layer), *args)


def functional(model: Llama):
    """(forward, state) for the runtime: forward(state, pool, ctx) is pure and hashable."""
    graphdef, state = nnx.split(model)
    return functools.partial(_forward, graphdef), state


def _forward(graphdef, state, pool, ctx):
    return nnx.merge(graphdef, state)(pool, ctx)


def random(preset: str | LlamaConfig, seed: int = 0, dtype=jnp.float32) -> Llama:
    """A randomly initialized model of a named preset ('tiny', 'llama3-1b', 'llama3-8b', 'qwen2-0.5b')."""
    config = PRESETS[preset] if isinstance(preset, str) else preset
    return Llama(config, dtype=dtype, rngs=nnx.Rngs(seed))


def from_pretrained(path: str, dtype=jnp.float32) -> Llama:
    """Loads a Hugging Face directory: config.json and one or sharded *.safetensors files."""
    from safetensors.numpy import load_file

    root = pathlib.Path(path)
    config = LlamaConfig.from_hf(json.loads((root / "config.json").read_text()))
    tensors = {}
    for shard in sorted(root.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    model = Llama(config, dtype=dtype, rngs=nnx.Rngs(0))

    def take(*names, transpose=False):
        """The named tensors, concatenated along their output axis (the last after transposing)."""
        missing = [n for n in names if n not in tensors]
        if missing:
            raise KeyError(f"{root}: missing tensor {missing[0]}")
        ts = [np.asarray(tensors[n], np.float32) for n in names]
        return jnp.asarray(np.concatenate([t.T if transpose else t for t in ts], axis=-1), dtype)

    model.embed[...] = take("model.embed_tokens.weight")
    model.norm.weight[...] = take("model.norm.weight")
    if not config.tie_word_embeddings:
        model.lm_head[...] = take("lm_head.weight", transpose=True)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer.input_norm.weight[...] = take(p + "input_layernorm.weight")
        layer.post_attn_norm.weight[...] = take(p + "post_attention_layernorm.weight")
        qkv = [p + f"self_attn.{proj}_proj." for proj in "qkv"]
        layer.attn.wqkv[...] = take(*(n + "weight" for n in qkv), transpose=True)
        layer.attn.wo[...] = take(p + "self_attn.o_proj.weight", transpose=True)
        if config.attention_bias:
            layer.attn.bqkv[...] = take(*(n + "bias" for n in qkv))
        if config.qk_norm:
            layer.attn.q_norm.weight[...] = take(p + "self_attn.q_norm.weight")
            layer.attn.k_norm.weight[...] = take(p + "self_attn.k_norm.weight")
        layer.w_gate_up[...] = take(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", transpose=True)
        layer.w_down[...] = take(p + "mlp.down_proj.weight", transpose=True)
    return model
