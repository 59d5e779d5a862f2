"""The PNG of a disaggregated run over simulated time (matplotlib, Agg backend, no pyplot)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvfunc.cli._disagg import DisaggResult
from kvfunc.cli._plot import _save, downsample
from kvfunc.cli._units import format_bytes

__all__ = ["plot_disaggregated"]


def _usage_panel(ax: Any, result: DisaggResult, role: str) -> None:
    side = result.prefill if role == "prefill" else result.decode
    for (_, index, times, usage), pools in zip(
            [u for u in result.usage if u[0] == role], side.instances, strict=True):
        for pool, used in zip(pools, usage, strict=True):
            xs, ys = downsample(times, used)
            usable = max(1, pool.num_blocks - 1)
            label = (f"{role} {index} {pool.label}: {usable:,} usable blocks, peak "
                     f"{pool.peak_fraction:.0%}, mean {pool.mean_fraction:.0%}")
            ax.plot(xs, [100 * y / usable for y in ys], linewidth=0.8, label=label)
    ax.set_ylabel(f"{role} side:\nblocks in use (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=6.5, loc="lower right", framealpha=0.8)


def _series_panel(ax: Any, result: DisaggResult, names: tuple[tuple[str, str], ...],
                  ylabel: str, *, scale: float = 1.0) -> None:
    times, series = result.series["time"], result.series
    top = 0.0
    for name, label in names:
        xs, ys = downsample(times, [round(v) for v in series[name]])
        ax.plot(xs, [y / scale for y in ys], linewidth=0.8, label=label)
        top = max(top, max(ys, default=0) / scale)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(1.0, 1.08 * top))
    ax.legend(fontsize=6.5, loc="upper left", framealpha=0.8)


def _hit_panel(ax: Any, result: DisaggResult) -> None:
    prefix = result.prefill.prefix
    assert prefix is not None
    times, series = result.series["time"], result.series
    xs, hits = downsample(times, [round(v) for v in series["hit_tokens"]])
    _, prompts = downsample(times, [round(v) for v in series["prompt_tokens"]])
    ax.plot(xs, [100 * h / p if p else 0.0 for h, p in zip(hits, prompts, strict=True)],
            linewidth=0.9, label=f"prefill side hit rate so far ({prefix.hit_rate:.1%} at the end)")
    ax.axhline(100 * prefix.bound.hit_rate, color="0.3", linestyle="--", linewidth=0.9,
               label=f"trace's upper bound, one infinite cache ({prefix.bound.hit_rate:.1%})")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_ylim(0, max(5.0, 120 * prefix.bound.hit_rate))
    ax.legend(fontsize=6.5, loc="center right", framealpha=0.8)


def plot_disaggregated(result: DisaggResult, path: str | Path, *,
                       title: str | None = None) -> Path:
    """Write a PNG of a disaggregated run over simulated time, one panel per question.

    Panels: blocks in use on each prefill instance, and on each decode
    instance (percent of usable blocks); requests queued and prefilling,
    transfers waiting for decode room and on (or waiting for) the link,
    requests decoding and recomputing; preemptions on each side so far; KV
    moved so far; and, on a run that caches prefixes, the prefill side's hit
    rate so far against the trace's upper bound.

    Raises:
        CLIError: the file cannot be written.

    >>> import tempfile, pathlib
    >>> from kvfunc.cli._disagg import DisaggConfig
    >>> from kvfunc.cli._disagg_run import run_disaggregated
    >>> from kvfunc.cli._plan import Budget
    >>> from kvfunc.cli._presets import build_preset
    >>> from kvfunc.cli._simulate import SimulationConfig
    >>> from kvfunc.cli._trace import synthetic_trace
    >>> base = SimulationConfig(build_preset("llama-3-8b"), synthetic_trace(5), Budget(2**33))
    >>> result = run_disaggregated(DisaggConfig(base, 2, 1))
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     plot_disaggregated(result, pathlib.Path(tmp) / "d.png").read_bytes()[:4]
    b'\x89PNG'
    """
    prefix = result.prefill.prefix
    caching = prefix is not None and prefix.enabled
    panels = 6 if caching else 5
    fig = Figure(figsize=(9, 2.0 * panels + 0.8), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, sharex=True)
    _usage_panel(axes[0], result, "prefill")
    _usage_panel(axes[1], result, "decode")
    _series_panel(axes[2], result, (
        ("prefill_waiting", "queued for prefill"), ("prefill_running", "prefilling"),
        ("wait_room", "transfers waiting for decode room"),
        ("on_link", "transfers on the link or waiting for it"),
        ("decode_running", "decoding"), ("decode_waiting", "waiting to be recomputed (decode)")),
        "requests")
    p_pre, d_pre = (int(result.series[k][-1]) if result.series[k] else 0
                    for k in ("prefill_preemptions", "decode_preemptions"))
    _series_panel(axes[3], result, (
        ("prefill_preemptions", f"prefill side preemptions ({p_pre:,} at the end)"),
        ("decode_preemptions", f"decode side preemptions ({d_pre:,} at the end)")),
        "preemptions so far")
    moved = result.transfers.bytes_moved
    _series_panel(axes[4], result, (
        ("bytes_moved", f"KV moved so far ({format_bytes(moved)} at the end)"),),
        "KV moved (GiB)", scale=2**30)
    if caching:
        _hit_panel(axes[5], result)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("simulated time (s)")
    cfg = result.config
    base = cfg.base
    default_title = (f"{base.model.name}, disaggregated {cfg.ratio}: "
                     f"{len(base.trace.requests):,} requests of {base.trace.name}, "
                     f"{format_bytes(base.budget.memory_bytes)} per instance, links "
                     f"{cfg.link_bandwidth / 1e9:g} GB/s")
    axes[0].set_title(title or default_title, fontsize=10)
    return _save(fig, path)
