"""A continuous-batching engine: waiting and running queues, chunked prefill mixed with decode.

Each `step()`:
  1. admits waiting requests (FIFO) while a request slot and the blocks of its prompt are free;
  2. prefills up to `prefill_token_budget` prompt tokens (chunks of several requests packed
     into one extend forward, padded to a token-count bucket); a request whose prompt is done
     samples its first token from its last prompt position;
  3. runs one bucketed decode step (DecodeRunner) over every running request, allocating a
     block when the next position needs one; out of blocks, the newest running request is
     preempted back to the waiting queue (its tokens are recomputed later). With
     `overlap_decode` the engine dispatches the following decode step before it reads this
     one's tokens (each continuing row takes its token from the device), so the host's
     bookkeeping runs while the GPU works; a row of a request that this step finishes is
     computed and dropped;
  4. finishes requests on EOS, a stop token or max_new_tokens, and on abort; their blocks and
     slots return to the free lists.

The engine does not import a model: it takes any object with `config` (vocab_size,
num_layers, num_kv_heads, head_dim, max_position_embeddings, eos_token_id), `layer_leaves`
and `functional()` -> (forward, state), as `models.llama.Llama` provides.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from decodejax.cache import CacheGroup, CacheGroupRouter, KVPool, Leaf, OutOfPages, PageAllocator
from decodejax.metadata import DecodeRow, ExtendInputs, build_extend_metadata
from decodejax.runner import AttentionLeafBackend, DecodeRunner, PendingStep, RunnerConfig, default_step_xla_options
from decodejax.sampling import SamplingParams, sample_window


class RequestError(ValueError):
    """A request that cannot be served as given (raised before any device work)."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; BOS and EOS above them."""

    def __init__(self, bos: int | None = 256, eos: int | None = 257):
        self.bos, self.eos = bos, eos

    def encode(self, text: str) -> list[int]:
        return ([self.bos] if self.bos is not None else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` package."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


# EngineConfig.for_model on a device that reports its memory (a GPU). 64 rows: the default
# capture ladder up to 64 is nine buckets (64 to 82 s to compile cold for llama3-8b on the H200,
# 8.2 and 8.9 s from the compilation cache; benchmarks/README.md, forty-first session). 8,192
# tokens: the longest context the end-to-end benchmark runs, a block table row of 512 entries.
DEVICE_MAX_BATCH = 64
DEVICE_MAX_CONTEXT = 8192
# Prompt tokens a prefill step takes on such a device, and its token-count buckets (each compiled
# on first use). llama3-8b bf16 on the H200 (benchmarks/README.md, thirty-ninth session): with the
# CPU's 256-token chunks a 2,048-token prompt's TTFT was 193 to 218 ms and an 8,000-token one's
# 808 to 931 ms; with 2,048-token chunks, 77 to 80 and 313 to 325 ms. The doubling ladder keeps
# a short prompt from being padded to the whole budget (512 tokens in a 2,048 bucket: 70 ms,
# against 57 to 67 in a 256 bucket).
DEVICE_PREFILL_TOKEN_BUDGET = 2048
DEVICE_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# Device memory the pool leaves free for the compiled steps' buffers (at most 100 MB for a
# llama3-8b decode step at B 128 on the H200) and for XLA's autotuning while they compile.
POOL_HEADROOM_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. Field defaults fit small models on a CPU; `for_model` fits a model and its device.

    Attributes:
      max_batch: running requests (the decode buffers' rows).
      max_context: tokens per request (prompt + generated).
      page_size: kernel page = scheduler block size, in tokens.
      num_pages: pages in the pool (page 0 is the null page); default fits every slot.
      prefill_token_budget: prompt tokens prefilled per step (chunked prefill).
      prefill_buckets: padded token counts of the prefill forward (one compile each).
      max_capture_bs: top of the decode capture ladder.
      capture_ladder: the decode buckets (default: the runner's ladder up to max_capture_bs).
      kv_dtype: K/V pool dtype.
      compilation_cache_dir: JAX persistent compilation cache for the decode buckets (None: off).
      overlap_decode: dispatch decode step k + 1 before reading step k's tokens (one step in
        flight); False runs each step to its end first. Tokens are the same either way.
      step_xla_options: bs -> XLA compile options of decode bucket bs (`RunnerConfig`).
    """

    max_batch: int = 8
    max_context: int = 512
    page_size: int = 16
    num_pages: int | None = None
    prefill_token_budget: int = 256
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256)
    max_capture_bs: int | None = None
    capture_ladder: tuple[int, ...] | None = None
    kv_dtype: str = "float32"
    compilation_cache_dir: str | None = None
    overlap_decode: bool = True
    step_xla_options: Callable[[int], dict] = default_step_xla_options

    def __post_init__(self):
        if self.prefill_token_budget > max(self.prefill_buckets):
            raise ValueError(f"prefill_token_budget={self.prefill_token_budget} exceeds the largest bucket {max(self.prefill_buckets)}")

    @classmethod
    def for_model(cls, model_config, kv_dtype, memory_stats: dict | None = None, *,
                  max_batch: int | None = None, max_context: int | None = None) -> EngineConfig:
        """The defaults `Engine(model)` takes: K/V in kv_dtype (the model's weight dtype), sized to the device.

        Args:
          model_config: num_layers, num_kv_heads, head_dim, max_position_embeddings.
          kv_dtype: the K/V pool's dtype.
          memory_stats: the device's `Device.memory_stats()`, taken after the model's weights
            are on it; None (a CPU reports none) or without "bytes_limit": no memory to fit.
          max_batch, max_context: replace the rows and the tokens per request chosen below (a
            one-prompt command line asks for one row); the pool is sized to them.

        Without a memory limit: the field defaults, max_context min(512, the model's positions)
        and pages for every slot. With one: DEVICE_MAX_BATCH rows of up to
        min(DEVICE_MAX_CONTEXT, the model's positions) tokens, prefill chunks of
        DEVICE_PREFILL_TOKEN_BUDGET tokens, and as many pages as the free memory less
        POOL_HEADROOM_BYTES holds, at most every slot's (more could never be used).
        Fewer pages than every slot's is a valid pool: requests wait for free pages.

        Raises:
          ValueError: the free memory does not hold one request of max_context tokens.
        """
        kv_dtype = jnp.dtype(kv_dtype)
        positions = model_config.max_position_embeddings
        if not memory_stats or "bytes_limit" not in memory_stats:
            return cls(max_batch=max_batch or cls.max_batch, max_context=max_context or min(512, positions), kv_dtype=kv_dtype.name)
        page_size, max_context = cls.page_size, max_context or min(DEVICE_MAX_CONTEXT, positions)
        max_batch = max_batch or DEVICE_MAX_BATCH
        blocks_per_request = -(-max_context // page_size)
        page_bytes = model_config.num_layers * 2 * page_size * model_config.num_kv_heads * model_config.head_dim * kv_dtype.itemsize
        free = memory_stats["bytes_limit"] - memory_stats.get("bytes_in_use", 0) - POOL_HEADROOM_BYTES
        num_pages = min(max_batch * blocks_per_request + 1, int(max(0, free) // page_bytes))
        if num_pages < blocks_per_request + 1:
            raise ValueError(
                f"device memory: {free / 2**30:.2f} GiB free after the weights and {POOL_HEADROOM_BYTES / 2**30:.0f} GiB of headroom "
                f"holds {num_pages} pages of {page_bytes} bytes; one request of max_context={max_context} tokens needs "
                f"{blocks_per_request + 1} (pass an EngineConfig with a smaller max_context)")
        return cls(max_batch=max_batch, max_context=max_context, num_pages=num_pages, kv_dtype=kv_dtype.name,
                   prefill_token_budget=DEVICE_PREFILL_TOKEN_BUDGET, prefill_buckets=DEVICE_PREFILL_BUCKETS)


@dataclasses.dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    epoch: int = 0  # bumped when its blocks are released: an in-flight row of an older epoch is stale

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        """len(tokens) without building it: the decode loop asks every step, for every request."""
        return len(self.prompt) + len(self.generated)

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]


@dataclasses.dataclass(frozen=True)
class Result:
    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str


def weights_dtype(state) -> jnp.dtype:
    """The floating dtype that holds most of a parameter pytree's bytes (bf16 matrices beside f32 RoPE tables: bf16)."""
    bytes_by_dtype: dict[jnp.dtype, int] = {}
    for leaf in jax.tree.leaves(state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            bytes_by_dtype[leaf.dtype] = bytes_by_dtype.get(leaf.dtype, 0) + leaf.size * leaf.dtype.itemsize
    if not bytes_by_dtype:
        raise ValueError("the model's state holds no floating-point parameters")
    return max(bytes_by_dtype, key=bytes_by_dtype.get)


def _memory_stats(state) -> dict | None:
    """memory_stats() of the device holding the model's first parameter (None on a CPU)."""
    device = min(jax.tree.leaves(state)[0].devices(), key=lambda d: d.id)
    return device.memory_stats()


def fitted_config(model_config, state, **overrides) -> EngineConfig:
    """`EngineConfig.for_model` for a model's parameters: K/V in the dtype of most of their bytes,
    sized to the memory of the device that holds them; overrides: for_model's max_batch, max_context."""
    return EngineConfig.for_model(model_config, weights_dtype(state), _memory_stats(state), **overrides)


def _prefill_forward(forward, param_tree, param_leaves, pool, ctx, last_rows, positions, slots, sampling):
    """Extend forward, then a first token sampled at each request's last row (fixed [max_batch] shapes).

    Takes the runner's flat parameter leaves, as its decode steps do (see runner.decode_step)."""
    logits, pool = forward(jax.tree.unflatten(param_tree, param_leaves), pool, ctx)
    first = logits[last_rows, 0][:, None, :]
    tokens, _ = sample_window(first, jnp.zeros_like(positions), positions, slots, sampling)
    return tokens[:, 0], pool


@dataclasses.dataclass
class InFlight:
    """A dispatched decode step: its pending output and, per row, the request and its epoch."""

    pending: PendingStep
    rows: list[tuple[Request, int]]


class Engine:
    """Continuous batching over a paged cache with bucketed decode steps.

    config None takes `fitted_config`: K/V in the dtype of most of the model's parameter bytes,
    sized to the memory of the device that holds them."""

    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None):
        c = model.config
        forward, state = model.functional()
        self.config = config or fitted_config(c, state)
        ec = self.config
        if ec.max_context > c.max_position_embeddings:
            raise ValueError(f"max_context={ec.max_context} exceeds the model's {c.max_position_embeddings} positions")
        self.tokenizer = tokenizer or ByteTokenizer(c.bos_token_id if c.vocab_size > 257 else None, c.eos_token_id)
        self.vocab_size, self.eos = c.vocab_size, c.eos_token_id
        P = ec.page_size
        blocks_per_request = -(-ec.max_context // P)
        num_pages = ec.num_pages or ec.max_batch * blocks_per_request + 1
        self.router = CacheGroupRouter((CacheGroup("main", P, blocks_per_request),), (Leaf("full", "main", P),))
        self._forward = forward
        pool = KVPool.create(c.num_layers, num_pages, P, c.num_kv_heads, c.head_dim, jnp.dtype(ec.kv_dtype))
        backend = AttentionLeafBackend("full", tuple(range(c.num_layers)), P, c.num_kv_heads, c.head_dim, str(jnp.dtype(ec.kv_dtype)))
        top = ec.max_capture_bs or ec.max_batch
        self.runner = DecodeRunner(forward, state, pool, self.router, model.layer_leaves, [backend],
                                   RunnerConfig(max_decode_bs=ec.max_batch, max_capture_bs=min(top, ec.max_batch),
                                                capture_ladder=ec.capture_ladder, compilation_cache_dir=ec.compilation_cache_dir,
                                                step_xla_options=ec.step_xla_options),
                                   vocab_size=c.vocab_size, max_requests=ec.max_batch)
        self.layer_leaves = tuple(model.layer_leaves)
        self.allocator = PageAllocator(num_pages)
        self.free_slots = list(range(ec.max_batch - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._ids = itertools.count()
        self._in_flight: InFlight | None = None
        self._prefill = jax.jit(functools.partial(_prefill_forward, forward, self.runner.param_tree), donate_argnums=(1,))
        self.capture_seconds = self.runner.capture(progress=None)

    # -- requests ---------------------------------------------------------------------------
    def _validate(self, prompt, params) -> tuple[list[int], SamplingParams]:
        if isinstance(params, dict):
            try:
                params = SamplingParams(**params)
            except (TypeError, ValueError) as exc:
                raise RequestError(f"invalid sampling parameters: {exc}") from exc
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be SamplingParams or a dict, got {type(params).__name__}")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids or (isinstance(prompt, str) and not prompt):
            raise RequestError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:8]} outside the vocabulary of {self.vocab_size}")
        if len(ids) + params.max_new_tokens > self.config.max_context:
            raise RequestError(f"prompt of {len(ids)} tokens + max_new_tokens={params.max_new_tokens} exceeds the context of {self.config.max_context}")
        pages = -(-(len(ids) + params.max_new_tokens) // self.config.page_size)
        if pages > self.allocator.num_pages - 1:  # it could never run, even alone: it would wait forever
            raise RequestError(f"prompt of {len(ids)} tokens + max_new_tokens={params.max_new_tokens} needs {pages} pages; "
                               f"the pool has {self.allocator.num_pages - 1}")
        return ids, params

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | dict | None = None) -> int:
        """Queues a request; RequestError (nothing queued, nothing run) if it cannot be served."""
        return self._enqueue(*self._validate(prompt, params if params is not None else SamplingParams()))

    def _enqueue(self, tokens: list[int], params: SamplingParams) -> int:
        req = Request(next(self._ids), tokens, params)
        self.waiting.append(req)
        return req.id

    def abort(self, request_id: int) -> None:
        for queue in (self.running, self.waiting):
            for req in list(queue):
                if req.id == request_id:
                    queue.remove(req)
                    self._finish(req, "abort")
                    return
        raise KeyError(f"no live request {request_id}")

    def _release(self, req: Request) -> None:
        """Returns the request's blocks and slot to the free lists."""
        self.allocator.free(req.blocks)
        req.blocks, req.cached = [], 0
        req.epoch += 1
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self._release(req)
        self.finished[req.id] = req

    def _preempt(self, req: Request) -> None:
        """Back to the waiting queue; its tokens are prefilled again when it is readmitted."""
        self.running.remove(req)
        self._release(req)
        self.waiting.appendleft(req)

    def _blocks_for(self, req: Request, tokens: int) -> bool:
        need = -(-tokens // self.config.page_size) - len(req.blocks)
        if need <= 0:
            return True
        try:
            req.blocks += self.allocator.allocate(need)
            return True
        except OutOfPages:
            return False

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[tuple[int, int]]:
        """One scheduler iteration; returns the (request_id, token) pairs it produced."""
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if not self._blocks_for(req, req.num_tokens + 1):
                break  # out of pages: it waits
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            self.runner.set_sampling(req.slot, req.params)
            self.running.append(req)
        produced = self._prefill_step()
        produced += self._decode_step()
        return produced

    def _emit(self, req: Request, token: int, produced: list) -> None:
        req.generated.append(token)
        produced.append((req.id, token))
        p = req.params
        if (token == self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            self.running.remove(req)
            self._finish(req, "stop")
        elif len(req.generated) >= p.max_new_tokens:
            self.running.remove(req)
            self._finish(req, "length")

    def _prefill_step(self) -> list[tuple[int, int]]:
        budget, chunks = self.config.prefill_token_budget, []
        for req in self.running:
            todo = req.num_tokens - 1 - req.cached if req.generated else req.num_tokens - req.cached
            if todo > 0 and budget > 0:
                n = min(todo, budget)
                chunks.append((req, n))
                budget -= n
        if not chunks:
            return []
        total = sum(n for _, n in chunks)
        bucket = next(b for b in sorted(self.config.prefill_buckets) if b >= total)
        inputs = ExtendInputs(
            extend_lens=tuple(n for _, n in chunks), prefix_lens=tuple(r.cached for r, _ in chunks),
            slots=tuple(r.slot for r, _ in chunks), token_ids=tuple(t for r, n in chunks for t in r.tokens[r.cached : r.cached + n]),
            block_tables={"main": [r.blocks for r, _ in chunks]},
        )
        ctx = build_extend_metadata(self.router, self.layer_leaves, inputs=inputs, pad_to=bucket, pad_requests_to=self.config.max_batch)
        # Per chunk (padded to max_batch): its last row, that row's position and the request slot.
        B = self.config.max_batch
        last_rows, positions, slots = np.zeros(B, np.int32), np.zeros((B, 1), np.int32), np.zeros(B, np.int32)
        last_rows[: len(chunks)] = np.cumsum([n for _, n in chunks]) - 1
        positions[: len(chunks), 0] = [r.cached + n - 1 for r, n in chunks]
        slots[: len(chunks)] = [r.slot for r, _ in chunks]
        tokens, self.runner.pool = self._prefill(self.runner.param_leaves, self.runner.pool, ctx, last_rows, positions, slots, self.runner.sampling)
        tokens = np.asarray(tokens)
        produced = []
        for i, (r, n) in enumerate(chunks):
            r.cached += n
            if r.cached == r.num_tokens and not r.generated:  # the prompt is in: its first token
                self._emit(r, int(tokens[i]), produced)
        return produced

    def _decode_step(self) -> list[tuple[int, int]]:
        """Reads one decode step's tokens: the one in flight, or one dispatched now; with
        overlap_decode, the next step is dispatched before the read."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            step = self._dispatch_decode(self._host_ready_rows())
            if step is None:
                return []
        if self.config.overlap_decode:
            ready = self._host_ready_rows(step)  # first: it may preempt requests of `step`
            self._in_flight = self._dispatch_decode(ready + self._continuing_rows(step))
        return self._collect(step)

    def drain(self) -> list[tuple[int, int]]:
        """Reads the decode step in flight, if any, dispatching nothing: afterwards the device
        holds no work of the engine's and every running request's last token is on the host."""
        step, self._in_flight = self._in_flight, None
        return self._collect(step) if step is not None else []

    def _host_ready_rows(self, in_flight: InFlight | None = None) -> list[tuple[Request, DecodeRow]]:
        """Rows of running requests whose last token the host has (none of the step in flight).

        Out of blocks, the newest running request is preempted back to the waiting queue, even
        one in flight: its row there is dropped, and the blocks it frees are written by later
        steps only, in stream order. Build these rows before `_continuing_rows`, which then
        skips the preempted.
        """
        flying = set() if in_flight is None else {id(r) for r, epoch in in_flight.rows if r.epoch == epoch}
        ready = [r for r in self.running if r.generated and r.cached == r.num_tokens - 1 and id(r) not in flying]
        for req in list(ready):
            if req.slot is None:
                continue  # preempted for an earlier row: it holds no blocks while it waits
            while not self._blocks_for(req, req.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim in ready:
                    ready.remove(victim)
                if victim is req:
                    break
        return [(r, DecodeRow(r.slot, r.cached, (r.last_token,), {"main": r.blocks})) for r in ready if r.slot is not None]

    def _continuing_rows(self, step: InFlight) -> list[tuple[Request, DecodeRow]]:
        """Rows that go on from the step in flight: position + 1, token read from its row."""
        rows = []
        for j, (req, epoch) in enumerate(step.rows):
            alive = req.epoch == epoch and req.finish_reason is None
            if alive and len(req.generated) + 1 < req.params.max_new_tokens and self._blocks_for(req, req.num_tokens + 1):
                rows.append((req, DecodeRow(req.slot, req.cached + 1, (0,), {"main": req.blocks}, token_from_row=j)))
        return rows

    def _dispatch_decode(self, rows: list[tuple[Request, DecodeRow]]) -> InFlight | None:
        if not rows:
            return None
        return InFlight(self.runner.submit([row for _, row in rows]), [(req, req.epoch) for req, _ in rows])

    def _collect(self, step: InFlight) -> list[tuple[int, int]]:
        """Waits for the step's tokens and emits them; rows of requests that finished, aborted or
        were preempted since its dispatch are dropped."""
        produced = []
        for (req, epoch), sampled in zip(step.rows, self.runner.fetch(step.pending)):
            if req.epoch == epoch and req.finish_reason is None:
                req.cached += 1
                self._emit(req, int(sampled[0]), produced)
        return produced

    # -- front ends -------------------------------------------------------------------------
    def _submit_all(self, prompts, sampling_params) -> list[int]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        validated = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                validated.append(self._validate(p, sp if sp is not None else SamplingParams()))
            except RequestError as exc:
                raise RequestError(f"prompt {i}: {exc}") from exc
        return [self._enqueue(tokens, sp) for tokens, sp in validated]

    def stream(self, prompts, sampling_params=None) -> Iterator[tuple[int, int]]:
        """Yields (index of the prompt, token id) as tokens are produced."""
        ids = self._submit_all(prompts, sampling_params)
        index = {rid: i for i, rid in enumerate(ids)}
        while any(rid not in self.finished for rid in ids):
            for rid, token in self.step():
                if rid in index:
                    yield index[rid], token

    def generate(self, prompts, sampling_params=None) -> list[Result]:
        """One Result (token_ids, text, finish_reason) per prompt, in order."""
        ids = self._submit_all(prompts, sampling_params)
        while any(rid not in self.finished for rid in ids):
            self.step()
        return [Result(rid, list(self.finished[rid].generated), self.tokenizer.decode(self.finished[rid].generated),
                       self.finished[rid].finish_reason) for rid in ids]
