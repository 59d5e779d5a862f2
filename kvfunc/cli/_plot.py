"""A PNG of block usage per manager key over simulated time (matplotlib, Agg backend).

The figure is drawn on an explicit Agg canvas, never through ``pyplot``: no
GUI backend is ever selected and no global figure state is kept.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvfunc.cli._errors import CLIError
from kvfunc.cli._simulate import SimulationResult

__all__ = ["downsample", "plot_usage"]

MAX_POINTS = 2000


def downsample(times: tuple[float, ...], values: tuple[int, ...], max_points: int = MAX_POINTS
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


def plot_usage(result: SimulationResult, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG of each group's used blocks (percent of usable blocks) over time.

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
    fig = Figure(figsize=(9, 4.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for group, used in zip(result.groups, result.usage, strict=True):
        xs, ys = downsample(result.times, used)
        usable = max(1, group.num_blocks - 1)
        kind = "" if group.manager_key == group.attn_type else f" ({group.attn_type})"
        label = (f"{group.manager_key}{kind}: {usable:,} blocks, "
                 f"peak {group.peak_fraction:.0%}, mean {group.mean_fraction:.0%}")
        ax.plot(xs, [100 * y / usable for y in ys], linewidth=0.9, label=label)
    cfg = result.config
    default_title = (f"{cfg.model.name}: KV-cache blocks in use, "
                     f"{len(cfg.trace.requests):,} requests of {cfg.trace.name}")
    ax.set_title(title or default_title, fontsize=10)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("blocks in use (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    # Below the axes, so that it never hides a peak.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
              frameon=False)
    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, format="png")
    except OSError as exc:
        raise CLIError(f"cannot write the plot to {str(out)!r}: {exc.strerror}") from None
    return out
