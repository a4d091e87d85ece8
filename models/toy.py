"""A small functional decoder (attention-only, no MLP) that runs on the paged cache.

It stands in for a real model in the runtime's tests and benchmarks: it writes K/V only where
`ForwardContext.write_locations` says and reads the cache only through
`decodejax.decode_attention` with the context's page tables and lengths. It never computes a
slot, a page index or a padding rule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import decodejax
from decodejax.cache import KVPool
from decodejax.metadata import ForwardContext


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 64
    d_model: int = 32
    num_layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    layer_leaves: tuple[str, ...] = ("full", "full")
    backend: str = "auto"


def init_params(config: ToyConfig, seed: int = 0) -> dict:
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 + 4 * config.num_layers))
    dense = lambda k, i, o: jax.random.normal(k, (i, o), jnp.float32) * i**-0.5  # noqa: E731
    d, qd, kd = config.d_model, config.q_heads * config.head_dim, config.kv_heads * config.head_dim
    return {
        "embed": jax.random.normal(next(keys), (config.vocab_size, d), jnp.float32),
        "unembed": dense(next(keys), d, config.vocab_size),
        "layers": [
            {"wq": dense(next(keys), d, qd), "wk": dense(next(keys), d, kd), "wv": dense(next(keys), d, kd), "wo": dense(next(keys), qd, d)}
            for _ in range(config.num_layers)
        ],
    }


def forward(config: ToyConfig, params: dict, pool: KVPool, ctx: ForwardContext) -> tuple[jax.Array, KVPool]:
    """logits f32[rows, N, V] for the context's rows and windows; returns the updated pool."""
    rows, N = ctx.window_ids.shape
    H_q, H_kv, D = config.q_heads, config.kv_heads, config.head_dim
    x = params["embed"][ctx.window_ids]  # [rows, N, d]
    for layer, w in enumerate(params["layers"]):
        q = (x @ w["wq"]).reshape(rows * N, H_q, D)
        k = (x @ w["wk"]).reshape(rows * N, H_kv, D)
        v = (x @ w["wv"]).reshape(rows * N, H_kv, D)
        pool = pool.write(layer, ctx.write_locations(layer, ctx.mode), k, v)
        table, lens = ctx.attention_rows(layer)
        o = decodejax.decode_attention(
            q.astype(pool.dtype), pool.k[layer], pool.v[layer], table, lens, backend=config.backend
        )
        x = x + (o.astype(jnp.float32).reshape(rows, N, H_q * D) @ w["wo"])
    return x @ params["unembed"], pool
