"""Allocations while tokens are in flight: vLLM's windows let go on the processed count.

With async scheduling (or pipeline parallelism) a request's ``computed``
tokens include tokens an in-flight step is still writing.  vLLM lets a
sliding window's blocks go below ``processed = computed - in_flight`` only,
since the in-flight step still reads them; kvfunc's ``allocate_slots``
recycles below its ``computed_tokens``, and treats every position from
``computed_tokens`` on as written by the step (a block there that another
request shares would be copied first).  Neither count alone is right, so
such a step is two entries of one ``allocate_batch``::

    A  windows only: computed = processed, no new tokens,
       lookahead = -processed (nothing allocated, copied or cached)  -> recycles like vLLM
    B  every group:  computed = c, up to the step's end, with hashes -> allocates and caches

where ``c`` (at most ``computed``) is the largest count at which no window
recycles anything more.  When a block between ``c`` and the step's end is
shared with another request (a same-step prefix hit on blocks whose tokens
are still in flight), ``B`` would copy it: then no entry split is exact and
the step is the plain allocation from ``computed`` (the windows let go up
to ``in_flight`` tokens earlier than vLLM; shadow mode reports it).
"""

from __future__ import annotations

import kvfunc as kf
from kvfunc.core._policy import slid_out
from kvfunc.core._rows import leading_nulls
from kvfunc.vllm._layout import Layout

__all__ = ["entries"]


def entries(state: kf.KVState, layout: Layout, rid: str, processed: int, computed: int,
            written: int, lookahead: int, hashes: kf.BlockHashes | None
            ) -> list[kf.SlotRequest] | None:
    """The two step entries of an in-flight allocation, or None when one plain entry is exact."""
    bs = layout.block_size
    windows: list[str] = []
    limit = computed
    differ = False
    for key, window, group in zip(layout.keys, layout.windows, state.groups, strict=True):
        if window is None:
            continue
        table = group.table(rid)
        if not table:
            continue
        nulls = leading_nulls(table)
        policy, mode = group.policy, group.traits[2]  # the core's skip mode, kept per group
        at_processed = max(nulls, slid_out(policy, mode, processed, len(table)))
        if at_processed != max(nulls, slid_out(policy, mode, computed, len(table))):
            differ = True
        windows.append(key)
        limit = min(limit, (at_processed + 1) * bs + window - 2)
    if not differ:
        return None
    c = max(limit, processed)
    end = -(-(written + lookahead) // bs)
    for group, pool_index in ((g, g.pool) for g in state.groups):
        pool, span = state.pools[pool_index], group.table(rid)[c // bs:end]
        if pool.linked and span:
            with pool.reading() as store:
                refs = store.refs
                if any(b and refs[b] > 1 for b in span):
                    return None  # B would copy a shared block: no exact split
    return [kf.SlotRequest(rid, processed, 0, -processed, 0, windows),
            kf.SlotRequest(rid, c, written - c, lookahead, 0, None, hashes)]
