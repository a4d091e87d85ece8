"""decodejax: exact, fast paged decode attention and a decode runtime for JAX."""

from decodejax import addressing, dispatch, planning, reference, split_state
from decodejax._ops import append_attention, decode_attention, gather_pages, merge_states
from decodejax.addressing import AddressingError, KVLayout
from decodejax.dispatch import backends, explain, select
from decodejax.engine import Engine, EngineConfig, RequestError
from decodejax.masks import DecodeMask
from decodejax.planning import SplitPlan
from decodejax.sampling import SamplingParams
from decodejax.split_state import LseState, SplitState

__all__ = [
    "AddressingError",
    "DecodeMask",
    "Engine",
    "EngineConfig",
    "KVLayout",
    "LseState",
    "RequestError",
    "SamplingParams",
    "SplitPlan",
    "SplitState",
    "addressing",
    "append_attention",
    "backends",
    "decode_attention",
    "dispatch",
    "explain",
    "gather_pages",
    "merge_states",
    "planning",
    "reference",
    "select",
    "split_state",
]
