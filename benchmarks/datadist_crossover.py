"""The crossover section of ``bench_datadist.py``: Mooncake pulls in place against staged.

Both sides of every pull are forced to one mode (``STAGE_BELOW`` set to 0:
never stage, or to 2**62: stage whenever a side has more than one run) and
the two modes are timed interleaved, round after round, for blocks in runs
of 1 to 32 consecutive blocks (16 KiB to 512 KiB runs, 64 MiB in all), and
for a few blocks only.  Where staging stops paying is the rule's
threshold: ``kvfunc.datadist._slices.STAGE_BELOW``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from kvfunc.datadist import _slices

NEVER, ALWAYS = 0, 1 << 62  # STAGE_BELOW values that force in place / staged


def run_ids(n: int, run: int, num_blocks: int, seed: int) -> list[int]:
    """``n`` block ids in runs of ``run`` consecutive blocks, the runs shuffled."""
    starts = torch.randperm(num_blocks // run, generator=torch.Generator().manual_seed(seed))
    return [run * int(s) + k for s in starts[:max(n // run, 1)] for k in range(run)][:n]


def cases(moved: int, num_blocks: int) -> list[tuple[int, int]]:
    """(blocks moved, blocks per run) of each case: all the bytes in runs of 1-32 blocks,
    and a few scattered blocks."""
    out = [(moved, run) for run in (1, 2, 4, 8, 16, 32) if run <= moved]
    return out + [(n, 1) for n in (16, 4, 1) if n < moved]


def run(pull: Callable[[list[int], list[int]], float], set_stage_below: Callable[[int], None],
        moved: int, num_blocks: int, row_bytes: int, tensors: int, rounds: int
        ) -> dict[str, Any]:
    """Time each case in place and staged (``pull`` pulls and checks, ``set_stage_below``
    sets both sides' threshold); print the table and the crossover run length."""
    ids = {case: (run_ids(case[0], case[1], num_blocks, 1), run_ids(case[0], case[1],
                                                                  num_blocks, 2))
           for case in cases(moved, num_blocks)}
    times: dict[tuple[tuple[int, int], int], list[float]] = {
        (case, mode): [] for case in ids for mode in (NEVER, ALWAYS)}
    keys = list(times)
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for k in range(len(keys)):
                case, mode = keys[(k + r) % len(keys)]
                set_stage_below(mode)
                seconds = pull(*ids[case])
                if r:
                    times[case, mode].append(seconds)
    finally:
        set_stage_below(-1)  # back to the default
    print(f"crossover over Mooncake: each case in place vs staged, median of {rounds} "
          f"interleaved rounds ({tensors} tensors, {row_bytes >> 10} KiB blocks)")
    out: dict[str, Any] = {}
    in_place_wins = []  # per run length of the full-size cases: is in place no slower?
    for case in ids:
        in_place = statistics.median(times[case, NEVER])
        staged = statistics.median(times[case, ALWAYS])
        run_bytes = case[1] * row_bytes
        print(f"  {case[0]:>4} blocks in runs of {case[1]:>2} ({run_bytes >> 10:>4} KiB): "
              f"in place {in_place * 1e3:7.1f} ms, staged {staged * 1e3:7.1f} ms, "
              f"staged/in place {staged / in_place:5.2f}")
        out[f"{case[0]}x{case[1]}"] = {"in_place_ms": [t * 1e3 for t in times[case, NEVER]],
                                       "staged_ms": [t * 1e3 for t in times[case, ALWAYS]]}
        if case[0] == moved:
            in_place_wins.append((run_bytes, in_place <= staged))
    crossover = next((b for k, (b, _) in enumerate(in_place_wins)
                      if all(win for _, win in in_place_wins[k:])), None)
    print(f"  crossover: in place is no slower from runs of "
          f"{'(none measured)' if crossover is None else f'{crossover >> 10} KiB'} on; "
          f"the rule stages runs under {_slices.STAGE_BELOW >> 10} KiB")
    out["crossover_bytes"] = crossover
    return out
