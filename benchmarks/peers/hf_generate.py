"""The end-to-end peer: Hugging Face transformers `generate` with a static cache and torch.compile (GPU).

Same shapes as benchmarks.e2e_decode: `batch` prompts of `context` random tokens, greedy,
`steps` new tokens; decode tokens/s = batch * steps / (generate time - prefill time), with
the prefill measured as a 1-token generate. Weights are random, with the preset's shapes
(models.llama.PRESETS), bf16.
"""

import argparse
import json
import time

import torch
import transformers

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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--batch", default="1,8,32,64,128")
    p.add_argument("--context", default="512,2048,8192")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config(a.model)).to(torch.bfloat16).cuda().eval()
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    rows = []
    for context in (int(c) for c in a.context.split(",")):
        for batch in (int(b) for b in a.batch.split(",")):
            ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
            kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
            try:
                for n in (1, a.steps + 1):  # warm both lengths (compiles)
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                torch.cuda.synchronize()
                t = time.perf_counter(); model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw); torch.cuda.synchronize()
                prefill = time.perf_counter() - t
                t = time.perf_counter(); model.generate(ids, max_new_tokens=a.steps + 1, min_new_tokens=a.steps + 1, **kw); torch.cuda.synchronize()
                total = time.perf_counter() - t
                decode = total - prefill
                rows.append({"batch": batch, "context": context, "step_ms": decode / a.steps * 1e3, "tokens_per_s": batch * a.steps / decode})
            except Exception as exc:  # recorded, not hidden
                rows.append({"batch": batch, "context": context, "error": repr(exc)[:500]})
            print(rows[-1], flush=True)
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
