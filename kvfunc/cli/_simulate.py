"""Simulation: size a model's cache for a budget, then run a trace through the scheduler.

:func:`run_simulation` is what ``kvfunc simulate`` runs; a notebook can call
it directly and plot :attr:`SimulationResult.usage` itself.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import IO, Any

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._log import DeltaLogWriter
from kvfunc.cli._plan import Budget, PlanConfig, size_blocks
from kvfunc.cli._presets import ModelPreset
from kvfunc.cli._scheduler import Scheduler, SchedulerConfig
from kvfunc.cli._trace import Trace
from kvfunc.core import KVState

__all__ = ["GroupUsage", "SimulationConfig", "SimulationResult", "run_simulation"]

Progress = Callable[[int, int], None]


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
    """

    model: ModelPreset
    trace: Trace
    budget: Budget
    concurrency: int = 64
    max_batched_tokens: int = 2048
    max_model_len: int | None = None
    step_ms: float = 20.0
    speedup: float = 1.0

    def __attrs_post_init__(self) -> None:
        checks = (("--concurrency", self.concurrency), ("--max-batched-tokens",
                                                         self.max_batched_tokens))
        for name, value in checks:
            if type(value) is not int or value <= 0:
                raise CLIError(f"{name} must be a positive integer, got {value!r}")
        if self.max_batched_tokens < 1 + self.model.next_n:
            msg = (f"--max-batched-tokens ({self.max_batched_tokens}) must leave room for one "
                   f"decode step of {1 + self.model.next_n} tokens")
            raise CLIError(msg)
        if self.max_model_len is not None and (
                type(self.max_model_len) is not int or self.max_model_len <= 0):
            raise CLIError(f"--max-model-len must be a positive integer, got "
                           f"{self.max_model_len!r}")
        for name, number in (("--step-ms", self.step_ms), ("--speedup", self.speedup)):
            if not number > 0:
                raise CLIError(f"{name} must be a positive number, got {number!r}")

    @property
    def model_len(self) -> int:
        """``max_model_len``, or the model's context length."""
        return self.max_model_len or self.model.max_model_len


@attrs.frozen
class GroupUsage:
    """Block usage of one manager key over the run (the null block excluded)."""

    manager_key: str
    attn_type: str
    num_blocks: int
    peak_blocks: int
    mean_blocks: float

    @property
    def peak_fraction(self) -> float:
        """Peak usage as a share of the usable blocks."""
        return self.peak_blocks / max(1, self.num_blocks - 1)

    @property
    def mean_fraction(self) -> float:
        """Mean usage over steps as a share of the usable blocks."""
        return self.mean_blocks / max(1, self.num_blocks - 1)


@attrs.frozen(eq=False)
class SimulationResult:
    """What a run did; :meth:`to_json` is the ``--json`` summary."""

    config: SimulationConfig
    num_blocks: dict[str, int]
    groups: tuple[GroupUsage, ...]
    counters: dict[str, int]
    steps: int
    simulated_s: float
    wall_s: float
    alloc_us: dict[str, float]
    times: tuple[float, ...]
    usage: tuple[tuple[int, ...], ...]
    final_state: KVState

    def to_json(self) -> dict[str, Any]:
        """Plain data: settings, counters, per-group usage and allocator timings."""
        cfg = self.config
        groups = [{**attrs.asdict(g), "peak_fraction": round(g.peak_fraction, 4),
                   "mean_fraction": round(g.mean_fraction, 4),
                   "mean_blocks": round(g.mean_blocks, 2)} for g in self.groups]
        return {
            "model": cfg.model.name, "trace": cfg.trace.description,
            "memory_bytes": cfg.budget.memory_bytes, "mem_fraction": cfg.budget.mem_fraction,
            "used_bytes": cfg.budget.used_bytes, "concurrency": cfg.concurrency,
            "max_batched_tokens": cfg.max_batched_tokens, "max_model_len": cfg.model_len,
            "mtp_depth": cfg.model.next_n, "step_ms": cfg.step_ms, "speedup": cfg.speedup,
            "prefix_caching": False,
            "num_blocks": self.num_blocks, **self.counters, "steps": self.steps,
            "simulated_s": round(self.simulated_s, 3), "wall_s": round(self.wall_s, 3),
            "allocator_us_per_step": {k: round(v, 2) for k, v in self.alloc_us.items()},
            "groups": groups,
        }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def build_state(config: SimulationConfig) -> KVState:
    """The empty cache state the budget gives ``config.model``.

    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> cfg = SimulationConfig(build_preset("llama-3-8b"), synthetic_trace(1), Budget(2**33))
    >>> build_state(cfg)
    KVState(max_model_len=8192, groups=('FullAttention',), usage='FullAttention:1/3686')
    """
    plan = PlanConfig(config.budget, concurrency=config.concurrency,
                      max_prefill_tokens=config.max_batched_tokens, max_len=config.model_len)
    blocks = size_blocks(config.model, plan)
    return KVState.from_cache_info(config.model.cache_info, blocks, config.model_len)


def run_simulation(config: SimulationConfig, *, record: IO[str] | None = None,
                   on_progress: Progress | None = None) -> SimulationResult:
    """Run ``config.trace`` through the scheduler on a freshly sized cache.

    Args:
        config: model, trace, budget and engine settings.
        record: a text stream to write the delta log to (see :mod:`kvfunc.cli._log`).
        on_progress: called now and then with ``(requests done, requests in all)``.

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
    sched = Scheduler(state, config.trace.requests, SchedulerConfig(
        max_num_seqs=config.concurrency, max_batched_tokens=config.max_batched_tokens,
        next_n=config.model.next_n, step_s=config.step_ms / 1000, speedup=config.speedup),
        on_delta=writer.write if writer is not None else None)
    total = len(config.trace.requests)
    start = time.perf_counter()
    while sched.step():
        if on_progress is not None and sched.steps % 256 == 0:
            on_progress(sched.done, total)
    wall = time.perf_counter() - start
    if writer is not None:
        writer.close(sched.state)
    if on_progress is not None:
        on_progress(sched.done, total)
    groups = tuple(
        GroupUsage(g.key, g.policy.attn_type, g.policy.num_blocks, max(used, default=0),
                   statistics.fmean(used) if used else 0.0)
        for g, used in zip(state.groups, sched.usage, strict=True))
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
        config, {g.key: g.policy.num_blocks for g in state.groups}, groups, counters,
        sched.steps, sched.clock, wall, alloc_us, tuple(sched.times),
        tuple(tuple(u) for u in sched.usage), sched.state)
