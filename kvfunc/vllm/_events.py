"""vLLM's own KV event records, from kvfunc deltas.

A kvfunc delta lists, in the order they happened, the cached blocks a
transition forgot (``Evicted``), the full blocks it cached (``Stored``) and
the groups whose cache it reset (``Cleared``).  vLLM's block pool reports the
same moments with its ``vllm.distributed.kv_events`` records::

    Evicted rows               -> one BlockRemoved per block hash (vLLM's shape)
    a run of Stored rows of    -> one BlockStored: the run's hashes, the parent hash,
      one group                   the run's tokens, LoRA, extra keys, session id
    Cleared rows of one reset  -> one AllBlocksCleared

Every transition of the manager concerns one request at most, so the fields
vLLM takes from the request (LoRA, multimodal and salt extra keys, session
id) come from the request the call was about.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvfunc.core import BlocksChanged, Cleared, Evicted, Stored

__all__ = ["annotate", "cached_block_events", "vllm_events"]


def _stored(request: Any, rows: Sequence[Stored], group: int, block_size: int,
            start: int) -> Any:
    """vLLM's ``BlockStored`` for one run of stored rows of a request in one group.

    vLLM's record spans the blocks from where the request's caching stood
    (``start``), null blocks of a window included: their tokens and parent
    hash are in it, their hashes are not.
    """
    from vllm.distributed.kv_events import MEDIUM_GPU, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    first = min(start, rows[0].position)
    parent = request.block_hashes[first - 1] if first else None
    return _block_stored(BlockStored, MEDIUM_GPU, request,
                         [maybe_convert_block_hash(r.block_hash) for r in rows],
                         None if parent is None else maybe_convert_block_hash(parent),
                         first * block_size, (rows[-1].position + 1) * block_size,
                         block_size, group, [r.position for r in rows])


def _block_stored(cls: Any, medium: str, request: Any, hashes: list[Any], parent: Any,
                  start: int, end: int, block_size: int, group: int,
                  positions: Sequence[int]) -> Any:
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    extra: list[Any] = []
    mm = 0
    for p in positions:
        keys, mm = generate_block_hash_extra_keys(request, p * block_size,
                                                  (p + 1) * block_size, mm)
        extra.append(keys)
    lora = request.lora_request
    return cls(block_hashes=hashes, parent_block_hash=parent,
               token_ids=request.all_token_ids[start:end], block_size=block_size,
               lora_id=lora.adapter_id if lora else None, medium=medium,
               lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra),
               group_idx=group, session_id=request.session_id, lookahead_token_ids=None)


def vllm_events(delta: BlocksChanged, request: Any, groups: dict[str, int], block_size: int,
                start: Callable[[str, int], int]) -> list[Any]:
    """The vLLM KV events of one transition's delta, in the order of its operations.

    ``groups`` maps kvfunc manager keys to vLLM group indices; ``request`` is
    the request the transition was about (``None`` when it stored nothing);
    ``start(key, position)`` is where vLLM's caching of the request stood in
    that group before a run of stores beginning at ``position``.
    """
    from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list[Any] = []
    run: list[Stored] = []

    def flush() -> None:
        key = run[0].key
        out.append(_stored(request, run, groups[key], block_size, start(key, run[0].position)))
        run.clear()

    for op in delta.operations():
        if isinstance(op, Stored):
            if run and run[-1].key != op.key:
                flush()
            run.append(op)
            continue
        if run:
            flush()
        if isinstance(op, Evicted):
            out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(op.block_hash)],
                                    medium=MEDIUM_GPU, group_idx=groups[op.key]))
        elif isinstance(op, Cleared) and not (out and type(out[-1]) is AllBlocksCleared):
            out.append(AllBlocksCleared())
    if run:
        flush()
    return out


def cached_block_events(request: Any, tables: Sequence[Sequence[int]], block_size: int
                        ) -> list[Any]:
    """``BlockStored`` events reporting a prefix hit's blocks (``kv_cache_report_mode="full"``)."""
    from vllm.distributed.kv_events import MEDIUM_GPU, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out = []
    for group, table in enumerate(tables):
        if table:
            hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[:len(table)]]
            out.append(_block_stored(BlockStored, MEDIUM_GPU, request, hashes, None, 0,
                                     len(table) * block_size, block_size, group,
                                     range(len(table))))
    return out


def annotate(events: list[Any], metadata: Sequence[tuple[str, int | None]]) -> list[Any]:
    """Stamp each ``BlockStored`` with its group's spec kind and window (vLLM's ``take_events``)."""
    from vllm.distributed.kv_events import BlockStored

    for event in events:
        if type(event) is BlockStored and event.group_idx is not None:
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = (
                metadata[event.group_idx])
    return events
