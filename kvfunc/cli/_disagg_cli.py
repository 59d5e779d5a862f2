"""``kvfunc simulate --disaggregated P:D``: its flags, their checks, and the command's run."""

from __future__ import annotations

import argparse
import json

from rich.progress import Progress

from kvfunc.cli._disagg import DEFAULT_BANDWIDTH, DisaggConfig, parse_bandwidth, parse_instances
from kvfunc.cli._errors import CLIError
from kvfunc.cli._simulate import SimulationConfig

__all__ = ["add_disaggregated_args", "check_disaggregated_args", "simulate_disaggregated"]


def add_disaggregated_args(sim: argparse.ArgumentParser) -> None:
    """Add ``--disaggregated`` and ``--link-bandwidth`` to ``kvfunc simulate``'s parser.

    >>> p = argparse.ArgumentParser(); add_disaggregated_args(p)
    >>> p.parse_args(["--disaggregated", "2:1"]).disaggregated
    '2:1'
    """
    sim.add_argument("--disaggregated", metavar="P:D", default=None,
                     help="serve with P prefill and D decode instances, each with its own "
                          "--memory and cache (prefix caching on the prefill side); each "
                          "request's KV moves to a decode instance over a link (see "
                          "docs/how-to/disaggregated.md)")
    sim.add_argument("--link-bandwidth", metavar="RATE", default=None,
                     help="with --disaggregated: what each instance sends or receives per "
                          f"second, e.g. 25GB/s or 200Gbit/s (default {DEFAULT_BANDWIDTH})")


def check_disaggregated_args(args: argparse.Namespace) -> None:
    """Refuse, before any work, flags that do not go with ``--disaggregated`` (or without it).

    >>> check_disaggregated_args(argparse.Namespace(disaggregated=None, link_bandwidth="1GB/s",
    ...                                             capacity_sweep=None, record=None))
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: --link-bandwidth applies to --disaggregated runs
    """
    if args.disaggregated is None:
        if args.link_bandwidth is not None:
            raise CLIError("--link-bandwidth applies to --disaggregated runs")
        return
    parse_instances(args.disaggregated)
    parse_bandwidth(args.link_bandwidth or DEFAULT_BANDWIDTH)
    if args.capacity_sweep is not None:
        raise CLIError("--capacity-sweep runs one instance per point; leave out "
                       "--disaggregated")
    if args.record:
        raise CLIError("--record logs one instance's deltas; a --disaggregated run has many")


def simulate_disaggregated(args: argparse.Namespace, base: SimulationConfig,
                           plot_path: str | None, progress: Progress) -> int:
    """Run, plot and print a ``--disaggregated`` simulation; returns the exit code."""
    from kvfunc.cli._disagg_report import render_disaggregated
    from kvfunc.cli._disagg_run import run_disaggregated
    from kvfunc.cli._render import make_console

    num_prefill, num_decode = parse_instances(args.disaggregated)
    config = DisaggConfig(base, num_prefill, num_decode,
                          parse_bandwidth(args.link_bandwidth or DEFAULT_BANDWIDTH))
    with progress:
        task = progress.add_task("simulate", total=len(base.trace.requests))
        result = run_disaggregated(config, on_progress=lambda done, _total:
                                   progress.update(task, completed=done))
    if plot_path is not None:
        from kvfunc.cli._disagg_plot import plot_disaggregated  # matplotlib: only if needed

        plot_path = str(plot_disaggregated(result, plot_path))
    if args.json:
        print(json.dumps({**result.to_json(), "plot": plot_path}, indent=2))
    else:
        render_disaggregated(result, make_console(), plot_path)
    return 0
