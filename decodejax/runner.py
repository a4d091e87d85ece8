"""The decode runner: bucketed AOT-compiled steps as captured graphs (R1-R4, R6-R8).

| CUDA-graph engine            | here                                                          |
|------------------------------|---------------------------------------------------------------|
| capture bucket bs            | AOT-compile the step for bs at start-up, run it once on       |
|                              | placeholder tables (actual_bs = 0)                            |
| replay                       | call the executable: pad to the bucket, never retrace         |
| persistent buffers           | DecodeBuffers + KVPool, donated to every step                 |
| eager decode                 | the same step function, not jitted, at the exact batch size   |
| above the ladder             | the same step compiled at its exact size on first use, cached |

One step is: refresh_decode_metadata -> model forward -> sample_window; tokens and accept
lengths land in `buffers.sampled` (where the next step can read them on the device) and leave
as the step's own small output, which reaches the host in one copy (`submit` -> `fetch`).

The step samples without sorting the logits, which is exact for greedy, temperature and min-p
rows. When a live row asks for a top-k above 1 or a top-p below 1 (the host knows each slot's
parameters), a second small executable per bucket, `resample_step`, samples the step's logits
again with the sort and overwrites the step's output before it is copied back.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from decodejax import dispatch
from decodejax.cache import CacheGroupRouter, KVPool
from decodejax.metadata import DecodeBuffers, DecodeRow, ForwardContext, pack_decode_batch, packed_width, refresh_decode_metadata
from decodejax.sampling import SamplingParams, SamplingPool, needs_order_statistics, sample_window

log = logging.getLogger("decodejax.runner")

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_compile_count = [0]


def _count_compiles(event: str, duration: float, **_):
    if event in _COMPILE_EVENTS:
        _compile_count[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def compile_events() -> int:
    """Traces plus backend compiles seen in this process so far."""
    return _compile_count[0]


def _finished_at(fn: Callable, *args):
    """fn(*args), and the perf_counter reading when it returned."""
    result = fn(*args)
    return (*result, time.perf_counter())


def default_capture_ladder(max_capture_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, then every 32 up to max_capture_bs."""
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64] + list(range(96, max_capture_bs + 1, 32))
    return tuple(b for b in ladder if b <= max_capture_bs)


# XLA options every compiled step gets (names of XLA's DebugOptions; per executable, so a
# user's XLA_FLAGS elsewhere in the process are untouched). Command buffers (XLA's CUDA graphs)
# scheduled by data dependence, with concurrent regions: the few kernels of a layer that do not
# depend on each other (the K and V row writes, the query's RoPE) may overlap (not checked in a
# trace: the profiler runs the steps op by op).
CONCURRENT_COMMAND_BUFFERS = (("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),
                              ("xla_gpu_graph_enable_concurrent_region", True))
# From this bucket up, the dense matmuls go to cuBLASLt rather than XLA's Triton GEMMs.
CUBLASLT_MIN_BS = 64
CUBLASLT_GEMMS = (("xla_gpu_enable_triton_gemm", False), ("xla_gpu_enable_cublaslt", True))


def default_step_xla_options(bs: int) -> dict[str, str | bool]:
    """XLA compile options of bucket bs's step: concurrent command buffers, and cuBLASLt GEMMs
    at bs >= CUBLASLT_MIN_BS.

    On the H200 (llama3-8b shape, bf16, T 2,048, two processes each way in one call) the engine's
    step took 1% to 5% less with them at every bucket measured (1, 8, 32, 64, 128; the most at
    B 64, 9.19 -> 8.76 ms; benchmarks/README.md, thirty-third session). cuBLASLt read the dense
    weights faster than XLA's GEMMs at B 64 and 128 and slower at B 1 and 32
    (`dense_ceiling.py`), hence the threshold; between 32 and 64 it was not measured.
    """
    return dict(CONCURRENT_COMMAND_BUFFERS + (CUBLASLT_GEMMS if bs >= CUBLASLT_MIN_BS else ()))


class CaptureError(RuntimeError):
    """A bucket failed to compile or run at start-up: fatal, never an eager fallback."""


class RebindError(ValueError):
    """A cache pool rebind that some backend node rejected; nothing was changed."""


class GraphDebugError(RuntimeError):
    """DECODEJAX_GRAPH_DEBUG found a donated buffer that moved, or a compile after warm-up."""


class BackendNode:
    """A node of the backend tree: declares bucket support per phase and validates pools."""

    supports_buckets: ClassVar[dict[str, bool]] = {"decode": True, "prefill": False}

    def validate_pool(self, pool: KVPool) -> list[str]:
        return []


@dataclasses.dataclass(frozen=True)
class AttentionLeafBackend(BackendNode):
    """The paged decode attention of one leaf, on the layers that use it."""

    leaf: str
    layers: tuple[int, ...]
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    def validate_pool(self, pool: KVPool) -> list[str]:
        L, (_, P, H, D) = pool.num_layers, pool.page_shape
        reasons = []
        if max(self.layers) >= L:
            reasons.append(f"{self.leaf}: layer {max(self.layers)} outside a pool of {L} layers")
        if (P, H, D) != (self.page_size, self.kv_heads, self.head_dim):
            reasons.append(f"{self.leaf}: pool pages [P={P}, H_kv={H}, D={D}] != [{self.page_size}, {self.kv_heads}, {self.head_dim}]")
        shapes = {(str(a.dtype), a.shape) for a in pool.k + pool.v}
        if len(shapes) != 1 or str(pool.dtype) != self.dtype:
            reasons.append(f"{self.leaf}: pool layers {sorted(shapes)} are not all {self.dtype}{list(pool.page_shape)}")
        return reasons


def compose_bucket_support(nodes, phase: str) -> tuple[bool, list[str]]:
    """AND of every node's declared support for `phase`; the culprits by class name."""
    culprits = [type(n).__name__ for n in nodes if not n.supports_buckets.get(phase, False)]
    return not culprits, culprits


class GraphGuard:
    """DECODEJAX_GRAPH_DEBUG=1: donated buffers keep their device addresses; nothing compiles after warm-up."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = os.environ.get("DECODEJAX_GRAPH_DEBUG") == "1" if enabled is None else enabled
        self._pointers: dict[str, int] = {}
        self._compiles = 0

    @staticmethod
    def _addresses(trees: dict) -> dict[str, int]:
        out = {}
        for name, tree in trees.items():
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                out[name + jax.tree_util.keystr(path)] = leaf.unsafe_buffer_pointer()
        return out

    def arm(self, trees: dict) -> None:
        if self.enabled:
            self._pointers = self._addresses(trees)
            self._compiles = compile_events()

    def check(self, trees: dict) -> None:
        if not self.enabled:
            return
        now = self._addresses(trees)
        moved = [path for path, ptr in now.items() if self._pointers.get(path) != ptr]
        if moved:
            raise GraphDebugError(f"donated buffers moved (or were rebound): {moved}")
        if compile_events() != self._compiles:
            raise GraphDebugError(f"{compile_events() - self._compiles} trace/compile event(s) after warm-up")


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A dispatched decode step: its live rows and its (device) output i32[bs, N + 1]."""

    actual_bs: int
    sampled: jax.Array


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Static runner settings.

    Attributes:
      max_decode_bs: rows of the persistent buffers (>= max_capture_bs): the capacity limit.
      max_capture_bs: top of the capture ladder: a performance subset, not a limit.
      window: N, candidate-window width (1 without a drafter).
      capture_ladder: buckets; default `default_capture_ladder(max_capture_bs)`.
      enforce_eager: run the step function un-jitted at the exact batch size.
      compilation_cache_dir: JAX persistent compilation cache directory (None: off).
      step_xla_options: bs -> the XLA compile options of bucket bs's step and resample step
        (`default_step_xla_options`); `lambda bs: {}` compiles with XLA's defaults.
    """

    max_decode_bs: int = 64
    max_capture_bs: int = 32
    window: int = 1
    capture_ladder: tuple[int, ...] | None = None
    enforce_eager: bool = False
    compilation_cache_dir: str | None = None
    step_xla_options: Callable[[int], dict] = default_step_xla_options

    def __post_init__(self):
        if self.max_decode_bs < self.max_capture_bs:
            raise ValueError(f"max_decode_bs={self.max_decode_bs} must be >= max_capture_bs={self.max_capture_bs}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.capture_ladder is not None and any(b > self.max_capture_bs or b < 1 for b in self.capture_ladder):
            raise ValueError(f"capture_ladder {self.capture_ladder} must lie in [1, max_capture_bs={self.max_capture_bs}]")

    @property
    def ladder(self) -> tuple[int, ...]:
        return tuple(sorted(self.capture_ladder or default_capture_ladder(self.max_capture_bs)))


def decode_step(param_leaves, pool, buffers, sampling, packed, *, bs, router, layer_leaves, model_forward, param_tree):
    """The hot step: refresh -> forward -> sample (no sort). Returns (pool, buffers, sampled
    i32[bs, N + 1], logits [bs, N, V]); pool and buffers are donated.

    `packed` (i32[1 + bs, width], see pack_decode_batch) is the step's one host upload. The
    parameters come as their flat leaves (`param_tree` rebuilds them): flattening a Flax NNX
    State on every call costs about 0.2 ms of host time per step for a 32-layer model, while a
    list of arrays flattens in C++.
    """
    params = jax.tree.unflatten(param_tree, param_leaves)
    buffers = refresh_decode_metadata(buffers, packed, bs=bs, router=router)
    ctx = ForwardContext.for_decode(buffers, bs, layer_leaves)
    logits, pool = model_forward(params, pool, ctx)
    buffers, sampled = _record_sampled(buffers, logits, ctx, sampling, bs=bs, order_statistics=False)
    return pool, buffers, sampled, logits


def resample_step(buffers, sampling, logits, *, bs):
    """Samples a step's logits [bs, N, V] again with the sort (top-k > 1, top-p < 1 rows) and
    overwrites its output. Returns (buffers, sampled i32[bs, N + 1]); buffers are donated."""
    ctx = ForwardContext.for_decode(buffers, bs, ())
    return _record_sampled(buffers, logits, ctx, sampling, bs=bs, order_statistics=True)


def _record_sampled(buffers, logits, ctx, sampling, *, bs, order_statistics):
    tokens, accept = sample_window(logits, ctx.window_ids, ctx.positions, ctx.slots, sampling, order_statistics=order_statistics)
    sampled = jnp.concatenate([tokens, accept[:, None]], axis=1)
    # `sampled` also leaves as its own array: the host copies it back while the next step,
    # which donates the buffers, is already running.
    return dataclasses.replace(buffers, sampled=buffers.sampled.at[:bs].set(sampled)), sampled


_donating_step = jax.jit(decode_step, static_argnames=("bs", "router", "layer_leaves", "model_forward", "param_tree"), donate_argnums=(1, 2))
_donating_resample = jax.jit(resample_step, static_argnames=("bs",), donate_argnums=(0,))


class DecodeRunner:
    """Owns the persistent buffers, the pool and the compiled bucket steps.

    Args:
      model_forward: (params, pool, ctx) -> (logits [rows, N, V], pool); hashable (e.g. a partial).
      params: model parameters (a pytree of device arrays).
      pool: the KVPool.
      router: the cache-group router.
      layer_leaves: the leaf of each layer.
      backends: the backend tree (BackendNode instances).
      config: RunnerConfig.
      vocab_size: V, to validate window ids.
      max_requests: request slots of the sampling pool.
    """

    def __init__(self, model_forward: Callable, params, pool: KVPool, router: CacheGroupRouter, layer_leaves, backends, config: RunnerConfig, *, vocab_size: int, max_requests: int):
        self.model_forward, self.pool = model_forward, pool
        self.param_leaves, self.param_tree = jax.tree.flatten(params)  # the steps take the leaves
        self.router, self.layer_leaves, self.backends, self.config = router, tuple(layer_leaves), list(backends), config
        self.vocab_size = vocab_size
        reasons = [r for node in self.backends for r in node.validate_pool(pool)]
        if reasons:
            raise RebindError(f"the initial pool is rejected: {reasons}")
        self.buffers = DecodeBuffers.create(router, config.max_decode_bs, config.window)
        self.sampling = SamplingPool.create(max_requests)
        self._sorting_slots = np.zeros(max_requests, bool)  # host copy of needs_order_statistics per slot
        self.bucketed, culprits = compose_bucket_support(self.backends, "decode")
        if culprits:
            log.warning("decode buckets disabled by backend classes %s: every batch runs at its exact size", culprits)
        if config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        self.guard = GraphGuard()
        # Capture and idle steps read placeholder tables: one persistent all-zeros upload
        # (header actual_bs = 0, every table entry the null page), sliced per bucket.
        self._placeholder = np.zeros((1 + config.max_decode_bs, packed_width(router, config.window)), np.int32)
        self.capture_seconds: dict[int, float] = {}
        self._executables: dict[int, tuple[Callable, Callable]] = {}  # bucket -> (step, resample_step)
        self.selections: dict[int, tuple] = {}  # bucket -> the dispatch selections of its trace
        self._announced: set[int] = set()

    # -- start-up ---------------------------------------------------------------------------
    def _statics(self, bs):
        return dict(bs=bs, router=self.router, layer_leaves=self.layer_leaves, model_forward=self.model_forward, param_tree=self.param_tree)

    def _lower(self, bs: int):
        """Traces and lowers the step and resample_step for bs (Python: holds the GIL); records
        the backend selections made while tracing the step. Returns what `_compile_lowered` takes."""
        packed = jax.ShapeDtypeStruct((1 + bs, packed_width(self.router, self.config.window)), jnp.int32)
        with dispatch.capturing(), dispatch.recording() as selections:
            lowered = _donating_step.lower(self.param_leaves, self.pool, self.buffers, self.sampling, packed, **self._statics(bs))
        self.selections[bs] = tuple(selections)
        logits = lowered.out_info[3]
        resample = _donating_resample.lower(self.buffers, self.sampling, jax.ShapeDtypeStruct(logits.shape, logits.dtype), bs=bs)
        return lowered, resample, self.config.step_xla_options(bs)

    @staticmethod
    def _compile_lowered(lowered, resample, options) -> tuple[Callable, Callable]:
        """XLA's compile of both, or their load from the persistent cache (C++: frees the GIL)."""
        return lowered.compile(compiler_options=options), resample.compile(compiler_options=options)

    def _compile(self, bs: int) -> tuple[Callable, Callable]:
        return self._compile_lowered(*self._lower(bs))

    def capture(self, progress=sys.stderr) -> dict[int, float]:
        """Compiles every bucket of the ladder, then runs each once on placeholder tables (actual_bs = 0).

        Lowering is Python and holds the GIL; XLA's compile, or its load from the persistent
        cache, runs in C++ without it. So one compile thread takes each bucket as soon as it is
        lowered while this thread lowers the next: a warm start costs about the lowering alone
        instead of lowering plus loading. A single compile thread keeps XLA's autotuning serial,
        and the first runs wait until every compile is done, so no autotuning measurement shares
        the device with other work.

        Returns seconds per bucket: how long after the previous bucket's its compile finished,
        plus its first run, so the values sum to the capture's wall time. Any failure raises
        CaptureError naming the bucket (no eager fallback); a failed compile leaves no bucket
        captured.
        """
        if self.config.enforce_eager or not self.bucketed:
            return {}
        ladder = self.config.ladder
        start = time.perf_counter()
        compiled: dict[int, tuple[Callable, Callable, float]] = {}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="decodejax-compile") as compiler:
            futures = {}
            try:
                for bs in ladder:
                    futures[bs] = compiler.submit(_finished_at, self._compile_lowered, *self._lower(bs))
                for i, bs in enumerate(ladder):
                    compiled[bs] = futures[bs].result()
                    if progress is not None:
                        bar = "#" * (i + 1) + "." * (len(ladder) - i - 1)
                        print(f"\rcapture [{bar}] bs={bs:4d} compiled at {compiled[bs][2] - start:6.2f}s", end="", file=progress, flush=True)
            except Exception as exc:
                compiler.shutdown(cancel_futures=True)
                raise CaptureError(f"capturing bucket bs={bs} failed: {exc!r}") from exc
        previous = start
        for bs in ladder:
            step, resample, finished = compiled[bs]
            t0 = time.perf_counter()
            try:
                self.pool, self.buffers, _, logits = step(self.param_leaves, self.pool, self.buffers, self.sampling, self._placeholder[: 1 + bs])
                self.buffers, _ = resample(self.buffers, self.sampling, logits)
                jax.block_until_ready(self.buffers)
            except Exception as exc:
                raise CaptureError(f"capturing bucket bs={bs} failed: {exc!r}") from exc
            self._executables[bs] = step, resample
            self.capture_seconds[bs] = finished - previous + time.perf_counter() - t0
            previous = finished
        if progress is not None:
            print(f"\ncaptured {len(ladder)} buckets in {sum(self.capture_seconds.values()):.2f}s", file=progress)
        self.guard.arm({"pool": self.pool, "buffers": self.buffers})
        return dict(self.capture_seconds)

    def compiled_memory(self) -> dict[int, dict[str, int]]:
        """Per compiled bucket: bytes of the step's temporaries and of its donated (aliased) buffers.

        Temporaries that grow with the pool would mean a step copies cache layers.
        """
        out = {}
        for bs, (step, _) in sorted(self._executables.items()):
            stats = step.memory_analysis()
            out[bs] = {"temp_bytes": int(stats.temp_size_in_bytes), "alias_bytes": int(stats.alias_size_in_bytes)}
        return out

    # -- per step ---------------------------------------------------------------------------
    def bucket_for(self, actual_bs: int) -> int:
        """The padded size a batch of actual_bs rows runs at."""
        if actual_bs > self.config.max_decode_bs:
            raise ValueError(f"batch of {actual_bs} rows exceeds max_decode_bs={self.config.max_decode_bs}")
        if self.config.enforce_eager or not self.bucketed or actual_bs > self.config.ladder[-1]:
            return actual_bs  # above the ladder: its exact size
        return next(b for b in self.config.ladder if b >= actual_bs)

    def executable(self, bs: int) -> tuple[Callable, Callable]:
        """The compiled step and resample_step of bucket bs (compiled on first use above the ladder)."""
        if bs not in self._executables:
            if bs not in self._announced:
                log.warning("decode batch of %d rows is above the capture ladder: compiling that exact size once", bs)
                self._announced.add(bs)
            self._executables[bs] = self._compile(bs)
            self.guard.arm({"pool": self.pool, "buffers": self.buffers})
        return self._executables[bs]

    def set_sampling(self, slot: int, params: SamplingParams) -> None:
        self.sampling = self.sampling.set(slot, params)
        self._sorting_slots[slot] = needs_order_statistics(params)

    def submit(self, rows: list[DecodeRow]) -> "PendingStep":
        """Validates and packs the batch, then dispatches one step (asynchronously).

        Returns the step's pending output; its device-to-host copy starts as soon as the step ends.
        """
        actual = len(rows)
        if actual == 0:
            raise ValueError("a decode step needs at least one row")
        slots = [row.slot for row in rows]
        bad_slots = [slot for slot in slots if not 0 <= slot < len(self._sorting_slots)]
        if bad_slots:
            raise ValueError(f"request slots {bad_slots} outside [0, max_requests={len(self._sorting_slots)})")
        bs = self.bucket_for(actual)
        packed = pack_decode_batch(rows, bs=bs, router=self.router, window=self.config.window, vocab_size=self.vocab_size,
                                   max_rows=self.config.max_decode_bs)
        if self.config.enforce_eager:
            step, resample = functools.partial(decode_step, **self._statics(bs)), functools.partial(resample_step, bs=bs)
            packed = jnp.asarray(packed)
        else:
            step, resample = self.executable(bs)
        self.pool, self.buffers, sampled, logits = step(self.param_leaves, self.pool, self.buffers, self.sampling, packed)
        if self._sorting_slots[slots].any():
            self.buffers, sampled = resample(self.buffers, self.sampling, logits)
        if not self.config.enforce_eager:
            self.guard.check({"pool": self.pool, "buffers": self.buffers})
        sampled.copy_to_host_async()
        return PendingStep(actual, sampled)

    @staticmethod
    def fetch(pending: "PendingStep") -> np.ndarray:
        """The step's i32[actual_bs, N + 1] (tokens, then accept_len); waits for the step."""
        return np.asarray(pending.sampled)[: pending.actual_bs]

    def step(self, rows: list[DecodeRow]) -> np.ndarray:
        """Runs one decode step; returns i32[len(rows), N + 1] (tokens, then accept_len)."""
        return self.fetch(self.submit(rows))

    # -- pool rebind ------------------------------------------------------------------------
    def rebind_pool(self, pool: KVPool) -> None:
        """Validates the new pool against every backend node, then publishes it (R7).

        A rejected rebind raises RebindError and changes nothing. An accepted one whose shape
        differs drops the compiled buckets, which `capture()` builds again.
        """
        reasons = [r for node in self.backends for r in node.validate_pool(pool)]
        if reasons:
            raise RebindError(f"pool rebind rejected: {reasons}")
        reshaped = [a.shape for a in jax.tree.leaves(self.pool)] != [a.shape for a in jax.tree.leaves(pool)]
        self.pool = pool
        if reshaped:
            self._executables.clear()
            self.capture_seconds.clear()
