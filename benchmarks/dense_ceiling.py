"""What XLA's dense layers alone cost at decode: the ceiling a model step cannot beat.

    python -m benchmarks.dense_ceiling --model llama3-8b --batch 1,8,32,64,128 --out dense.json

Runs a Llama's decode-step matmuls and norms with its preset's shapes and random bf16 weights,
attention replaced by the identity (o = q), for one token per row: every weight is read once,
as in a real step. Three layouts of the same weights: `separate` (q, k, v, gate and up as their
own matmuls), `fused` (one qkv matmul, one gate|up matmul, as `models.llama` holds them, each
weight [in, out]) and `fused_nk` (`fused` with each weight stored [out, in], Hugging Face's
orientation, contracted on its last axis).
Timing is `decodejax.evidence.timed_samples` (back-to-back calls, then one sync); TB/s is
weight bytes read / median time against the 4.8 TB/s datasheet. The gap between this and an
end-to-end step is attention, the cache write, sampling and the engine's host work.
"""

import argparse
import functools
import json
import os
import platform

import jax
import jax.numpy as jnp

from decodejax import evidence
from models.llama import PRESETS

DATASHEET_BPS = 4.8e12
LAYOUTS = ("separate", "fused", "fused_nk")


def random_weights(config, fused: bool, dtype, seed: int = 0, out_in: bool = False) -> dict:
    """The dense weights of `config`'s decoder, each [in, out], or [out, in] with `out_in`."""
    c, key = config, jax.random.key(seed)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def w(shape):
        nonlocal key
        key, sub = jax.random.split(key)
        weight = (jax.random.normal(sub, shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)
        return weight.T if out_in else weight

    layers = []
    for _ in range(c.num_layers):
        layer = {"wo": w((q, c.hidden_size)), "w_down": w((c.intermediate_size, c.hidden_size))}
        if fused:
            layer.update(wqkv=w((c.hidden_size, q + 2 * kv)), w_gate_up=w((c.hidden_size, 2 * c.intermediate_size)))
        else:
            layer.update(wq=w((c.hidden_size, q)), wk=w((c.hidden_size, kv)), wv=w((c.hidden_size, kv)),
                         w_gate=w((c.hidden_size, c.intermediate_size)), w_up=w((c.hidden_size, c.intermediate_size)))
        layers.append(layer)
    return {"layers": layers, "head": w((c.hidden_size, c.vocab_size))}


def _rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


@functools.partial(jax.jit, static_argnames="out_in")
def dense_step(weights, x, out_in: bool = False):  # x [B, hidden] -> (logits f32[B, V], f32 sum of every k and v)
    def mm(a, w):  # a [B, in] times w [in, out], or w [out, in] with out_in
        return jax.lax.dot_general(a, w, (((1,), (1 if out_in else 0,)), ((), ())))

    q_width = weights["layers"][0]["wo"].shape[1 if out_in else 0]
    kv_sum = jnp.zeros((), jnp.float32)  # returned, so the k and v matmuls cannot be dropped
    for layer in weights["layers"]:
        y = _rms(x)
        if "wqkv" in layer:
            qkv = mm(y, layer["wqkv"])
            q, kv = qkv[:, :q_width], qkv[:, q_width:]
        else:
            q, kv = mm(y, layer["wq"]), jnp.concatenate([mm(y, layer["wk"]), mm(y, layer["wv"])], axis=-1)
        kv_sum = kv_sum + kv.astype(jnp.float32).sum()
        x = x + mm(q, layer["wo"])
        y = _rms(x)
        if "w_gate_up" in layer:
            gate, up = jnp.split(mm(y, layer["w_gate_up"]), 2, axis=-1)
        else:
            gate, up = mm(y, layer["w_gate"]), mm(y, layer["w_up"])
        x = x + mm(jax.nn.silu(gate) * up, layer["w_down"])
    return mm(_rms(x), weights["head"]).astype(jnp.float32), kv_sum


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", default="1,8,32,64,128")
    parser.add_argument("--layouts", default="separate,fused")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/dense_ceiling.json")
    args = parser.parse_args(argv)
    config, dtype = PRESETS[args.model], jnp.bfloat16
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: {unknown} not among {LAYOUTS}")
    rows = []
    for layout in layouts:
        out_in = layout == "fused_nk"
        weights = random_weights(config, layout != "separate", dtype, out_in=out_in)
        nbytes = sum(a.nbytes for a in jax.tree.leaves(weights))
        for batch in (int(b) for b in args.batch.split(",")):
            x = jax.random.normal(jax.random.key(batch), (batch, config.hidden_size), jnp.float32).astype(dtype)
            us = evidence.timed_samples(functools.partial(dense_step, out_in=out_in), (weights, x), samples=args.samples)
            med = sorted(us)[len(us) // 2]
            rows.append({"layout": layout, "batch": batch, "us_samples": us, "us_median": med, "us_min": min(us),
                         "weight_bytes": nbytes, "tb_per_s": nbytes / med / 1e6, "datasheet_fraction": nbytes / (med * 1e-6) / DATASHEET_BPS})
            print(f"{layout:8s} B={batch:4d} {med / 1e3:7.3f} ms  {rows[-1]['tb_per_s']:.2f} TB/s", flush=True)
        del weights
    result = {"machine": {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
                          "xla_flags": os.environ.get("XLA_FLAGS", "")},
              "model": args.model, "dtype": "bfloat16", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
