"""Cost of prefix caching: the same shared-prefix trace with caching off and on.

Theory of operation
-------------------
A seeded generator (stdlib ``random``) builds the whole trace before
anything is timed, token ids included.  It is ``bench_core``'s trace (``R``
requests always running, prompts log-uniform 128..4096 tokens, outputs
log-uniform 16..1024, block size 16, ``max_model_len`` 8192, a fill step then
decode steps of exactly ``R`` allocate calls) except that half of the
prompts start with one of 8 fixed system prompts of 256..2048 tokens: such a
prompt is the system prompt followed by a user part drawn like a core
prompt.  Every token id (system prompts, user parts, outputs) is a seeded
random id in 0..65535.

The trace is replayed through these lanes, all on the same pool.  In every
lane the engine keeps each request's token list, as any engine does: it
appends each decode token and drops the list when the request ends.

* caching off (a plain state, counts only, as an engine without caching
  calls the core): ``allocate_slots`` per call, or ``allocate_batch`` per
  step over plain tuples built in the timed loop;
* caching on, for ``sha256`` and ``xxh3_128``, the engine's whole work:
  ``BlockHashes.of`` of each admitted prompt, ``lookup_prefix`` and the
  admission with the hit (a ``SlotRequest``), ``BlockHashes.update`` when a
  decode token fills a block (hashing it once), plain tuples for decodes
  with the step's ``block_hashes`` mapping (``block_hashes=`` per call on the
  per-call lane), the frees;

each per step (one ``allocate_batch``: the target, all steps), per call (one
``allocate_slots`` per request: information, the first 128 steps) and on
decode-only steps (every request of the fill decodes, nothing is admitted or
freed: ``allocate_batch``, the decode target).

Lanes are timed in interleaved segments of steps (the order rotates), with
the garbage collector off, and medians of the rounds are reported; the
on/off ratio is the median of the per-round ratios of lanes that ran side by
side.  Untimed checks: the caching-off lanes end with the block ids of
``bench_core``'s naive allocator; the caching-on lanes end with the same
block ids for ``sha256`` and ``xxh3_128``; ``check_invariants`` holds on
every final state; a hit never exceeds the admitted prompt's system prompt
(and unshared prompts never hit).  ``benchmarks/README.md`` explains every
figure.  Run ``python benchmarks/bench_prefix.py [--quick] [--json PATH]
[--profile | --profile-only] [--config full|hybrid]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import json
import math
import os
import platform
import pstats
import random
import statistics
import sys
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import kvfunc as kf


def _load_core() -> Any:
    """``bench_core.py`` (its naive allocator, pool sizing and cross-check), by path."""
    path = Path(__file__).resolve().with_name("bench_core.py")
    spec = importlib.util.spec_from_file_location("bench_core", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_core", module)
    spec.loader.exec_module(module)
    return module


core = _load_core()

BLOCK_SIZE = core.BLOCK_SIZE  # 16
MAX_MODEL_LEN = core.MAX_MODEL_LEN  # 8192
CONFIGS = core.CONFIGS  # full; full + SlidingWindow(1024)
SEED = 0
SHARED_FRACTION = 0.5
SYSTEM_LENGTHS = tuple(round(256 * 8 ** (i / 7)) for i in range(8))  # 256 .. 2048, log-spaced
TARGET_RATIO = 1.5  # caching on <= 1.5x caching off, per call, hashing included
HASH_FNS = ("sha256", "xxh3_128")
SEGMENT = 32  # steps timed back to back before the next lane takes its turn
DECODE_STEPS = 128  # decode-only steps after the fill (the 1.25x target)
TARGET_DECODE_RATIO = 1.25  # caching on <= 1.25x caching off, decode-only steps

Refused = core.Refused
_us, _verdict = core._us, core._verdict  # the same units and wording as bench_core
Alloc = tuple[int, int, int]  # (request id, computed tokens, new tokens)
Step = tuple[tuple[int, ...], tuple[Alloc, ...]]  # (freed, allocs): bench_core's step
Op = tuple[int, int, Any]  # (rid, 0, prompt token list) admits; (rid, computed, token) decodes
OnStep = tuple[tuple[int, ...], tuple[Op, ...]]


# ----------------------------------------------------------------------------
# the trace

class Trace:
    """The seeded shared-prefix trace, as counts (``steps``) and with tokens (``on_steps``).

    ``fill``/``steps`` are ``bench_core``'s format; ``on_fill``/``on_steps``
    hold the same calls with their tokens: an admission is
    ``(rid, 0, prompt)`` and a decode ``(rid, computed, token)``, the token
    the engine appends to the request before the call.
    """

    def __init__(self, num_running: int, num_steps: int, seed: int = SEED) -> None:
        rng = random.Random(seed)

        def log_uniform(lo: int, hi: int) -> int:
            return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))

        def tokens(n: int) -> list[int]:
            return list(array("H", rng.randbytes(2 * n)))

        self.system = [tokens(n) for n in SYSTEM_LENGTHS]
        self.prompts: dict[int, list[int]] = {}
        self.system_of: dict[int, int | None] = {}  # rid -> index of its system prompt
        outputs: dict[int, list[int]] = {}
        next_rid = 0

        def admit() -> list[int]:  # [rid, prompt length, output length, generated]
            nonlocal next_rid
            next_rid += 1
            rid = next_rid
            user, out = log_uniform(128, 4096), log_uniform(16, 1024)
            if rng.random() < SHARED_FRACTION:
                k = rng.randrange(len(self.system))
                prompt = self.system[k] + tokens(user)
            else:
                k, prompt = None, tokens(user)
            self.prompts[rid], self.system_of[rid], outputs[rid] = prompt, k, tokens(out)
            return [rid, len(prompt), out, 0]

        running = [admit() for _ in range(num_running)]
        fill_ids = [(r[0], r[1]) for r in running]  # (rid, prompt length) of the fill
        self.fill: tuple[Alloc, ...] = tuple((r[0], 0, r[1]) for r in running)
        self.on_fill: tuple[Op, ...] = tuple((r[0], 0, self.prompts[r[0]]) for r in running)
        self.steps: list[Step] = []
        self.on_steps: list[OnStep] = []
        for _ in range(num_steps):
            frees: list[int] = []
            allocs: list[Alloc] = []
            ops: list[Op] = []
            for i, r in enumerate(running):
                rid, prompt, output, generated = r
                if generated == output:  # finished last step: free it, admit one here
                    frees.append(rid)
                    r = running[i] = admit()
                    allocs.append((r[0], 0, r[1]))
                    ops.append((r[0], 0, self.prompts[r[0]]))
                else:
                    allocs.append((rid, prompt + generated, 1))
                    ops.append((rid, prompt + generated, outputs[rid][generated]))
                    r[3] = generated + 1
            self.steps.append((tuple(frees), tuple(allocs)))
            self.on_steps.append((tuple(frees), tuple(ops)))
        # decode-only steps after the fill: every request of the fill decodes its output, with
        # no admission and no free (a request that has finished drops out of the steps)
        self.decode_steps: list[OnStep] = [
            ((), tuple((rid, n + k, outputs[rid][k]) for rid, n in fill_ids
                       if k < len(outputs[rid])))
            for k in range(DECODE_STEPS)]
        assert all(len(p) + 1024 <= MAX_MODEL_LEN for p in self.prompts.values())

    def calls(self) -> int:
        return sum(len(a) for _, a in self.steps)

    def admissions(self) -> int:
        return sum(len(f) for f, _ in self.steps)


# ----------------------------------------------------------------------------
# the lanes: setup (untimed, replays the fill), replay (timed), snapshot

Groups = tuple[tuple[str, int | None, int], ...]  # (key, window or None, num_blocks)


def make_state(groups: Groups, caching: bool) -> kf.KVState:
    policies: dict[str, Any] = {
        key: kf.FullAttention(num_blocks=n, block_size=BLOCK_SIZE) if w is None
        else kf.SlidingWindow(num_blocks=n, block_size=BLOCK_SIZE, sliding_window=w)
        for key, w, n in groups}
    return kf.KVState.create(policies, max_model_len=MAX_MODEL_LEN,
                             enable_prefix_caching=caching)


class Ctx:
    """A lane's engine-side state: the core state, and per request its hashes and tokens."""

    def __init__(self, state: kf.KVState, hash_fn: str | None, trace: Trace) -> None:
        self.state = state
        self.hash_fn = hash_fn
        self.hashes: dict[int, kf.BlockHashes] = {}
        # the engine's token list of each request (copied here, untimed: the engine has it)
        self.toks = {r: list(p) for r, p in trace.prompts.items()}
        self.retries = 0  # batched admissions refused because a hit block was evicted


def off_setup(groups: Groups, trace: Trace, hash_fn: str | None) -> Ctx:
    res = kf.allocate_batch(make_state(groups, False), trace.fill)
    if res.refused:
        raise Refused(res.refused)
    return Ctx(res.state, None, trace)


def on_setup(groups: Groups, trace: Trace, hash_fn: str | None) -> Ctx:
    ctx = Ctx(make_state(groups, True), hash_fn, trace)
    on_call_replay(ctx, [((), trace.on_fill)], None)  # the fill, one admission at a time
    return ctx


def off_call_replay(ctx: Ctx, steps: Sequence[OnStep], log: list[Any] | None) -> None:
    allocate_slots, free_request = kf.allocate_slots, kf.free_request
    state, toks = ctx.state, ctx.toks
    for frees, ops in steps:
        for rid in frees:
            state, _ = free_request(state, rid)
            del toks[rid]
        for rid, computed, x in ops:
            if computed:  # decode: the engine appends the token (caching or not)
                toks[rid].append(x)
                r = allocate_slots(state, rid, computed, 1)
            else:
                r = allocate_slots(state, rid, 0, len(x))
            if not r.ok:
                raise Refused(rid)
            state = r.state
            if log is not None:
                log.append(r.delta)
    ctx.state = state


def off_batch_replay(ctx: Ctx, steps: Sequence[OnStep], log: list[Any] | None) -> None:
    allocate_batch, free_request = kf.allocate_batch, kf.free_request
    state, toks = ctx.state, ctx.toks
    for frees, ops in steps:
        for rid in frees:
            state, _ = free_request(state, rid)
            del toks[rid]
        reqs = []
        for rid, computed, x in ops:  # the documented natural form: plain tuples
            if computed:  # decode: the engine appends the token (caching or not)
                toks[rid].append(x)
                reqs.append((rid, computed, 1))
            else:
                reqs.append((rid, 0, len(x)))
        res = allocate_batch(state, reqs)
        if res.refused:
            raise Refused(res.refused)
        state = res.state
        if log is not None:
            log.append(res.delta)
    ctx.state = state


def on_call_replay(ctx: Ctx, steps: Sequence[OnStep], log: list[Any] | None) -> None:
    allocate_slots, free_request, lookup = kf.allocate_slots, kf.free_request, kf.lookup_prefix
    of, fn, bs = kf.BlockHashes.of, ctx.hash_fn, BLOCK_SIZE
    state, hashes, toks = ctx.state, ctx.hashes, ctx.toks
    for frees, ops in steps:
        for rid in frees:
            state, d = free_request(state, rid)
            del hashes[rid], toks[rid]
            if log is not None:
                log.append(d)
        for rid, computed, x in ops:
            if computed:  # decode: the engine appends the token; a full block is hashed once
                t = toks[rid]
                t.append(x)
                if not len(t) % bs:
                    hashes[rid] = hashes[rid].update(t)
                r = allocate_slots(state, rid, computed, 1, block_hashes=hashes[rid])
            else:  # admission: hash the prompt, look it up, admit with the hit
                h = hashes[rid] = of(x, bs, hash_fn=fn)
                hit = lookup(state, h, max_tokens=len(x) - 1)
                r = allocate_slots(state, rid, hit.num_tokens, len(x) - hit.num_tokens,
                                   block_hashes=h, prefix_hit=hit)
            if not r.ok:
                raise Refused(rid)
            state = r.state
            if log is not None:
                log.append(r.delta)
    ctx.state = state


def on_batch_replay(ctx: Ctx, steps: Sequence[OnStep], log: list[Any] | None) -> None:
    allocate_batch, free_request, lookup = kf.allocate_batch, kf.free_request, kf.lookup_prefix
    of, fn, bs, slot_request = kf.BlockHashes.of, ctx.hash_fn, BLOCK_SIZE, kf.SlotRequest
    state, hashes, toks = ctx.state, ctx.hashes, ctx.toks
    for frees, ops in steps:
        for rid in frees:
            state, d = free_request(state, rid)
            del hashes[rid], toks[rid]
            if log is not None:
                log.append(d)
        reqs = []
        for rid, computed, x in ops:
            if computed:  # decode: a plain tuple; a block that fills is hashed once, here
                t = toks[rid]
                t.append(x)
                if not len(t) % bs:
                    hashes[rid] = hashes[rid].update(t)
                reqs.append((rid, computed, 1))
            else:  # looked up on the state before the step, as a scheduler does
                h = hashes[rid] = of(x, bs, hash_fn=fn)
                hit = lookup(state, h, max_tokens=len(x) - 1)
                reqs.append(slot_request(rid, hit.num_tokens, len(x) - hit.num_tokens,
                                         block_hashes=h, prefix_hit=hit))
        res = allocate_batch(state, reqs, block_hashes=hashes)  # read only where a block fills
        state = res.state
        if log is not None:
            log.append(res.delta)
        for rid in res.refused:  # a hit block was handed out earlier in the step: look again
            ctx.retries += 1
            prompt = next(x for r, c, x in ops if r == rid and not c)
            h = hashes[rid]
            hit = lookup(state, h, max_tokens=len(prompt) - 1)
            r = kf.allocate_slots(state, rid, hit.num_tokens, len(prompt) - hit.num_tokens,
                                  block_hashes=h, prefix_hit=hit)
            if not r.ok:
                raise Refused(rid)
            state = r.state
            if log is not None:
                log.append(r.delta)
    ctx.state = state


class Lane:
    """One timed path: caching off or on (with a hash function), per call or per step.

    ``suffix`` names what it replays: ``batch`` and ``call`` the trace's steps,
    ``decode`` its decode-only steps (batched).
    """

    def __init__(self, caching: bool, batched: bool, hash_fn: str | None = None,
                 suffix: str | None = None) -> None:
        self.caching, self.batched, self.hash_fn = caching, batched, hash_fn
        mode = "allocate_batch per step" if batched else "allocate_slots per call"
        suffix = suffix or ("batch" if batched else "call")
        self.name = (f"on_{hash_fn}" if caching else "off") + f"_{suffix}"
        self.label = f"caching {'on, ' + str(hash_fn) if caching else 'off'}, {mode}"
        self.setup = on_setup if caching else off_setup
        self.replay: Callable[[Ctx, Sequence[Any], list[Any] | None], None] = (
            (on_batch_replay if batched else on_call_replay) if caching
            else (off_batch_replay if batched else off_call_replay))


def snapshot(state: kf.KVState) -> Any:
    return core.state_snapshot(state)


def time_lanes(lanes: Sequence[Lane], groups: Groups, trace: Trace, rounds: int,
               steps: Sequence[OnStep]) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Nanoseconds per round of every lane, and each lane's final snapshot (last round).

    A round sets every lane up (untimed, the fill step), then replays
    ``steps`` in segments of ``SEGMENT``: every lane replays a segment, in an
    order that rotates, before the next segment starts.
    ``check_invariants`` runs on every final state.
    """
    times: dict[str, list[int]] = {lane.name: [] for lane in lanes}
    snaps: dict[str, Any] = {}
    for _ in range(rounds):
        ctxs = [lane.setup(groups, trace, lane.hash_fn) for lane in lanes]
        spent = [0] * len(lanes)
        gc.collect()
        gc.disable()
        try:
            for i, start in enumerate(range(0, len(steps), SEGMENT)):
                segment = steps[start:start + SEGMENT]
                for j in range(len(lanes)):
                    k = (i + j) % len(lanes)
                    t0 = perf_counter_ns()
                    lanes[k].replay(ctxs[k], segment, None)
                    spent[k] += perf_counter_ns() - t0
        finally:
            gc.enable()
        for lane, ctx, ns in zip(lanes, ctxs, spent, strict=True):
            times[lane.name].append(ns)
            snaps[lane.name] = snapshot(ctx.state)
            kf.check_invariants(ctx.state)
        del ctxs
    return times, snaps


# ----------------------------------------------------------------------------
# untimed checks and cache metrics

def naive_snapshot(groups: Groups, trace: Trace, num_steps: int) -> Any:
    """``bench_core``'s naive allocator after the fill and the first ``num_steps`` steps."""
    naive = core.NaiveAllocator(groups, MAX_MODEL_LEN)
    if naive.allocate_step(trace.fill):
        raise Refused("fill")
    core.naive_batch_replay(naive, trace.steps[:num_steps])
    return naive.snapshot()


def cache_metrics(lane: Lane, groups: Groups, trace: Trace, num_steps: int) -> dict[str, Any]:
    """Replay ``lane`` once, untimed, keeping its deltas: metrics, hit checks, invariants."""
    ctx = lane.setup(groups, trace, lane.hash_fn)
    stats = kf.PrefixCacheStats()
    seen: set[int] = {trace.system_of[r] for r, _, _ in trace.fill} - {None}  # type: ignore[misc]
    ideal = 0
    steps = trace.on_steps[:num_steps]
    for start in range(0, len(steps), SEGMENT):
        log: list[Any] = []
        segment = steps[start:start + SEGMENT]
        lane.replay(ctx, segment, log)
        for d in log:
            stats = stats.add(d)
            for rid, got in zip(d.hit_request_ids, d.hit_tokens, strict=True):
                k = trace.system_of[rid]
                most = (0 if k is None else
                        min(len(trace.system[k]), len(trace.prompts[rid]) - 1)
                        // BLOCK_SIZE * BLOCK_SIZE)
                assert got <= most and got % BLOCK_SIZE == 0, (rid, got, most)
        for _, ops in segment:  # the best any cache could do: every repeated system prompt
            for rid, computed, _ in ops:
                k = trace.system_of[rid]
                if not computed and k is not None:
                    if k in seen:
                        ideal += (min(len(trace.system[k]), len(trace.prompts[rid]) - 1)
                                  // BLOCK_SIZE * BLOCK_SIZE)
                    seen.add(k)
    kf.check_invariants(ctx.state)
    admissions = sum(len(f) for f, _ in steps)
    assert stats.queries == admissions, (stats.queries, admissions)
    return {"queries": stats.queries, "hits": stats.hits, "query_tokens": stats.query_tokens,
            "hit_tokens": stats.hit_tokens, "hit_rate": stats.hit_rate,
            "ideal_hit_tokens": ideal, "stored_blocks": stats.stored_blocks,
            "evicted_blocks": stats.evicted_blocks, "batch_retries": ctx.retries,
            "snapshot": snapshot(ctx.state)}


# ----------------------------------------------------------------------------
# the report

class Settings:
    """Sizes of one run (full or ``--quick``)."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.num_running = 16 if quick else 256
        self.num_steps = 48 if quick else 512  # the batched lanes (the target)
        self.call_steps = 48 if quick else 128  # the per-call lanes (info; 2-3x slower)
        self.profile_steps = 48 if quick else 128
        self.rounds = 2 if quick else 5


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def hash_functions() -> list[str]:
    """The hash functions this machine has (``xxh3_128`` needs the ``xxhash`` package)."""
    out = []
    for fn in HASH_FNS:
        try:
            kf.hash_function(fn)
        except kf.NotSupportedError:
            continue
        out.append(fn)
    return out


def pools_for(config: str, trace: Trace) -> tuple[dict[str, int], Groups]:
    """Per group: the caching-off peak, and the groups with pools of peak x1.25 (bench_core's)."""
    windows = CONFIGS[config]
    peak = core.peak_blocks(windows, trace.fill, trace.steps)
    return peak, tuple((k, w, core.pool_for(peak[k])) for k, w in windows)


def time_mode(s: Settings, mode: str, groups: Groups, trace: Trace, fns: Sequence[str],
              num_steps: int) -> dict[str, Any]:
    """Time caching off against caching on (every hash function).

    ``mode`` is ``batch`` (the trace's steps, allocate_batch: the target),
    ``call`` (allocate_slots per call: information) or ``decode`` (decode-only
    steps after the fill, allocate_batch: the decode target).
    """
    batched = mode != "call"
    lanes = [Lane(False, batched, suffix=mode)] + [Lane(True, batched, fn, mode) for fn in fns]
    steps = (trace.decode_steps if mode == "decode" else trace.on_steps)[:num_steps]
    num_steps = len(steps)
    calls = sum(len(ops) for _, ops in steps)
    target = TARGET_DECODE_RATIO if mode == "decode" else TARGET_RATIO
    load0 = _load()
    times, snaps = time_lanes(lanes, groups, trace, s.rounds, steps)
    load1 = _load()
    med = {n: statistics.median(t) for n, t in times.items()}
    what = {"batch": "allocate_batch per step: the target",
            "call": "allocate_slots per call: information",
            "decode": "decode-only steps, allocate_batch per step: the decode target"}[mode]
    print(f"{what}; {num_steps} steps, {calls} calls per round; load {load0} -> {load1}")
    print(f"  {'lane':46s} {'µs/call':>8s} {'µs/step':>9s}   {'min..max µs/call':>16s}")
    for lane in lanes:
        t = times[lane.name]
        print(f"  {lane.label:46s} {_us(med[lane.name]) / calls:8.3f} "
              f"{_us(med[lane.name]) / num_steps:9.1f}   "
              f"{_us(min(t)) / calls:7.3f}..{_us(max(t)) / calls:<7.3f}")
    off = times[f"off_{mode}"]
    ratios = {fn: statistics.median(a / b for a, b in zip(times[f"on_{fn}_{mode}"], off,
                                                            strict=True)) for fn in fns}
    print("  ratio on/off (median of per-round ratios): "
          + ", ".join(f"{fn} {r:.2f}x {_verdict(r <= target)}" for fn, r in ratios.items())
          + f" (<= {target}x)")
    return {"num_steps": num_steps, "calls": calls, "runs_ns": times, "target": target,
            "us_per_call": {n: _us(v) / calls for n, v in med.items()},
            "us_per_step": {n: _us(v) / num_steps for n, v in med.items()},
            "ratio_on_off": ratios, "load_before": load0, "load_after": load1,
            "snapshots": snaps}


def bench_config(s: Settings, config: str, trace: Trace, fns: Sequence[str],
                 out: dict[str, Any]) -> bool:
    peak, groups = pools_for(config, trace)
    print(f"\n-- ({'i' if config == 'full' else 'ii'}) {config}: "
          + " + ".join(f"{k}[{'FullAttention' if w is None else f'SlidingWindow({w})'}] "
                       f"peak {peak[k]} -> {n} blocks" for k, w, n in groups))
    steps = {"batch": s.num_steps, "call": s.call_steps}
    timed = {mode: time_mode(s, mode, groups, trace, fns, n) for mode, n in steps.items()}
    timed["decode"] = time_mode(s, "decode", groups, trace, fns, DECODE_STEPS)
    ok = all(r <= t["target"] for t in timed.values() for r in t["ratio_on_off"].values())

    # untimed: cache metrics and cross-checks
    metrics = {mode: cache_metrics(Lane(True, mode == "batch", fns[0]), groups, trace, n)
               for mode, n in steps.items()}
    for mode, m in metrics.items():
        print(f"cache ({fns[0]}, {'per step' if mode == 'batch' else 'per call'}, "
              f"{steps[mode]} steps): {m['hits']}/{m['queries']} admissions hit; hit tokens "
              f"{m['hit_tokens']} of {m['query_tokens']} looked up, hit rate "
              f"{m['hit_rate']:.1%} (a cache that never evicts: {m['ideal_hit_tokens']}); "
              f"{m['stored_blocks']} blocks stored, {m['evicted_blocks']} evicted"
              + (f"; {m['batch_retries']} admissions looked up again" if mode == "batch"
                 else ""))
    for mode, n in steps.items():
        snaps = timed[mode].pop("snapshots")
        core.cross_check({f"off_{mode}": snaps[f"off_{mode}"],
                          "naive": naive_snapshot(groups, trace, n)})
        core.cross_check({"metrics pass": metrics[mode].pop("snapshot"),
                          **{fn: snaps[f"on_{fn}_{mode}"] for fn in fns}})
    snaps = timed["decode"].pop("snapshots")
    core.cross_check({fn: snaps[f"on_{fn}_decode"] for fn in fns})
    print(f"cross-check [{config}]: caching off = bench_core's naive allocator (block ids, free "
          f"queues), per call and per step; caching on: {' = '.join(fns)}, per call, per "
          f"step and decode-only; check_invariants on every final state; every hit within "
          f"its prompt's system prompt: OK")
    out["configs"][config] = {"peak": peak, "pools": {k: n for k, _, n in groups},
                              "target_met": ok, "cache": metrics, **timed}
    return ok


PROFILED = {("_transitions.py", "allocate_batch"): "allocate_batch",
            ("_transitions.py", "allocate_slots"): "allocate_slots",
            ("_hashing.py", "of"): "BlockHashes.of",
            ("_hashing.py", "update"): "BlockHashes.update",
            ("_prefix.py", "lookup_prefix"): "lookup_prefix",
            ("_transitions.py", "free_request"): "free_request",
            ("<string>", "<lambda>"): "SlotRequest(...)"}


def _where(file: str, line: int, name: str) -> str:
    if (file, name) == ("<string>", "<lambda>"):
        return "SlotRequest.__new__ (namedtuple)"
    return f"{Path(file).name}:{line}({name})" if line else name


def profile(trace: Trace, fn: str, num_steps: int, top: int = 15) -> dict[str, Any]:
    """cProfile one replay (gc off) of the caching-on lanes, full config: top ``top`` by tottime."""
    _, groups = pools_for("full", trace)
    result: dict[str, Any] = {}
    for batched in (True, False):
        lane = Lane(True, batched, fn)
        ctx = lane.setup(groups, trace, fn)
        prof = cProfile.Profile()
        gc.collect()
        gc.disable()
        try:
            prof.enable()
            lane.replay(ctx, trace.on_steps[:num_steps], None)
            prof.disable()
        finally:
            gc.enable()
        st = pstats.Stats(prof, stream=io.StringIO())
        entries = st.stats  # type: ignore[attr-defined]
        total = sum(v[2] for v in entries.values())
        cum = {label: sum(v[3] for (file, _, name), v in entries.items()
                          if (Path(file).name, name) == key)
               for key, label in PROFILED.items()}
        print(f"\n== profile: {lane.label}, full config, {num_steps} steps, gc off "
              f"(cProfile; share of {total:.2f} s total own time) ==")
        print("cumulative: " + ", ".join(f"{k} {v / total:.0%}" for k, v in cum.items() if v))
        rows = sorted(entries.items(), key=lambda kv: -kv[1][2])[:top]
        listed = []
        for (file, line, name), (_, ncalls, tt, ct, _) in rows:
            where = _where(file, line, name)
            print(f"{tt / total:6.1%} own  cum {ct / total:6.1%}  {ncalls:>8d} calls  {where}")
            listed.append({"where": where, "calls": ncalls, "own_share": tt / total,
                           "cum_share": ct / total})
        result[lane.name] = {"total_s": total, "cumulative_share":
                             {k: v / total for k, v in cum.items()}, "top": listed}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--config", choices=[*CONFIGS, "all"], default="all",
                        help="time one configuration only (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile the caching-on lanes once (first hash function)")
    parser.add_argument("--profile-only", action="store_true", help="profile, time nothing")
    args = parser.parse_args(argv)
    s = Settings(args.quick)
    fns = hash_functions()
    print(f"kvfunc bench_prefix{' --quick' if s.quick else ''}: Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}, "
          f"load {_load()}; hash functions: {', '.join(fns)}"
          + ("" if "xxh3_128" in fns else " (xxh3_128 skipped: pip install xxhash)"))
    trace = Trace(s.num_running, s.num_steps)
    shared = sum(1 for k in trace.system_of.values() if k is not None)
    print(f"trace: seed {SEED}, {s.num_running} running, block size {BLOCK_SIZE}; "
          f"{len(trace.system)} system prompts of {'/'.join(map(str, SYSTEM_LENGTHS))} tokens "
          f"start {SHARED_FRACTION:.0%} of the prompts (then a user part log-uniform "
          f"128..4096), the others log-uniform 128..4096; outputs log-uniform 16..1024; fill "
          f"step + {len(trace.steps)} decode steps, {trace.admissions()} admissions in them; "
          f"{shared} of {len(trace.prompts)} prompts shared")
    out: dict[str, Any] = {"quick": s.quick, "python": platform.python_version(),
                           "num_running": s.num_running, "hash_fns": fns,
                           "system_lengths": list(SYSTEM_LENGTHS), "target_ratio": TARGET_RATIO,
                           "configs": {}}
    if not args.profile_only:
        print(f"timing: µs/call = round time / allocate calls (hashing, lookups and frees "
              f"included); median of {s.rounds} rounds; lanes interleaved in segments of "
              f"{SEGMENT} steps, gc off; pools = caching-off peak x{core.HEADROOM}, rounded up "
              f"to 1024")
        configs = list(CONFIGS) if args.config == "all" else [args.config]
        verdicts = {c: bench_config(s, c, trace, fns, out) for c in configs}
        print(f"\ntarget: caching on <= {TARGET_RATIO}x caching off, µs/call, allocate_batch "
              f"per step, hashing included, every hash function: "
              + ", ".join(f"{c} {_verdict(ok)}" for c, ok in verdicts.items()))
        out["target_met"] = verdicts
    if args.profile or args.profile_only:
        out["profile"] = profile(trace, fns[0], s.profile_steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
