"""The ``kvfunc`` command: each subcommand's handler; the work is in the library modules.

Exit codes: 0 success; 1 ``kvfunc replay`` found a mismatch; 2 bad input
(one line on stderr saying what is wrong and how to fix it); 130 interrupted;
141 (128 + SIGPIPE) when the reader of the output went away (``kvfunc plan
--json | head -1``), quietly, as a Unix tool killed by SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvfunc.cli._args import (
    SIMULATE_DEFAULTS,
    SIMULATE_MEMORY,
    SIMULATE_TRACE_MEMORY,
    build_parser,
    join_negative_values,
)
from kvfunc.cli._custom import load_model_file
from kvfunc.cli._disagg_cli import check_disaggregated_args, simulate_disaggregated
from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import check_writable, show
from kvfunc.cli._layout import SIM_LAYOUTS, default_layout
from kvfunc.cli._log import ReplayFailed, log_write_error, verify_log
from kvfunc.cli._offload import OffloadConfig, parse_remote
from kvfunc.cli._plan import Budget, PlanConfig, plan_model, render_shared_plan
from kvfunc.cli._presets import ModelPreset, build_preset, preset_names
from kvfunc.cli._render import (
    make_console,
    render_plan,
    render_simulation,
    render_sweep,
    usage_summary,
)
from kvfunc.cli._simulate import SimulationConfig, run_simulation
from kvfunc.cli._sweep import run_sweep
from kvfunc.cli._trace import load_trace
from kvfunc.cli._units import parse_bytes
from kvfunc.core import KVFuncError

__all__ = ["main"]

EXIT_BROKEN_PIPE = 141

def _model(args: argparse.Namespace, default_preset: str | None) -> ModelPreset:
    if args.model:
        if args.block_size is not None or args.kv_dtype is not None:
            raise CLIError("--block-size and --kv-dtype apply to presets; set them in the "
                           "model file instead")
        return load_model_file(args.model, next_n=args.mtp)
    name = args.preset or default_preset
    if name is None:
        raise CLIError(f"name a model: --preset one of {preset_names()}, or --model FILE.toml")
    return build_preset(name, block_size=args.block_size, kv_dtype=args.kv_dtype,
                        next_n=args.mtp)


def _budget(args: argparse.Namespace, model: ModelPreset) -> Budget:
    if args.memory:
        memory = parse_bytes(args.memory, what="--memory")
    else:  # the largest default that applies (a plan has no trace)
        defaults = [SIMULATE_DEFAULTS["memory"], SIMULATE_MEMORY.get(model.name, "0"),
                    SIMULATE_TRACE_MEMORY.get(getattr(args, "trace", None) or "", "0")]
        memory = max(parse_bytes(size, what="--memory") for size in defaults)
    return Budget(memory, args.mem_fraction,
                  parse_bytes(args.used_memory, what="--used-memory"),
                  parse_bytes(args.extra_reserved, what="--extra-reserved"))


def _plan(args: argparse.Namespace) -> int:
    model = _model(args, None)
    max_len = args.max_len or min(8192, model.max_model_len)
    report = plan_model(model, PlanConfig(
        _budget(args, model), concurrency=args.concurrency,
        max_prefill_tokens=args.max_prefill_tokens, max_len=max_len,
        offline_max_len=args.offline_max_len))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        console = make_console()
        render_plan(report, console)
        render_shared_plan(report, console)
    return 0


def _progress(args: argparse.Namespace, what: str, unit: str) -> Progress:
    err = make_console(stderr=True)
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                    TimeElapsedColumn(), console=err,
                    disable=args.no_progress or args.json or not err.is_terminal)


def _outputs(args: argparse.Namespace) -> str | None:
    """Check, before any work, that every output can be written; returns the plot's path."""
    sweep = args.capacity_sweep is not None
    if sweep and args.record:
        raise CLIError("--record logs one run; a --capacity-sweep makes many")
    plot = None if args.no_plot else args.plot or (
        "kvfunc-sweep.png" if sweep else "kvfunc-simulate.png")
    if plot is not None:
        check_writable(plot, what="--plot")
    if args.record:
        check_writable(args.record, what="--record")
    return plot


def _layouts(args: argparse.Namespace, model: ModelPreset) -> tuple[str, ...]:
    """The layouts to run: ``--layout``, the model's default, or both for a sweep."""
    if args.layout == "both":
        if args.capacity_sweep is None:
            raise CLIError("--layout both applies to --capacity-sweep (one curve per layout); "
                           "name one layout for a single run: shared or per-type")
        return SIM_LAYOUTS
    return (args.layout or default_layout(model),)


def _simulate(args: argparse.Namespace) -> int:
    check_disaggregated_args(args)
    plot_path = _outputs(args)
    model = _model(args, SIMULATE_DEFAULTS["preset"])
    trace = load_trace(args.trace, limit=args.requests, seed=args.seed)
    if args.requests and args.trace != "synthetic" and len(trace.requests) < args.requests:
        print(f"kvfunc simulate: note: --requests {args.requests:,} asked for more than the "
              f"trace has; simulating all {len(trace.requests):,}", file=sys.stderr)
    layouts = _layouts(args, model)
    config = SimulationConfig(model, trace, _budget(args, model), concurrency=args.concurrency,
                              max_batched_tokens=args.max_batched_tokens,
                              max_model_len=args.max_model_len, step_ms=args.step_ms,
                              speedup=args.speedup, prefix_caching=not args.no_prefix_caching,
                              layout=layouts[0], cache_outputs=args.cache_outputs,
                              offload=_offload(args))
    if args.capacity_sweep is not None:
        return _sweep(args, config, plot_path, layouts)
    if args.disaggregated is not None:
        return simulate_disaggregated(args, config, plot_path,
                                      _progress(args, "simulating", "requests"))
    log = _open_log(args.record) if args.record else None
    progress = _progress(args, "simulating", "requests")
    try:
        with progress:
            task = progress.add_task("simulate", total=len(trace.requests))
            result = run_simulation(config, record=log, on_progress=lambda done, _total:
                                    progress.update(task, completed=done))
    except BaseException:
        if log is not None:  # the error in flight says what went wrong, not a failed flush
            with contextlib.suppress(OSError):
                log.close()
        raise
    if log is not None:
        try:
            log.close()  # the last lines are flushed here: a full disk may show only now
        except OSError as exc:
            raise log_write_error(args.record, exc) from None
    if plot_path is not None:
        from kvfunc.cli._plot import plot_usage  # matplotlib loads only when it is needed

        plot_path = str(plot_usage(result, plot_path))
    if args.json:
        print(json.dumps({**result.to_json(), "plot": plot_path, "log": args.record}, indent=2))
    else:
        render_simulation(result, make_console(), plot_path, args.record)
    return 0


def _offload(args: argparse.Namespace) -> OffloadConfig:
    """The tiers the flags ask for (none without ``--host-memory`` and ``--remote``)."""
    host = 0 if args.host_memory is None else parse_bytes(args.host_memory,
                                                          what="--host-memory")
    if args.host_memory is not None and host <= 0:
        raise CLIError(f"--host-memory must be more than 0, got {args.host_memory!r}")
    remote = args.remote is not None
    return OffloadConfig(host, remote, parse_remote(args.remote) if remote else None,
                         args.host_bandwidth, args.remote_bandwidth, args.write_policy)


def _open_log(path: str) -> IO[str]:
    try:
        return open(path, "w", encoding="utf-8")  # the caller closes it
    except OSError as exc:
        raise log_write_error(path, exc) from None


def _sweep(args: argparse.Namespace, config: SimulationConfig, plot_path: str | None,
           layouts: tuple[str, ...]) -> int:
    progress = _progress(args, "sweeping", "cache sizes")
    with progress:
        task = progress.add_task("sweep", total=args.capacity_sweep * len(layouts))
        sweep = run_sweep(config, points=args.capacity_sweep, jobs=args.jobs, layouts=layouts,
                          on_point=lambda done, _total: progress.update(task, completed=done))
    if plot_path is not None:
        from kvfunc.cli._plot import plot_sweep  # matplotlib loads only when it is needed

        plot_path = str(plot_sweep(sweep, plot_path))
    if args.json:
        print(json.dumps({**sweep.to_json(), "plot": plot_path}, indent=2))
    else:
        render_sweep(sweep, make_console(), plot_path)
    return 0


def _replay(args: argparse.Namespace) -> int:
    try:
        final, count = verify_log(args.log)
    except ReplayFailed as exc:
        print(f"kvfunc replay: FAILED: {Path(args.log).name}: {exc}", file=sys.stderr)
        return 1
    usage = usage_summary(final)
    if args.json:
        print(json.dumps({"log": args.log, "deltas": count, "ok": True, "usage": usage}))
    else:
        held = ", ".join(f"{key} {u['used']:,} of {u['usable']:,}" for key, u in usage.items())
        print(f"kvfunc replay: OK: {count:,} deltas replayed; the final state matches the "
              f"recorded one bit for bit (usable blocks in use: {held})")
    return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file (a test's capture): nothing to flush
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvfunc`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    >>> main(["plan", "--preset", "nope", "--memory", "1GiB"])
    2
    """
    argv = join_negative_values(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handler = {"plan": _plan, "simulate": _simulate, "replay": _replay}[args.command]
    try:
        code = handler(args)
        sys.stdout.flush()
        return code
    except (CLIError, KVFuncError) as exc:  # KVFuncError: a value the checks let through
        print(f"kvfunc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away: stop quietly, as Unix tools do
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:  # an output failed (a full disk under stdout or a plot): one line
        where = f" ({show(exc.filename)})" if exc.filename else ""
        print(f"kvfunc {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        _silence_stdout()
        return 2
    except KeyboardInterrupt:
        print(f"kvfunc {args.command}: interrupted", file=sys.stderr)
        return 130
