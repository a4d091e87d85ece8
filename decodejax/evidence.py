"""Evidence bundles for one decode call, and estimators for comparing measurements.

A bundle binds one call key to what was observed, and claims the highest level of the
evidence ladder (seed 002, 0x0AH) that its fields support, never more:

    1  source identity      commit, path, content hash and symbol of each layer's source
    2  chain closure        public op -> dispatch -> kernel wrapper -> named kernel, all present
    3  loaded binaries      package versions and SHA-256 of every jax/jaxlib/plugin object mapped
    4  runtime selection    candidates, reasons and winner bound to the key's digest
    5  execution            the compiled program contains the kernel's named call, and a profiler
                            trace of the run names it
    6  measurement          >= 20 synchronized samples, environment, correctness within
                            tolerances fixed before the run
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from decodejax import dispatch, reference
from decodejax.addressing import KVLayout

REPO = pathlib.Path(__file__).resolve().parent.parent
KERNEL_NAMES = {"pallas_triton": "decodejax_paged_decode", "pallas_triton_interpret": "decodejax_paged_decode",
                "pallas_mosaic_gpu": "decodejax_paged_decode_mgpu", "pallas_mosaic_gpu_interpret": "decodejax_paged_decode_mgpu"}
# The source chain of a decode call: (path, symbol that must appear in it).
SOURCE_CHAIN = (
    ("decodejax/_ops.py", "def decode_attention("),
    ("decodejax/dispatch.py", "def select("),
    ("pallas_kernels/decode_attention.py", "def paged_decode("),
    ("pallas_kernels/decode_attention.py", 'name="decodejax_paged_decode"'),
    ("pallas_kernels/paged_blocks.py", "def online_softmax_step("),
)
TOLERANCES = {"bfloat16": {"o_abs": 2e-2, "o_rel": 2e-2, "lse_abs": 3e-3}, "float16": {"o_abs": 1e-3, "o_rel": 1e-3, "lse_abs": 3e-3},
              "float32": {"o_abs": 1e-5, "o_rel": 1e-5, "lse_abs": 1e-5}}
MIN_SAMPLES = 20


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def host_cpu() -> str | None:
    """The host processor's model name (Linux), for timings that depend on the host's speed: a
    peer whose decode step waits on Python between CUDA graph replays runs faster on a faster CPU."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None


def environment() -> dict:
    device = jax.devices()[0]
    versions = {}
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "triton"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    driver = None
    if device.platform == "gpu":
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {"python": platform.python_version(), "platform": platform.platform(), "packages": versions,
            "device_kind": device.device_kind, "device_platform": device.platform,
            "compute_capability": getattr(device, "compute_capability", None), "driver": driver, "host_cpu": host_cpu()}


def loaded_artifacts() -> list[dict]:
    """Path and SHA-256 of every jax/jaxlib/plugin shared object mapped into this process."""
    paths = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if ".so" in path and any(part in path for part in ("jax", "jaxlib", "jax_plugins", "nvidia", "triton")):
                    paths.add(path)
    except OSError:
        return []
    return [{"path": p, "sha256": _sha256(p)} for p in sorted(paths) if os.path.exists(p)]


def source_identity() -> dict:
    git_head = None
    try:
        git_head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    # A copy of the tree sent elsewhere (a remote GPU machine) may carry no .git, or a stale
    # one: the sender names the commit it sent, and the chain's content hashes below let
    # anyone check that claim against the commit's files.
    claimed = os.environ.get("DECODEJAX_SOURCE_COMMIT")
    commit, commit_from = (claimed, "DECODEJAX_SOURCE_COMMIT") if claimed else (git_head, "git" if git_head else None)
    chain = []
    for rel, symbol in SOURCE_CHAIN:
        path = REPO / rel
        text = path.read_text() if path.exists() else ""
        chain.append({"path": rel, "sha256": hashlib.sha256(text.encode()).hexdigest() if text else None, "symbol": symbol, "present": symbol in text})
    return {"commit": commit, "commit_from": commit_from, "git_head": git_head, "chain": chain}


REPS_PER_SAMPLE, WARMUP_CALLS = 10, 3


def _timed_sample(fn, args, reps: int) -> float:
    """Microseconds per call of `reps` back-to-back calls, then one sync."""
    t0 = time.perf_counter()
    for _ in range(reps):
        result = fn(*args)
    jax.block_until_ready(result)
    return (time.perf_counter() - t0) * 1e6 / reps


def timed_samples(fn, args, *, samples: int, reps: int = REPS_PER_SAMPLE, warmup: int = WARMUP_CALLS) -> list[float]:
    """Microseconds per call: each sample is `reps` back-to-back calls, then one sync.

    Back-to-back calls pipeline the host's launch overhead as a decode loop does, so a sample
    measures the device; one call per sync would add the host's dispatch to every figure.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    return [_timed_sample(fn, args, reps) for _ in range(samples)]


def timed_samples_interleaved(calls: dict, *, samples: int, reps: int = REPS_PER_SAMPLE,
                              warmup: int = WARMUP_CALLS) -> tuple[dict[str, list[float]], dict[str, str]]:
    """`timed_samples` of every {name: (fn, args)} of `calls`, the samples taken in turns: one
    sample of each, then the next round.

    The host's speed drifts within a process: on the H200 machine the first variants of a case
    read about twice as slow by the host's clock as later ones running the same kernel (B 1: 98.0
    against 44.2 us). In turns, a drift reaches every variant alike. Returns the samples by name
    and the errors by name: a variant whose call raised leaves the rounds, and the others go on.
    """
    out, errors = {name: [] for name in calls}, {}

    def attempt(name, take):
        try:
            take()
        except Exception as exc:  # recorded, not hidden; the other variants' rounds go on
            errors[name] = repr(exc)[:600]

    for name, (fn, args) in calls.items():
        attempt(name, lambda: [jax.block_until_ready(fn(*args)) for _ in range(warmup)])
    for _ in range(samples):
        for name, (fn, args) in calls.items():
            if name not in errors:
                attempt(name, lambda: out[name].append(_timed_sample(fn, args, reps)))
    return {name: v for name, v in out.items() if name not in errors}, errors


def chained_program(fn, calls: int):
    """One jitted program of `calls` calls fn(x_i, *rest), one per x_i of a list, each x_i tied by
    an optimization barrier to the previous call's output.

    How a jitted model or an AOT step runs an op: its calls run one after another in one program,
    as a model's layers do, and the host dispatches the program once. The distinct x_i keep the
    compiler from merging the calls, the barriers (under XLA's default scheduling, below) from
    running them side by side or hoisting them, and nothing is copied inside the program (slicing
    one stacked array cost a copy kernel per call on the H200). Call it as
    program([x_1, ..., x_calls], *rest): `distinct_copies`.

    Compile it with XLA's default command-buffer scheduling. The barrier is no command, so under
    the runner's CONCURRENT scheduling (`runner.CONCURRENT_COMMAND_BUFFERS`) no call reads the one
    before it and the calls may run side by side: on an H100, 32 chained M 64 Pallas matmuls read
    41.8 us of kernel time a call within a span of 12.96 us a call (benchmarks/README.md,
    fifty-fifth session). Options that only pick kernels (`runner.CUBLASLT_GEMMS`) are safe.
    """

    def program(xs, *rest):
        outputs = []
        for x in xs:
            if outputs:
                _, x = jax.lax.optimization_barrier((outputs[-1], x))
            outputs.append(fn(x, *rest))
        return outputs

    return jax.jit(program)


def distinct_copies(x: jax.Array, n: int) -> list[jax.Array]:
    """n bit-identical copies of x in buffers of their own."""
    return [jnp.array(x, copy=True) for _ in range(n)]


def chained_call(fn, args, calls: int):
    """(program, its arguments): `chained_program(fn, calls)` and args with the first replaced by
    `calls` distinct copies of it."""
    return chained_program(fn, calls), (distinct_copies(args[0], calls), *args[1:])


def timed_samples_in_program(fn, args, *, samples: int, calls: int = REPS_PER_SAMPLE, warmup: int = WARMUP_CALLS,
                             programs_per_sample: int = 5) -> list[float]:
    """Microseconds per call of `chained_program` by the host's clock: each sample is
    `programs_per_sample` programs of `calls` calls dispatched back to back, then one sync.

    Several programs per sample spread the first dispatch after a sync, which costs the host
    several times a warm one, over more calls: with one 50-call program a sample, the B 32 decode
    call read 147 us against 130 with five (H200; its kernels' traced span was 125 us a call).
    """
    per_program = timed_samples(*chained_call(fn, args, calls), samples=samples, reps=programs_per_sample, warmup=warmup)
    return [t / calls for t in per_program]


def _profile_names_kernel(fn, args, name: str) -> dict:
    """Runs fn under jax.profiler.trace; reports whether the trace files mention `name`."""
    trace_dir = tempfile.mkdtemp(prefix="decodejax_trace_")
    try:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(*args))
    except Exception as exc:  # profiler unavailable: the bundle says so and stays below level 5
        return {"available": False, "error": repr(exc)[:300]}
    files = [f for f in glob.glob(os.path.join(trace_dir, "**", "*"), recursive=True) if os.path.isfile(f)]
    found = any(name.encode() in open(f, "rb").read() for f in files)
    return {"available": bool(files), "dir": trace_dir, "files": len(files), "names_kernel": found}


def evidence_level(bundle: dict) -> int:
    """The highest ladder level whose fields (and every lower level's) are present and hold."""
    src = bundle.get("source", {})
    checks = [
        bool(src.get("commit")) and all(c["sha256"] for c in src.get("chain", [])),
        bool(src.get("chain")) and all(c["present"] for c in src["chain"]),
        bool(bundle.get("environment", {}).get("packages")) and bool(bundle.get("loaded_artifacts")),
        bool(bundle.get("selection")) and bundle["selection"].get("digest") == bundle.get("digest"),
        bool(bundle.get("execution", {}).get("compiled_has_kernel")) and bool(bundle.get("execution", {}).get("profile", {}).get("names_kernel")),
        len(bundle.get("timing", {}).get("samples_us", [])) >= MIN_SAMPLES and bool(bundle.get("correctness", {}).get("passed")),
    ]
    level = 0
    for ok in checks:
        if not ok:
            break
        level += 1
    return level


def collect(shape: tuple[int, int, int, int, int, int], *, dtype=jnp.bfloat16, backend: str = "auto", samples: int = 30, seed: int = 0) -> dict:
    """Runs the paged decode call of `shape` = (B, T, H_q, H_kv, D, P) and returns its evidence bundle."""
    import decodejax

    B, T, H_q, H_kv, D, P = shape
    dtype_name = str(jnp.dtype(dtype))
    tolerances = dict(TOLERANCES[dtype_name])  # fixed before anything runs
    rng = np.random.default_rng(seed)
    width = -(-T // P)
    num_pages = B * width + 1
    table = (rng.permutation(np.arange(1, num_pages))[: B * width].reshape(B, width)).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(B, H_q, D)), dtype)
    k = jnp.asarray(rng.normal(size=(num_pages, P, H_kv, D)), dtype)
    v = jnp.asarray(rng.normal(size=(num_pages, P, H_kv, D)), dtype)
    lens = jnp.full((B,), T, jnp.int32)
    table = jnp.asarray(table)

    key = dispatch.DispatchKey.from_call(q, k, layout=KVLayout.PAGED_NHD, page_table=table, backend=backend)
    selection = dispatch.select(key)
    fn = jax.jit(lambda *a: decodejax.decode_attention(*a, return_lse=True, backend=selection.backend))
    args = (q, k, v, table, lens)
    compiled_text = fn.lower(*args).compile().as_text()
    kernel = KERNEL_NAMES.get(selection.backend)
    execution = {"kernel_name": kernel, "compiled_has_kernel": bool(kernel) and kernel in compiled_text,
                 "profile": _profile_names_kernel(fn, args, kernel) if kernel else {"available": False, "reason": f"backend {selection.backend} has no named kernel"}}

    o, lse = fn(*args)
    ref_o, ref_lse = reference.paged_decode(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), table, lens)
    err_o = np.abs(np.asarray(o, np.float32) - np.asarray(ref_o))
    bound = tolerances["o_abs"] + tolerances["o_rel"] * np.abs(np.asarray(ref_o))
    err_lse = float(np.max(np.abs(np.asarray(lse) - np.asarray(ref_lse))))
    correctness = {"tolerances": tolerances, "max_abs_err_o": float(err_o.max()), "max_abs_err_lse": err_lse,
                   "passed": bool(np.all(err_o <= bound)) and err_lse <= tolerances["lse_abs"] and not np.isnan(np.asarray(o, np.float32)).any()}

    times = timed_samples(fn, args, samples=max(samples, MIN_SAMPLES))
    kv_bytes = B * T * H_kv * D * 2 * jnp.dtype(dtype).itemsize
    timing = {"samples_us": times, "unit": f"microseconds per call: {REPS_PER_SAMPLE} back-to-back calls per synchronized sample",
              "min_us": float(np.min(times)),
              "median_us": float(np.median(times)), "p95_us": float(np.percentile(times, 95)), "max_us": float(np.max(times)),
              "kv_bytes": kv_bytes, "tbps_median": kv_bytes / float(np.median(times)) / 1e6}

    bundle = {"shape": {"B": B, "T": T, "H_q": H_q, "H_kv": H_kv, "D": D, "P": P, "dtype": dtype_name},
              "key": dataclasses.asdict(key), "digest": key.digest(), "environment": environment(),
              "loaded_artifacts": loaded_artifacts(), "source": source_identity(), "selection": selection.to_json(),
              "execution": execution, "correctness": correctness, "timing": timing}
    bundle["evidence_level"] = evidence_level(bundle)
    return bundle


def write_bundle(bundle: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"evidence_{bundle['digest'][:16]}.json")
    with open(path, "w") as f:
        json.dump(bundle, f, indent=1)
    return path


# -- estimators and comparability ----------------------------------------------------------
COMPARABILITY_FIELDS = ("scope", "phase", "metric", "gpu", "precision", "workload", "statistic")


class NotComparable(ValueError):
    """Two measurement rows differ in a field that must match before they can be ranked."""


def check_comparable(a: dict, b: dict) -> None:
    """Raises NotComparable naming every comparability field on which the rows differ."""
    diffs = [f"{f}: {a.get(f)!r} vs {b.get(f)!r}" for f in COMPARABILITY_FIELDS if a.get(f) != b.get(f)]
    if diffs:
        raise NotComparable("rows are not comparable: " + "; ".join(diffs))


def ratio_estimators(baseline_us: dict[str, float], candidate_us: dict[str, float]) -> dict:
    """Speedups of candidate over baseline (baseline time / candidate time) over the shared cases.

    Returns the sweep (case -> ratio) and four estimators, which answer different questions:
    arithmetic mean of per-case ratios, ratio of summed times (the total-time view), geometric
    mean (symmetric in the direction of the ratio), and the maximum per-case ratio.
    """
    cases = sorted(set(baseline_us) & set(candidate_us))
    if not cases:
        raise ValueError("no shared cases to compare")
    ratios = {c: baseline_us[c] / candidate_us[c] for c in cases}
    r = np.array(list(ratios.values()))
    return {
        "cases": cases, "ratios": ratios,
        "arithmetic_mean_of_ratios": float(r.mean()),
        "ratio_of_sums": float(sum(baseline_us[c] for c in cases) / sum(candidate_us[c] for c in cases)),
        "geometric_mean": float(math.exp(np.log(r).mean())),
        "max": float(r.max()),
    }


def compare(baseline_rows: list[dict], candidate_rows: list[dict], value: str = "median_us") -> dict:
    """Estimators over rows keyed by 'case', after checking every pair is comparable."""
    base = {r["case"]: r for r in baseline_rows}
    cand = {r["case"]: r for r in candidate_rows}
    for c in set(base) & set(cand):
        check_comparable(base[c], cand[c])
    return ratio_estimators({c: r[value] for c, r in base.items()}, {c: r[value] for c, r in cand.items()})
