"""kvfunc against vLLM 0.33's ``KVCacheManager``, prefix caching on, one trace, one run.

Theory of operation
-------------------
The trace is ``bench_prefix.py``'s: 256 requests always running, prompts
log-uniform 128..4096 tokens, half of them starting with one of 8 shared
system prompts, outputs log-uniform 16..1024, block size 16, sha256 block
hashes on both sides.  Two models: ``full`` (one full-attention group) and
``hybrid`` (full attention plus a sliding window of 1024 tokens; kvfunc's
shared layout, vLLM's own layout: one pool for both groups).  Both managers
get the same number of blocks: the caching-off peak x1.25 (``bench_core``'s
rule), summed over the groups for the shared pool.

The figure is the engine's whole cost per allocation: allocate, free,
prefix lookup, token bookkeeping and block hashing.

* vLLM, per call: building each ``Request`` (which hashes the prompt),
  ``get_computed_blocks``, ``allocate_slots`` (with the hit at admission),
  ``append_output_token_ids`` (which hashes each block that fills),
  ``free``;
* kvfunc, per call: ``BlockHashes.of``, ``lookup_prefix``,
  ``allocate_slots`` (with ``block_hashes`` and the hit), and at a request's
  end ``BlockHashes.update`` and ``free_request(..., block_hashes=)``, which
  caches its output blocks as it frees them (vLLM caches each as it fills;
  no request of this trace hits another's output while it runs, so the hits
  are the same);
* kvfunc, per step: the same, with one ``allocate_batch`` per step, in each
  documented input form: plain tuples with the step's ``block_hashes``
  mapping (admissions as ``SlotRequest`` with their hit), a ``SlotRequest``
  per entry carrying its hashes, and 8-field tuples carrying them.

vLLM has no batch call: its per-step cost is its per-call cost.  Lanes run
interleaved in segments of 32 steps, the garbage collector off; medians of
the rounds, and ratios are medians of per-round ratios.  A kvfunc lane keeps
only its newest state while it runs, as an engine does (an older state kept
costs its undo logs, then one copy: ``kvfunc.core._lineage``).  Untimed checks:
every kvfunc lane's hit tokens equal vLLM's; every kvfunc lane ends in the
same state; ``check_invariants`` holds.

vLLM is optional: where it is not installed (``../shared/peers/vllm-cpu.sh``
builds a CPU-only environment), the vLLM lane is skipped and the kvfunc
lanes still run.  Run ``python benchmarks/bench_peers.py [--quick] [--json
PATH] [--config full|hybrid]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import kvfunc as kf


def _load(name: str) -> Any:
    """A benchmark module beside this file, by path (they are not a package)."""
    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


prefix = _load("bench_prefix")
BS = prefix.BLOCK_SIZE
MAX_LEN = prefix.MAX_MODEL_LEN
SEGMENT = 32
TARGET_CALL, TARGET_STEP, TARGET_FORMS = 0.5, 0.4, 1.3
FORMS = ("tuples", "slot_requests", "tuples8")


def vllm_available() -> str | None:
    """None when vLLM's KV cache manager imports, else why not."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception as exc:  # any import failure means: no vLLM here
        return f"{type(exc).__name__}: {exc}"
    return None


# ----------------------------------------------------------------------------
# the lanes


class VllmLane:
    """vLLM 0.33's KVCacheManager driven per call, as its scheduler drives it."""

    name = "vllm_call"
    label = "vLLM 0.33 KVCacheManager, per call"

    def __init__(self, windows: Sequence[int | None], num_blocks: int, trace: Any) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request

        init_none_hash(sha256)

        def spec(w: int | None) -> Any:
            if w is None:
                return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                         dtype=torch.float32)
            return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1,
                                     dtype=torch.float32, sliding_window=w)

        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], spec(w)) for i, w in enumerate(windows)])
        self.mgr = KVCacheManager(config, max_model_len=MAX_LEN, scheduler_block_size=BS,
                                  hash_block_size=BS, enable_caching=True)
        params = SamplingParams(max_tokens=MAX_LEN)
        params.update_from_generation_config({}, eos_token_id=None)
        hasher = get_request_block_hasher(BS, sha256)
        self.new_request: Callable[[int, list[int]], Any] = lambda rid, prompt: Request(
            request_id=str(rid), prompt_token_ids=prompt, mm_features=None,
            sampling_params=params, pooling_params=None, block_hasher=hasher)
        self.reqs: dict[int, Any] = {}
        self.hit_tokens = 0
        self.replay(((), trace.on_fill))

    def replay(self, *steps: Any) -> None:
        mgr, reqs, new_request = self.mgr, self.reqs, self.new_request
        get_computed, allocate, free = mgr.get_computed_blocks, mgr.allocate_slots, mgr.free
        hits = 0
        for frees, ops in steps:
            for rid in frees:
                free(reqs.pop(rid))
            for rid, computed, x in ops:
                if computed:
                    r = reqs[rid]
                    r.append_output_token_ids(x)
                    if allocate(r, 1) is None:
                        raise prefix.Refused(rid)
                    r.num_computed_tokens += 1
                else:
                    r = reqs[rid] = new_request(rid, x)
                    blocks, n, _ = get_computed(r)
                    if allocate(r, len(x) - n, n, blocks) is None:
                        raise prefix.Refused(rid)
                    r.num_computed_tokens = len(x)
                    hits += n
        self.hit_tokens += hits


class KvLane:
    """kvfunc driven by an engine: per call, or one ``allocate_batch`` per step in a form."""

    def __init__(self, form: str, state: kf.KVState, trace: Any) -> None:
        self.form = form
        self.name = f"kvfunc_{form}"
        self.label = {"call": "kvfunc allocate_slots, per call",
                      "tuples": "kvfunc allocate_batch: tuples + block_hashes map",
                      "slot_requests": "kvfunc allocate_batch: SlotRequests",
                      "tuples8": "kvfunc allocate_batch: 8-field tuples"}[form]
        self.state = state
        self.hashes: dict[int, kf.BlockHashes] = {}
        self.toks = {r: list(p) for r, p in trace.prompts.items()}
        self.hit_tokens = 0
        self.retries = 0
        self.call(((), trace.on_fill))  # the fill, one admission at a time

    def replay(self, *steps: Any) -> None:
        (self.call if self.form == "call" else self.batch)(*steps)

    def call(self, *steps: Any) -> None:
        allocate, free, lookup, of = (kf.allocate_slots, kf.free_request, kf.lookup_prefix,
                                      kf.BlockHashes.of)
        state, hashes, toks = self.state, self.hashes, self.toks
        self.state = None  # type: ignore[assignment]  # an engine keeps the newest state only
        hits = 0
        for frees, ops in steps:
            for rid in frees:  # its output blocks are hashed once, and cached as it is freed
                state = free(state, rid, block_hashes=hashes.pop(rid).update(toks.pop(rid)))[0]
            for rid, computed, x in ops:
                if computed:  # the engine appends the token
                    toks[rid].append(x)
                    r = allocate(state, rid, computed, 1, block_hashes=hashes[rid])
                else:
                    h = hashes[rid] = of(x, BS)
                    hit = lookup(state, h, max_tokens=len(x) - 1)
                    r = allocate(state, rid, hit.num_tokens, len(x) - hit.num_tokens,
                                 block_hashes=h, prefix_hit=hit)
                    hits += hit.num_tokens
                if not r.ok:
                    raise prefix.Refused(rid)
                state = r.state
        self.state, self.hit_tokens = state, self.hit_tokens + hits

    def batch(self, *steps: Any) -> None:
        allocate, free, lookup, of = (kf.allocate_batch, kf.free_request, kf.lookup_prefix,
                                      kf.BlockHashes.of)
        slot_request, form = kf.SlotRequest, self.form
        state, hashes, toks = self.state, self.hashes, self.toks
        self.state = None  # type: ignore[assignment]  # an engine keeps the newest state only
        hits = 0
        for frees, ops in steps:
            for rid in frees:
                state = free(state, rid, block_hashes=hashes.pop(rid).update(toks.pop(rid)))[0]
            reqs: list[Any] = []
            looked: dict[int, int] = {}  # each admission's hit, looked up before the step
            for rid, computed, x in ops:
                if computed:
                    toks[rid].append(x)
                    if form == "tuples":
                        reqs.append((rid, computed, 1))
                    elif form == "slot_requests":
                        reqs.append(slot_request(rid, computed, 1, block_hashes=hashes[rid]))
                    else:
                        reqs.append((rid, computed, 1, 0, 0, None, hashes[rid], None))
                else:  # looked up on the state before the step, as a scheduler does
                    h = hashes[rid] = of(x, BS)
                    hit = lookup(state, h, max_tokens=len(x) - 1)
                    reqs.append(slot_request(rid, hit.num_tokens, len(x) - hit.num_tokens,
                                             block_hashes=h, prefix_hit=hit))
                    looked[rid] = hit.num_tokens
            res = allocate(state, reqs, block_hashes=hashes if form == "tuples" else None)
            state = res.state
            hits += sum(looked.values())
            for rid in res.refused:  # a hit block was handed out earlier in the step
                state, again = self._again(state, rid)
                hits += again - looked[rid]
        self.state, self.hit_tokens = state, self.hit_tokens + hits

    def _again(self, state: kf.KVState, rid: int) -> tuple[kf.KVState, int]:
        """Admit a refused entry alone, looked up again: the state and its hit tokens."""
        self.retries += 1
        prompt, h = self.toks[rid], self.hashes[rid]
        hit = kf.lookup_prefix(state, h, max_tokens=len(prompt) - 1)
        r = kf.allocate_slots(state, rid, hit.num_tokens, len(prompt) - hit.num_tokens,
                              block_hashes=h, prefix_hit=hit)
        if not r.ok:
            raise prefix.Refused(rid)
        return r.state, hit.num_tokens


# ----------------------------------------------------------------------------
# timing


def make_state(windows: Sequence[int | None], pools: Sequence[int]) -> kf.KVState:
    """The caching state: one pool per group (``full``) or one shared pool (``hybrid``)."""
    keys = [f"g{i}" for i in range(len(windows))]
    n = sum(pools)
    groups: dict[str, Any] = {
        k: kf.FullAttention(num_blocks=n, block_size=BS) if w is None
        else kf.SlidingWindow(num_blocks=n, block_size=BS, sliding_window=w)
        for k, w in zip(keys, windows, strict=True)}
    return kf.KVState.create(groups, MAX_LEN, enable_prefix_caching=True, layout="shared")


def time_lanes(makers: dict[str, Callable[[], Any]], steps: Sequence[Any], rounds: int
               ) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """Nanoseconds per round of each lane, and each lane of the last round (for checks)."""
    times: dict[str, list[int]] = {n: [] for n in makers}
    lanes: dict[str, Any] = {}
    for _ in range(rounds):
        lanes = {n: make() for n, make in makers.items()}
        names = list(lanes)
        spent = dict.fromkeys(names, 0)
        gc.collect()
        gc.disable()
        try:
            for i, start in enumerate(range(0, len(steps), SEGMENT)):
                segment = steps[start:start + SEGMENT]
                for j in range(len(names)):
                    name = names[(i + j) % len(names)]
                    t0 = perf_counter_ns()
                    lanes[name].replay(*segment)
                    spent[name] += perf_counter_ns() - t0
        finally:
            gc.enable()
        for n in names:
            times[n].append(spent[n])
    return times, lanes


def bench(config: str, trace: Any, num_steps: int, rounds: int, with_vllm: bool
          ) -> dict[str, Any]:
    """One model: every lane, the ratios and the checks."""
    _, groups = prefix.pools_for(config, trace)
    windows = [w for _, w, _ in groups]
    pools = [n for _, _, n in groups]
    steps = trace.on_steps[:num_steps]
    allocs = sum(len(ops) for _, ops in steps)
    makers: dict[str, Callable[[], Any]] = {}
    if with_vllm:
        makers["vllm_call"] = lambda: VllmLane(windows, sum(pools), trace)
    for form in ("call", *FORMS):
        makers[f"kvfunc_{form}"] = lambda form=form: KvLane(form, make_state(windows, pools),
                                                            trace)
    times, lanes = time_lanes(makers, steps, rounds)
    per = {n: statistics.median(t) / allocs / 1000 for n, t in times.items()}
    out: dict[str, Any] = {"pool_blocks": sum(pools), "windows": windows, "allocations": allocs,
                           "us_per_allocation": per, "runs_ns": times}
    print(f"\n-- {config}: {' + '.join('full' if w is None else f'window {w}' for w in windows)}"
          f", one pool of {sum(pools)} blocks; {len(steps)} steps, {allocs} allocations; "
          f"median of {rounds} rounds")
    for n, lane in lanes.items():
        print(f"  {lane.label:52s} {per[n]:7.2f} µs/allocation")
    fastest = min(per[f"kvfunc_{f}"] for f in FORMS)
    forms = {f: statistics.median(a / min(b) for a, *b in zip(
        times[f"kvfunc_{f}"], *(times[f"kvfunc_{g}"] for g in FORMS), strict=True))
        for f in FORMS}
    out["forms_over_fastest"] = forms
    print("  forms over the fastest (<= 1.3x): " + ", ".join(
        f"{f} {r:.2f}x" for f, r in forms.items()) + f" (fastest {fastest:.2f} µs)")
    _check_states(lanes)
    out["hit_tokens"] = {n: lane.hit_tokens for n, lane in lanes.items()}
    if with_vllm:
        out.update(_ratios(times, lanes))
    return out


def _ratios(times: dict[str, list[int]], lanes: dict[str, Any]) -> dict[str, Any]:
    base = times["vllm_call"]
    call = statistics.median(a / b for a, b in zip(times["kvfunc_call"], base, strict=True))
    step = {f: statistics.median(a / b for a, b in zip(times[f"kvfunc_{f}"], base,
                                                        strict=True)) for f in FORMS}
    kv_hits = {n: lane.hit_tokens for n, lane in lanes.items() if n.startswith("kvfunc_")}
    same = set(kv_hits.values()) == {lanes["vllm_call"].hit_tokens}
    print(f"  kvfunc / vLLM per call: {call:.2f}x (target <= {TARGET_CALL}x: "
          f"{'PASS' if call <= TARGET_CALL else 'FAIL'})")
    print("  kvfunc / vLLM per step: " + ", ".join(
        f"{f} {r:.2f}x" for f, r in step.items())
        + f" (target <= {TARGET_STEP}x: {'PASS' if max(step.values()) <= TARGET_STEP else 'FAIL'})")
    print(f"  hit tokens: vLLM {lanes['vllm_call'].hit_tokens}, kvfunc "
          + ", ".join(f"{n[7:]} {h}" for n, h in kv_hits.items())
          + f": {'identical' if same else 'DIFFERENT'}")
    return {"ratio_call": call, "ratio_step": step, "hits_identical": same}


def _check_states(lanes: dict[str, Any]) -> None:
    """Every kvfunc batch lane ends in one state; every state keeps the invariants."""
    states = [lane.state for name, lane in lanes.items() if name.startswith("kvfunc_")]
    for state in states:
        kf.check_invariants(state)
    batch = [lanes[f"kvfunc_{f}"].state for f in FORMS]
    assert all(s == batch[0] for s in batch[1:]), "the batch forms ended in different states"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--config", choices=["full", "hybrid", "all"], default="all")
    args = parser.parse_args(argv)
    running, num_steps, rounds = (16, 40, 2) if args.quick else (256, 512, 5)
    why = vllm_available()
    print(f"kvfunc bench_peers{' --quick' if args.quick else ''}: Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, load "
          f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    if why is not None:
        print(f"vLLM is not installed here ({why}); the vLLM lane is skipped. "
              "../shared/peers/vllm-cpu.sh builds a CPU-only environment with it.")
    trace = prefix.Trace(running, num_steps)
    configs = ["full", "hybrid"] if args.config == "all" else [args.config]
    out: dict[str, Any] = {"quick": args.quick, "vllm": why is None, "configs": {}}
    for config in configs:
        out["configs"][config] = bench(config, trace, num_steps, rounds, why is None)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
