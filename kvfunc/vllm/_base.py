"""The drop-in manager's state, its one place of change, and vLLM's view of it.

:class:`ManagerBase` holds one kvfunc :class:`~kvfunc.KVState` and, between
calls, only what vLLM needs from it: the KV events and new block ids not
taken yet, the prefix-cache stats, the converted hashes of each request (a
cache of ``request.block_hashes``), the ``KVCacheBlock`` handles it gives
vLLM, and the owed calls (decode calls whose only work is caching a block
that filled, or taking the next blocks: :meth:`ManagerBase._pay_owed`).
:meth:`ManagerBase._commit` is the one place the state changes: each
scheduler call that changes the cache hands it one transition's state and
delta, and it turns the delta into what vLLM reads (events, metrics, block
ids to zero); with none of those read, nor a journal, transitions build no
delta (``_records``) and every answer is read from the state.  ``_state`` is
the state with every owed call paid (what readers read); ``_value`` the last
committed one, for what owed calls cannot change (the tables and rows of a
request that owes no take; free counts less the blocks promised).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import kvfunc as kf
from kvfunc.core._internal import run_owed
from kvfunc.vllm._events import vllm_events
from kvfunc.vllm._handles import Handles
from kvfunc.vllm._hashes import RequestHashes
from kvfunc.vllm._layout import Layout, plan_layout
from kvfunc.vllm._views import BlockPoolView, CoordinatorView, GroupView, ViewedManager

__all__ = ["Journal", "ManagerBase", "logger"]

logger = logging.getLogger("vllm.kvfunc")

#: ``(call name, request id or None, arguments, delta)``: one recorded transition.
Journal = Callable[[str, Any, tuple[Any, ...], kf.BlocksChanged], None]


class ManagerBase:
    """The manager's state and what vLLM needs between calls (see the module docstring).

    The constructor takes vLLM's arguments; a configuration kvfunc does not
    model raises :class:`~kvfunc.vllm.NotModelledError` here, never later.
    """

    def __init__(self, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                 log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1,
                 metrics_collector: Any = None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )
        from vllm.v1.metrics.stats import PrefixCacheStats

        layout = plan_layout(
            kv_cache_config, max_model_len=max_model_len,
            max_in_flight_tokens=max_model_len if max_in_flight_tokens is None
            else max_in_flight_tokens, scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size, use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead, dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size)
        if not watermark >= 0.0:
            raise kf.InvalidArgumentError(f"watermark must be non-negative, got {watermark!r}")
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = False
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(layout.keys)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec))
            for spec in layout.specs)
        self._blocks_type = KVCacheBlocks
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in layout.keys))
        self._layout: Layout = layout
        self._group_index = {key: i for i, key in enumerate(layout.keys)}
        self._windowed = any(w is not None for w in layout.windows)
        self._value = layout.initial_state()
        #: request id -> (its entry, the digests it may cache, how many digests it had, the
        #: position of the first of them, the blocks it takes per group, ``()`` for a slide,
        #: or None): decode calls whose only work, caching the blocks that filled, taking
        #: blocks or letting a window's cached blocks go, is owed (_pay_owed)
        self._owed: dict[Any, tuple[kf.SlotRequest, Any, int, int,
                                    list[list[int]] | tuple[()] | None]] = {}
        self._owed_keys: set[bytes] = set()  # every owed call's digests (disjoint sets)
        self._takes = 0  # blocks the owed calls take
        self._cursor: int | None = None  # the last of them in the free queue
        self._slides = 0  # owed calls that let a window's block go
        self._freed = 0  # blocks those free
        self._letgo: dict[int, int] = {}  # block -> holders the owed slides let go
        self._defers = enable_caching and not enable_kv_cache_events
        self._handles = Handles(layout.num_blocks, KVCacheBlock)
        self._hashes = RequestHashes(layout.block_size)
        self._events: list[Any] = []
        self._zeroing = bool(kv_cache_config.needs_kv_cache_zeroing)
        self._new_block_ids: list[int] = []
        self._journal: Journal | None = None
        manager = cast(ViewedManager, self)  # the full class (KVCacheManager) answers them
        self.block_pool = BlockPoolView(manager, layout.num_blocks, layout.block_size,
                                        enable_caching, self._handles.null)
        self.coordinator = CoordinatorView(
            manager, [GroupView(i, spec, layout.block_size, enable_caching)
                   for i, spec in enumerate(layout.specs)],
            self.block_pool, kv_cache_config, layout.block_size)

    # -- the state ---------------------------------------------------------------------
    @property
    def _state(self) -> kf.KVState:
        """The current state, every caching owed done first (what every reader reads)."""
        if self._owed:
            self._pay_owed()
        return self._value

    @property
    def _tables(self) -> kf.KVState:
        """The state whose tables are current: the owed takes done first, if any (the owed
        caching changes no table)."""
        if self._owes_blocks:
            self._pay_owed()
        return self._value

    @property
    def _owes_blocks(self) -> bool:
        """Whether owed calls take blocks or let blocks go: until they are paid, every read
        of the tables or the free queue, and every other change, pays them first (but a step
        that may come before them, :meth:`_ahead_of_takes`)."""
        return bool(self._takes or self._slides)

    def _pay_owed(self) -> None:
        """Make the owed calls' transitions now, in the order they came: one transition.

        A decode call whose only work is caching the blocks its tokens fill
        (vLLM caches each block as it fills) is not a transition of its own:
        it is owed (:meth:`_owe`, with the hashes it came with), and done by
        the request's next transition when that can cache it first
        (:meth:`_settle_owed`), or here, before anything could tell: a read of
        the state, a lookup, an admission or a step that could cache a digest
        owed, a call on an owing request, an eviction or a reset.  Caching a
        block its request holds changes no free count, no table and no block
        another call can take, and the digests owed by different calls are
        disjoint, so every other call gives what it would have given after the
        owed ones (``docs/how-to/vllm.md``, "Calls owed to the cache").  With
        KV events on nothing is owed (their order is vLLM's).

        A decode call whose only work is taking blocks (and caching what
        fills) is owed too (:meth:`_owe_take`): it answers with the blocks the
        free queue hands out next after those promised to earlier owed calls,
        which this one transition (``run_owed``), making the calls in the order they
        came, takes; it checks that each took what it promised.  So is a decode
        call whose only work is letting a window's cached blocks go (and caching
        what fills, :meth:`_owe_slide`): its blocks count free at once.  While
        takes or slides are owed every read of the tables or the free queue, and
        every other change, pays first, but a step that may come before them
        (:meth:`_ahead_of_takes`; none comes before a slide).
        """
        owed = self._owed
        result = run_owed(self._value, [(e[0], e[4] or None) for e in owed.values()],
                          self._records)  # (a slide's ``()``: it takes nothing)
        if result.refused:  # caching takes no block, and the takes were counted: never refused
            raise kf.KVFuncError(f"the calls owed by {list(result.refused)} were refused")
        if self._owes_blocks and result.state.pools[0].num_free != self.num_free_blocks:
            raise kf.KVFuncError("the owed calls took or let go other blocks than counted")
        self._forget_owed()
        self._commit(result.state, result.delta, "owed_calls", None,
                     tuple(e[0][:4] for e in owed.values()))

    def _forget_owed(self) -> None:
        """Owe nothing (the calls owed were paid, or the state they were owed on replaced)."""
        self._owed, self._owed_keys, self._takes, self._cursor = {}, set(), 0, None
        self._slides, self._freed, self._letgo = 0, 0, {}

    def _state_for(self, request: Any, reads_digests: bool = True) -> kf.KVState:
        """The state as a call about ``request`` sees it: the owed calls paid first when
        takes are owed, when it owes one, or (``reads_digests``) when its digests meet an
        owed one."""
        if self._owed and (self._owes_blocks or request.request_id in self._owed or (
                reads_digests and not self._owed_keys.isdisjoint(request.block_hashes))):
            self._pay_owed()
        return self._value

    @property
    def state(self) -> kf.KVState:
        """The current kvfunc state (a value: keep it, query it, replay onto it)."""
        return self._state

    def snapshot(self) -> kf.KVState:
        """The manager's state as a kvfunc value, to keep and :meth:`restore` later."""
        return self._state

    def restore(self, state: kf.KVState) -> None:
        """Make ``state`` (a :meth:`snapshot` of this manager's layout) the current state.

        The scheduler's own request bookkeeping is the caller's to restore.
        """
        if not isinstance(state, kf.KVState):
            raise kf.InvalidTypeError(f"restore takes a KVState, got {type(state).__name__}")
        mine = self._value
        if (state.manager_keys != mine.manager_keys or state.max_model_len != mine.max_model_len
                or [p.num_blocks for p in state.pools] != [p.num_blocks for p in mine.pools]
                or not state.prefix_caching):
            raise kf.InvalidArgumentError(
                "restore takes a snapshot of a manager with the same KV cache layout, got a "
                f"state of groups {state.manager_keys} and {state.max_model_len} tokens")
        self._value = state
        self._forget_owed()
        self._hashes.clear()

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the one pool (cached blocks waiting in the queue included; caching
        owed changes none; blocks promised to owed takes count as taken)."""
        return self._value.pools[0].num_free - self._takes + self._freed

    @property
    def usage(self) -> float:
        """The share of the pool in use, between 0.0 and 1.0 (vLLM's ``usage``)."""
        total = self._layout.num_blocks - 1
        return 1.0 - self.num_free_blocks / total if total else 0.0

    @property
    def _records(self) -> bool:
        """Whether transitions build their deltas: something reads them (KV events, a
        metrics collector, zeroing, a journal).  Nothing else does, so without them a
        transition builds none (``record=False``) and :meth:`_commit` takes None."""
        return (self.enable_kv_cache_events or self.metrics_collector is not None
                or self._zeroing or self._journal is not None)

    def _commit(self, state: kf.KVState, delta: kf.BlocksChanged | None, call: str,
                request: Any, args: tuple[Any, ...] = (), *, zeroed: list[int] | None = None,
                ahead: bool = False) -> None:
        """Make ``state`` current and hand ``delta``'s news to vLLM (events, metrics, zeroing).

        ``zeroed`` lists the new block ids to zero when not every block the
        delta appended needs it; ``delta`` is None for a transition that built
        none (see :attr:`_records`).  With takes owed, only a transition that
        may come before them (``ahead``: :meth:`_ahead_of_takes`) is committed;
        any other is a caller that forgot to pay them (a typed error, nothing
        changed), as is a transition without its delta while one is read.
        """
        if self._owes_blocks and not ahead:
            raise kf.KVFuncError(f"{call} would change the state before the owed takes")
        if delta is None:
            if self._records:
                raise kf.KVFuncError(f"{call} built no delta, and its delta is read")
            self._value = state
            return
        old, self._value = self._value, state
        if delta.is_empty:
            return
        if self._journal is not None:
            self._journal(call, None if request is None else request.request_id, args, delta)
        if self.enable_kv_cache_events and (delta.stored_keys or delta.evicted_keys
                                            or delta.cleared_keys):
            self._events.extend(vllm_events(delta, request, self._group_index,
                                            self._layout.block_size,
                                            _caching_start(old, state, request)))
        if self.metrics_collector is not None:
            self._feed_metrics(delta)
        if self._zeroing:
            self._new_block_ids.extend(
                (b for b in delta.appended_block_ids if b) if zeroed is None else zeroed)

    def _feed_metrics(self, delta: kf.BlocksChanged) -> None:
        """vLLM's block residency metrics: blocks handed out, blocks a hit reused."""
        collector, blocks = self.metrics_collector, self._handles.blocks
        for op in delta.operations():
            if isinstance(op, kf.Appended) and op.block_id:
                (handle,) = blocks((op.block_id,))
                if self.enable_caching:  # vLLM's pool reports every hand-out as an eviction
                    collector.on_block_evicted(handle)
                collector.on_block_allocated(handle)
            elif isinstance(op, kf.Shared) and op.block_id:
                collector.on_block_accessed(blocks((op.block_id,))[0])

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether a local prefix-cache lookup may run for this request."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def block_hashes(self, request: Any) -> kf.BlockHashes:
        """``request.block_hashes`` as a :class:`~kvfunc.BlockHashes` (for kvfunc queries)."""
        return self._hashes.of(request)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> Any:
        """``KVCacheBlocks`` of these per-group blocks (the shared empty one when none)."""
        return self._blocks_type(blocks) if any(blocks) else self.empty_kv_cache_blocks


_new = tuple.__new__


def _caching_start(old: kf.KVState, new: kf.KVState, request: Any) -> Callable[[str, int], int]:
    """Where vLLM's caching of ``request`` stood in a group before stores from a position.

    vLLM counts the blocks it cached per request, null blocks of a window
    included; kvfunc's row keeps the same count (``stored``).  A store that
    begins after null entries begins, for vLLM, where the count stood.
    """

    def start(key: str, position: int) -> int:
        row = old.group(key).row(request.request_id)
        done = 0 if row is None else row.stored
        table = new.group(key).table(request.request_id)
        while position > done and not table[position - 1]:
            position -= 1
        return position

    return start
