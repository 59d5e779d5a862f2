"""Request traces: arrival time, prompt tokens and output tokens per request.

Sources:

* ``code`` / ``conv``: the sample of the Azure LLM inference trace 2023
  shipped in :mod:`kvfunc.data` (the first 3,000 rows of each; CC-BY-4.0,
  see ``kvfunc/data/ATTRIBUTION.md``);
* ``mooncake-conversation`` / ``mooncake-synthetic``: the Mooncake FAST'25
  traces shipped in :mod:`kvfunc.data` (Apache-2.0), whose requests name
  their prompt blocks, so prefix sharing is known exactly;
* ``synthetic``: seeded Poisson arrivals with log-normal lengths;
* a CSV file with the Azure columns ``TIMESTAMP,ContextTokens,GeneratedTokens``.
  ``TIMESTAMP`` is either ``YYYY-MM-DD HH:MM:SS[.fffffff]`` or seconds;
* a ``.jsonl`` (or ``.jsonl.gz``) file in the Mooncake format
  (:mod:`kvfunc.cli._mooncake`).

Files are read within the bounds of :mod:`kvfunc.cli._inputs` (64 MiB).
"""

from __future__ import annotations

import csv
import io
import math
import random
import re
from datetime import date
from pathlib import Path
from typing import NamedTuple

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import MAX_TRACE_BYTES, decode_text, read_bounded, show
from kvfunc.cli._mooncake import parse_trace_jsonl
from kvfunc.data import MOONCAKE_TRACES, TRACE_SAMPLES, mooncake_trace, trace_sample

__all__ = ["MAX_SYNTHETIC_REQUESTS", "Trace", "TraceRequest", "load_trace", "parse_trace_csv",
           "synthetic_trace"]

#: The most requests ``--trace synthetic`` makes (each costs memory before the run starts).
MAX_SYNTHETIC_REQUESTS = 1_000_000

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_STAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)")


class TraceRequest(NamedTuple):
    """One request: when it arrives (seconds from the trace's start) and its lengths.

    ``hash_ids`` names the prompt's blocks of 512 tokens where the trace
    records them (Mooncake traces), and is empty where it does not.
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@attrs.frozen
class Trace:
    """A named list of requests, sorted by arrival.

    Attributes:
        name: a short name (``azure-conv``, ``mooncake-conversation``).
        description: one line for reports.
        requests: the requests, in arrival order.
    """

    name: str
    description: str
    requests: tuple[TraceRequest, ...]

    @property
    def has_hash_ids(self) -> bool:
        """Whether the requests name their prompt blocks (prefix sharing is known)."""
        return bool(self.requests) and all(r.hash_ids for r in self.requests)


def _seconds(text: str, where: str) -> float:
    match = _STAMP.fullmatch(text.strip())
    if match is not None:
        y, mo, d, h, mi = (int(match.group(i)) for i in range(1, 6))
        try:
            day = date(y, mo, d).toordinal()
        except ValueError:
            raise CLIError(f"{where}: TIMESTAMP {show(text)} is not a valid date") from None
        return day * 86400.0 + h * 3600 + mi * 60 + float(match.group(6))
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        msg = (f"{where}: TIMESTAMP {show(text)} is neither 'YYYY-MM-DD HH:MM:SS.ffff' "
               "nor a number of seconds")
        raise CLIError(msg)
    return value


def _count(text: str, column: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise CLIError(f"{where}: {column} must be a positive integer, got {show(text)}")
    return value


def parse_trace_csv(text: str, *, name: str, limit: int | None = None) -> Trace:
    """Parse CSV text with the Azure columns into a :class:`Trace`.

    Rows are sorted by arrival (stably) and arrival times are shifted so that
    the first request arrives at 0; ``limit`` keeps the first rows of the file.

    Raises:
        CLIError: a missing column, a malformed or non-positive value.

    >>> t = parse_trace_csv("TIMESTAMP,ContextTokens,GeneratedTokens\\n"
    ...                     "2023-11-16 18:15:46.5,374,44\\n2023-11-16 18:15:47,10,5\\n", name="x")
    >>> [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in t.requests]
    [(0.0, 374, 44), (0.5, 10, 5)]
    >>> parse_trace_csv("TIMESTAMP,ContextTokens\\n1,2\\n", name="bad.csv")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: trace bad.csv lacks column(s) ['GeneratedTokens']; ...
    """
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[TraceRequest] = []
    line = 1
    try:
        header = [cell.strip() for cell in next(reader, [])]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            msg = (f"trace {name} lacks column(s) {missing}; its header must name "
                   f"{','.join(COLUMNS)} (found {show(header)})")
            raise CLIError(msg)
        at = [header.index(c) for c in COLUMNS]
        for line, row in enumerate(reader, start=2):
            if limit is not None and len(rows) >= limit:
                break
            if not row or all(not cell.strip() for cell in row):
                continue
            where = f"trace {name} line {line}"
            if len(row) < len(header):
                raise CLIError(f"{where}: expected {len(header)} fields, got {len(row)}")
            rows.append(TraceRequest(_seconds(row[at[0]], where),
                                     _count(row[at[1]], COLUMNS[1], where),
                                     _count(row[at[2]], COLUMNS[2], where)))
    except csv.Error as exc:  # a field over csv's limit (128 KiB), a NUL byte, a stray quote
        raise CLIError(f"trace {name} near line {line + 1}: not a CSV row ({exc})") from None
    if not rows:
        raise CLIError(f"trace {name} has no requests (only a header)")
    rows.sort(key=lambda r: r.arrival_s)
    start = rows[0].arrival_s
    requests = tuple(r._replace(arrival_s=round(r.arrival_s - start, 7)) for r in rows)
    return Trace(name, f"{len(requests)} requests from {name}", requests)


def synthetic_trace(num_requests: int, *, seed: int = 0, rate_per_s: float = 4.0,
                    mean_prompt: int = 1024, mean_output: int = 256) -> Trace:
    """Seeded Poisson arrivals with log-normal prompt and output lengths.

    >>> t = synthetic_trace(3, seed=1)
    >>> len(t.requests), t.requests[0].arrival_s
    (3, 0.0)
    >>> t == synthetic_trace(3, seed=1)
    True
    """
    rng = random.Random(seed)
    clock, requests = 0.0, []
    for i in range(num_requests):
        if i:
            clock += rng.expovariate(rate_per_s)
        # sigma 1 gives the long right tail real traces have; mu makes the mean right.
        prompt = max(1, round(rng.lognormvariate(math.log(mean_prompt) - 0.5, 1.0)))
        output = max(1, round(rng.lognormvariate(math.log(mean_output) - 0.5, 1.0)))
        requests.append(TraceRequest(round(clock, 6), min(prompt, 16384), min(output, 4096)))
    desc = (f"{num_requests} synthetic requests (seed {seed}, {rate_per_s}/s, "
            f"mean prompt {mean_prompt}, mean output {mean_output})")
    return Trace("synthetic", desc, tuple(requests))


def _mooncake(text: str, name: str, limit: int | None) -> Trace:
    rows = parse_trace_jsonl(text, name=name, limit=limit)
    requests = tuple(TraceRequest(*row) for row in rows)
    return Trace(name, f"{len(requests)} requests from {name}", requests)


def _first(limit: int | None) -> str:
    return "" if limit is None else "the first "


def _is_jsonl(path: str) -> bool:
    return path.lower().endswith((".jsonl", ".jsonl.gz"))


def load_trace(spec: str, *, limit: int | None = None, seed: int = 0) -> Trace:
    """The trace ``spec`` names: a packaged trace, ``synthetic``, or a file's path.

    Packaged: ``code``, ``conv`` (Azure samples), ``mooncake-conversation``,
    ``mooncake-synthetic``.  A path ending in ``.jsonl`` or ``.jsonl.gz`` is
    read in the Mooncake format, any other path as an Azure-style CSV.
    ``limit`` keeps the first requests (the synthetic trace makes that many;
    it defaults to 1,000 there); a trace with fewer says so in its
    description.

    Raises:
        CLIError: an unknown name, a missing, oversized or malformed file.

    >>> t = load_trace("conv", limit=10)
    >>> len(t.requests), t.requests[0]
    (10, TraceRequest(arrival_s=0.0, prompt_tokens=374, output_tokens=44, hash_ids=()))
    >>> load_trace("mooncake-conversation", limit=2).requests[1].hash_ids[:3]
    (0, 14, 15)
    """
    if limit is not None and (type(limit) is not int or limit <= 0):
        raise CLIError(f"--requests must be a positive integer, got {show(limit)}")
    if spec == "synthetic":
        count = 1000 if limit is None else limit
        if count > MAX_SYNTHETIC_REQUESTS:
            msg = (f"--requests {count:,} is more than the synthetic trace makes "
                   f"({MAX_SYNTHETIC_REQUESTS:,})")
            raise CLIError(msg)
        return synthetic_trace(count, seed=seed)
    if spec in TRACE_SAMPLES:
        text = trace_sample(spec).read_text(encoding="utf-8")
        trace = parse_trace_csv(text, name=f"azure-{spec}", limit=limit)
        desc = (f"Azure LLM inference trace 2023 ({spec}), {_first(limit)}"
                f"{len(trace.requests):,} requests of the packaged sample (CC-BY-4.0)")
    elif spec in MOONCAKE_TRACES:
        data = read_bounded(str(mooncake_trace(spec)), what="trace", limit=MAX_TRACE_BYTES)
        trace = _mooncake(decode_text(data, what=f"trace {spec}"), spec, limit)
        desc = (f"Mooncake FAST'25 {spec.removeprefix('mooncake-')} trace, {_first(limit)}"
                f"{len(trace.requests):,} requests (Apache-2.0)")
    else:
        path = Path(spec)
        if path.suffix.lower() not in (".csv", ".gz") and not _is_jsonl(spec) \
                and not path.exists():
            names = ", ".join([*TRACE_SAMPLES, *MOONCAKE_TRACES, "synthetic"])
            msg = (f"unknown trace {show(spec)}; use {names}, or the path of a .csv or "
                   ".jsonl file")
            raise CLIError(msg)
        data = read_bounded(path, what="trace", limit=MAX_TRACE_BYTES)
        text = decode_text(data, what=f"trace {path.name}")
        trace = (_mooncake(text, path.name, limit) if _is_jsonl(spec)
                 else parse_trace_csv(text, name=path.name, limit=limit))
        desc = trace.description
    if limit is not None and len(trace.requests) < limit:
        desc += f" (--requests {limit:,} asked for more: the trace has {len(trace.requests):,})"
    return attrs.evolve(trace, description=desc)
