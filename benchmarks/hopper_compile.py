"""Compile the Pallas kernels for Hopper (sm_90) on a machine without a GPU.

    pip install -e ".[hopper-compile]"          # the triton package: its compiler and ptxas run on a CPU
    python -m benchmarks.hopper_compile --out benchmarks/results/hopper_compile.json

Each public op is cross-lowered for CUDA (`decodejax.dispatch.targeting`), the Triton IR of
every kernel is read from its custom call, and Triton compiles it for sm_90 with the kernel's
warps and stages; `ptxas -v` reports registers and spills. Per kernel: shared memory,
registers, spills, and counts of the PTX instructions that say how it moves and multiplies
data (cp.async, ld.global, wgmma, mma.sync).

What it shows: that a kernel compiles for Hopper and what it uses. What it does not: the jax
here (CPU machine) may lower differently from the GPU machine's, and this Triton may differ from
the one inside that jaxlib, so the GPU machine's binary can differ. It reads the Triton IR that
jaxlib <= 0.10.2 puts in the custom call; later jaxlibs compile Triton while lowering, which needs
their CUDA plugin, so there this tool finds no kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile

TRITON_TARGET = "__gpu$xla.gpu.triton"
PTX_COUNTS = {"cp.async": r"cp\.async\.", "ld.global": r"ld\.global", "wgmma": r"wgmma\.mma_async", "mma.sync": r"mma\.sync"}


def triton_kernels(lowered) -> list[dict]:
    """Every Triton custom call of a CUDA-lowered computation: name, warps, stages, Triton IR text."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect

    found = []

    def visit(op):
        for region in op.regions:
            for block in region:
                for inner in block:
                    if inner.name == "stablehlo.custom_call" and ir.StringAttr(inner.attributes["call_target_name"]).value == TRITON_TARGET:
                        config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                        found.append({"name": ir.StringAttr(config["name"]).value,
                                      "num_warps": ir.IntegerAttr(config["num_warps"]).value,
                                      "num_stages": ir.IntegerAttr(config["num_stages"]).value,
                                      "bytecode": ir.StringAttr(config["ir"]).value_bytes})
                    visit(inner)

    visit(lowered.compiler_ir("stablehlo").operation)
    for kernel in found:
        context = ir.Context()
        dialect.register_dialect(context)
        # jaxlib registers no gpu dialect, so a block barrier prints in generic form, with a
        # property that Triton 3.6's gpu.barrier does not take: it is written back as the op.
        context.allow_unregistered_dialects = True
        with context:
            asm = ir.Module.parse(kernel.pop("bytecode")).operation.get_asm(enable_debug_info=False)
        kernel["ttir"] = re.sub(r'"gpu\.barrier"\(\)(?: <[^>]*>)? : \(\) -> \(\)', "gpu.barrier", asm)
    return found


def compile_for_hopper(kernel: dict, workdir: str) -> dict:
    """Triton -> PTX -> ptxas for sm_90a; the resources and instruction counts of the result."""
    import triton
    from triton.backends.compiler import GPUTarget

    path = os.path.join(workdir, kernel["name"] + ".ttir")
    with open(path, "w") as f:
        f.write(kernel["ttir"])
    compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"]})
    ptx = compiled.asm["ptx"]
    ptx_path = path + ".ptx"
    with open(ptx_path, "w") as f:
        f.write(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", path + ".cubin"], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    return {"name": kernel["name"], "num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"],
            "shared_bytes": compiled.metadata.shared, "registers": registers, "spill_bytes": sum(spills),
            "ptx_counts": {name: len(re.findall(pattern, ptx)) for name, pattern in PTX_COUNTS.items()}}


def lowered_cases():
    """(case, lowered) for the decode kernel (three head dims, and D 128 with its fused merge and
    with its programs in launch order, not dealt), merge_states, gather_pages and append."""
    import jax
    import jax.numpy as jnp

    import decodejax
    from decodejax import dispatch

    bf16 = jnp.bfloat16
    cases = []
    with dispatch.targeting("gpu", "9.0"):
        for D in (64, 128, 256):
            B, T, H_q, H_kv, P = 8, 4096, 32, 8, 16
            q, pages = jnp.zeros((B, H_q, D), bf16), jnp.zeros((B * T // P + 1, P, H_kv, D), bf16)
            table, lens = jnp.zeros((B, T // P), jnp.int32), jnp.full((B,), T, jnp.int32)
            lowered = jax.jit(lambda *a: decodejax.decode_attention(*a, backend="pallas_triton")).trace(q, pages, pages, table, lens)
            cases.append((f"decode_attention B={B} T={T} H_q={H_q} H_kv={H_kv} D={D} P={P} bf16", lowered.lower(lowering_platforms=("cuda",))))
            if D == 128:
                from pallas_kernels.decode_attention import default_config

                for option, change in (("fused_merge", dict(fused_merge=True)), ("launch_order", dict(longest_first=False))):
                    config = dataclasses.replace(default_config(D), **change)
                    lowered = jax.jit(lambda *a, config=config: decodejax.decode_attention(*a, config=config, backend="pallas_triton")).trace(
                        q, pages, pages, table, lens)
                    cases.append((f"decode_attention B={B} T={T} H_q={H_q} H_kv={H_kv} D={D} P={P} bf16 {option}",
                                  lowered.lower(lowering_platforms=("cuda",))))
                gather = jax.jit(lambda p, t, n: decodejax.gather_pages(p, t, n, backend="pallas_triton")).trace(pages, table, lens)
                cases.append((f"gather_pages B={B} T={T} H_kv={H_kv} D={D} P={P} bf16", gather.lower(lowering_platforms=("cuda",))))
                o, lse = jnp.zeros((B, H_q, 4, D), jnp.float32), jnp.zeros((B, H_q, 4), jnp.float32)
                merge = jax.jit(lambda o, l: decodejax.merge_states(o, l, backend="pallas_triton")).trace(o, lse)
                cases.append((f"merge_states B={B} H_q={H_q} S=4 D={D} f32", merge.lower(lowering_platforms=("cuda",))))
        N, C, W = 2048, 8, 600
        q, pages = jnp.zeros((N, 32, 128), bf16), jnp.zeros((C * W + 1, 16, 8, 128), bf16)
        table, indptr, kv_lens = jnp.zeros((C, W), jnp.int32), jnp.arange(0, N + 1, N // C, dtype=jnp.int32), jnp.full((C,), 4096, jnp.int32)
        append = jax.jit(lambda *a: decodejax.append_attention(*a, backend="pallas_triton")).trace(q, pages, pages, table, indptr, kv_lens)
        cases.append((f"append_attention N={N} C={C} H_q=32 H_kv=8 D=128 P=16 bf16", append.lower(lowering_platforms=("cuda",))))
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit('needs the triton package: pip install -e ".[hopper-compile]"')
    import jax

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case, lowered in lowered_cases():
            for kernel in triton_kernels(lowered):
                row = {"case": case, **compile_for_hopper(kernel, workdir)}
                rows.append(row)
                print(f"{row['name']:26s} {case:58s} warps {row['num_warps']} stages {row['num_stages']}  "
                      f"smem {row['shared_bytes']:6d} B  regs {row['registers']:3d}  spills {row['spill_bytes']} B  {row['ptx_counts']}")
    import triton

    report = {"jax": jax.__version__, "triton": triton.__version__, "target": "sm_90a", "kernels": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
