"""What the compat facade, the shell and the vLLM drop-in build on: the core's working
copies, folds and transitions that may build no delta.

Not part of the public API: these names may change with the core.  They are
gathered here so that code outside the core imports one named module instead
of reaching into private ones.
"""

from kvfunc.core._builder import DeltaBuilder
from kvfunc.core._cache_info import as_listed
from kvfunc.core._checks import check_count, check_manager_keys, check_request_id, excerpt
from kvfunc.core._delta import family_rows
from kvfunc.core._fold import fold, quiet, slot_entry
from kvfunc.core._group import GroupCopy
from kvfunc.core._pool_copy import PoolCopy
from kvfunc.core._rows import Row, row_table
from kvfunc.core._runs import busy_slots, run_batch, run_free, run_owed
from kvfunc.core._sizing import calculate_block_num_lazy
from kvfunc.core._state import FrozenDict, group_cache_entries, usage_string
from kvfunc.core._transient import Transient
from kvfunc.core._transitions import free_into, recycle_into
from kvfunc.core._validate import mamba_entry, positive_field

__all__ = [
    "DeltaBuilder", "FrozenDict", "GroupCopy", "PoolCopy", "Row", "Transient", "as_listed",
    "busy_slots", "calculate_block_num_lazy", "check_count", "check_manager_keys",
    "check_request_id", "excerpt", "family_rows", "fold", "free_into", "group_cache_entries",
    "mamba_entry", "positive_field", "quiet", "recycle_into", "row_table", "run_batch",
    "run_free", "run_owed", "slot_entry", "usage_string",
]
