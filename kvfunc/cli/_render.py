"""Human-readable output of ``kvfunc plan``, ``simulate`` and ``replay`` (rich tables).

Block counts follow one convention everywhere: **usable blocks**, the null
block excluded (each pool's block 0 is never handed out).  A pool of
``num_blocks`` blocks (what :func:`kvfunc.calculate_block_num` returns and the
JSON's ``num_blocks`` says) has ``num_blocks - 1`` usable ones, and an empty
cache has 0 of them in use.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvfunc.cli._plan import PlanReport
from kvfunc.cli._simulate import SimulationResult
from kvfunc.cli._sweep import SweepResult
from kvfunc.cli._units import format_bytes
from kvfunc.core import KVState

__all__ = ["make_console", "render_plan", "render_simulation", "render_sweep", "usage_summary"]


class _Console(Console):
    """A rich console that lets a closed pipe reach the command (rich would exit with 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def make_console(*, stderr: bool = False) -> Console:
    """A console that keeps tables whole when the output is not a terminal.

    A closed pipe (``kvfunc plan | head -1``) raises :class:`BrokenPipeError`,
    which the command turns into a quiet exit.

    >>> make_console().width >= 80
    True
    """
    probe = Console(stderr=stderr)
    return _Console(stderr=stderr, width=None if probe.is_terminal else 120,
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
    for header in ("manager key", "type", "sizing", "block\nsize", "usable\nblocks", "tokens",
                   "bytes", "blocks/\nreq", f"max reqs\n@{cfg.max_len:,}"):
        table.add_column(header, justify="left" if header in ("manager key", "type",
                                                             "sizing") else "right")
    for g in report.groups:
        table.add_row(g.manager_key, g.attn_type, g.sizing, str(g.block_size),
                      _n(g.num_blocks - 1), _n(g.tokens), format_bytes(g.bytes),
                      _n(g.blocks_per_request), _n(g.max_concurrency))
    console.print(table)
    console.print(f"caches take {format_bytes(report.total_bytes)}; requests of "
                  f"{cfg.max_len:,} tokens that fit at once: [bold]{report.max_concurrency:,}"
                  "[/bold] (usable blocks and tokens: the null block excluded; bytes: the "
                  "null block included; blocks/req: blocks one such request holds at its "
                  "peak)")
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
    console.print(f"layout: {_layout_line(result)}")
    caching = ("prefix caching" if cfg.caches_prefixes else "no prefix caching"
               + (" (--no-prefix-caching)" if cfg.trace.has_hash_ids else
                  " (the trace records no token ids)"))
    console.print(f"scheduler: FIFO, up to {cfg.concurrency} running, "
                  f"{cfg.max_batched_tokens:,} tokens/step (chunked prefill), "
                  f"{cfg.step_ms:g} ms/step, arrivals x{cfg.speedup:g}, MTP {cfg.model.next_n}, "
                  f"preemption by recompute, {caching}")
    console.print(f"requests: {c['requests']:,}; served [bold]{c['served']:,}[/bold], "
                  f"rejected {c['rejected']:,}; preemptions {c['preemptions']:,}; "
                  f"refused allocations {c['refused_allocations']:,}")
    console.print(f"tokens: prefilled {c['prefill_tokens']:,} (+ {c['recomputed_tokens']:,} "
                  f"recomputed after preemption), generated {c['generated_tokens']:,}")
    p = result.prefix
    if p is not None:
        console.print(
            f"prefix cache: {p.hit_tokens:,} of {p.prompt_tokens:,} prompt tokens hit, "
            f"[bold]{p.hit_rate:.1%}[/bold] (the trace's upper bound, an infinite cache: "
            f"{p.bound.hit_rate:.1%}); {p.recompute_hit_tokens:,} more hit after preemption; "
            f"blocks stored {p.stored_blocks:,}, evicted {p.evicted_blocks:,}")
    if result.tiers is not None:
        for line in result.tiers.lines(0 if p is None else p.prompt_tokens):
            console.print(line)
    table = Table(show_edge=False)
    for header in ("pool", "groups", "usable\nblocks", "peak\nused", "peak", "mean\nused",
                   "mean"):
        table.add_column(header, justify="left" if header in ("pool", "groups") else "right")
    for u in result.pools:
        groups = ", ".join(k if k == t else f"{k} ({t})"
                           for k, t in zip(u.manager_keys, u.attn_types, strict=True))
        table.add_row(u.pool, groups, f"{u.num_blocks - 1:,}", f"{u.peak_blocks:,}",
                      f"{u.peak_fraction:.1%}", f"{u.mean_blocks:,.0f}", f"{u.mean_fraction:.1%}")
    console.print(table)
    a = result.alloc_us
    console.print(f"allocator time per step (allocations, frees, prefix lookups): mean "
                  f"{a['mean']:.0f} us, p50 {a['p50']:.0f} us, "
                  f"p99 {a['p99']:.0f} us, max {a['max']:.0f} us "
                  f"({a['total_ms'] / 1000:.2f} s in all)")
    console.print(f"{result.steps:,} steps, {result.simulated_s:,.1f} simulated s, "
                  f"{result.wall_s:.1f} s wall")
    if plot_path:
        console.print(f"plot: {plot_path}")
    if log_path:
        console.print(f"delta log: {log_path} (check it with: kvfunc replay {log_path})")


def _layout_line(result: SimulationResult) -> str:
    """What the run's layout is, in a few words."""
    if result.config.layout == "shared":
        return ("shared: one pool for every group, block ids unique across groups (vLLM's "
                "hybrid layout); usage is per pool")
    return "per-type: a pool per group, each sized for its own need (the seed's layout)"


def render_sweep(sweep: SweepResult, console: Console, plot_path: str | None = None) -> None:
    """Print a capacity sweep: one row per cache size, and the trace's upper bound.

    >>> import io
    >>> from kvfunc.cli._mooncake import UpperBound
    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._simulate import SimulationConfig
    >>> from kvfunc.cli._sweep import SweepPoint
    >>> from kvfunc.cli._trace import load_trace
    >>> cfg = SimulationConfig(build_preset("deepseek-v3"),
    ...                        load_trace("mooncake-conversation", limit=10), Budget(2**36))
    >>> point = SweepPoint(2**36, 960_000, {"FullAttention": 15001}, 1000, 250, 90, 0, 10, 0,
    ...                    0, 1.5)
    >>> out = Console(file=io.StringIO(), width=120)
    >>> render_sweep(SweepResult(cfg, (point,), UpperBound(1000, 300), False, 2.0), out)
    >>> "25.0%" in out.file.getvalue(), "upper bound" in out.file.getvalue()
    (True, True)
    """
    cfg, layouts = sweep.config, sweep.layouts
    sizes = len(sweep.curve(layouts[0])) if layouts else 0
    console.print(f"[bold]kvfunc simulate --capacity-sweep[/bold]: {cfg.model.name}, "
                  f"{sizes} cache sizes" + (f" in {len(layouts)} layouts" if len(layouts) > 1
                                             else ""))
    console.print(f"trace: {cfg.trace.description}")
    console.print(f"layout: {' and '.join(layouts)}" + (
        " (capacity: the paged groups' tokens; a shared pool's, beyond what the window and "
        "state groups need for --concurrency requests)" if "shared" in layouts else ""))
    table = Table(show_edge=False)
    hosts = any(pt.host_memory_bytes for pt in sweep.points)
    headers = ("memory", *(("host\nmemory",) if hosts else ()), "capacity\n(tokens)",
               "hit rate", "hit tokens", "stored\nblocks", "evicted\nblocks", "preemptions",
               "rejected", "wall s")
    for header in ("layout", *headers) if len(layouts) > 1 else headers:
        table.add_column(header, justify="left" if header == "layout" else "right")
    for pt in sweep.points:
        host = (format_bytes(pt.host_memory_bytes),) if hosts else ()
        row = (format_bytes(pt.memory_bytes), *host, f"{pt.capacity_tokens:,}",
               f"{pt.hit_rate:.1%}", f"{pt.hit_tokens:,}", f"{pt.stored_blocks:,}",
               f"{pt.evicted_blocks:,}", f"{pt.preemptions:,}", f"{pt.rejected:,}",
               f"{pt.wall_s:.1f}")
        table.add_row(*((pt.layout, *row) if len(layouts) > 1 else row))
    console.print(table)
    b = sweep.bound
    console.print(f"the trace's upper bound (an infinite cache): [bold]{b.hit_rate:.1%}[/bold] "
                  f"({b.hit_tokens:,} of {b.prompt_tokens:,} prompt tokens)")
    if sweep.capped:
        console.print("note: the largest size stops at the simulator's bound of blocks; "
                      "a larger --block-size reaches further")
    console.print(f"{sweep.wall_s:.1f} s wall")
    if plot_path:
        console.print(f"plot: {plot_path}")


def usage_summary(state: KVState) -> dict[str, dict[str, int]]:
    """Usable blocks in use and in all, per pool (the null block excluded).

    A pool per type is named by its manager key; a shared pool, once, ``"shared"``.

    >>> from kvfunc.core import FullAttention
    >>> usage_summary(KVState.create({"f": FullAttention(num_blocks=577, block_size=16)}, 64))
    {'f': {'used': 0, 'usable': 576}}
    """
    return {p.name: {"used": p.num_blocks - 1 - p.num_free, "usable": p.num_blocks - 1}
            for p in state.pools}
