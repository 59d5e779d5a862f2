"""Request traces: arrival time, prompt tokens and output tokens per request.

Three sources:

* ``code`` / ``conv``: the sample of the Azure LLM inference trace 2023
  shipped in :mod:`kvfunc.data` (the first 3,000 rows of each; CC-BY-4.0,
  see ``kvfunc/data/ATTRIBUTION.md``);
* ``synthetic``: seeded Poisson arrivals with log-normal lengths;
* a CSV file with the Azure columns ``TIMESTAMP,ContextTokens,GeneratedTokens``.
  ``TIMESTAMP`` is either ``YYYY-MM-DD HH:MM:SS[.fffffff]`` or seconds.
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
from kvfunc.data import TRACE_SAMPLES, trace_sample

__all__ = ["Trace", "TraceRequest", "load_trace", "parse_trace_csv", "synthetic_trace"]

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_STAMP = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)")


class TraceRequest(NamedTuple):
    """One request: when it arrives (seconds from the trace's start) and its lengths."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@attrs.frozen
class Trace:
    """A named list of requests, sorted by arrival."""

    name: str
    description: str
    requests: tuple[TraceRequest, ...]


def _seconds(text: str, where: str) -> float:
    match = _STAMP.fullmatch(text.strip())
    if match is not None:
        y, mo, d, h, mi = (int(match.group(i)) for i in range(1, 6))
        try:
            day = date(y, mo, d).toordinal()
        except ValueError:
            raise CLIError(f"{where}: TIMESTAMP {text!r} is not a valid date") from None
        return day * 86400.0 + h * 3600 + mi * 60 + float(match.group(6))
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        msg = (f"{where}: TIMESTAMP {text!r} is neither 'YYYY-MM-DD HH:MM:SS.ffff' "
               "nor a number of seconds")
        raise CLIError(msg)
    return value


def _count(text: str, column: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise CLIError(f"{where}: {column} must be a positive integer, got {text!r}")
    return value


def parse_trace_csv(text: str, *, name: str, limit: int | None = None) -> Trace:
    """Parse CSV text with the Azure columns into a :class:`Trace`.

    Rows are sorted by arrival (stably) and arrival times are shifted so that
    the first request arrives at 0; ``limit`` keeps the first rows of the file.

    Raises:
        CLIError: a missing column, a malformed or non-positive value.

    >>> t = parse_trace_csv("TIMESTAMP,ContextTokens,GeneratedTokens\\n"
    ...                     "2023-11-16 18:15:46.5,374,44\\n2023-11-16 18:15:47,10,5\\n", name="x")
    >>> t.requests
    (TraceRequest(arrival_s=0.0, prompt_tokens=374, output_tokens=44), \
TraceRequest(arrival_s=0.5, prompt_tokens=10, output_tokens=5))
    >>> parse_trace_csv("TIMESTAMP,ContextTokens\\n1,2\\n", name="bad.csv")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: trace bad.csv lacks column(s) ['GeneratedTokens']; ...
    """
    reader = csv.reader(io.StringIO(text, newline=""))
    header = [cell.strip() for cell in next(reader, [])]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        msg = (f"trace {name} lacks column(s) {missing}; its header must name "
               f"{','.join(COLUMNS)} (found {header})")
        raise CLIError(msg)
    at = [header.index(c) for c in COLUMNS]
    rows: list[TraceRequest] = []
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


def load_trace(spec: str, *, limit: int | None = None, seed: int = 0) -> Trace:
    """The trace ``spec`` names: ``code``, ``conv``, ``synthetic`` or a CSV path.

    ``limit`` keeps the first requests (the synthetic trace makes that many;
    it defaults to 1,000 there).

    Raises:
        CLIError: an unknown name, a missing file or a malformed one.

    >>> t = load_trace("conv", limit=10)
    >>> len(t.requests), t.requests[0]
    (10, TraceRequest(arrival_s=0.0, prompt_tokens=374, output_tokens=44))
    """
    if limit is not None and (type(limit) is not int or limit <= 0):
        raise CLIError(f"--requests must be a positive integer, got {limit!r}")
    if spec == "synthetic":
        return synthetic_trace(1000 if limit is None else limit, seed=seed)
    if spec in TRACE_SAMPLES:
        text = trace_sample(spec).read_text(encoding="utf-8")
        trace = parse_trace_csv(text, name=f"azure-{spec}", limit=limit)
        desc = (f"Azure LLM inference trace 2023 ({spec}), first {len(trace.requests)} "
                "requests of the packaged sample (CC-BY-4.0)")
        return attrs.evolve(trace, description=desc)
    path = Path(spec)
    if path.suffix.lower() != ".csv" and not path.exists():
        msg = f"unknown trace {spec!r}; use code, conv, synthetic or the path of a .csv file"
        raise CLIError(msg)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot read trace {spec!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CLIError(f"trace {spec!r} is not a UTF-8 text CSV file") from None
    return parse_trace_csv(text, name=path.name, limit=limit)
