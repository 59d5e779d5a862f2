"""Output blocks cached as they fill, or once at release: hit rates and KV events on both traces.

Theory of operation
-------------------
An engine may skip hashing while a request decodes and hand the request's
hashes to ``free_request(..., block_hashes=)`` when it finishes or is
preempted; its output blocks are then cached at release, as SGLang's radix
cache inserts a request's tokens at its end, instead of one by one as each
fills (vLLM's way).  This script runs ``kvfunc simulate``'s scheduler both
ways (``--cache-outputs as-filled`` and ``at-release``) on both Mooncake
traces and reports, per trace:

* the prompt-token hit rate of each way and their difference in points
  (the claim: within 0.1 points);
* that the KV events of each run describe its cache exactly: every delta's
  events (``kvfunc.events.events_from_delta``) applied to a
  ``CachedBlocksView`` in order end equal to the final state's own view, and
  the count of blocks the events report stored equals the count the deltas
  stored.

Run ``python benchmarks/cache_outputs.py [--requests N] [--preset NAME]
[--memory SIZE] [--json PATH]``; the defaults (3,000 requests of each trace,
gpt-oss-120b, 24 GiB) take a few minutes.  The traces are Mooncake FAST'25's
(Apache-2.0), shipped with kvfunc.  The script exits 1 when a claim fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from kvfunc.cli._plan import Budget
from kvfunc.cli._presets import build_preset
from kvfunc.cli._simulate import SimulationConfig, build_state, run_simulation
from kvfunc.cli._trace import load_trace
from kvfunc.cli._units import parse_bytes
from kvfunc.core import BlocksChanged
from kvfunc.events import BlockStored, CachedBlocksView, events_from_delta

TRACES = ("mooncake-conversation", "mooncake-synthetic")
MODES = ("as-filled", "at-release")
MAX_GAP_POINTS = 0.1


def run(config: SimulationConfig) -> dict[str, Any]:
    """One simulation; its hit rate and whether its KV events mirror its cache."""
    sizes = build_state(config)  # the block sizes events are reported in
    view = CachedBlocksView()
    counts = {"events": 0, "deltas": 0}

    def on_delta(_step: int, delta: BlocksChanged) -> None:
        nonlocal view
        events = events_from_delta(delta, sizes)
        view = view.apply(events)
        counts["events"] += sum(len(e.block_hashes) for e in events if type(e) is BlockStored)
        counts["deltas"] += len(delta.stored_keys)

    result = run_simulation(config, on_delta=on_delta)
    assert result.prefix is not None, "the trace names no prompt blocks"
    return {"hit_rate_pct": 100 * result.prefix.hit_rate,
            "hit_tokens": result.prefix.hit_tokens,
            "served": result.counters["served"],
            "stored_blocks_events": counts["events"],
            "stored_blocks_deltas": counts["deltas"],
            "events_mirror_cache": view == CachedBlocksView.of_state(result.final_state),
            "wall_s": round(result.wall_s, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run both ways on both traces; print the table; exit 1 if a claim fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--preset", default="gpt-oss-120b")
    parser.add_argument("--memory", default="24GiB")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    model = build_preset(args.preset)
    figures: dict[str, Any] = {}
    ok = True
    for trace_name in TRACES:
        trace = load_trace(trace_name, limit=args.requests)
        runs = {mode: run(SimulationConfig(model, trace, Budget(parse_bytes(args.memory)),
                                           cache_outputs=mode)) for mode in MODES}
        gap = runs["at-release"]["hit_rate_pct"] - runs["as-filled"]["hit_rate_pct"]
        mirrored = all(r["events_mirror_cache"] and r["stored_blocks_events"]
                       == r["stored_blocks_deltas"] for r in runs.values())
        ok = ok and abs(gap) <= MAX_GAP_POINTS and mirrored
        figures[trace_name] = {**runs, "gap_points": round(gap, 3), "events_ok": mirrored}
        for mode, r in runs.items():
            print(f"{trace_name:22} {mode:10} hit {r['hit_rate_pct']:6.3f} %  served "
                  f"{r['served']:5}  stored (events/deltas) {r['stored_blocks_events']:,}/"
                  f"{r['stored_blocks_deltas']:,}  events mirror the cache: "
                  f"{r['events_mirror_cache']}  ({r['wall_s']} s)")
        print(f"{trace_name:22} at-release - as-filled: {gap:+.3f} points "
              f"(claim: within {MAX_GAP_POINTS})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"preset": args.preset, "memory": args.memory,
                       "requests": args.requests, "traces": figures}, out, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
