"""Backend admission and selection (invariant D1): which kernel runs, and why, is never a guess.

    call -> DispatchKey (frozen, canonical JSON, SHA-256 digest)
         -> malformed?                  MalformedCall, before any admission
         -> candidate domain            backends whose platforms and phases contain the key's
         -> admission, every candidate  admit(key) -> list of reasons ([] = admitted)
         -> forced backend              admitted, or AdmissionError with its reasons
            auto                        first admitted by priority, with every rejection above it

A backend is a small object: name, platforms, phases, priority, `admit`, `run`. A backend
whose package is missing stays in the registry and says so in its reasons.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from decodejax.addressing import KVLayout

PHASES = ("decode", "append", "prefill")
OPERATIONS = ("attention", "merge_states", "gather_pages")
MASK_KINDS = ("causal", "dense_custom")


class MalformedCall(ValueError):
    """A call no backend may accept (e.g. H_q not a multiple of H_kv): an error before admission."""


class AdmissionError(RuntimeError):
    """No backend (or not the forced one) admits the key; `reasons` maps backend -> its reasons."""

    def __init__(self, message: str, reasons: dict[str, list[str]]):
        super().__init__(message + "".join(f"\n  {name}: {'; '.join(r)}" for name, r in reasons.items()))
        self.reasons = reasons


@dataclasses.dataclass(frozen=True)
class DispatchKey:
    """The frozen coordinate of one call: environment, operation, tensors, semantics, controls."""

    # environment
    device_type: str  # "gpu" or "cpu"
    compute_capability: str | None  # "9.0" on an H200; None off GPU
    # operation
    operation: str
    phase: str
    # tensors
    q_dtype: str
    kv_dtype: str
    q_len: int
    kv_len: int  # max keys per request (the cache capacity of the call)
    num_q_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    cache_layout: str  # a KVLayout value
    page_size: int | None
    last_dim_contiguous: bool = True
    # semantics
    mask_kind: str = "causal"
    soft_cap: float | None = None
    window_left: int | None = None
    sinks: int = 0
    # runtime controls
    requires_deterministic: bool = False
    bucket_mode: bool = False
    backend_request: str = "auto"

    def __post_init__(self):
        problems = []
        if self.operation not in OPERATIONS:
            problems.append(f"operation={self.operation!r} is not one of {OPERATIONS}")
        if self.phase not in PHASES:
            problems.append(f"phase={self.phase!r} is not one of {PHASES}")
        if self.mask_kind not in MASK_KINDS:
            problems.append(f"mask_kind={self.mask_kind!r} is not one of {MASK_KINDS}")
        if self.num_kv_heads <= 0 or self.num_q_heads % self.num_kv_heads:
            problems.append(f"H_q={self.num_q_heads} is not a multiple of H_kv={self.num_kv_heads}")
        if self.q_len <= 0:
            problems.append(f"q_len={self.q_len} must be > 0")
        if self.head_dim_qk <= 0 or self.head_dim_v <= 0:
            problems.append(f"head dims d_qk={self.head_dim_qk}, d_v={self.head_dim_v} must be > 0")
        paged = KVLayout(self.cache_layout).is_paged
        if paged and not self.page_size:
            problems.append(f"layout {self.cache_layout} is paged but page_size={self.page_size}")
        if not paged and self.page_size is not None:
            problems.append(f"layout {self.cache_layout} is contiguous but page_size={self.page_size}")
        if problems:
            raise MalformedCall("malformed call: " + "; ".join(problems))

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace: the same key always has the same bytes."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @staticmethod
    def environment() -> tuple[str, str | None]:
        """(device_type, compute_capability) of the default device, or of `targeting(...)`."""
        target = getattr(_target, "env", None)
        if target is not None:
            return target
        device = jax.devices()[0]
        if device.platform == "gpu":
            return "gpu", str(getattr(device, "compute_capability", None))
        return "cpu", None

    @staticmethod
    def from_call(q, k_pages, *, layout: KVLayout, page_table=None, operation: str = "attention", phase: str = "decode",
                  q_len: int = 1, soft_cap=None, window_left=None, sinks: int = 0, deterministic: bool = False,
                  bucket_mode: bool | None = None, mask_kind: str = "causal", backend: str = "auto", environment=None) -> "DispatchKey":
        """The key of a paged attention call: q [B, H_q, D], k_pages in `layout`, page_table [B_c, W].

        q_len: query rows per request (1 for decode; the packed new tokens for append).

        bucket_mode defaults to whether the runtime is capturing a bucket (`capturing()`).
        """
        from decodejax.addressing import pool_geometry

        device_type, cc = environment or DispatchKey.environment()
        _, P, H_kv, D = pool_geometry(k_pages, layout)
        width = page_table.shape[1] if page_table is not None else 1
        return DispatchKey(
            device_type=device_type, compute_capability=cc, operation=operation, phase=phase,
            q_dtype=str(jnp.dtype(q.dtype)), kv_dtype=str(jnp.dtype(k_pages.dtype)), q_len=q_len, kv_len=width * P,
            num_q_heads=q.shape[1], num_kv_heads=H_kv, head_dim_qk=q.shape[-1], head_dim_v=D,
            cache_layout=layout.value, page_size=P, mask_kind=mask_kind,
            soft_cap=None if soft_cap is None else float(soft_cap), window_left=window_left, sinks=sinks,
            requires_deterministic=deterministic, bucket_mode=in_bucket_mode() if bucket_mode is None else bucket_mode,
            backend_request=backend,
        )


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: where it may run, how it ranks, what it admits, and how it runs."""

    name: str
    platforms: frozenset[str]
    phases: frozenset[str]
    operations: frozenset[str]
    priority: int
    admit: Callable[[DispatchKey], list[str]]
    package: str | None = None  # import name the backend needs

    def run(self, operation: str, *args, **kwargs):
        """Runs `operation` with this backend (implementations: `decodejax._ops.IMPLEMENTATIONS`)."""
        from decodejax import _ops

        implementation = _ops.IMPLEMENTATIONS.get(self.name, {}).get(operation)
        if implementation is None:
            raise NotImplementedError(f"backend {self.name!r} has no {operation!r} implementation behind the public ops")
        return implementation(*args, **kwargs)

    def reasons(self, key: DispatchKey) -> list[str]:
        """Every failed predicate (not just the first); [] means admitted."""
        out = []
        if self.package and importlib.util.find_spec(self.package) is None:
            out.append(f"package {self.package} is not installed")
        return out + self.admit(key)


def _paged_attention_reasons(key: DispatchKey) -> list[str]:
    """What every paged attention kernel needs: a paged layout, d_qk = d_v, causal masks."""
    r = []
    if key.cache_layout not in (KVLayout.PAGED_NHD.value, KVLayout.PAGED_HND.value):
        r.append(f"cache_layout={key.cache_layout}: paged layouts only (PAGED_NHD, PAGED_HND)")
    if key.head_dim_qk != key.head_dim_v:
        r.append(f"d_qk={key.head_dim_qk} != d_v={key.head_dim_v}")
    if key.mask_kind != "causal":
        r.append(f"mask_kind={key.mask_kind} (causal with window/sinks only)")
    return r


def _operand_reasons(key: DispatchKey) -> list[str]:
    """What every Pallas kernel needs of its operands: one dtype, a contiguous last dim."""
    r = []
    if key.q_dtype != key.kv_dtype:
        r.append(f"q_dtype={key.q_dtype} != kv_dtype={key.kv_dtype}")
    if not key.last_dim_contiguous:
        r.append("last dim not contiguous")
    return r


def _pallas_decode_reasons(key: DispatchKey, *, need_gpu: bool) -> list[str]:
    r = []
    if key.operation == "merge_states" and key.head_dim_v & (key.head_dim_v - 1):
        r.append(f"head_dim_vo={key.head_dim_v} is not a power of two")
    if key.operation == "attention":
        if key.phase == "decode" and key.q_len != 1:
            r.append(f"q_len={key.q_len}: one query row per request only")
        for name, d in (("head_dim_qk", key.head_dim_qk), ("head_dim_vo", key.head_dim_v)):
            if d not in (64, 128, 256):
                r.append(f"{name}={d} unsupported (64, 128, 256)")
        if key.num_q_heads // key.num_kv_heads > 16:
            r.append(f"group size {key.num_q_heads // key.num_kv_heads} > 16")
        r += _paged_attention_reasons(key)
    for name, dt in (("q_dtype", key.q_dtype), ("kv_dtype", key.kv_dtype)):
        if dt not in ("bfloat16", "float16", "float32"):
            r.append(f"{name}={dt} unsupported")
    r += _operand_reasons(key)
    if need_gpu and key.compute_capability is not None and float(key.compute_capability) < 8.0:
        r.append(f"compute capability {key.compute_capability} < 8.0")
    return r


def _mosaic_decode_reasons(key: DispatchKey, *, need_gpu: bool) -> list[str]:
    """The Mosaic GPU decode kernel: one query row, paged K/V, wgmma/TMA shapes (its `supports`)."""
    from decodejax import _ops
    from pallas_kernels import decode_attention_mgpu as kernel

    r = []
    if key.phase != "decode" or key.q_len != 1:
        r.append(f"phase={key.phase}, q_len={key.q_len}: decode (one query row) only")
    r += _paged_attention_reasons(key) + _operand_reasons(key)
    config, item_heads, item_dim = _ops.kernel_items(kernel, None, key.head_dim_v, key.num_kv_heads,  # what its items see
                                                     key.num_q_heads // key.num_kv_heads, KVLayout(key.cache_layout))
    r += kernel.supports(key.page_size or 0, item_dim, key.num_q_heads // item_heads, key.kv_dtype, config)
    if need_gpu and key.compute_capability is not None and float(key.compute_capability) < 9.0:
        r.append(f"compute capability {key.compute_capability} < 9.0 (wgmma and TMA are Hopper's)")
    return r


def _xla_reasons(key: DispatchKey) -> list[str]:
    if key.mask_kind == "dense_custom" and key.bucket_mode:
        return ["mask_kind=dense_custom cannot be captured in bucket mode (its shape follows the batch)"]
    return []


def _cudnn_reasons(key: DispatchKey) -> list[str]:
    r = []
    if KVLayout(key.cache_layout).is_paged:
        r.append(f"cache_layout={key.cache_layout}: contiguous K/V only")
    for name, d in (("head_dim_qk", key.head_dim_qk), ("head_dim_vo", key.head_dim_v)):
        if d > 128 or d % 8:
            r.append(f"{name}={d} unsupported (multiple of 8, <= 128)")
    if key.q_dtype not in ("bfloat16", "float16"):
        r.append(f"q_dtype={key.q_dtype}: bf16/fp16 only")
    if key.soft_cap is not None:
        r.append("soft_cap unsupported")
    if key.sinks:
        r.append("sinks unsupported")
    if key.requires_deterministic:
        r.append("no batch-invariance guarantee")
    return r


REGISTRY: tuple[Backend, ...] = (
    Backend("pallas_triton", frozenset({"gpu"}), frozenset({"decode", "append"}), frozenset(OPERATIONS), 100,
            lambda k: _pallas_decode_reasons(k, need_gpu=True), package="jax.experimental.pallas.triton"),
    Backend("pallas_mosaic_gpu", frozenset({"gpu"}), frozenset({"decode"}), frozenset({"attention"}), 90,
            lambda k: _mosaic_decode_reasons(k, need_gpu=True), package="jax.experimental.pallas.mosaic_gpu"),
    Backend("cudnn", frozenset({"gpu"}), frozenset({"decode", "prefill"}), frozenset({"attention"}), 60, _cudnn_reasons),
    Backend("xla", frozenset({"gpu", "cpu"}), frozenset(PHASES), frozenset(OPERATIONS), 50, _xla_reasons),
    Backend("pallas_triton_interpret", frozenset({"gpu", "cpu"}), frozenset({"decode", "append"}), frozenset(OPERATIONS), 10,
            lambda k: _pallas_decode_reasons(k, need_gpu=False), package="jax.experimental.pallas.triton"),
    Backend("pallas_mosaic_gpu_interpret", frozenset({"gpu", "cpu"}), frozenset({"decode"}), frozenset({"attention"}), 5,
            lambda k: _mosaic_decode_reasons(k, need_gpu=False), package="jax.experimental.pallas.mosaic_gpu"),
)


def backends() -> tuple[str, ...]:
    """Names accepted by `backend=` (besides "auto")."""
    return tuple(b.name for b in REGISTRY)


def backend(name: str) -> Backend:
    """The registry entry called `name`."""
    for b in REGISTRY:
        if b.name == name:
            return b
    raise KeyError(f"no backend {name!r}; backends are {backends()}")


@dataclasses.dataclass(frozen=True)
class Selection:
    """The outcome of `select`: the winner, every candidate's reasons, and what was skipped."""

    key: DispatchKey
    backend: str
    candidates: tuple[tuple[str, tuple[str, ...]], ...]  # (name, reasons) in priority order
    rejected_above: tuple[tuple[str, tuple[str, ...]], ...]
    fallback: bool  # True when a higher-priority candidate was rejected
    forced: bool

    def to_json(self) -> dict:
        return {
            "key": dataclasses.asdict(self.key), "digest": self.key.digest(), "selected": self.backend,
            "forced": self.forced, "fallback": self.fallback,
            "candidates": [{"backend": n, "admitted": not r, "reasons": list(r)} for n, r in self.candidates],
        }


@dataclasses.dataclass(frozen=True)
class SelectionPolicy:
    """Automatic-selection policy: backends to leave out of the domain, and backends to try first
    (in the order given, before the rest by priority) where they admit a call; none by default."""

    exclude: tuple[str, ...] = ()
    prefer: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = [n for n in self.exclude + self.prefer if n not in backends()]
        if unknown:
            raise MalformedCall(f"backends {unknown} are not among {backends()}")

    def rank(self, b: Backend) -> tuple[int, int]:
        """Sort key of automatic selection: the preferred backends in their order, then priority."""
        return (self.prefer.index(b.name) if b.name in self.prefer else len(self.prefer), -b.priority)


def select(key: DispatchKey, policy: SelectionPolicy | None = None) -> Selection:
    """Forced: the requested backend admits the key or AdmissionError; auto: first admitted by the
    policy's order (default: the one `preferring` set, else priority alone)."""
    policy = current_policy() if policy is None else policy
    domain = [b for b in sorted(REGISTRY, key=policy.rank)
              if key.device_type in b.platforms and key.phase in b.phases and key.operation in b.operations
              and b.name not in policy.exclude]
    candidates = tuple((b.name, tuple(b.reasons(key))) for b in domain)
    if key.backend_request != "auto":
        if key.backend_request not in backends():
            raise MalformedCall(f"backend={key.backend_request!r} is not one of {('auto',) + backends()}")
        reasons = dict(candidates).get(key.backend_request)
        if reasons is None:
            raise AdmissionError(f"forced backend {key.backend_request!r} is outside the domain of "
                                 f"{key.device_type}/{key.phase}/{key.operation}", {key.backend_request: ["outside the candidate domain"]})
        if reasons:
            raise AdmissionError(f"forced backend {key.backend_request!r} rejects the call", {key.backend_request: list(reasons)})
        selection = Selection(key, key.backend_request, candidates, (), False, True)
    else:
        winner = next((i for i, (_, r) in enumerate(candidates) if not r), None)
        if winner is None:
            raise AdmissionError(f"no backend admits {key.operation}/{key.phase} on {key.device_type}",
                                 {n: list(r) for n, r in candidates})
        selection = Selection(key, candidates[winner][0], candidates, candidates[:winner], winner > 0, False)
    _record(selection)
    return selection


# -- target environment: for lowering to a platform other than the local one -------------
_target = threading.local()


@contextlib.contextmanager
def targeting(device_type: str, compute_capability: str | None = None) -> Iterator[None]:
    """Keys built inside the block describe this environment (e.g. cross-lowering for CUDA on a CPU host)."""
    previous = getattr(_target, "env", None)
    _target.env = (device_type, compute_capability)
    try:
        yield
    finally:
        _target.env = previous


# -- preferred backends: a caller's order for automatic selection ---------------------------
_policy = threading.local()


@contextlib.contextmanager
def preferring(*names: str) -> Iterator[None]:
    """Automatic selection inside the block tries `names` first, in that order, and falls back to
    priority where none of them admits a call (or its operation is outside their domain): e.g.
    preferring("pallas_mosaic_gpu") runs decode attention on the Mosaic GPU kernel and leaves
    append attention and merges to the others. Selection happens where a call is traced, so the
    block must hold the tracing (for the runtime: the capture of its steps)."""
    previous = current_policy()
    _policy.value = dataclasses.replace(previous, prefer=tuple(names))
    try:
        yield
    finally:
        _policy.value = previous


def current_policy() -> SelectionPolicy:
    return getattr(_policy, "value", SelectionPolicy())


# -- bucket mode: set by the runtime while it compiles a bucket --------------------------
_bucket_mode = threading.local()


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Marks calls traced inside the block as bucket-mode (captured) calls."""
    previous = getattr(_bucket_mode, "on", False)
    _bucket_mode.on = True
    try:
        yield
    finally:
        _bucket_mode.on = previous


def in_bucket_mode() -> bool:
    return getattr(_bucket_mode, "on", False)


# -- recording selections (the runtime records one per compiled bucket) --------------------
_recorders = threading.local()


def _record(selection: Selection) -> None:
    for sink in getattr(_recorders, "stack", []):
        sink.append(selection)


@contextlib.contextmanager
def recording() -> Iterator[list[Selection]]:
    """Collects every selection made inside the block (selection happens at trace time)."""
    sink: list[Selection] = []
    _recorders.stack = getattr(_recorders, "stack", []) + [sink]
    try:
        yield sink
    finally:
        _recorders.stack = [s for s in _recorders.stack if s is not sink]


def explain_text(selection_or_error) -> str:
    """Human-readable candidates, reasons and winner of a selection (or of an AdmissionError)."""
    if isinstance(selection_or_error, Selection):
        s = selection_or_error
        lines = [f"key {s.key.digest()[:16]}  {s.key.operation}/{s.key.phase} on {s.key.device_type}"]
        for name, reasons in s.candidates:
            mark = "->" if name == s.backend else "  "
            lines.append(f"{mark} {name:26s} {'admitted' if not reasons else '; '.join(reasons)}")
        lines.append(f"selected {s.backend}" + (" (fallback)" if s.fallback else "") + (" (forced)" if s.forced else ""))
        return "\n".join(lines)
    return f"error: {selection_or_error}"


def explain(**call) -> Selection | AdmissionError:
    """Prints the candidates, their reasons and the winner for DispatchKey(**call); returns the outcome."""
    key = DispatchKey(**call)
    try:
        outcome = select(key)
    except AdmissionError as exc:
        outcome = exc
    print(explain_text(outcome))
    return outcome


# -- plan / run -----------------------------------------------------------------------------
def decode_kernel(backend_name: str):
    """The pallas_kernels module whose tiling and plan a decode backend follows: the Mosaic GPU kernel's
    for its backends, the Triton kernel's for any other (a backend without splits ignores the plan)."""
    from pallas_kernels import decode_attention, decode_attention_mgpu

    return decode_attention_mgpu if backend_name.startswith("pallas_mosaic_gpu") else decode_attention


class StalePlan(ValueError):
    """A run whose static fields differ from its plan's."""


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The static projection of a paged decode call, with its selected backend and split capacity.

    Static (part of the plan; a run that differs raises StalePlan): platform, layout, page
    size, batch, H_q, H_kv, head dims, dtypes, table width, bucket mode, split capacity, and
    the selected backend. Dynamic (a run may change them freely): seq_lens, page-table
    values, cache_batch_idx values, and the q/K/V data.
    """

    platform: str
    layout: str
    page_size: int
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: str
    kv_dtype: str
    table_width: int
    bucket_mode: bool
    split_capacity: int
    backend: str

    STATIC_FIELDS = ("platform", "layout", "page_size", "batch", "num_q_heads", "num_kv_heads", "head_dim",
                     "q_dtype", "kv_dtype", "table_width", "bucket_mode")

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()

    @staticmethod
    def _projection(q, k_pages, page_table, layout: KVLayout, bucket_mode: bool) -> dict:
        from decodejax.addressing import pool_geometry

        _, P, H_kv, _ = pool_geometry(k_pages, layout)
        return dict(platform=DispatchKey.environment()[0], layout=layout.value, page_size=P, batch=q.shape[0],
                    num_q_heads=q.shape[1], num_kv_heads=H_kv, head_dim=q.shape[2], q_dtype=str(jnp.dtype(q.dtype)),
                    kv_dtype=str(jnp.dtype(k_pages.dtype)), table_width=page_table.shape[1], bucket_mode=bucket_mode)

    @staticmethod
    def create(q, k_pages, page_table, *, layout: KVLayout = KVLayout.PAGED_NHD, num_splits: int | None = None,
               deterministic: bool = False, bucket_mode: bool = False, backend: str = "auto") -> "DecodePlan":
        from decodejax import _ops

        key = DispatchKey.from_call(q, k_pages, layout=layout, page_table=page_table, deterministic=deterministic,
                                    bucket_mode=bucket_mode, backend=backend)
        selected = select(key).backend
        proj = DecodePlan._projection(q, k_pages, page_table, layout, bucket_mode)
        # The split capacity the selected kernel's own auto plan has (the Triton kernel's for a
        # backend without splits, whose runs ignore it).
        config, item_heads, item_dim = _ops.kernel_items(decode_kernel(selected), None, proj["head_dim"], proj["num_kv_heads"],
                                                         proj["num_q_heads"] // proj["num_kv_heads"], layout,
                                                         batch=proj["batch"], deterministic=deterministic)
        split = _ops.decode_plan(proj["batch"], item_heads, proj["table_width"] * proj["page_size"], config,
                                 num_splits=num_splits, deterministic=deterministic, head_dim=item_dim)
        return DecodePlan(**proj, split_capacity=split.capacity, backend=selected)

    def check(self, q, k_pages, page_table, layout: KVLayout, bucket_mode: bool = False) -> None:
        """Raises StalePlan naming every static field the call changes."""
        proj = self._projection(q, k_pages, page_table, layout, bucket_mode)
        diffs = [f"{f}: plan {getattr(self, f)!r}, run {proj[f]!r}" for f in self.STATIC_FIELDS if proj[f] != getattr(self, f)]
        if diffs:
            raise StalePlan("stale plan: " + "; ".join(diffs))

    def run(self, q, k_pages, v_pages, page_table, seq_lens, *, layout: KVLayout = KVLayout.PAGED_NHD, **options):
        """decode_attention with this plan's backend and split capacity; dynamic inputs may change."""
        from decodejax import _ops

        self.check(q, k_pages, page_table, layout)
        if not options.get("deterministic"):
            options.setdefault("num_splits", self.split_capacity)
        return _ops.decode_attention(q, k_pages, v_pages, page_table, seq_lens, layout=layout, backend=self.backend, **options)
