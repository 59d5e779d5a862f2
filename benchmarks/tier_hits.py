"""What tiers buy on the Mooncake conversation trace: hit rates by tier, and what they cost.

Theory of operation
-------------------
This script runs ``kvfunc simulate``'s scheduler three times on one trace
and one device budget (deepseek-v3, 24 GiB by default):

* the device alone;
* with host memory behind it (``--host-memory``, 256 GiB by default);
* with a Mooncake Store behind the host too (``--remote``, 2 TiB by default);

and prints, per run, the prompt-token hit rate (split by tier), the blocks
loaded and stored, the time to first token the loads save against recompute
(:mod:`kvfunc.cli._offload`'s model), the allocator's time and the wall time.
It checks the targets of the tiered runs (hit rate >= 17 % with host memory,
>= 34 % with the store; an LRU cache of those capacities hits 18.5 % and
36.7 %) and exits 1 when one is missed; ``--requests N`` runs a prefix of the
trace and checks nothing but that the tiers add hits.

Run ``python benchmarks/tier_hits.py [--requests N] [--json PATH]``; the
whole trace takes about ten minutes on a two-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvfunc.cli._offload import OffloadConfig
from kvfunc.cli._plan import Budget
from kvfunc.cli._presets import build_preset
from kvfunc.cli._simulate import SimulationConfig, run_simulation
from kvfunc.cli._trace import load_trace
from kvfunc.cli._units import parse_bytes

TARGETS = {"host": 0.17, "host+remote": 0.34}


def run(name: str, config: SimulationConfig) -> dict[str, Any]:
    """One run's figures."""
    result = run_simulation(config)
    prefix = result.prefix
    assert prefix is not None
    row: dict[str, Any] = {
        "run": name, "hit_rate": round(prefix.hit_rate, 4),
        "bound": round(prefix.bound.hit_rate, 4), "wall_s": round(result.wall_s, 1),
        "allocator_s": round(result.alloc_us["total_ms"] / 1000, 1),
        "served": result.counters["served"]}
    if result.tiers is not None:
        t = result.tiers.to_json()
        row.update({k: t[k] for k in ("hit_tokens", "loaded_blocks", "stored_blocks",
                                      "ttft_saved_s", "ttft_saved_ms_per_loading_admission")})
        row["hit_share"] = {k: round(v / prefix.prompt_tokens, 4)
                            for k, v in t["hit_tokens"].items()}
    print(json.dumps(row), flush=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three configurations; exit 1 when a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--memory", default="24GiB")
    parser.add_argument("--host-memory", default="256GiB")
    parser.add_argument("--remote", default="2TiB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    trace = load_trace("mooncake-conversation", limit=args.requests)
    base = SimulationConfig(build_preset("deepseek-v3"), trace,
                            Budget(parse_bytes(args.memory, what="--memory")))
    host = parse_bytes(args.host_memory, what="--host-memory")
    remote = parse_bytes(args.remote, what="--remote")
    runs = [run("device", base),
            run("host", SimulationConfig(base.model, trace, base.budget,
                                         offload=OffloadConfig(host))),
            run("host+remote", SimulationConfig(base.model, trace, base.budget,
                                                offload=OffloadConfig(host, True, remote)))]
    rates = {r["run"]: r["hit_rate"] for r in runs}
    if args.requests is None:
        missed = [f"{name}: {rates[name]:.1%} < {goal:.0%}" for name, goal in TARGETS.items()
                  if rates[name] < goal]
    else:
        missed = [] if rates["device"] <= rates["host"] <= rates["host+remote"] else [
            f"tiers lost hits: {rates}"]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"runs": runs, "targets": TARGETS, "missed": missed}, f, indent=2)
    for line in missed:
        print(f"missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
