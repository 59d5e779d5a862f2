"""PNGs of a run over simulated time and of a capacity sweep (matplotlib, Agg backend).

The figure is drawn on an explicit Agg canvas, never through ``pyplot``: no
GUI backend is ever selected and no global figure state is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from kvfunc.cli._errors import CLIError
from kvfunc.cli._simulate import SimulationResult
from kvfunc.cli._sweep import SweepResult
from kvfunc.cli._units import format_bytes

__all__ = ["downsample", "plot_sweep", "plot_usage"]

MAX_POINTS = 2000


def downsample(times: Sequence[float], values: Sequence[int], max_points: int = MAX_POINTS
               ) -> tuple[list[float], list[int]]:
    """At most ``max_points`` points: each bucket's last time and its *peak* value.

    Peaks are kept so that the plot never hides how full the cache got.

    >>> downsample((1.0, 2.0, 3.0, 4.0), (5, 9, 1, 2), max_points=2)
    ([2.0, 4.0], [9, 2])
    """
    n = len(values)
    if n <= max_points:
        return list(times), list(values)
    size = -(-n // max_points)
    xs = [times[min(i + size, n) - 1] for i in range(0, n, size)]
    ys = [max(values[i:i + size]) for i in range(0, n, size)]
    return xs, ys


def _save(fig: Figure, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, format="png")
    except OSError as exc:
        raise CLIError(f"cannot write the plot to {str(out)!r}: {exc.strerror}") from None
    return out


def _usage_panel(ax: Any, result: SimulationResult) -> None:
    for pool, used in zip(result.pools, result.usage, strict=True):
        xs, ys = downsample(result.times, used)
        usable = max(1, pool.num_blocks - 1)
        label = (f"{pool.label}: {usable:,} usable blocks, "
                 f"peak {pool.peak_fraction:.0%}, mean {pool.mean_fraction:.0%}")
        ax.plot(xs, [100 * y / usable for y in ys], linewidth=0.9, label=label)
    ax.set_ylabel("blocks in use per pool (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.8)


def _series_panel(ax: Any, times: tuple[float, ...], series: dict[str, tuple[int, ...]],
                  names: tuple[str, ...], labels: tuple[str, ...], ylabel: str) -> None:
    for name, label in zip(names, labels, strict=True):
        xs, ys = downsample(times, series[name])
        ax.plot(xs, ys, linewidth=0.9, label=f"{label} ({series[name][-1]:,} at the end)"
                if name in ("preemptions", "refused_allocations") else label)
    ax.set_ylabel(ylabel)
    top = max((max(series[name], default=0) for name in names), default=0)
    ax.set_ylim(0, max(1.0, 1.08 * top))
    ax.legend(fontsize=7, loc="upper left", framealpha=0.8)


def _hit_panel(ax: Any, result: SimulationResult) -> None:
    prefix = result.prefix
    assert prefix is not None
    xs, hits = downsample(result.times, result.series["hit_tokens"])
    _, prompts = downsample(result.times, result.series["prompt_tokens"])
    ax.plot(xs, [100 * h / p if p else 0.0 for h, p in zip(hits, prompts, strict=True)],
            linewidth=0.9, label=f"hit rate so far ({prefix.hit_rate:.1%} at the end)")
    ax.axhline(100 * prefix.bound.hit_rate, color="0.3", linestyle="--", linewidth=0.9,
               label=f"trace's upper bound, infinite cache ({prefix.bound.hit_rate:.1%})")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_ylim(0, max(5.0, 120 * prefix.bound.hit_rate))
    ax.legend(fontsize=7, loc="center right", framealpha=0.8)


def plot_usage(result: SimulationResult, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG of a run over simulated time, one panel per question.

    Panels: each pool's blocks in use (percent of its usable blocks: a pool
    per group with ``--layout per-type``, one for every group with ``shared``);
    requests waiting and running; preemptions and refused allocations so far;
    and, on a run that caches prefixes, the hit rate so far against the
    trace's upper bound.

    Raises:
        CLIError: the file cannot be written.

    >>> import tempfile, pathlib
    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._simulate import SimulationConfig, run_simulation
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> result = run_simulation(SimulationConfig(build_preset("llama-3-8b"),
    ...                                          synthetic_trace(5), Budget(2**33)))
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     plot_usage(result, pathlib.Path(tmp) / "u.png").read_bytes()[:4]
    b'\x89PNG'
    """
    caching = result.prefix is not None and result.prefix.enabled
    panels = 4 if caching else 3
    fig = Figure(figsize=(9, 2.1 * panels + 0.8), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, sharex=True)
    _usage_panel(axes[0], result)
    times, series = result.times, result.series
    _series_panel(axes[1], times, series, ("waiting", "running"),
                  ("waiting requests", "running requests"), "requests")
    _series_panel(axes[2], times, series, ("preemptions", "refused_allocations"),
                  ("preemptions", "refused allocations"), "events so far")
    if caching:
        _hit_panel(axes[3], result)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("simulated time (s)")
    cfg = result.config
    default_title = (f"{cfg.model.name}: {len(cfg.trace.requests):,} requests of "
                     f"{cfg.trace.name}, {format_bytes(cfg.budget.memory_bytes)} of memory, "
                     f"{cfg.layout} layout")
    axes[0].set_title(title or default_title, fontsize=10)
    return _save(fig, path)


def _short(count: float) -> str:
    """``1.5M``, ``200k``: a tick label for a token count.

    >>> _short(1_500_000), _short(200_000), _short(512)
    ('1.5M', '200k', '512')
    """
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:g}{unit}"
    return f"{count:g}"


def plot_sweep(sweep: SweepResult, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG of hit rate against cache capacity (log x), the upper bound marked.

    One curve per layout swept; the first layout's points are labelled with
    the ``--memory`` of their run (every layout runs the same sizes).

    Raises:
        CLIError: the file cannot be written.

    >>> import tempfile, pathlib
    >>> from kvfunc.cli import (Budget, SimulationConfig, SweepPoint, UpperBound,
    ...                         build_preset, synthetic_trace)
    >>> base = SimulationConfig(build_preset("llama-3-8b"), synthetic_trace(1), Budget(2**33))
    >>> points = tuple(SweepPoint(2**30 * m, 15_000 * m, {}, 1000, 100 * m, 0, 0, 10, 0, 0, 1.0)
    ...                for m in (1, 2, 3))
    >>> sweep = SweepResult(base, points, UpperBound(1000, 350), False, 3.0)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     plot_sweep(sweep, pathlib.Path(tmp) / "s.png").read_bytes()[:4]
    b'\x89PNG'
    """
    fig = Figure(figsize=(8, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    layouts = sweep.layouts
    for i, layout in enumerate(layouts):
        curve = sweep.curve(layout)
        label = ("simulated hit rate" if len(layouts) == 1 else
                 f"simulated hit rate, {layout} layout")
        ax.plot([p.capacity_tokens for p in curve], [100 * p.hit_rate for p in curve],
                marker="os"[i % 2], linewidth=1.2, label=label)
    for p in (sweep.curve(layouts[0]) if layouts else ()):
        # above and to the left: a rising curve leaves that corner free
        ax.annotate(format_bytes(p.memory_bytes), (p.capacity_tokens, 100 * p.hit_rate),
                    textcoords="offset points", xytext=(-5, 5), ha="right", fontsize=6.5,
                    color="0.35")
    bound = 100 * sweep.bound.hit_rate
    ax.axhline(bound, color="0.3", linestyle="--", linewidth=1,
               label=f"trace's upper bound, infinite cache ({bound:.1f} %)")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _short(x)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("cache capacity (tokens, log scale; labels: --memory of each run)")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_ylim(0, max(5.0, 1.15 * bound))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    cfg = sweep.config
    default_title = (f"{cfg.model.name}: prefix-cache hit rate against capacity, "
                     f"{len(cfg.trace.requests):,} requests of {cfg.trace.name}")
    ax.set_title(title or default_title, fontsize=10)
    return _save(fig, path)
