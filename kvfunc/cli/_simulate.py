"""Simulation: size a model's cache for a budget, then run a trace through the scheduler.

:func:`run_simulation` is what ``kvfunc simulate`` runs; a notebook can call
it directly and plot :attr:`SimulationResult.usage` and
:attr:`SimulationResult.series` itself.  On a trace that names its prompt
blocks (the Mooncake traces) the run caches prefixes unless told not to, and
:attr:`SimulationResult.prefix` says what that saved next to what an
infinite cache could (:func:`kvfunc.cli._mooncake.upper_bound`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import check_state_size, show
from kvfunc.cli._layout import PoolUsage, check_layout, default_layout, group_rows, pool_usage
from kvfunc.cli._log import DeltaLogWriter
from kvfunc.cli._mooncake import UpperBound, hit_rate, upper_bound
from kvfunc.cli._offload import OffloadConfig, TierReport, block_bytes, tiered_state
from kvfunc.cli._plan import (
    MAX_CONCURRENCY,
    Budget,
    PlanConfig,
    size_blocks,
    size_shared_blocks,
)
from kvfunc.cli._prefix import PrefixCacher, hash_block_size
from kvfunc.cli._presets import MAX_MODEL_LEN, ModelPreset
from kvfunc.cli._scheduler import CACHE_OUTPUTS, Scheduler, SchedulerConfig
from kvfunc.cli._tier_scheduler import TieredScheduler, tier_report
from kvfunc.cli._trace import Trace
from kvfunc.core import BlocksChanged, KVState

__all__ = ["PrefixReport", "SimulationConfig", "SimulationResult", "build_state",
           "run_simulation"]

Progress = Callable[[int, int], None]
#: Block hashes in the simulator: the traces are the only tenant, so the fast
#: non-cryptographic digest is safe here (``sha256`` without the xxhash package).
PREFIX_HASH_FN = "xxh3_128" if importlib.util.find_spec("xxhash") else "sha256"


@attrs.frozen
class SimulationConfig:
    """Everything one simulation depends on.

    Attributes:
        model: the model whose caches are simulated.
        trace: the requests.
        budget: device memory (sized as by ``kvfunc plan``).
        concurrency: the most requests running at once; sizes the fixed groups too.
        max_batched_tokens: tokens one step may schedule; also the sizing's
            ``max_prefill_tokens`` (prefills are chunked to it).
        max_model_len: the longest request; ``None`` takes the model's.
        step_ms: simulated milliseconds per step.
        speedup: arrival times are divided by this.
        prefix_caching: cache prompt prefixes when the trace names its
            prompt blocks (a Mooncake trace); ``False`` prefills every prompt
            in full, for comparison.
        layout: ``"shared"`` (one pool for every group, vLLM's hybrid layout)
            or ``"per-type"`` (a pool per group, the seed's); by default
            ``"shared"`` for a model with more than one group, else
            ``"per-type"`` (see :mod:`kvfunc.cli._layout`).
        cache_outputs: when output blocks are cached, ``"as-filled"`` or
            ``"at-release"`` (:attr:`~kvfunc.cli.SchedulerConfig.cache_outputs`).
        offload: tiers behind the device cache (host memory, a Mooncake Store;
            none by default, see :mod:`kvfunc.cli._offload`).
    """

    model: ModelPreset
    trace: Trace
    budget: Budget
    concurrency: int = 64
    max_batched_tokens: int = 2048
    max_model_len: int | None = None
    step_ms: float = 20.0
    speedup: float = 1.0
    prefix_caching: bool = True
    layout: str = attrs.field(
        default=attrs.Factory(lambda self: default_layout(self.model), takes_self=True))
    cache_outputs: str = "as-filled"
    offload: OffloadConfig = attrs.field(factory=OffloadConfig)

    def __attrs_post_init__(self) -> None:
        checks = (("--concurrency", self.concurrency, MAX_CONCURRENCY),
                  ("--max-batched-tokens", self.max_batched_tokens, MAX_MODEL_LEN))
        for name, value, most in checks:
            if type(value) is not int or not 0 < value <= most:
                raise CLIError(f"{name} must be an integer from 1 to {most:,}, got "
                               f"{show(value)}")
        if self.max_batched_tokens < 1 + self.model.next_n:
            msg = (f"--max-batched-tokens ({self.max_batched_tokens}) must leave room for one "
                   f"decode step of {1 + self.model.next_n} tokens")
            raise CLIError(msg)
        if self.max_model_len is not None and (
                type(self.max_model_len) is not int or self.max_model_len <= 0):
            raise CLIError(f"--max-model-len must be a positive integer, got "
                           f"{self.max_model_len!r}")
        if self.max_model_len is not None and self.max_model_len > MAX_MODEL_LEN:
            raise CLIError(f"--max-model-len must be at most {MAX_MODEL_LEN:,}, got "
                           f"{self.max_model_len:,}")
        for name, number in (("--step-ms", self.step_ms), ("--speedup", self.speedup)):
            if not (isinstance(number, int | float) and 1e-6 <= number <= 1e6):
                raise CLIError(f"{name} must be a number from 1e-06 to 1e+06, got {number!r}")
        if type(self.prefix_caching) is not bool:
            raise CLIError(f"prefix_caching must be a bool, got {self.prefix_caching!r}")
        check_layout(self.layout)
        if self.cache_outputs not in CACHE_OUTPUTS:
            raise CLIError(f"--cache-outputs must be one of {', '.join(CACHE_OUTPUTS)}, got "
                           f"{show(self.cache_outputs)}")
        if self.offload.enabled and not self.caches_prefixes:
            raise CLIError("--host-memory and --remote need prefix caching on a trace that "
                           "names its prompt blocks (a Mooncake trace)")

    @property
    def caches_prefixes(self) -> bool:
        """Whether the run caches prefixes: asked to, on a trace that names its blocks."""
        return self.prefix_caching and self.trace.has_hash_ids

    @property
    def model_len(self) -> int:
        """``max_model_len``, or the model's context length."""
        return self.max_model_len or self.model.max_model_len


@attrs.frozen
class PrefixReport:
    """Prefix caching on a trace that names its prompt blocks, and the trace's upper bound.

    Attributes:
        enabled: whether the run cached prefixes (``--no-prefix-caching`` turns it off).
        prompt_tokens: prompt tokens of the requests admitted (each counted once).
        hit_tokens: of those, tokens found cached when the request was first admitted.
        recompute_hit_tokens: tokens found cached when a preempted request came back.
        stored_blocks: blocks the cache stored, summed over groups.
        evicted_blocks: cached blocks handed out again, summed over groups.
        hash_block_size: tokens per hashed block (the gcd of the groups' block sizes).
        bound: what an infinite cache could hit on the requests the run admitted
            (all of the trace's unless some were rejected as too large).
    """

    enabled: bool
    prompt_tokens: int
    hit_tokens: int
    recompute_hit_tokens: int
    stored_blocks: int
    evicted_blocks: int
    hash_block_size: int
    bound: UpperBound

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens."""
        return hit_rate(self.hit_tokens, self.prompt_tokens)

    def to_json(self) -> dict[str, Any]:
        """The ``"prefix_cache"`` object of ``--json``."""
        return {"enabled": self.enabled, "prompt_tokens": self.prompt_tokens,
                "hit_tokens": self.hit_tokens, "hit_rate": round(self.hit_rate, 4),
                "recompute_hit_tokens": self.recompute_hit_tokens,
                "stored_blocks": self.stored_blocks, "evicted_blocks": self.evicted_blocks,
                "hash_block_size": self.hash_block_size, "upper_bound": self.bound.to_json()}


@attrs.frozen(eq=False)
class SimulationResult:
    """What a run did; :meth:`to_json` is the ``--json`` summary.

    ``pools`` is each pool's usage over the run (:class:`PoolUsage`: with
    ``--layout per-type`` a pool per group, with ``shared`` one for all).
    ``times`` holds the simulated time at the end of each step; ``usage`` the
    blocks each pool held then (the null block excluded); ``series`` the
    scheduler's per-step series (waiting and running requests, running totals
    of preemptions, refused allocations, prompt tokens and hit tokens).
    ``prefix`` is ``None`` on a trace that does not name its prompt blocks.
    """

    config: SimulationConfig
    num_blocks: dict[str, int]
    pools: tuple[PoolUsage, ...]
    counters: dict[str, int]
    steps: int
    simulated_s: float
    wall_s: float
    alloc_us: dict[str, float]
    times: tuple[float, ...]
    usage: tuple[tuple[int, ...], ...]
    final_state: KVState
    series: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    prefix: PrefixReport | None = None
    tiers: TierReport | None = None

    def to_json(self) -> dict[str, Any]:
        """Plain data: settings, counters, usage per pool, the groups, allocator timings."""
        cfg = self.config
        return {
            "model": cfg.model.name, "trace": cfg.trace.description,
            "memory_bytes": cfg.budget.memory_bytes, "mem_fraction": cfg.budget.mem_fraction,
            "used_bytes": cfg.budget.used_bytes, "concurrency": cfg.concurrency,
            "max_batched_tokens": cfg.max_batched_tokens, "max_model_len": cfg.model_len,
            "mtp_depth": cfg.model.next_n, "step_ms": cfg.step_ms, "speedup": cfg.speedup,
            "prefix_caching": cfg.caches_prefixes, "layout": cfg.layout,
            "prefix_cache": None if self.prefix is None else self.prefix.to_json(),
            "tiers": None if self.tiers is None else self.tiers.to_json(),
            "num_blocks": self.num_blocks, **self.counters, "steps": self.steps,
            "simulated_s": round(self.simulated_s, 3), "wall_s": round(self.wall_s, 3),
            "allocator_us_per_step": {k: round(v, 2) for k, v in self.alloc_us.items()},
            "pools": [u.to_json() for u in self.pools], "groups": group_rows(self.final_state),
        }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def build_state(config: SimulationConfig) -> KVState:
    """The empty cache state the budget gives ``config.model`` in ``config.layout``.

    ``per-type`` sizes a pool per group (:func:`~kvfunc.cli._plan.size_blocks`),
    ``shared`` one pool for every group
    (:func:`~kvfunc.cli._plan.size_shared_blocks`).

    Raises:
        CLIError: the budget cannot hold the caches, or the state would be too large.

    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> cfg = SimulationConfig(build_preset("llama-3-8b"), synthetic_trace(1), Budget(2**33))
    >>> build_state(cfg)
    KVState(max_model_len=8192, groups=('FullAttention',), usage='FullAttention:1/3686')
    >>> hybrid = SimulationConfig(build_preset("gpt-oss-120b"), synthetic_trace(1),
    ...                           Budget(2**33))
    >>> [(p.name, p.members, p.num_blocks) for p in build_state(hybrid).pools]
    [('shared', ('SlidingWindow', 'FullAttention'), 13107)]
    """
    plan = PlanConfig(config.budget, concurrency=config.concurrency,
                      max_prefill_tokens=config.max_batched_tokens, max_len=config.model_len)
    fix = "lower --memory or --concurrency, or raise --block-size"
    if config.layout == "shared":
        size = size_shared_blocks(config.model, plan)
        check_state_size({"shared": size}, fix=fix)
        keys = {c.group_key for _, c in config.model.cache_info.iter_caches() if c.needs_block}
        blocks = dict.fromkeys(keys, size)
    else:
        blocks = size_blocks(config.model, plan)
        check_state_size(blocks, fix=fix)
    return KVState.from_cache_info(config.model.cache_info, blocks, config.model_len,
                                   enable_prefix_caching=config.caches_prefixes,
                                   layout=config.layout)


@contextlib.contextmanager
def _cycle_collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector, and restore it as it was.

    A state's per-block vectors are containers of ``num_blocks`` items that
    the collector traverses whole on every young-generation pass, and each
    transition makes new ones: at 1.73 million blocks, 2,000 Mooncake requests
    took 102 s with the collector on and 4.7 s with it paused.  The scheduler's
    loop makes no reference cycles (the run's peak memory is the same either
    way), so nothing is left for the collector to find.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run_simulation(config: SimulationConfig, *, record: IO[str] | None = None,
                   on_progress: Progress | None = None,
                   on_delta: Callable[[int, BlocksChanged], None] | None = None
                   ) -> SimulationResult:
    """Run ``config.trace`` through the scheduler on a freshly sized cache.

    Args:
        config: model, trace, budget and engine settings.
        record: a text stream to write the delta log to (see :mod:`kvfunc.cli._log`).
        on_progress: called now and then with ``(requests done, requests in all)``.
        on_delta: called with ``(step, delta)`` for every non-empty delta, after
            the log (if any) has it: KV events, a mirror of the cache.

    Raises:
        CLIError: the budget cannot hold the model's caches.

    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._trace import load_trace
    >>> cfg = SimulationConfig(build_preset("llama-3-8b"), load_trace("conv", limit=20),
    ...                        Budget(2**33))
    >>> result = run_simulation(cfg)
    >>> result.counters["served"], result.counters["rejected"]
    (20, 0)
    """
    state = build_state(config)
    writer = None
    if record is not None:
        meta = {"model": config.model.name, "trace": config.trace.description}
        writer = DeltaLogWriter(record, state, meta=meta)
    requests = config.trace.requests
    prefix = (PrefixCacher(requests, hash_block_size(state), hash_fn=PREFIX_HASH_FN)
              if config.caches_prefixes else None)
    tiers = (tiered_state(state, config.offload, block_bytes(config.model, config.layout))
             if config.offload.enabled else None)
    sched_config = SchedulerConfig(
        max_num_seqs=config.concurrency, max_batched_tokens=config.max_batched_tokens,
        next_n=config.model.next_n, step_s=config.step_ms / 1000, speedup=config.speedup,
        cache_outputs=config.cache_outputs)
    sink = _both(writer.write if writer is not None else None, on_delta)
    sched = (Scheduler(state, requests, sched_config, on_delta=sink, prefix=prefix)
             if tiers is None or prefix is None else
             TieredScheduler(state, requests, sched_config, on_delta=sink, prefix=prefix,
                             tiers=tiers))
    total = len(config.trace.requests)
    start = time.perf_counter()
    with _cycle_collector_paused():
        while sched.step():
            if on_progress is not None and sched.steps % 256 == 0:
                on_progress(sched.done, total)
    wall = time.perf_counter() - start
    if writer is not None:
        writer.close(sched.state)
    if on_progress is not None:
        on_progress(sched.done, total)
    spent = sorted(sched.alloc_s)
    alloc_us = {"mean": statistics.fmean(spent) * 1e6 if spent else 0.0,
                "p50": _percentile(spent, 0.5) * 1e6, "p99": _percentile(spent, 0.99) * 1e6,
                "max": (spent[-1] if spent else 0.0) * 1e6, "total_ms": sum(spent) * 1e3}
    counters = {"requests": total, "served": sched.finished, "rejected": sched.rejected,
                "preemptions": sched.preemptions,
                "refused_allocations": sched.refused_allocations,
                "prefill_tokens": sched.prefill_tokens,
                "recomputed_tokens": sched.recomputed_tokens,
                "generated_tokens": sched.generated_tokens}
    return SimulationResult(
        config, {g.key: g.policy.num_blocks for g in state.groups},
        pool_usage(state, sched.usage), counters,
        sched.steps, sched.clock, wall, alloc_us, tuple(sched.times),
        tuple(tuple(u) for u in sched.usage), sched.state,
        {name: tuple(values) for name, values in sched.series.items()},
        _prefix_report(config, sched, hash_block_size(state)), _tier_report(config, sched))


def _tier_report(config: SimulationConfig, sched: Scheduler) -> TierReport | None:
    if not isinstance(sched, TieredScheduler):
        return None
    off = config.offload
    return tier_report(sched, block_bytes=block_bytes(config.model, config.layout),
                       host_gbps=off.host_gbps, remote_gbps=off.remote_gbps,
                       prefill_tokens_per_s=config.max_batched_tokens / (config.step_ms / 1000))


def _prefix_report(config: SimulationConfig, sched: Scheduler, block_size: int
                   ) -> PrefixReport | None:
    if not config.trace.has_hash_ids:
        return None
    p, stats = sched.prefix, sched.prefix_stats
    rejected = set(sched.rejected_ids)  # they never ran: nothing could hit their blocks
    bound = upper_bound(r for i, r in enumerate(config.trace.requests) if i not in rejected)
    return PrefixReport(
        p is not None, sched.prompt_tokens, 0 if p is None else p.hit_tokens,
        0 if p is None else p.recompute_hit_tokens, stats.stored_blocks, stats.evicted_blocks,
        block_size, bound)


def _both(first: Callable[[int, BlocksChanged], None] | None,
          then: Callable[[int, BlocksChanged], None] | None
          ) -> Callable[[int, BlocksChanged], None] | None:
    """One delta callback calling ``first`` then ``then`` (either may be None)."""
    if first is None or then is None:
        return first or then

    def both(step: int, delta: BlocksChanged) -> None:
        first(step, delta)
        then(step, delta)
    return both
