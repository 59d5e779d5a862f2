"""Traces in the Mooncake format: JSON lines whose requests name their 512-token prompt blocks.

One object per line, in arrival order (Qin et al., FAST 2025; the format of
the traces in ``kvfunc/data``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}

``timestamp`` is the arrival in milliseconds; ``hash_ids`` are the prompt's
blocks of :data:`HASH_BLOCK_TOKENS` tokens, the last one possibly partial, so
there are exactly ``ceil(input_length / 512)`` of them: two requests whose
prompts start with the same ``k`` ids share their first ``k x 512`` tokens.
Other keys are ignored.  Every line is checked (types, ranges, that the
length agrees with the ids), so a file cannot claim more than it carries.

:func:`upper_bound` is what an infinite cache could hit on a trace, from the
ids alone: the tokens of a prompt's leading ids seen before, capped at the
prompt length minus one (one token is always computed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import MAX_TRACE_LINE_BYTES, show

__all__ = ["HASH_BLOCK_TOKENS", "MAX_HASH_ID", "UpperBound", "hit_rate", "parse_trace_jsonl",
           "upper_bound"]

#: Tokens per hash id in the Mooncake traces.
HASH_BLOCK_TOKENS = 512
#: Hash ids must lie in ``[0, MAX_HASH_ID]``, so that synthesised token ids fit in int64.
MAX_HASH_ID = 2**53 - 1
_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


class MooncakeRow(NamedTuple):
    """One checked line: arrival in seconds, lengths and hash ids."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def _count(record: dict[str, Any], key: str, where: str) -> int:
    value = record[key]
    if type(value) is not int or value <= 0:
        raise CLIError(f"{where}: {key} must be a positive integer, got {show(value)}")
    return value


def _row(line: str, where: str) -> MooncakeRow:
    if len(line) > MAX_TRACE_LINE_BYTES:
        raise CLIError(f"{where}: the line is longer than 1 MiB, the most kvfunc reads")
    try:
        record = json.loads(line)
    except RecursionError:
        raise CLIError(f"{where}: the JSON is nested too deeply") from None
    except ValueError as exc:
        raise CLIError(f"{where}: not valid JSON ({show(str(exc))})") from None
    if not isinstance(record, dict):
        raise CLIError(f"{where}: expected a JSON object, got {show(record)}")
    missing = [k for k in _KEYS if k not in record]
    if missing:
        raise CLIError(f"{where}: missing key(s) {missing}; each line needs {list(_KEYS)}")
    stamp = record["timestamp"]
    if type(stamp) not in (int, float) or not (math.isfinite(stamp) and stamp >= 0):
        msg = f"{where}: timestamp must be a non-negative number of ms, got {show(stamp)}"
        raise CLIError(msg)
    prompt = _count(record, "input_length", where)
    output = _count(record, "output_length", where)
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not all(
            type(h) is int and 0 <= h <= MAX_HASH_ID for h in ids):
        msg = f"{where}: hash_ids must be a list of integers in [0, 2**53), got {show(ids)}"
        raise CLIError(msg)
    blocks = -(-prompt // HASH_BLOCK_TOKENS)
    if len(ids) != blocks:
        msg = (f"{where}: input_length {prompt} needs {blocks} hash ids of "
               f"{HASH_BLOCK_TOKENS} tokens, the line has {len(ids)}")
        raise CLIError(msg)
    return MooncakeRow(stamp / 1000, prompt, output, tuple(ids))


def parse_trace_jsonl(text: str, *, name: str, limit: int | None = None
                      ) -> list[MooncakeRow]:
    """Check and parse Mooncake JSON lines, the first ``limit`` requests (all by default).

    Rows come back sorted by arrival (stably) with the first arrival at 0.

    Raises:
        CLIError: a line that is not a well-formed request (it names the line).

    >>> rows = parse_trace_jsonl('{"timestamp": 500, "input_length": 600, "output_length": 3,'
    ...                          ' "hash_ids": [7, 8]}', name="t.jsonl")
    >>> rows[0]
    MooncakeRow(arrival_s=0.0, prompt_tokens=600, output_tokens=3, hash_ids=(7, 8))
    >>> parse_trace_jsonl('{"timestamp": 0, "input_length": 9000, "output_length": 3,'
    ...                   ' "hash_ids": [7]}', name="t.jsonl")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: trace t.jsonl line 1: input_length 9000 needs 18 hash ids ...
    """
    rows: list[MooncakeRow] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(rows) >= limit:
            break
        if line.strip():
            rows.append(_row(line, f"trace {name} line {number}"))
    if not rows:
        raise CLIError(f"trace {name} has no requests")
    rows.sort(key=lambda r: r.arrival_s)
    start = rows[0].arrival_s
    return [r._replace(arrival_s=round(r.arrival_s - start, 7)) for r in rows]


def hit_rate(hit_tokens: int, prompt_tokens: int) -> float:
    """Hit tokens over prompt tokens; 0.0 when there are none.

    >>> hit_rate(25, 100), hit_rate(0, 0)
    (0.25, 0.0)
    """
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


class UpperBound(NamedTuple):
    """What an infinite prefix cache could hit on a trace (see the module docstring)."""

    prompt_tokens: int
    hit_tokens: int

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens."""
        return hit_rate(self.hit_tokens, self.prompt_tokens)

    def to_json(self) -> dict[str, Any]:
        """The ``"upper_bound"`` object of a run's or a sweep's ``--json``.

        >>> UpperBound(1000, 350).to_json()
        {'prompt_tokens': 1000, 'hit_tokens': 350, 'hit_rate': 0.35}
        """
        return {"prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
                "hit_rate": round(self.hit_rate, 4)}


def upper_bound(requests: Iterable[Any]) -> UpperBound:
    """The trace's upper bound: leading ids seen before, in arrival order, capped at length - 1.

    ``requests`` are rows with ``prompt_tokens`` and ``hash_ids`` (a
    :class:`~kvfunc.cli.TraceRequest` or a :class:`MooncakeRow`).

    >>> from kvfunc.cli._trace import TraceRequest
    >>> bound = upper_bound([TraceRequest(0.0, 1000, 1, (1, 2)),
    ...                      TraceRequest(1.0, 1100, 1, (1, 2, 3))])
    >>> bound, round(bound.hit_rate, 3)
    (UpperBound(prompt_tokens=2100, hit_tokens=1024), 0.488)
    """
    seen: set[int] = set()
    prompt = hit = 0
    for r in requests:
        ids = r.hash_ids
        k = 0
        for h in ids:
            if h not in seen:
                break
            k += 1
        prompt += r.prompt_tokens
        hit += min(k * HASH_BLOCK_TOKENS, r.prompt_tokens - 1)
        seen.update(ids)
    return UpperBound(prompt, hit)
