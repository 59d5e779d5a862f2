"""The ``kvfunc`` argument parser: every option, its default, and its help."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import NoReturn

from kvfunc import WRITE_POLICIES, __version__
from kvfunc.cli._disagg_cli import add_disaggregated_args
from kvfunc.cli._offload import HOST_GBPS, REMOTE_GBPS
from kvfunc.cli._presets import preset_names
from kvfunc.cli._scheduler import CACHE_OUTPUTS

__all__ = ["SIMULATE_DEFAULTS", "SIMULATE_MEMORY", "SIMULATE_TRACE_MEMORY", "build_parser",
           "join_negative_values"]

#: What ``kvfunc simulate`` runs with no arguments: a deliberately small cache,
#: so that the replayed sample shows admission stalls and preemption.
SIMULATE_DEFAULTS = {"preset": "gpt-oss-120b", "trace": "conv", "memory": "2.5GiB"}
#: ``--memory`` when it is not given, for presets that need more than the default.
SIMULATE_MEMORY = {"qwen3-next-80b": "12GiB"}
#: ``--memory`` when it is not given, for built-in traces whose prompts need more (the
#: Mooncake prompts average about 10,000 tokens); the larger of this and the preset's wins.
SIMULATE_TRACE_MEMORY = {"mooncake-conversation": "24GiB", "mooncake-synthetic": "24GiB"}

_NEGATIVE = re.compile(r"-\.?[0-9]")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--memory -5GiB`` as ``--memory=-5GiB``, so that a negative value reads as a value.

    argparse takes ``-5GiB`` for an option (it is not a plain number) and
    would report a missing argument; joined, the option's own check says
    what is wrong with the value.

    >>> join_negative_values(["plan", "--memory", "-5GiB", "--json"])
    ['plan', '--memory=-5GiB', '--json']
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if (arg.startswith("--") and "=" not in arg and i + 1 < len(argv)
                and _NEGATIVE.match(argv[i + 1])):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def _model_args(p: argparse.ArgumentParser, *, memory_help: str | None) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument("--preset", help=f"a built-in model: {', '.join(preset_names())}")
    what.add_argument("--model", metavar="FILE",
                      help="a custom model (.toml or .json; the format: docs/reference/"
                           "model-file.md)")
    p.add_argument("--memory", required=memory_help is None, metavar="SIZE",
                   help="device memory, e.g. 64GiB or 80GB" + (memory_help or ""))
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


def _simulate_args(sim: argparse.ArgumentParser) -> None:
    sim.add_argument("--trace", default=SIMULATE_DEFAULTS["trace"],
                     help="code, conv (Azure samples, token counts only), "
                          "mooncake-conversation, mooncake-synthetic (Mooncake traces, "
                          "prefix sharing recorded), synthetic, or a PATH.csv / PATH.jsonl "
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
    sim.add_argument("--layout", choices=("shared", "per-type", "both"), default=None,
                     help="block pools: shared (one pool for every group, vLLM's hybrid "
                          "layout) or per-type (a pool per group, each sized for its own "
                          "need); both, with --capacity-sweep, plots one curve per layout "
                          "(default: shared for a model with more than one group, unless a "
                          "group would fill less than half of the shared page; else "
                          "per-type)")
    sim.add_argument("--cache-outputs", choices=CACHE_OUTPUTS, default="as-filled",
                     help="when a request's output blocks are cached: as-filled (each as a "
                          "step fills it, as vLLM does) or at-release (hashed once, when the "
                          "request is freed, as SGLang's radix cache inserts them)")
    sim.add_argument("--host-memory", default=None, metavar="SIZE",
                     help="host memory for KV blocks behind the device cache, e.g. 256GiB: "
                          "blocks the device evicts move there and load back on a hit "
                          "(default: none)")
    sim.add_argument("--remote", default=None, metavar="mooncake[:SIZE]",
                     help="a Mooncake Store behind host memory (SIZE: its capacity; "
                          "unbounded without one); needs --host-memory")
    sim.add_argument("--host-bandwidth", type=float, default=HOST_GBPS, metavar="GB/s",
                     help=f"host -> device copy bandwidth, PCIe (default {HOST_GBPS:g}: "
                          "PCIe 4.0 x16)")
    sim.add_argument("--remote-bandwidth", type=float, default=REMOTE_GBPS, metavar="GB/s",
                     help=f"remote -> device bandwidth, the network (default {REMOTE_GBPS:g}: "
                          "100 Gb/s)")
    sim.add_argument("--write-policy", choices=WRITE_POLICIES, default="write-back",
                     help="when blocks move down: write-back (when the device evicts them) "
                          "or write-through (when the device caches them)")
    sim.add_argument("--no-prefix-caching", action="store_true",
                     help="prefill every prompt in full, even on a trace that names its "
                          "prompt blocks (for comparison)")
    sim.add_argument("--capacity-sweep", type=int, nargs="?", const=8, default=None,
                     metavar="POINTS",
                     help="run the trace at POINTS cache sizes (default 8), from one that "
                          "barely holds the longest request to one that evicts nothing, and "
                          "plot hit rate against capacity (each point sets its own --memory)")
    sim.add_argument("--jobs", type=int, default=None, metavar="N",
                     help="processes for --capacity-sweep (default: one per CPU)")
    sim.add_argument("--plot", default=None, metavar="PNG",
                     help="where to write the plot (default kvfunc-simulate.png, or "
                          "kvfunc-sweep.png with --capacity-sweep)")
    sim.add_argument("--no-plot", action="store_true", help="write no plot")
    sim.add_argument("--record", metavar="LOG", help="write the delta log (JSON lines)")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_disaggregated_args(sim)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvfunc`` argument parser (subcommands ``plan``, ``simulate``, ``replay``).

    >>> build_parser().parse_args(["plan", "--preset", "llama-3-8b", "--memory", "64GiB"]).mtp
    """
    parser = _Parser(prog="kvfunc", description="Plan and simulate KV caches with kvfunc.")
    parser.add_argument("--version", action="version", version=f"kvfunc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan", help="blocks, tokens and bytes per manager key for a budget",
        description="Size a model's KV caches with calculate_block_num: the caches get "
                    "--memory x --mem-fraction - --used-memory - --extra-reserved; model "
                    "weights count only if passed as --used-memory.")
    _model_args(plan, memory_help=None)
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
                    "recompute). On a trace that names its prompt blocks (the Mooncake "
                    "traces) prompts share cached prefixes. With no arguments: --preset "
                    f"{SIMULATE_DEFAULTS['preset']} --memory {SIMULATE_DEFAULTS['memory']} "
                    f"--trace {SIMULATE_DEFAULTS['trace']} (the first 3,000 requests of the "
                    "Azure LLM inference trace 2023, CC-BY-4.0).")
    memory_by_preset = ", ".join(f"{size} for {name}" for name, size in SIMULATE_MEMORY.items())
    memory_by_trace = ", ".join(f"{size} on --trace {name}"
                                for name, size in SIMULATE_TRACE_MEMORY.items())
    _model_args(sim, memory_help=f" (default {SIMULATE_DEFAULTS['memory']}; "
                                 f"{memory_by_preset}, whose state caches need more; "
                                 f"{memory_by_trace}, whose prompts are long; the larger "
                                 "of these)")
    _simulate_args(sim)
    rep = sub.add_parser(
        "replay", help="replay a delta log and verify its final state",
        description="Rebuild the initial state from a log's header, replay every delta and "
                    "compare block tables and free queues with the recorded final state. "
                    "Exit 0 when they match, 1 when they do not, 2 when the log is malformed.")
    rep.add_argument("log", help="a log written by kvfunc simulate --record")
    rep.add_argument("--json", action="store_true", help="print JSON")
    return parser
