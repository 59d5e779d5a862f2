"""A disaggregated run's result, gathered from its instances, and its report as rich text."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvfunc.cli._disagg import (
    DisaggResult,
    LatencyReport,
    Quantiles,
    SideReport,
    TransferReport,
)
from kvfunc.cli._layout import pool_usage
from kvfunc.cli._mooncake import upper_bound
from kvfunc.cli._prefix import hash_block_size
from kvfunc.cli._scheduler import Scheduler
from kvfunc.cli._simulate import PrefixReport
from kvfunc.cli._units import format_bytes

if TYPE_CHECKING:
    from kvfunc.cli._disagg_run import _Run

__all__ = ["build_result", "render_disaggregated"]


def _side(role: str, instances: Sequence[Scheduler], prefix: PrefixReport | None
          ) -> SideReport:
    counters = {name: sum(getattr(i, name) for i in instances)
                for name in ("preemptions", "refused_allocations", "prefill_tokens",
                             "recomputed_tokens", "generated_tokens", "steps")}
    spent = sum(sum(i.alloc_s) for i in instances)
    return SideReport(role, tuple(pool_usage(i.state, i.usage) for i in instances), counters,
                      spent, prefix)


def _prefix_report(run: _Run) -> PrefixReport | None:
    trace = run.config.base.trace
    if not trace.has_hash_ids:
        return None
    rejected = set(run.rejected_ids)
    bound = upper_bound(r for i, r in enumerate(trace.requests) if i not in rejected)
    p = run.prefix
    return PrefixReport(
        p is not None, sum(i.prompt_tokens for i in run.prefill),
        0 if p is None else p.hit_tokens, 0 if p is None else p.recompute_hit_tokens,
        sum(i.prefix_stats.stored_blocks for i in run.prefill),
        sum(i.prefix_stats.evicted_blocks for i in run.prefill),
        hash_block_size(run.prefill[0].state), bound)


def build_result(run: _Run, wall_s: float) -> DisaggResult:
    """The :class:`DisaggResult` of a finished run."""
    simulated = max(run.clock, *(i.clock for i in (*run.prefill, *run.decode)))
    ledger, parts, waits = run.ledger, run.parts, run.waits
    step = run.config.base.step_ms / 1000
    span = simulated or 1.0
    transfers = TransferReport(
        ledger.done, ledger.bytes_moved, Quantiles.of(waits["room"]),
        Quantiles.of(waits["link"]), Quantiles.of(waits["transfer"]),
        sum(1 for w in waits["room"] if w > step), sum(1 for w in waits["link"] if w > 0),
        tuple(b / span for b in ledger.send_busy), tuple(b / span for b in ledger.recv_busy),
        ledger.peak_held_bytes, ledger.peak_keys)
    gaps: Counter[float] = Counter()
    for inst in run.decode:
        gaps.update(inst.gaps)
    latency = LatencyReport(Quantiles.of(run.ttft), Quantiles.weighted(gaps),
                            {k: statistics.fmean(v) if v else 0.0 for k, v in parts.items()})
    counters = {"requests": len(run.arrival), "served": run.served,
                "rejected": len(run.rejected_ids),
                "finished_on_prefill": run.finished_on_prefill}
    usage = tuple((role, inst.index, tuple(inst.times), tuple(tuple(u) for u in inst.usage))
                  for role, side in (("prefill", run.prefill), ("decode", run.decode))
                  for inst in side)
    series: dict[str, Sequence[float]] = {"time": run.times, **run.series}
    return DisaggResult(run.config, counters, _side("prefill", run.prefill, _prefix_report(run)),
                        _side("decode", run.decode, None), transfers, latency, simulated,
                        wall_s, series, usage)


def _ms(q: Quantiles) -> str:
    return f"p50 {q.p50 * 1000:,.1f} ms, p99 {q.p99 * 1000:,.1f} ms"


def _usage_table(result: DisaggResult) -> Table:
    table = Table(show_edge=False)
    for header in ("instance", "pool", "usable\nblocks", "peak\nused", "peak",
                   "mean\nused", "mean"):
        table.add_column(header, justify="left" if header in ("instance", "pool")
                         else "right")
    for side in (result.prefill, result.decode):
        for index, pools in enumerate(side.instances):
            for u in pools:
                table.add_row(f"{side.role} {index}", u.label, f"{u.num_blocks - 1:,}",
                              f"{u.peak_blocks:,}", f"{u.peak_fraction:.1%}",
                              f"{u.mean_blocks:,.0f}", f"{u.mean_fraction:.1%}")
    return table


def render_disaggregated(result: DisaggResult, console: Console,
                         plot_path: str | None = None) -> None:
    """Print a disaggregated run: both sides, the transfers, the latencies.

    >>> import io
    >>> from kvfunc.cli._disagg import DisaggConfig
    >>> from kvfunc.cli._disagg_run import run_disaggregated
    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._simulate import SimulationConfig
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> base = SimulationConfig(build_preset("llama-3-8b"), synthetic_trace(5), Budget(2**33))
    >>> out = Console(file=io.StringIO(), width=120)
    >>> render_disaggregated(run_disaggregated(DisaggConfig(base, 1, 1)), out)
    >>> "served 5" in out.file.getvalue()
    True
    """
    cfg = result.config
    base, c = cfg.base, result.counters
    budget = base.budget
    console.print(f"[bold]kvfunc simulate --disaggregated {cfg.ratio}[/bold]: {base.model.name}, "
                  f"each instance's caches get {format_bytes(budget.memory_bytes)} x "
                  f"{budget.mem_fraction:g} - {format_bytes(budget.used_bytes)} used")
    console.print(f"trace: {base.trace.description}")
    caching = "prefix caching" if base.caches_prefixes else "no prefix caching"
    console.print(f"instances: {cfg.num_prefill} prefill ({caching}), {cfg.num_decode} decode; "
                  f"each FIFO, up to {base.concurrency} requests, {base.max_batched_tokens:,} "
                  f"tokens/step, {base.step_ms:g} ms/step, arrivals x{base.speedup:g}, MTP "
                  f"{base.model.next_n}; links {cfg.link_bandwidth / 1e9:g} GB/s per instance; "
                  f"{base.layout} layout")
    console.print(f"requests: {c['requests']:,}; served [bold]{c['served']:,}[/bold], rejected "
                  f"{c['rejected']:,} ({c['finished_on_prefill']:,} finished on the prefill side: "
                  "one output token)")
    _render_sides(result, console)
    console.print(_usage_table(result))
    _render_transfers(result, console)
    lat = result.latency
    parts = ", ".join(f"{k} {v * 1000:,.1f} ms" for k, v in lat.ttft_parts.items())
    console.print(f"time to first token: [bold]{_ms(lat.ttft)}[/bold], mean "
                  f"{lat.ttft.mean * 1000:,.1f} ms ({parts}); time between tokens: "
                  f"[bold]{_ms(lat.tbt)}[/bold], max {lat.tbt.max * 1000:,.1f} ms (steps of "
                  f"{base.step_ms:g} ms, every draft token accepted)")
    console.print(f"steps: prefill {result.prefill.counters['steps']:,}, decode "
                  f"{result.decode.counters['steps']:,}; {result.simulated_s:,.1f} simulated s, "
                  f"{result.wall_s:.1f} s wall")
    if plot_path:
        console.print(f"plot: {plot_path}")


def _render_sides(result: DisaggResult, console: Console) -> None:
    p, d = result.prefill.counters, result.decode.counters
    console.print(f"prefill side: preemptions {p['preemptions']:,}; refused allocations "
                  f"{p['refused_allocations']:,}; prefilled {p['prefill_tokens']:,} "
                  f"(+ {p['recomputed_tokens']:,} recomputed after preemption)")
    px = result.prefill.prefix
    if px is not None:
        console.print(
            f"prefill side prefix cache: {px.hit_tokens:,} of {px.prompt_tokens:,} prompt tokens "
            f"hit, [bold]{px.hit_rate:.1%}[/bold] (the trace's upper bound, one infinite cache: "
            f"{px.bound.hit_rate:.1%}); {px.recompute_hit_tokens:,} more hit after preemption; "
            f"blocks stored {px.stored_blocks:,}, evicted {px.evicted_blocks:,}")
    console.print(f"decode side: preemptions {d['preemptions']:,}; refused allocations "
                  f"{d['refused_allocations']:,}; generated {d['generated_tokens']:,} tokens "
                  f"(+ {p['generated_tokens']:,} first tokens from the prefill side), "
                  f"{d['recomputed_tokens']:,} recomputed after preemption; no prefix caching "
                  "(hit rate 0)")


def _render_transfers(result: DisaggResult, console: Console) -> None:
    t = result.transfers
    mean = t.bytes_moved / t.count if t.count else 0
    console.print(f"transfers: {t.count:,}, KV moved [bold]{format_bytes(t.bytes_moved)}"
                  f"[/bold] (mean {format_bytes(mean)}), each on the link {_ms(t.transfer)}")
    for what, q, waited, how in (
            ("decode room", t.wait_room, t.waited_room, "longer than a step"),
            ("the link", t.wait_link, t.waited_link, "at all")):
        console.print(f"waiting for {what}: {q.mean * t.count:,.1f} s in all, {_ms(q)}, max "
                      f"{q.max * 1000:,.1f} ms; {waited:,} transfers waited {how}")
    busy = max((*t.send_busy, *t.recv_busy), default=0.0)
    console.print(f"links busy at most {busy:.1%} of the run; DataDist registry: a prefill "
                  f"instance held at most {format_bytes(t.peak_held_bytes)} under "
                  f"{t.peak_keys:,} cache keys for pulls; every key released by its pull")
