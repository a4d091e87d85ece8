"""The end-to-end peer: Hugging Face transformers `generate` with a static cache and torch.compile (GPU).

Same shapes as benchmarks.e2e_decode: `batch` prompts of `context` random tokens, greedy,
`steps` new tokens, random weights with the preset's shapes (models.llama.PRESETS), bf16.
With `cache_implementation="static"` on a GPU, `generate` compiles the decoding forward itself
(torch.compile, mode "reduce-overhead": CUDA graphs); the prefill runs uncompiled. Each shape
compiles once in a warm-up generate; then decode tokens/s = batch * steps / (min of `--repeats`
generates of steps + 1 tokens - min of as many generates of 1 token), each synchronized; raw
times are kept, in the order they ran.

The steps + 1 token generates also stream their tokens to a `TokenClock`, which stamps the host's
clock as each token reaches the host. `generate` already waits for every step's tokens on the host
(its stop check reads them), so the stamps add one small device-to-host copy a step and no wait.
The gaps between the stamps after the first token are the decode steps one by one, timed as
benchmarks.e2e_decode times ours (each step ends on its tokens on the host): `step_ms_samples`
per generate and their median over all generates, `step_ms_median`.

With `--profile`, two more generates of each shape (steps + 1 and steps // 2 + 1 tokens) run under
torch.profiler, and the kernels in their traces give the GPU's share of the decode step
(`gpu_kernel_ms_per_step`: the difference of their kernel times over the steps between them). A
step far longer on the host's clock than on the GPU waits on the host, and then a faster host CPU
makes the peer faster.

Shapes run in the order given until `--deadline-s` has passed; later shapes are recorded as
not run. A shape whose static cache does not fit is recorded with its error.
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from decodejax.evidence import host_cpu
from models.llama import PRESETS


def hf_config(preset: str) -> "transformers.LlamaConfig":
    c = PRESETS[preset]
    scaling = None
    if c.rope_llama3:
        f, lo, hi, old = c.rope_llama3
        scaling = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi, "original_max_position_embeddings": old}
    return transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                    num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                                    head_dim=c.head_dim, rope_theta=c.rope_theta, rope_scaling=scaling, rms_norm_eps=c.rms_norm_eps,
                                    max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)


class TokenClock(BaseStreamer):
    """Stamps the host's clock at each `put`: once for the prompt, then once per new token."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass

    def decode_step_ms(self) -> list[float]:
        """The gaps between the tokens after the first (which the prefill made), ms."""
        return [(b - a) * 1e3 for a, b in zip(self.stamps[1:], self.stamps[2:])]


def timed_generate(model, ids, new_tokens: int, streamer: BaseStreamer | None = None) -> float:
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    model.generate(ids, streamer=streamer, **kw)
    sync()
    return time.perf_counter() - t


def kernel_time_in_trace(trace_events: list[dict]) -> tuple[float, int]:
    """(ms, count) of the GPU kernels in a Chrome trace's events (category "kernel", `dur` in us)."""
    kernels = [e for e in trace_events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sum(e["dur"] for e in kernels) / 1e3, len(kernels)


def profiled_kernel_time(model, ids, new_tokens: int) -> tuple[float, int]:
    """(ms, count) of GPU kernels in one generate of `new_tokens` tokens under torch.profiler (every
    activity this build supports: on a CPU-only build no kernels, so (0.0, 0))."""
    with torch.profiler.profile(activities=torch.profiler.supported_activities()) as prof:
        timed_generate(model, ids, new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernel_time_in_trace(json.load(f)["traceEvents"])


def gpu_kernel_time_per_step(model, ids, steps: int) -> dict:
    """GPU kernel time a decode step: the difference between a generate of steps + 1 tokens and one
    of steps // 2 + 1, over the steps between them. Both hold the prefill and the first decode step,
    which runs 20 to 30 ms longer than the rest (sixty-sixth session), so neither skews the figure."""
    long, short = steps + 1, steps // 2 + 1
    long_ms, long_count = profiled_kernel_time(model, ids, long)
    short_ms, short_count = profiled_kernel_time(model, ids, short)
    steps_between = long - short
    return {"gpu_kernel_ms_per_step": (long_ms - short_ms) / steps_between, "kernels_per_step": (long_count - short_count) / steps_between,
            "profiled_kernel_ms": {f"{long}_tokens": long_ms, f"{short}_tokens": short_ms}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batch", default="1,8,32,64,128")
    p.add_argument("--context", default="2048,512,8192")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="timed generates of each length per shape")
    p.add_argument("--deadline-s", type=float, default=float("inf"))
    p.add_argument("--profile", action="store_true", help="add each shape's GPU kernel time a decode step (torch.profiler)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    start = time.perf_counter()
    # One compiled graph per (batch, cache length): allow all of them rather than falling back to eager.
    torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config(a.model)).to(torch.bfloat16).cuda().eval()
    rows = []
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
            "compile": "generate's own (static cache)", "steps": a.steps, "repeats": a.repeats, "host_cpu": host_cpu()}
    for context in (int(c) for c in a.context.split(",")):
        for batch in (int(b) for b in a.batch.split(",")):
            row = {"batch": batch, "context": context}
            if time.perf_counter() - start > a.deadline_s:
                row["not_run"] = f"deadline of {a.deadline_s:.0f} s passed"
            else:
                ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
                try:
                    t = time.perf_counter()
                    timed_generate(model, ids, a.steps + 1)  # compiles this shape
                    row["warmup_s"] = time.perf_counter() - t
                    prefills = [timed_generate(model, ids, 1) for _ in range(a.repeats)]
                    clocks = [TokenClock() for _ in range(a.repeats)]
                    totals = [timed_generate(model, ids, a.steps + 1, clock) for clock in clocks]
                    decode = min(totals) - min(prefills)
                    steps_ms = [clock.decode_step_ms() for clock in clocks]
                    row.update(prefill_s_samples=prefills, total_s_samples=totals, step_ms=decode / a.steps * 1e3,
                               tokens_per_s=batch * a.steps / decode, compiled=hasattr(model, "_compiled_call"),
                               step_ms_samples=steps_ms, step_ms_median=float(np.median(np.concatenate(steps_ms))))
                    if a.profile:
                        row.update(gpu_kernel_time_per_step(model, ids, a.steps))
                except torch.OutOfMemoryError as exc:
                    row["error"] = repr(exc)[:300]
                del ids
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
            with open(a.out, "w") as f:
                json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
