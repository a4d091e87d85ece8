"""One sampling route (R8): per-request parameters, a device parameter pool, verify-as-decode.

Greedy is not a branch: `SamplingParams` normalizes temperature 0 to top_k = 1, and top-k = 1
leaves one finite logit, which the categorical draw returns whatever the key. Decode is the
verification of a candidate window of width N: column 0 holds the last verified token and
columns 1.. a drafter's proposals (none without a drafter: N = 1). Column j's logits are
sampled; the draft of column j + 1 is accepted while it equals that sample, so
accept_len = 1 + the number of leading accepted drafts (N = 1: accept_len = 1).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated at creation.

    Attributes:
      temperature: >= 0; 0 means greedy (normalized to top_k = 1, temperature 1).
      top_k: keep the k most likely tokens; 0 disables.
      top_p: nucleus mass in (0, 1].
      min_p: drop tokens below min_p x the top probability, in [0, 1).
      seed: the request's PRNG seed (draws depend only on seed and position).
      max_new_tokens: >= 1.
      stop_token_ids: tokens that finish the request.
      ignore_eos: keep generating past the model's EOS token (fixed-length runs, benchmarks).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(name, value, rule):
            raise ValueError(f"SamplingParams.{name}={value!r}: {rule}")

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(name, value, "must be a finite number")
        if self.temperature < 0:
            bad("temperature", self.temperature, "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an int >= 0 (0 disables)")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            bad("min_p", self.min_p, "must be in [0, 1)")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            bad("seed", self.seed, "must be an int in [0, 2**32)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", self.max_new_tokens, "must be an int >= 1")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be ints >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.temperature == 0:  # greedy is top-k = 1: no argmax branch anywhere
            object.__setattr__(self, "top_k", 1)
            object.__setattr__(self, "temperature", 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingPool:
    """Device arrays of sampling parameters indexed by request slot, each [max_requests]."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array

    @staticmethod
    def create(max_requests: int) -> "SamplingPool":
        return SamplingPool(
            temperature=jnp.ones(max_requests, jnp.float32),
            top_k=jnp.ones(max_requests, jnp.int32),
            top_p=jnp.ones(max_requests, jnp.float32),
            min_p=jnp.zeros(max_requests, jnp.float32),
            seed=jnp.zeros(max_requests, jnp.uint32),
        )

    def set(self, slot: int, params: SamplingParams) -> "SamplingPool":
        return SamplingPool(
            temperature=self.temperature.at[slot].set(params.temperature),
            top_k=self.top_k.at[slot].set(params.top_k),
            top_p=self.top_p.at[slot].set(params.top_p),
            min_p=self.min_p.at[slot].set(params.min_p),
            seed=self.seed.at[slot].set(params.seed),
        )


def needs_order_statistics(params: SamplingParams) -> bool:
    """Whether the request's filter reads the sorted logits: a top-k above 1 or a top-p below 1.

    Greedy (top-k = 1), plain temperature and min-p rows need only the row's maximum.
    """
    return params.top_k > 1 or params.top_p < 1


def _filter_logits(logits, temperature, top_k, top_p, min_p, *, order_statistics: bool = True):
    """logits [R, V] -> filtered logits (dropped tokens at -inf); parameters [R].

    With order_statistics=False nothing is sorted, and the result is exact only for rows for
    which `needs_order_statistics` is False (for them both settings give the same kept set:
    the sorted threshold of top-k = 1 is the maximum, of top-k = 0 the minimum, and top-p = 1
    keeps everything). The choice is static because it must be: the sort costs up to about a
    millisecond per step (128 rows of a 128k vocabulary on the H200), and deciding it on device
    data makes a conditional, which XLA decides on the host: the step's dispatch then waited
    for the forward to finish, and the GPU idled 2 to 5 ms per engine step (benchmarks/README.md,
    end to end). The runner decides it on the host from the batch's parameters.
    """
    logits = logits.astype(jnp.float32) / temperature[:, None]
    probs = jax.nn.softmax(logits, axis=-1)
    keep = probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    if not order_statistics:
        keep &= (top_k[:, None] != 1) | (logits >= jnp.max(logits, axis=-1, keepdims=True))
        return jnp.where(keep, logits, -jnp.inf)
    V = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    keep &= logits >= jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    # Nucleus: keep the smallest prefix of the sorted tokens whose mass reaches top_p. A row
    # with top_p = 1 keeps everything (its rounded cumulative sum may reach 1 early).
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    cutoff_index = jnp.sum(mass_before < top_p[:, None], axis=-1) - 1
    cutoff = jnp.take_along_axis(sorted_logits, cutoff_index[:, None], axis=-1)
    keep &= (top_p[:, None] >= 1) | (logits >= cutoff)
    return jnp.where(keep, logits, -jnp.inf)


def sample_window(
    logits: jax.Array,  # [bs, N, V]
    window_ids: jax.Array,  # i32[bs, N]: column 0 last verified token, columns 1.. drafts
    positions: jax.Array,  # i32[bs, N]: position of each window column
    slots: jax.Array,  # i32[bs]: request slot of each row
    pool: SamplingPool,
    *,
    order_statistics: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Samples every window column and verifies the drafts: (tokens i32[bs, N], accept_len i32[bs]).

    The draw for (request, position) uses key fold_in(PRNGKey(seed), position), so a seeded
    request reproduces its tokens whatever its batch neighbours. order_statistics=False skips
    the sort and is exact only when no row `needs_order_statistics` (see _filter_logits).
    """
    bs, N, V = logits.shape
    rows = lambda x: jnp.repeat(x[slots], N)  # noqa: E731  per (row, column)
    filtered = _filter_logits(logits.reshape(bs * N, V), rows(pool.temperature), rows(pool.top_k), rows(pool.top_p), rows(pool.min_p),
                              order_statistics=order_statistics)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(rows(pool.seed), positions.reshape(-1))
    tokens = jax.vmap(jax.random.categorical)(keys, filtered).reshape(bs, N).astype(jnp.int32)
    drafts_ok = window_ids[:, 1:] == tokens[:, :-1]  # [bs, N - 1]
    accept_len = 1 + jnp.sum(jnp.cumprod(drafts_ok.astype(jnp.int32), axis=1), axis=1)
    return tokens, accept_len.astype(jnp.int32)
