"""The ``kvfunc`` command: argument parsing only; the work is in the library modules.

Exit codes: 0 success; 1 ``kvfunc replay`` found a mismatch; 2 bad input
(one line on stderr saying what is wrong and how to fix it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvfunc.cli._custom import load_model_file
from kvfunc.cli._errors import CLIError
from kvfunc.cli._log import ReplayFailed, verify_log
from kvfunc.cli._plan import Budget, PlanConfig, plan_model
from kvfunc.cli._presets import ModelPreset, build_preset, preset_names
from kvfunc.cli._render import make_console, render_plan, render_simulation
from kvfunc.cli._simulate import SimulationConfig, run_simulation
from kvfunc.cli._trace import load_trace
from kvfunc.cli._units import parse_bytes
from kvfunc.core import KVFuncError, format_usage

__all__ = ["SIMULATE_DEFAULTS", "build_parser", "main"]

#: What ``kvfunc simulate`` runs with no arguments: a deliberately small cache,
#: so that the replayed sample shows admission stalls and preemption.
SIMULATE_DEFAULTS = {"preset": "gpt-oss-120b", "trace": "conv", "memory": "2.5GiB"}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _model_args(p: argparse.ArgumentParser, memory_default: str | None) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--preset", help=f"a built-in model: {', '.join(preset_names())}")
    what.add_argument("--model", metavar="FILE", help="a custom model (.toml or .json)")
    p.add_argument("--memory", default=memory_default, required=memory_default is None,
                   help="device memory, e.g. 64GiB or 80GB" + (
                       f" (default {memory_default})" if memory_default else ""))
    p.add_argument("--mem-fraction", type=float, default=0.9,
                   help="share of --memory the engine may hold (default 0.9)")
    p.add_argument("--used-memory", default="0", metavar="SIZE",
                   help="memory already in use when caches are sized: model weights, "
                        "activations (default 0: weights not counted)")
    p.add_argument("--extra-reserved", default="0", metavar="SIZE",
                   help="memory to leave for other buffers (default 0)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="most requests running at once; sizes window and state groups "
                        "(default 64)")
    p.add_argument("--mtp", type=int, default=None, metavar="N",
                   help="multi-token-prediction depth (default: the model's, 1 for "
                        "deepseek-v3 and qwen3-next-80b, else 0)")
    p.add_argument("--block-size", type=int, default=None, help="override attention block size")
    p.add_argument("--kv-dtype", default=None, help="override attention cache dtype (e.g. fp8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvfunc`` argument parser (subcommands ``plan``, ``simulate``, ``replay``).

    >>> build_parser().parse_args(["plan", "--preset", "llama-3-8b", "--memory", "64GiB"]).mtp
    """
    parser = _Parser(prog="kvfunc", description="Plan and simulate KV caches with kvfunc.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan", help="blocks, tokens and bytes per manager key for a budget",
        description="Size a model's KV caches with calculate_block_num: the caches get "
                    "--memory x --mem-fraction - --used-memory - --extra-reserved; model "
                    "weights count only if passed as --used-memory.")
    _model_args(plan, None)
    plan.add_argument("--max-prefill-tokens", type=int, default=8192,
                      help="longest prefill the cache must hold (default 8192)")
    plan.add_argument("--max-len", type=int, default=None,
                      help="request length for the concurrency column (default: 8192, or "
                           "the model's context if shorter)")
    plan.add_argument("--offline-max-len", type=int, default=None,
                      help="size paged groups for this fixed request length (offline mode)")
    sim = sub.add_parser(
        "simulate", help="replay a trace through a batching scheduler",
        description="Replay a request trace through a continuous-batching scheduler on the "
                    "pure allocator (FIFO admission, chunked prefill, preemption by "
                    "recompute; no prefix caching). With no arguments: --preset "
                    f"{SIMULATE_DEFAULTS['preset']} --memory {SIMULATE_DEFAULTS['memory']} "
                    f"--trace {SIMULATE_DEFAULTS['trace']} (the first 3,000 requests of the "
                    "Azure LLM inference trace 2023, CC-BY-4.0).")
    _model_args(sim, SIMULATE_DEFAULTS["memory"])
    sim.add_argument("--trace", default=SIMULATE_DEFAULTS["trace"],
                     help="code, conv (packaged Azure samples), synthetic, or PATH.csv "
                          "(default conv)")
    sim.add_argument("--requests", type=int, default=None, metavar="N",
                     help="use the first N requests of the trace (default: all)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    sim.add_argument("--max-batched-tokens", type=int, default=2048,
                     help="tokens per step, prefill chunks included (default 2048)")
    sim.add_argument("--max-model-len", type=int, default=None,
                     help="longest request (default: the model's context length)")
    sim.add_argument("--step-ms", type=float, default=20.0,
                     help="simulated milliseconds per step (default 20)")
    sim.add_argument("--speedup", type=float, default=1.0,
                     help="divide arrival times by this (default 1)")
    sim.add_argument("--plot", default="kvfunc-simulate.png", metavar="PNG",
                     help="where to write the usage plot (default kvfunc-simulate.png)")
    sim.add_argument("--no-plot", action="store_true", help="write no plot")
    sim.add_argument("--record", metavar="LOG", help="write the delta log (JSON lines)")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    rep = sub.add_parser(
        "replay", help="replay a delta log and verify its final state",
        description="Rebuild the initial state from a log's header, replay every delta and "
                    "compare block tables and free queues with the recorded final state. "
                    "Exit 0 when they match, 1 when they do not, 2 when the log is malformed.")
    rep.add_argument("log", help="a log written by kvfunc simulate --record")
    rep.add_argument("--json", action="store_true", help="print JSON")
    return parser


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


def _budget(args: argparse.Namespace) -> Budget:
    return Budget(parse_bytes(args.memory, what="--memory"), args.mem_fraction,
                  parse_bytes(args.used_memory, what="--used-memory"),
                  parse_bytes(args.extra_reserved, what="--extra-reserved"))


def _plan(args: argparse.Namespace) -> int:
    model = _model(args, None)
    max_len = args.max_len or min(8192, model.max_model_len)
    report = plan_model(model, PlanConfig(
        _budget(args), concurrency=args.concurrency, max_prefill_tokens=args.max_prefill_tokens,
        max_len=max_len, offline_max_len=args.offline_max_len))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        render_plan(report, make_console())
    return 0


def _simulate(args: argparse.Namespace) -> int:
    model = _model(args, SIMULATE_DEFAULTS["preset"])
    trace = load_trace(args.trace, limit=args.requests, seed=args.seed)
    config = SimulationConfig(model, trace, _budget(args), concurrency=args.concurrency,
                              max_batched_tokens=args.max_batched_tokens,
                              max_model_len=args.max_model_len, step_ms=args.step_ms,
                              speedup=args.speedup)
    log = None
    if args.record:
        try:
            log = open(args.record, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise CLIError(f"cannot write the log {args.record!r}: {exc.strerror}") from None
    err = make_console(stderr=True)
    progress = Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("requests"), TimeElapsedColumn(), console=err,
                        disable=args.no_progress or args.json or not err.is_terminal)
    try:
        with progress:
            task = progress.add_task("simulate", total=len(trace.requests))
            result = run_simulation(config, record=log, on_progress=lambda done, _total:
                                    progress.update(task, completed=done))
    finally:
        if log is not None:
            log.close()
    plot_path = None
    if not args.no_plot:
        from kvfunc.cli._plot import plot_usage  # matplotlib loads only when it is needed

        plot_path = str(plot_usage(result, args.plot))
    if args.json:
        print(json.dumps({**result.to_json(), "plot": plot_path, "log": args.record}, indent=2))
    else:
        render_simulation(result, make_console(), plot_path, args.record)
    return 0


def _replay(args: argparse.Namespace) -> int:
    try:
        final, count = verify_log(args.log)
    except ReplayFailed as exc:
        print(f"kvfunc replay: FAILED: {Path(args.log).name}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"log": args.log, "deltas": count, "ok": True,
                          "usage": format_usage(final)}))
    else:
        print(f"kvfunc replay: OK: {count:,} deltas replayed; the final state matches the "
              f"recorded one bit for bit ({format_usage(final)})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvfunc`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    >>> main(["plan", "--preset", "nope", "--memory", "1GiB"])
    2
    """
    args = build_parser().parse_args(argv)
    handler = {"plan": _plan, "simulate": _simulate, "replay": _replay}[args.command]
    try:
        return handler(args)
    except CLIError as exc:
        print(f"kvfunc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KVFuncError as exc:  # a value the checks above let through; still the user's input
        print(f"kvfunc {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvfunc {args.command}: interrupted", file=sys.stderr)
        return 130
