"""The simulated scheduler with tiers below the device: host memory and a Mooncake Store.

:class:`TieredScheduler` runs :class:`~kvfunc.cli.Scheduler`'s steps on a
:class:`kvfunc.TieredState`: a step is one :func:`kvfunc.allocate_tiered`, a
free is :func:`kvfunc.free_tiered`, an admission looks up every tier
(:func:`kvfunc.lookup_tiers`) and loads what it finds below the device, and
every move a step started is reported done at the end of the step
(:func:`kvfunc.complete_moves`; see :mod:`kvfunc.cli._offload` for what the
copies cost).  :attr:`~kvfunc.cli.Scheduler.state` stays the device state;
:attr:`TieredScheduler.tiers` is the tiered state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvfunc.cli._offload import TierCounts, TierReport
from kvfunc.cli._prefix import PrefixCacher
from kvfunc.cli._scheduler import DeltaSink, Scheduler, SchedulerConfig
from kvfunc.cli._trace import TraceRequest
from kvfunc.core import (
    BatchResult,
    KVState,
    TieredHit,
    TieredResult,
    TieredState,
    allocate_tiered,
    complete_moves,
    free_tiered,
    lookup_tiers,
)

__all__ = ["TieredScheduler", "tier_report"]


class TieredScheduler(Scheduler):
    """A :class:`~kvfunc.cli.Scheduler` whose cache has tiers below the device.

    >>> from kvfunc.core import FullAttention
    >>> dev = KVState.create({"f": FullAttention(num_blocks=40, block_size=16)}, 4096,
    ...                      enable_prefix_caching=True)
    >>> reqs = [TraceRequest(0.0, 400, 2, (1,)), TraceRequest(0.0, 600, 2, (2, 3)),
    ...         TraceRequest(9.0, 400, 2, (1,))]
    >>> s = TieredScheduler(dev, reqs, SchedulerConfig(max_batched_tokens=512),
    ...                     prefix=PrefixCacher(reqs, 16),
    ...                     tiers=TieredState.create(dev, host_blocks=64))
    >>> while s.step():
    ...     pass
    >>> s.tier_counts.hit_tokens
    {'device': 16, 'host': 368, 'remote': 0}
    """

    def __init__(self, state: KVState, requests: Sequence[TraceRequest],
                 config: SchedulerConfig, *, prefix: PrefixCacher, tiers: TieredState,
                 on_delta: DeltaSink | None = None) -> None:
        super().__init__(state, requests, config, on_delta=on_delta, prefix=prefix)
        if tiers.device is not state:
            raise ValueError("the tiers must wrap the scheduler's state")
        #: The tiered state (its device is :attr:`state`).
        self.tiers = tiers
        self._tiered: TieredResult | None = None  # the last tiered allocation
        #: What the tiers did (hits by tier, loads, stores).
        self.tier_counts = TierCounts()

    def _allocate(self, state: KVState, batch: list[tuple[Any, ...]]) -> Any:
        assert self.tiers.device is state and self.prefix is not None
        t0 = time.perf_counter()
        self._tiered = tiered = allocate_tiered(self.tiers, batch,
                                                block_hashes=self.prefix.live,
                                                cache_loaded=True)  # copies take no time
        self._spent += time.perf_counter() - t0
        return BatchResult(tiered.state.device, tiered.delta.device, tiered.refused)

    def _free(self, state: KVState, rid: int) -> KVState:
        assert self.tiers.device is state and self.prefix is not None
        hashes = None if self._as_filled else self.prefix.hashes(rid, self.computed[rid])
        t0 = time.perf_counter()
        self.tiers, tiered = free_tiered(self.tiers, rid, block_hashes=hashes)
        self._spent += time.perf_counter() - t0
        self.tier_counts.moved(tiered.moved_directions)
        self._emit(tiered.device)
        return self.tiers.device

    def _lookup(self, state: KVState, rid: int, target: int) -> Any:
        assert self.prefix is not None
        return lookup_tiers(self.tiers, self.prefix.hashes(rid, target),
                            max_tokens=target - 1)

    def _stepped(self) -> None:
        """Adopt the step's tiered state and report every move it started done."""
        tiered = self._tiered
        assert tiered is not None and tiered.state.device is self.state
        self.tier_counts.moved(tiered.delta.moved_directions)
        t0 = time.perf_counter()
        done = complete_moves(tiered.state, done=tuple(tiered.state.moves))
        self.tier_counts.moved(done.delta.moved_directions)
        if done.state.moves:  # write-through: the remote stores of the host stores just done
            done = complete_moves(done.state, done=tuple(done.state.moves))
        self._spent += time.perf_counter() - t0
        self.tiers = done.state

    def _admitted(self, entry: tuple[Any, ...], *, again: bool) -> None:
        hit = entry[7]
        assert type(hit) is TieredHit
        counts, bs = self.tier_counts, self.tiers.block_size
        if hit.sources:
            counts.loading_admissions += 1
            counts.loaded_blocks["host"] += hit.host_blocks
            counts.loaded_blocks["remote"] += hit.remote_blocks
        if not again:
            counts.hit_tokens["device"] += hit.device.num_tokens
            positions = hit.position_sources  # a position of several groups: its slowest
            counts.hit_tokens["host"] += positions.count("host") * bs
            counts.hit_tokens["remote"] += positions.count("remote") * bs


def tier_report(sched: TieredScheduler, *, block_bytes: int, host_gbps: float,
                remote_gbps: float, prefill_tokens_per_s: float) -> TierReport:
    """What the tiers of a finished run did, with the bandwidths of the time model."""
    tiers, counts = sched.tiers, sched.tier_counts
    return TierReport(
        0 if tiers.host is None else tiers.host.num_blocks,
        None if tiers.remote is None else tiers.remote.capacity, tiers.remote is not None,
        block_bytes, tiers.block_size, tiers.write_policy, host_gbps, remote_gbps,
        prefill_tokens_per_s, dict(counts.hit_tokens), dict(counts.loaded_blocks),
        dict(counts.stored_blocks), counts.loading_admissions)

