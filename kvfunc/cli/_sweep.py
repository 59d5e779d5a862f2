"""Hit rate against cache capacity: one simulation per cache size, in worker processes.

Theory of operation
-------------------
:func:`sweep_capacities` picks the cache sizes, in tokens of the paged
(full-attention) groups, spaced evenly on a log scale between

* *far too small*: the longest request of the trace, which must fit; and
* *nothing is evicted*: the tokens of every distinct prompt block of the
  trace, every generated token, and one longest request of room,

capped where the cache would pass the simulator's block bound
(:data:`~kvfunc.cli._inputs.MAX_STATE_BLOCKS`).  Each size becomes the
memory budget that gives it (:func:`memory_for_tokens`), so every point is an
ordinary ``kvfunc simulate`` run with another ``--memory``.  With
``--host-memory`` the sweep keeps ``--memory`` and sweeps the host memory
instead (:func:`host_sizes`): halvings of ``--host-memory`` up to it, each
point's capacity the device's tokens plus the host tier's.  Given several
layouts (``--layout both``), every memory runs in each: one curve per layout,
each point at the capacity its layout gives the paged groups
(:func:`capacity_tokens`).  The points run in
a pool of processes (``spawn``: each imports kvfunc afresh and nothing is
shared but the configuration), and each sends back a small
:class:`SweepPoint`, never the run's per-step series.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, NamedTuple

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import MAX_STATE_BLOCKS, show
from kvfunc.cli._layout import check_layout
from kvfunc.cli._mooncake import HASH_BLOCK_TOKENS, UpperBound, hit_rate, upper_bound
from kvfunc.cli._plan import PlanConfig, plan_model
from kvfunc.cli._simulate import SimulationConfig, run_simulation
from kvfunc.cli._units import MAX_BYTES
from kvfunc.core import KVState

__all__ = ["SweepPoint", "SweepResult", "capacity_tokens", "host_sizes", "memory_for_tokens",
           "run_sweep", "sweep_capacities"]

MAX_POINTS = 64


@attrs.frozen
class SweepPoint:
    """One cache size of a sweep, in one layout, and what its run did."""

    memory_bytes: int
    capacity_tokens: int
    num_blocks: dict[str, int]
    prompt_tokens: int
    hit_tokens: int
    stored_blocks: int
    evicted_blocks: int
    served: int
    rejected: int
    preemptions: int
    wall_s: float
    layout: str = "per-type"
    host_memory_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens."""
        return hit_rate(self.hit_tokens, self.prompt_tokens)

    def to_json(self) -> dict[str, Any]:
        """Plain data, one row of ``--json``'s ``points``."""
        return {**attrs.asdict(self), "hit_rate": round(self.hit_rate, 4),
                "wall_s": round(self.wall_s, 2)}


@attrs.frozen
class SweepResult:
    """A whole sweep: its base configuration, the points by capacity, and the trace's bound.

    ``capped`` says the largest point stopped at the simulator's block bound
    before reaching a cache that evicts nothing.  ``points`` are grouped by
    layout (in the order the sweep ran them), each group by capacity.
    """

    config: SimulationConfig
    points: tuple[SweepPoint, ...]
    bound: UpperBound
    capped: bool
    wall_s: float

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layouts swept, in the order of ``points``."""
        return tuple(dict.fromkeys(p.layout for p in self.points))

    def curve(self, layout: str) -> tuple[SweepPoint, ...]:
        """The points of one layout, by capacity."""
        return tuple(p for p in self.points if p.layout == layout)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json``: each point carries its ``layout``."""
        cfg = self.config
        return {"model": cfg.model.name, "trace": cfg.trace.description,
                "concurrency": cfg.concurrency, "max_batched_tokens": cfg.max_batched_tokens,
                "layouts": list(self.layouts), "upper_bound": self.bound.to_json(),
                "capped_by_block_bound": self.capped, "wall_s": round(self.wall_s, 2),
                "points": [p.to_json() for p in self.points]}


class _Costs(NamedTuple):
    """What a budget buys, per token of the paged groups and in the other groups.

    ``fixed_blocks`` counts the fixed groups' pools, null blocks included;
    ``fixed_need`` the usable blocks they take for ``--concurrency`` requests.
    """

    bytes_per_token: float
    fixed_bytes: int
    fixed_blocks: int
    fixed_need: int
    paged_block_sizes: tuple[int, ...]


def _costs(config: SimulationConfig) -> _Costs:
    # Bytes per block and the fixed groups do not depend on the memory: plan with plenty.
    budget = attrs.evolve(config.budget, memory_bytes=MAX_BYTES)
    report = plan_model(config.model, PlanConfig(
        budget, concurrency=config.concurrency,
        max_prefill_tokens=config.max_batched_tokens, max_len=config.model_len))
    paged = [g for g in report.groups if g.sizing == "paged"]
    if not paged:
        raise CLIError(f"{config.model.name} has no paged (full-attention) cache to sweep")
    fixed = [g for g in report.groups if g.sizing != "paged"]
    return _Costs(sum(g.block_bytes / g.block_size for g in paged), sum(g.bytes for g in fixed),
                  sum(g.num_blocks for g in fixed), sum(g.num_blocks - 1 for g in fixed),
                  tuple(g.block_size for g in paged))


def capacity_tokens(config: SimulationConfig, state: KVState) -> int:
    """Tokens the paged (full-attention) groups of ``state`` hold: a sweep point's x.

    With a pool per type, the smallest paged pool's tokens.  With a shared
    pool, the tokens of every paged group at once in what the pool keeps
    beyond the fixed groups' need for ``--concurrency`` requests (what a pool
    per type would give them), so both layouts of one memory sit side by side.

    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._simulate import build_state
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> cfg = SimulationConfig(build_preset("gpt-oss-120b"), synthetic_trace(1), Budget(2**34))
    >>> per_type = attrs.evolve(cfg, layout="per-type")
    >>> capacity_tokens(cfg, build_state(cfg)), capacity_tokens(per_type, build_state(per_type))
    (410192, 410176)
    """
    paged = [g.policy for g in state.groups if g.policy.attn_type == "FullAttention"]
    if state.layout != "shared":
        return min((p.num_blocks - 1) * p.block_size for p in paged)
    usable = state.pools[0].num_blocks - 1 - _costs(config).fixed_need
    return max(0, int(usable / sum(1 / p.block_size for p in paged)))


def memory_for_tokens(config: SimulationConfig, tokens: int) -> int:
    """The ``--memory`` that gives the paged groups about ``tokens`` token slots.

    It inverts the budget (``memory x mem_fraction - used - reserved``) with
    the model's bytes per token; the run reports the capacity it really got.

    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> cfg = SimulationConfig(build_preset("llama-3-8b"), synthetic_trace(1), Budget(2**33))
    >>> round(memory_for_tokens(cfg, 100_000) / 2**30, 2)  # 128 KiB a token, 90 % of it
    13.57
    """
    costs = _costs(config)
    b = config.budget
    slack = 2 * max(costs.paged_block_sizes)  # the null block, and rounding down
    cache = costs.fixed_bytes + costs.bytes_per_token * (tokens + slack)
    return math.ceil((cache + b.used_bytes + b.extra_reserved_bytes) / b.mem_fraction)


def sweep_capacities(config: SimulationConfig, points: int) -> tuple[list[int], bool]:
    """``points`` capacities in tokens, log-spaced (see the module docstring), and ``capped``.

    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._trace import load_trace
    >>> cfg = SimulationConfig(build_preset("deepseek-v3"),
    ...                        load_trace("mooncake-conversation", limit=100), Budget(2**36))
    >>> sweep_capacities(cfg, 3)
    ([121215, 448665, 1660691], False)
    """
    if type(points) is not int or not 2 <= points <= MAX_POINTS:
        raise CLIError(f"--capacity-sweep takes 2 to {MAX_POINTS} points, got {points!r}")
    requests = config.trace.requests
    extra = 2 * config.model.next_n  # a decode step with MTP writes past the request
    longest = max(min(r.prompt_tokens + r.output_tokens, config.model_len) for r in requests)
    distinct = len({h for r in requests for h in r.hash_ids})
    high = distinct * HASH_BLOCK_TOKENS + sum(r.output_tokens for r in requests) + longest
    low = max(longest + extra, config.max_batched_tokens)
    costs = _costs(config)
    sizes = costs.paged_block_sizes
    # the null block, and memory_for_tokens' slack of two blocks, in each paged group
    room = MAX_STATE_BLOCKS - costs.fixed_blocks - 4 * len(sizes)
    most = int(room / sum(1 / s for s in sizes))
    capped = high > most
    high = max(low, min(high, most))
    ratio = (high / low) ** (1 / (points - 1))
    return [round(low * ratio**i) for i in range(points)], capped


def host_sizes(config: SimulationConfig, points: int) -> list[int]:
    """Host memory sizes of a host-memory sweep: halvings of ``--host-memory``, up to it.

    >>> from kvfunc.cli._offload import OffloadConfig
    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._trace import load_trace
    >>> cfg = SimulationConfig(build_preset("deepseek-v3"),
    ...                        load_trace("mooncake-conversation", limit=10), Budget(2**36),
    ...                        offload=OffloadConfig(2**38))
    >>> [s >> 30 for s in host_sizes(cfg, 4)]
    [32, 64, 128, 256]
    """
    if type(points) is not int or not 2 <= points <= MAX_POINTS:
        raise CLIError(f"--capacity-sweep takes 2 to {MAX_POINTS} points, got {points!r}")
    top = config.offload.host_bytes
    return [top >> (points - 1 - i) for i in range(points)]


def _run_point(config: SimulationConfig) -> SweepPoint:
    """One point, in a worker process."""
    result = run_simulation(config)
    prefix, c = result.prefix, result.counters
    assert prefix is not None  # the sweep runs only on traces with hash ids
    capacity = capacity_tokens(config, result.final_state)
    if result.tiers is not None:
        capacity += result.tiers.host_blocks * result.tiers.block_size
    return SweepPoint(config.budget.memory_bytes, capacity, result.num_blocks,
                      prefix.prompt_tokens, prefix.hit_tokens, prefix.stored_blocks,
                      prefix.evicted_blocks, c["served"], c["rejected"], c["preemptions"],
                      result.wall_s, config.layout, config.offload.host_bytes)


def run_sweep(config: SimulationConfig, *, points: int = 8, jobs: int | None = None,
              layouts: Sequence[str] | None = None,
              on_point: Callable[[int, int], None] | None = None) -> SweepResult:
    """Simulate ``config`` at ``points`` cache sizes in ``jobs`` processes (default: CPUs).

    Args:
        config: the run to repeat; its ``budget`` gives ``mem_fraction``,
            ``used_bytes`` and ``extra_reserved_bytes``; each point sets its own
            ``memory_bytes`` (``--memory`` is not used), unless the config
            has a host tier: then every point keeps ``--memory`` and sets its
            own host memory (:func:`host_sizes`).
        points: how many cache sizes.
        jobs: worker processes (at most ``points`` times the layouts).
        layouts: run every size in each of these layouts (one curve each);
            default ``config.layout`` alone.  Both layouts run the same memory
            sizes.
        on_point: called with ``(points done, points in all)`` as they finish.

    Raises:
        CLIError: a trace without hash ids, caching turned off, bad counts or layouts.

    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._trace import load_trace
    >>> cfg = SimulationConfig(build_preset("deepseek-v3"),
    ...                        load_trace("mooncake-conversation", limit=30), Budget(2**36))
    >>> sweep = run_sweep(cfg, points=2, jobs=1)
    >>> [p.evicted_blocks > 0 for p in sweep.points], sweep.points[-1].hit_rate
    ([True, False], 0.0...)
    """
    if not (config.trace.has_hash_ids and config.prefix_caching):
        raise CLIError("--capacity-sweep needs prefix caching on a trace that names its prompt "
                       "blocks (mooncake-conversation, mooncake-synthetic or a .jsonl file)")
    if jobs is not None and (type(jobs) is not int or jobs <= 0):
        raise CLIError(f"--jobs must be a positive integer, got {jobs!r}")
    layouts = tuple(check_layout(x) for x in (layouts or (config.layout,)))
    if not layouts or len(set(layouts)) != len(layouts):
        raise CLIError(f"layouts must name each layout once, got {show(layouts)}")
    if config.offload.host_bytes:
        if len(layouts) > 1:
            raise CLIError("a host-memory sweep runs one layout; name it, or leave --layout out")
        capped = False
        configs = [attrs.evolve(config, offload=attrs.evolve(config.offload, host_bytes=h))
                   for h in host_sizes(config, points)]
    else:
        sizes, capped = sweep_capacities(config, points)
        memory = [memory_for_tokens(config, tokens) for tokens in sizes]
        configs = [attrs.evolve(config, layout=layout, budget=attrs.evolve(
            config.budget, memory_bytes=m)) for layout in layouts for m in memory]
    workers = min(len(configs), jobs or os.cpu_count() or 1)
    done: list[SweepPoint] = []
    start = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_run_point, c) for c in configs]
        for future in as_completed(futures):
            done.append(future.result())
            if on_point is not None:
                on_point(len(done), len(futures))
    ordered = tuple(sorted(done, key=lambda p: (layouts.index(p.layout), p.capacity_tokens)))
    return SweepResult(config, ordered, upper_bound(config.trace.requests), capped,
                       time.perf_counter() - start)
