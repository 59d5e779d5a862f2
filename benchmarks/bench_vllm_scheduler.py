"""vLLM 0.33's Scheduler with its own KV cache manager and with kvfunc's: one workload, one run.

Theory of operation
-------------------
Two vLLM ``Scheduler`` objects (``kvfunc.vllm.harness``, prefix caching on)
serve the same requests, one with vLLM's ``KVCacheManager`` and one with
kvfunc's (``KVFUNC_VLLM=1``'s class).  The workload: 256 requests always
running (``max_num_seqs=256``, more waiting), prompts log-uniform in
128..4096 tokens of which half start with one of 8 shared system prompts,
outputs log-uniform in 16..512 tokens, block size 16, chunked prefill of
8192 tokens a step.  Each step is ``schedule()`` then
``update_from_output()`` with a fake model output (one sampled token per
request that finished its prefill), vLLM's own code both.

Measured per lane, in the same run: the whole step, and the time inside the
manager -- every method the scheduler calls on it (``allocate_slots``,
``get_computed_blocks``, ``free``, ``usage``...), its block pool's
``free_blocks`` and its coordinator's block arithmetic -- through a
subclass that times each call, in all and by call (``allocate_slots`` split
into a running request's one next token and anything larger; the report
prints the five largest, the JSON has every one).  The timing wrapper's own
cost per call is measured on a no-op and subtracted.  After a warm-up that fills the 256
slots, the timed steps run interleaved in segments of 16 (lane order
rotating), the garbage collector off; each round builds both schedulers
afresh; figures are medians over rounds, ratios medians of per-round
ratios.  Untimed checks: every step's scheduled requests, token counts,
block ids and preemptions are identical in both lanes, and so are the
prefix-cache hits.

Targets: time in the manager <= 0.5x vLLM's, a whole step <= 1.0x.
``--profile`` adds a cProfile of kvfunc's manager calls (where its time
goes).  ``--gc`` adds the step as vLLM's engine runs it, with the garbage
collector on: each lane alone in a process of its own (two processes per
lane, alternating), the heap frozen once the scheduler is built (as vLLM's
engine core does), the same warm-up, then the timed steps with every
collection timed through ``gc.callbacks``; it reports the median step and
the collections' time per step.  Run ``python
benchmarks/bench_vllm_scheduler.py [--quick] [--json PATH] [--config
full|hybrid|all] [--profile] [--gc]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from time import perf_counter_ns
from typing import Any

BS = 16
SEGMENT = 16
TARGET_MANAGER, TARGET_STEP = 0.5, 1.0
#: The calls vLLM's scheduler makes on its manager (methods; ``usage`` is a property).
MANAGER_CALLS = (
    "new_step_starts", "get_computed_blocks", "get_computed_blocks_for_connector",
    "allocate_slots", "get_blocks", "get_block_ids", "get_block_ids_for_computed_tokens",
    "free", "pop_blocks_for_free", "cache_blocks", "estimate_cached_tokens",
    "truncate_computed_blocks", "remove_skipped_blocks", "record_prefix_cache_stats",
    "make_prefix_cache_stats", "reset_prefix_cache", "take_events", "take_new_block_ids",
    "take_kv_cache_block_copies", "take_boundary_state_offloads", "record_blocks_for_zeroing",
    "evict_blocks", "finalize_partial_tail_offloads")
CONFIGS = {"full": (None,), "hybrid": (None, 1024)}


def vllm_available() -> str | None:
    """None when vLLM's scheduler imports, else why not."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception as exc:  # any import failure means: no vLLM here
        return f"{type(exc).__name__}: {exc}"
    return None


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def workload(num_requests: int, seed: int = 0, scale: float = 1.0
             ) -> list[tuple[str, list[int], int]]:
    """``(request id, prompt, max_tokens)``: half the prompts open with a shared system prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50000) for _ in range(_log_uniform(rng, 256, 2048))]
               for _ in range(8)]
    out = []
    for i in range(num_requests):
        n = max(2, int(_log_uniform(rng, 128, 4096) * scale))
        head = rng.choice(systems)[:n // 2] if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(50000) for _ in range(n - len(head))]
        out.append((f"req{i}", prompt, max(2, int(_log_uniform(rng, 16, 512) * scale))))
    return out


# ----------------------------------------------------------------------------
# timing the manager


class Clock:
    """Nanoseconds spent in a manager's outermost calls, and how many (a call the manager
    makes on itself is inside its caller's time, not counted again)."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0
        self.hits = 0
        self.depth = 0
        self.by_call: dict[str, list[int]] = {}  # call -> [ns, calls]

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, timed under ``name`` when not inside another timed call."""
        if self.depth:
            return fn(*args, **kwargs)
        self.depth = 1
        t0 = perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = perf_counter_ns() - t0
            self.ns += dt
            self.calls += 1
            self.depth = 0
            if name == "allocate_slots":  # a running request's next token, or anything larger
                name += ", one token" if args[2:3] == (1,) and len(args) == 3 else ", more"
            acc = self.by_call.setdefault(name, [0, 0])
            acc[0] += dt
            acc[1] += 1


def timed_class(cls: type, clock: Clock) -> type:
    """A subclass of ``cls`` whose scheduler-facing calls add their time to ``clock``."""

    def wrap(name: str) -> Callable[..., Any]:
        fn = getattr(cls, name)

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            return clock.call(name, fn, self, *args, **kwargs)

        return timed

    body: dict[str, Any] = {name: wrap(name) for name in MANAGER_CALLS if hasattr(cls, name)}
    usage = cls.usage  # a property

    def timed_usage(self: Any) -> float:
        value: float = clock.call("usage", usage.fget, self)
        return value

    body["usage"] = property(timed_usage)
    return type(f"Timed{cls.__name__}", (cls,), body)


def time_views(manager: Any, clock: Clock) -> None:
    """Time the block pool's ``free_blocks`` and the coordinator's block arithmetic too."""
    for owner, name in ((manager.block_pool, "free_blocks"),
                        (manager.coordinator, "get_num_blocks_to_allocate")):
        fn = getattr(owner, name)

        def timed(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            return clock.call(_name, _fn, *args, **kwargs)

        setattr(owner, name, timed)


def wrapper_cost_ns() -> float:
    """What one timed call adds (a no-op method through the same wrapper), in ns."""

    class Noop:
        def new_step_starts(self) -> None:
            return None

        @property
        def usage(self) -> float:
            return 0.0

    clock = Clock()
    obj = timed_class(Noop, clock)()
    plain = Noop()
    runs = []
    for _ in range(5):
        t0 = perf_counter_ns()
        for _ in range(20000):
            obj.new_step_starts()
        t1 = perf_counter_ns()
        for _ in range(20000):
            plain.new_step_starts()
        runs.append((t1 - t0 - (perf_counter_ns() - t1)) / 20000)
    return max(0.0, statistics.median(runs))


# ----------------------------------------------------------------------------
# the lanes


class Lane:
    """One scheduler over the workload, with its manager's calls timed."""

    def __init__(self, manager: str, windows: tuple[int | None, ...], num_blocks: int,
                 requests: list[tuple[str, list[int], int]], running: int) -> None:
        from kvfunc.vllm.harness import build_scheduler, kv_cache_config, make_request

        self.name = manager
        self.clock = Clock()
        self.scheduler = s = build_scheduler(
            kv_cache_config(num_blocks, BS, windows), manager=manager, max_model_len=16384,
            max_num_seqs=running, max_num_batched_tokens=8192, enable_prefix_caching=True)
        mgr = s.kv_cache_manager
        mgr.__class__ = timed_class(type(mgr), self.clock)
        time_views(mgr, self.clock)
        record = mgr.record_prefix_cache_stats

        def count_hits(request: Any, num_hits: int) -> None:
            self.clock.hits += num_hits
            record(request, num_hits)

        mgr.record_prefix_cache_stats = count_hits
        for rid, prompt, max_tokens in requests:
            s.add_request(make_request(rid, prompt, block_size=BS, max_tokens=max_tokens))
        self.step_ns = 0
        self.digests: list[Any] = []

    def step(self) -> None:
        """One ``schedule()`` and its ``update_from_output()``, timed."""
        from kvfunc.vllm.harness import model_output

        s = self.scheduler
        t0 = perf_counter_ns()
        out = s.schedule()
        result = model_output(out, s)
        s.update_from_output(out, result)
        self.step_ns += perf_counter_ns() - t0
        self.digests.append(digest(out))


def digest(out: Any) -> tuple[Any, ...]:
    """What a step decided: who runs how many tokens on which blocks, who was preempted."""
    c = out.scheduled_cached_reqs
    return (tuple((r.req_id, r.block_ids) for r in out.scheduled_new_reqs),
            tuple(zip(c.req_ids, map(repr, c.new_block_ids), strict=True)),
            tuple(out.num_scheduled_tokens.items()), tuple(sorted(out.preempted_req_ids or ())))


def pool_size(requests: list[tuple[str, list[int], int]], running: int) -> int:
    """Blocks for the first ``running`` requests at their longest, x1.25 (bench_core's rule)."""
    need = sum(-(-(len(p) + m) // BS) for _, p, m in requests[:running])
    return int(need * 1.25) + 1


def run_round(windows: tuple[int | None, ...], requests: list[Any], running: int,
              warmup: int, steps: int) -> dict[str, Lane]:
    """Both lanes through ``warmup`` untimed steps and ``steps`` timed ones, interleaved."""
    blocks = pool_size(requests, running) * len(windows)
    lanes = {name: Lane(name, windows, blocks, requests, running) for name in ("vllm", "kvfunc")}
    for _ in range(warmup):
        for lane in lanes.values():
            lane.step()
    for lane in lanes.values():
        lane.step_ns, lane.clock.ns, lane.clock.calls, lane.digests = 0, 0, 0, []
        lane.clock.by_call = {}
    order = list(lanes.values())
    gc.collect()
    gc.disable()
    try:
        for start in range(0, steps, SEGMENT):
            for lane in order:
                for _ in range(min(SEGMENT, steps - start)):
                    lane.step()
            order.reverse()
    finally:
        gc.enable()
    a, b = lanes["vllm"], lanes["kvfunc"]
    assert a.digests == b.digests, "the two schedulers made different steps"
    assert a.clock.hits == b.clock.hits, f"prefix hits differ: {a.clock.hits} {b.clock.hits}"
    return lanes


def profile_kvfunc(windows: tuple[int | None, ...], requests: list[Any], running: int,
                   warmup: int, steps: int) -> str:
    """Where kvfunc's manager spends its time in the timed steps (cProfile, by own time)."""
    lane = Lane("kvfunc", windows, pool_size(requests, running) * len(windows), requests,
                running)
    for _ in range(warmup):
        lane.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        lane.step()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(r"kvfunc|immutables|pyrsistent", 25)
    return text.getvalue()


def bench(config: str, rounds: int, running: int, warmup: int, steps: int, scale: float,
          profile: bool) -> dict[str, Any]:
    """One configuration: every round, the figures, the ratios and the checks."""
    windows = CONFIGS[config]
    requests = workload(running * 4, scale=scale)
    cost = wrapper_cost_ns()
    per: dict[str, dict[str, list[float]]] = {n: {"manager": [], "step": []}
                                              for n in ("vllm", "kvfunc")}
    calls: dict[str, int] = {}
    split: dict[str, dict[str, Any]] = {}  # call -> µs per step of each lane, per round
    hits = 0
    for _ in range(rounds):
        lanes = run_round(windows, requests, running, warmup, steps)
        for name, lane in lanes.items():
            per[name]["manager"].append((lane.clock.ns - cost * lane.clock.calls) / steps / 1e3)
            per[name]["step"].append((lane.step_ns - cost * lane.clock.calls) / steps / 1e3)
            calls[name] = lane.clock.calls
            for call, (ns, n) in lane.clock.by_call.items():
                split.setdefault(call, {"vllm": [], "kvfunc": [], "calls_per_step": n / steps})
                split[call][name].append((ns - cost * n) / steps / 1e3)
        hits = lanes["vllm"].clock.hits
    ratio = {k: statistics.median(b / a for a, b in zip(per["vllm"][k], per["kvfunc"][k],
                                                         strict=True))
             for k in ("manager", "step")}
    out = {"windows": list(windows), "running": running, "steps": steps, "rounds": rounds,
           "wrapper_ns_per_call": cost, "calls_per_round": calls, "hit_tokens": hits,
           "us_per_step": {n: {k: statistics.median(v) for k, v in d.items()}
                           for n, d in per.items()}, "runs_us": per, "ratio": ratio,
           "by_call_us_per_step": {c: {"calls_per_step": d["calls_per_step"],
                                       **{n: statistics.median(d[n]) for n in ("vllm", "kvfunc")
                                          if d[n]}}
                                   for c, d in split.items()}}
    report(config, out)
    if profile:
        print(profile_kvfunc(windows, requests, running, warmup, min(steps, 100)))
    return out


def gc_lane(manager: str, config: str, running: int, warmup: int, steps: int,
            scale: float) -> dict[str, Any]:
    """One lane alone in this process with the garbage collector on (see ``--gc``)."""
    windows = CONFIGS[config]
    requests = workload(running * 4, scale=scale)
    lane = Lane(manager, windows, pool_size(requests, running) * len(windows), requests,
                running)
    gc.enable()
    gc.collect()
    gc.freeze()  # as vLLM's engine core freezes its heap once the engine is built
    for _ in range(warmup):
        lane.step()
    spent, counts, start = [0, 0, 0], [0, 0, 0], [0]

    def timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            start[0] = perf_counter_ns()
        else:
            spent[info["generation"]] += perf_counter_ns() - start[0]
            counts[info["generation"]] += 1

    times = []
    gc.callbacks.append(timer)
    try:
        for _ in range(steps):
            t0 = perf_counter_ns()
            lane.step()
            times.append(perf_counter_ns() - t0)
    finally:
        gc.callbacks.remove(timer)
    return {"step_us": statistics.median(times) / 1e3,
            "mean_step_us": sum(times) / len(times) / 1e3,
            "gc_us_per_step": [x / steps / 1e3 for x in spent], "collections": counts}


def bench_gc(config: str, running: int, warmup: int, steps: int, scale: float
             ) -> dict[str, Any]:
    """Both lanes with the collector on, each alone in its processes (see ``--gc``)."""
    runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "kvfunc": []}
    for name in ("vllm", "kvfunc", "kvfunc", "vllm"):
        cmd = [sys.executable, __file__, "--gc-lane", name, "--config", config,
               "--sizes", json.dumps([running, warmup, steps, scale])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
        runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out = {n: {"step_us": statistics.median(r["step_us"] for r in rs),
               "gc_us_per_step": statistics.median(sum(r["gc_us_per_step"]) for r in rs),
               "collections": rs[0]["collections"], "runs": rs} for n, rs in runs.items()}
    ratio = out["kvfunc"]["step_us"] / out["vllm"]["step_us"]
    print(f"  with the garbage collector on (each lane alone, two processes each, "
          f"{steps} timed steps):")
    for name in ("vllm", "kvfunc"):
        o = out[name]
        print(f"    {name:7s} whole step {o['step_us']:9.1f} µs/step (median), of which "
              f"collections {o['gc_us_per_step']:7.1f} µs/step (gen 0/1/2 collections in "
              f"the first run: {'/'.join(map(str, o['collections']))})")
    verdict = "PASS" if ratio <= TARGET_STEP else "FAIL"
    print(f"    kvfunc / vLLM, step with the collector on: {ratio:.2f}x (target <= "
          f"{TARGET_STEP}x: {verdict})")
    return {"ratio_step": ratio, **out}


def report(config: str, out: dict[str, Any]) -> None:
    """Print one configuration's figures."""
    med, ratio = out["us_per_step"], out["ratio"]
    print(f"\n-- {config}: windows {out['windows']}, {out['running']} running, "
          f"{out['steps']} timed steps, median of {out['rounds']} rounds "
          f"(timing wrapper {out['wrapper_ns_per_call']:.0f} ns/call, subtracted)")
    for name in ("vllm", "kvfunc"):
        m = med[name]
        print(f"  {name:7s} manager {m['manager']:9.1f} µs/step   whole step "
              f"{m['step']:9.1f} µs/step   ({out['calls_per_round'][name]} manager calls)")
    for key, target in (("manager", TARGET_MANAGER), ("step", TARGET_STEP)):
        verdict = "PASS" if ratio[key] <= target else "FAIL"
        print(f"  kvfunc / vLLM, {key:7s}: {ratio[key]:.2f}x (target <= {target}x: {verdict})")
    print(f"  steps and block ids identical in both lanes; prefix-hit tokens identical: "
          f"{out['hit_tokens']}")
    print("  by call (µs per step, medians; the five largest for vLLM):")
    rows = sorted(out["by_call_us_per_step"].items(), key=lambda kv: -kv[1].get("vllm", 0))
    for call, d in rows[:5]:
        v, k = d.get("vllm", 0.0), d.get("kvfunc", 0.0)
        print(f"    {call:34s} {d['calls_per_step']:6.1f} calls  vllm {v:8.1f}  kvfunc {k:8.1f}"
              f"  ({k / v if v else float('nan'):.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--config", choices=["full", "hybrid", "all"], default="all")
    parser.add_argument("--profile", action="store_true",
                        help="also profile kvfunc's manager calls (cProfile)")
    parser.add_argument("--gc", action="store_true",
                        help="also time each lane alone with the garbage collector on")
    parser.add_argument("--gc-lane", choices=["vllm", "kvfunc"], help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gc_lane:  # one lane of --gc, in a process of its own: its figures as JSON
        if args.config == "all" or not args.sizes:
            parser.error("--gc-lane runs one lane of --gc: it needs one --config and --sizes")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            running, warmup, steps, scale = json.loads(args.sizes)
            print(json.dumps(gc_lane(args.gc_lane, args.config, running, warmup, steps,
                                     scale)))
        return 0
    why = vllm_available()
    print(f"kvfunc bench_vllm_scheduler{' --quick' if args.quick else ''}: Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, load "
          f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    if why is not None:
        print(f"vLLM is not installed here ({why}); nothing to compare. "
              "bash .ci/vllm-env.sh installs vLLM 0.33 for CPU.")
        return 0
    sizes = (1, 16, 8, 24, 0.1) if args.quick else (3, 256, 60, 300, 1.0)
    rounds, running, warmup, steps, scale = sizes
    configs = list(CONFIGS) if args.config == "all" else [args.config]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = {c: bench(c, rounds, running, warmup, steps, scale, args.profile)
                   for c in configs}
        if args.gc:
            for c in configs:
                print(f"\n-- {c}:")
                results[c]["gc_on"] = bench_gc(c, running, warmup, steps, scale)
    if args.json:
        Path(args.json).write_text(json.dumps({"quick": args.quick, "configs": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
