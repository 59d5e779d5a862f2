"""Human-readable output of ``kvfunc plan`` and ``kvfunc simulate`` (rich tables)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvfunc.cli._plan import PlanReport
from kvfunc.cli._simulate import SimulationResult
from kvfunc.cli._units import format_bytes

__all__ = ["make_console", "render_plan", "render_simulation"]


def make_console(*, stderr: bool = False) -> Console:
    """A console that keeps tables whole when the output is not a terminal.

    >>> make_console().width >= 80
    True
    """
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, width=None if probe.is_terminal else 120,
                   highlight=False)


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def render_plan(report: PlanReport, console: Console) -> None:
    """Print a plan: what the budget means, one row per manager key, the sources.

    >>> import io
    >>> from kvfunc.cli._plan import Budget, PlanConfig, plan_model
    >>> from kvfunc.cli._presets import build_preset
    >>> out = Console(file=io.StringIO(), width=120)
    >>> render_plan(plan_model(build_preset("llama-3-8b"), PlanConfig(Budget(2**36))), out)
    >>> "fit at once: 57" in out.file.getvalue()
    True
    """
    model, cfg, budget = report.model, report.config, report.config.budget
    console.print(f"[bold]{model.name}[/bold]: {model.title}")
    console.print(
        f"budget: {format_bytes(budget.memory_bytes)} x {budget.mem_fraction:g} "
        f"- {format_bytes(budget.used_bytes)} used - "
        f"{format_bytes(budget.extra_reserved_bytes)} reserved = "
        f"[bold]{format_bytes(budget.cache_budget_bytes)}[/bold] for KV caches "
        "(model weights count only as --used-memory)")
    mode = (f"offline, every request {cfg.offline_max_len:,} tokens" if cfg.offline_max_len
            else "online: paged groups share what fixed groups leave")
    console.print(f"concurrency {cfg.concurrency}, max prefill {cfg.max_prefill_tokens:,} "
                  f"tokens, MTP depth {model.next_n}, {mode}")
    table = Table(show_edge=False)
    for header in ("manager key", "type", "sizing", "block size", "blocks", "tokens",
                   "bytes", "blocks/req", f"max reqs @{cfg.max_len:,}"):
        table.add_column(header, justify="left" if header in ("manager key", "type",
                                                             "sizing") else "right")
    for g in report.groups:
        table.add_row(g.manager_key, g.attn_type, g.sizing, str(g.block_size),
                      _n(g.num_blocks), _n(g.tokens), format_bytes(g.bytes),
                      _n(g.blocks_per_request), _n(g.max_concurrency))
    console.print(table)
    console.print(f"caches take {format_bytes(report.total_bytes)}; requests of "
                  f"{cfg.max_len:,} tokens that fit at once: [bold]{report.max_concurrency:,}"
                  "[/bold] (blocks/req: blocks one such request holds at its peak; tokens: "
                  "token slots, the null block excluded)")
    for note in model.notes:
        console.print(f"note: {note}")
    for source in model.sources:
        console.print(f"source: {source}", soft_wrap=True)


def render_simulation(result: SimulationResult, console: Console,
                      plot_path: str | None = None, log_path: str | None = None) -> None:
    """Print a simulation's summary: counters, tokens, usage per group, allocator time.

    >>> import io
    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._simulate import SimulationConfig, run_simulation
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> result = run_simulation(SimulationConfig(build_preset("llama-3-8b"),
    ...                                          synthetic_trace(5), Budget(2**33)))
    >>> out = Console(file=io.StringIO(), width=120)
    >>> render_simulation(result, out)
    >>> "served 5" in out.file.getvalue()
    True
    """
    cfg, c = result.config, result.counters
    budget = cfg.budget
    console.print(f"[bold]kvfunc simulate[/bold]: {cfg.model.name}, caches get "
                  f"{format_bytes(budget.memory_bytes)} x {budget.mem_fraction:g} "
                  f"- {format_bytes(budget.used_bytes)} used")
    console.print(f"trace: {cfg.trace.description}")
    console.print(f"scheduler: FIFO, up to {cfg.concurrency} running, "
                  f"{cfg.max_batched_tokens:,} tokens/step (chunked prefill), "
                  f"{cfg.step_ms:g} ms/step, arrivals x{cfg.speedup:g}, MTP {cfg.model.next_n}, "
                  "preemption by recompute, no prefix caching")
    console.print(f"requests: {c['requests']:,}; served [bold]{c['served']:,}[/bold], "
                  f"rejected {c['rejected']:,}; preemptions {c['preemptions']:,}; "
                  f"refused allocations {c['refused_allocations']:,}")
    console.print(f"tokens: prefilled {c['prefill_tokens']:,} (+ {c['recomputed_tokens']:,} "
                  f"recomputed after preemption), generated {c['generated_tokens']:,}")
    table = Table(show_edge=False)
    for header in ("manager key", "type", "blocks", "peak used", "peak", "mean used", "mean"):
        table.add_column(header, justify="left" if header in ("manager key", "type")
                         else "right")
    for g in result.groups:
        table.add_row(g.manager_key, g.attn_type, f"{g.num_blocks:,}", f"{g.peak_blocks:,}",
                      f"{g.peak_fraction:.1%}", f"{g.mean_blocks:,.0f}", f"{g.mean_fraction:.1%}")
    console.print(table)
    a = result.alloc_us
    console.print(f"allocator time per step: mean {a['mean']:.0f} us, p50 {a['p50']:.0f} us, "
                  f"p99 {a['p99']:.0f} us, max {a['max']:.0f} us "
                  f"({a['total_ms'] / 1000:.2f} s in all)")
    console.print(f"{result.steps:,} steps, {result.simulated_s:,.1f} simulated s, "
                  f"{result.wall_s:.1f} s wall")
    if plot_path:
        console.print(f"plot: {plot_path}")
    if log_path:
        console.print(f"delta log: {log_path} (check it with: kvfunc replay {log_path})")
