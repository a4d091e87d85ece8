"""decodejax: exact, fast paged decode attention and a decode runtime for JAX."""

from decodejax import addressing, planning, reference, split_state
from decodejax import dispatch
from decodejax._ops import decode_attention, gather_pages, merge_states
from decodejax.dispatch import backends, explain, select
from decodejax.addressing import AddressingError, KVLayout
from decodejax.masks import DecodeMask
from decodejax.planning import SplitPlan
from decodejax.split_state import LseState, SplitState

__all__ = [
    "AddressingError",
    "DecodeMask",
    "KVLayout",
    "LseState",
    "SplitPlan",
    "SplitState",
    "addressing",
    "backends",
    "decode_attention",
    "dispatch",
    "explain",
    "select",
    "gather_pages",
    "merge_states",
    "planning",
    "reference",
    "split_state",
]
