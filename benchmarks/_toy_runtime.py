"""The toy model on a DecodeRunner, shared by the runtime benchmarks (soak, overhead)."""

import functools

import jax.numpy as jnp

from decodejax.cache import CacheGroup, CacheGroupRouter, KVPool, Leaf
from decodejax.runner import AttentionLeafBackend, DecodeRunner, RunnerConfig
from models import toy

CFG = toy.ToyConfig()
BLOCK, PAGE, MAX_BLOCKS, NUM_BLOCKS = 16, 8, 16, 512
ROUTER = CacheGroupRouter((CacheGroup("main", BLOCK, MAX_BLOCKS),), (Leaf("full", "main", PAGE),))


def make_runner(config: RunnerConfig, max_requests: int = 256) -> DecodeRunner:
    pool = KVPool.create(CFG.num_layers, NUM_BLOCKS * BLOCK // PAGE, PAGE, CFG.kv_heads, CFG.head_dim, jnp.float32)
    backend = AttentionLeafBackend("full", tuple(range(CFG.num_layers)), PAGE, CFG.kv_heads, CFG.head_dim, "float32")
    return DecodeRunner(functools.partial(toy.forward, CFG), toy.init_params(CFG), pool, ROUTER, CFG.layer_leaves,
                        [backend], config, vocab_size=CFG.vocab_size, max_requests=max_requests)
