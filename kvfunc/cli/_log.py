"""Delta logs: a simulation's transitions as JSON lines, and their verified replay.

A log is plain JSON, one object per line (no pickle, nothing executable)::

    {"kvfunc_delta_log": 1, "delta_version": 2, "max_model_len": 8192,
     "groups": [{"key": "FullAttention", "policy": "FullAttention",
                 "params": {"num_blocks": 1024, "block_size": 16, "compress_ratio": 1}}],
     "meta": {...}}                                         <- header: the initial state
    {"step": 0, "delta": {"registered_keys": [...], ...}}   <- one per non-empty delta
    ...
    {"final": {"num_deltas": 812, "groups": [{"key": "FullAttention",
               "tables": [[7, [1, 2, 3]]], "free": [4, 5, ...], "detached": 0}]}}

A delta line holds the non-empty columns of one :class:`kvfunc.BlocksChanged`;
block hashes are written as hex strings.  A run with prefix caching says so in
its header (``"prefix_caching": true``); logs without the key are runs without.
:func:`verify_log` rebuilds the initial state from the header, replays every
delta with :func:`kvfunc.replay`, and compares the result with the recorded
final state: every request's block table and every group's free queue, in
order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import MAX_LOG_LINE_BYTES, check_state_size, show
from kvfunc.core import (
    DELTA_VERSION,
    BlocksChanged,
    KVState,
    ReplayMismatchError,
    policy_class,
    replay,
)

__all__ = ["LOG_VERSION", "DeltaLogWriter", "ReplayFailed", "log_write_error", "state_content",
           "verify_log"]

LOG_VERSION = 2
_COLUMNS = BlocksChanged.FIELDS[1:]
_HASH_COLUMNS = frozenset({"stored_hashes", "stored_parent_hashes", "evicted_hashes"})


class ReplayFailed(Exception):
    """The log is well formed but its replay does not reproduce the recorded state."""


def state_content(state: KVState) -> list[dict[str, Any]]:
    """What a log's final record holds: per group, tables, its pool's free queue and detached count.

    >>> from kvfunc.core import FullAttention, allocate_slots
    >>> s = KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64)
    >>> state_content(allocate_slots(s, 7, 0, 5).state)
    [{'key': 'f', 'tables': [[7, [1, 2]]], 'free': [3], 'detached': 0}]
    """
    pools = state.pools
    return [{"key": g.key, "tables": [[rid, list(t)] for rid, t in g.tables.items()],
             "free": list(pools[g.pool].free_block_ids()),
             "detached": pools[g.pool].num_detached()}
            for g in state.groups]


def _header(state: KVState, meta: dict[str, Any]) -> dict[str, Any]:
    # Policies are attrs classes; the Policy protocol does not say so.
    groups = [{"key": g.key, "policy": g.policy.attn_type,
               "params": attrs.asdict(cast(Any, g.policy))} for g in state.groups]
    pools = [{"name": p.name, "members": list(p.members)} for p in state.pools]
    order = "vllm" if state.pools and state.pools[0].linked else "seed"
    return {"kvfunc_delta_log": LOG_VERSION, "delta_version": DELTA_VERSION,
            "max_model_len": state.max_model_len, "prefix_caching": state.prefix_caching,
            "free_order": order, "groups": groups, "pools": pools, "meta": meta}


def _to_json(name: str, value: Any) -> Any:
    """One delta column as JSON: ``order`` as is, hashes as hex (a parent may be None)."""
    if name == "order":
        return value
    if name in _HASH_COLUMNS:
        return [None if h is None else h.hex() for h in value]
    return list(value)


def _from_json(name: str, value: Any) -> Any:
    """A column read back: ``order`` as is, hex to bytes, lists (token ids) to tuples."""
    if name == "order":
        return value
    if name in _HASH_COLUMNS:
        return tuple(None if h is None else bytes.fromhex(h) for h in value)
    return tuple(map(_leaf, value))


class DeltaLogWriter:
    """Writes a log while a simulation runs; :meth:`close` adds the final state.

    >>> import io
    >>> from kvfunc.core import FullAttention, allocate_slots
    >>> s0 = KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64)
    >>> out = io.StringIO()
    >>> log = DeltaLogWriter(out, s0)
    >>> r = allocate_slots(s0, 7, 0, 5)
    >>> log.write(0, r.delta)
    >>> log.close(r.state)
    >>> len(out.getvalue().splitlines()), log.num_deltas
    (3, 1)
    """

    def __init__(self, out: IO[str], initial: KVState, *, meta: dict[str, Any] | None = None
                 ) -> None:
        self._out = out
        self.num_deltas = 0
        self._line(_header(initial, meta or {}))

    def _line(self, record: dict[str, Any]) -> None:
        try:
            self._out.write(json.dumps(record, separators=(",", ":")))
            self._out.write("\n")
        except OSError as exc:  # a full disk, a failing device: the run cannot be logged
            raise log_write_error(getattr(self._out, "name", "the log"), exc) from None

    def write(self, step: int, delta: BlocksChanged) -> None:
        """Append one delta (its non-empty columns) recorded at ``step``."""
        columns: dict[str, Any] = {name: _to_json(name, value) for name in _COLUMNS
                                   if (value := getattr(delta, name))}
        self._line({"step": step, "delta": columns})
        self.num_deltas += 1

    def close(self, final: KVState) -> None:
        """Append the final-state record (the caller closes the stream)."""
        self._line({"final": {"num_deltas": self.num_deltas, "groups": state_content(final)}})


def log_write_error(path: object, exc: OSError) -> CLIError:
    """The one-line error for a log that cannot be written (opened, written or flushed).

    >>> str(log_write_error("/dev/full", OSError(28, "No space left on device")))
    "cannot write the log '/dev/full': No space left on device"
    """
    return CLIError(f"cannot write the log {show(path)}: {exc.strerror or exc}")


def _malformed(path: str, line: int, what: str) -> CLIError:
    return CLIError(f"{path} line {line}: {what}; is it a log written by kvfunc simulate "
                    "--record?")


def _is(value: object, want: int) -> bool:
    """``value`` is the int ``want`` (a bool or a float equal to it is not)."""
    return type(value) is int and value == want


def _initial_state(header: object, path: str) -> KVState:
    if not isinstance(header, dict) or not _is(header.get("kvfunc_delta_log"), LOG_VERSION):
        raise _malformed(path, 1, f"not a kvfunc delta log header (version {LOG_VERSION})")
    if not _is(header.get("delta_version"), DELTA_VERSION):
        version = show(header.get("delta_version"))
        msg = f"delta version {version}, this kvfunc reads {DELTA_VERSION}"
        raise _malformed(path, 1, msg)
    try:
        groups = header["groups"]
        sizes = {str(i): g["params"]["num_blocks"] for i, g in enumerate(groups)}
        if not all(type(n) is int for n in sizes.values()):
            raise TypeError(f"num_blocks must be integers, got {show(list(sizes.values()))}")
        check_state_size(sizes, fix="this log's cache is larger than kvfunc replays")
        policies = {g["key"]: policy_class(g["policy"])(**g["params"]) for g in groups}
        caching = header.get("prefix_caching", False)
        layout = {p["name"]: p["members"] for p in header["pools"]}
        return KVState.create(policies, header["max_model_len"], enable_prefix_caching=caching,
                              layout=layout, free_order=header.get("free_order", "seed"))
    except (KeyError, TypeError, ValueError) as exc:
        raise _malformed(path, 1, f"the header does not rebuild a state ({show(str(exc))})"
                         ) from None


def _delta(record: object, path: str, line: int) -> BlocksChanged:
    columns = record.get("delta") if isinstance(record, dict) else None
    if not isinstance(columns, dict) or set(columns) - set(_COLUMNS):
        raise _malformed(path, line, "expected {\"step\": N, \"delta\": {columns}}")
    if not isinstance(columns.get("order", ""), str) or not all(
            isinstance(v, list) for k, v in columns.items() if k != "order"):
        raise _malformed(path, line, "a delta's order must be a string, its columns lists")
    try:
        fields: dict[str, Any] = {name: _from_json(name, value) for name, value in columns.items()}
    except (TypeError, ValueError):
        raise _malformed(path, line, "a hash column holds something other than hex") from None
    return BlocksChanged(**fields)


def _leaf(value: object) -> object:
    """A JSON cell as a delta holds it: a list (a block's token ids) becomes a tuple."""
    return tuple(value) if isinstance(value, list) else value


@attrs.define
class _Reader:
    path: str
    final: dict[str, Any] | None = None
    line: int = 1
    step: object = None

    def deltas(self, lines: Iterator[str]) -> Iterator[BlocksChanged]:
        for text in lines:
            self.line += 1
            try:
                record = json.loads(text)
            except (ValueError, RecursionError):
                raise _malformed(self.path, self.line, "not valid JSON") from None
            if isinstance(record, dict) and "final" in record:
                if not isinstance(record["final"], dict):
                    raise _malformed(self.path, self.line, "the final record is not an object")
                self.final = record["final"]
                if next(lines, None) is not None:
                    raise _malformed(self.path, self.line + 1, "text after the final record")
                return
            step = record.get("step") if isinstance(record, dict) else None
            if type(step) is not int or step < 0 or (type(self.step) is int and step < self.step):
                msg = (f"step {show(step)} does not follow step {self.step!r}: steps are "
                       "non-negative ints that never decrease")
                raise _malformed(self.path, self.line, msg)
            self.step = step
            yield _delta(record, self.path, self.line)


def _comparable(field: str, value: object) -> object:
    """Tables compare as a mapping (their order carries no meaning); the rest as is."""
    if field != "tables" or not isinstance(value, list):
        return value
    try:
        return {rid: blocks for rid, blocks in value}
    except (TypeError, ValueError):
        return value


def _compare(replayed: list[dict[str, Any]], recorded: object, path: str) -> None:
    if not isinstance(recorded, list) or not all(isinstance(g, dict) for g in recorded):
        raise CLIError(f"{path}: the final record has no list of groups")
    if [g.get("key") for g in recorded] != [g["key"] for g in replayed]:
        msg = (f"manager keys differ: replayed {[g['key'] for g in replayed]}, recorded "
               f"{[g.get('key') for g in recorded]}")
        raise ReplayFailed(msg)
    for mine, theirs in zip(replayed, recorded, strict=True):
        key = mine["key"]
        for field in ("tables", "free", "detached"):
            if _comparable(field, mine[field]) == _comparable(field, theirs.get(field)):
                continue
            detail = ""
            if field == "free" and isinstance(theirs.get(field), list):
                pairs = zip(mine["free"], theirs["free"], strict=False)
                at = next((i for i, (a, b) in enumerate(pairs) if a != b),
                          min(len(mine["free"]), len(theirs["free"])))
                detail = (f" at position {at} (replayed {mine['free'][at:at + 3]}..., recorded "
                          f"{theirs['free'][at:at + 3]}...; lengths {len(mine['free'])} and "
                          f"{len(theirs['free'])})")
            label = {"tables": "block tables", "free": "free queue",
                     "detached": "detached count"}[field]
            raise ReplayFailed(f"group {key!r}: the replayed {label} differs from the "
                               f"recorded final state{detail}")


def _bounded_lines(handle: IO[str], path: str) -> Iterator[str]:
    """The file's lines, each refused past :data:`MAX_LOG_LINE_BYTES` (``/dev/zero`` has none)."""
    number = 0
    while line := handle.readline(MAX_LOG_LINE_BYTES + 1):
        number += 1
        if len(line) > MAX_LOG_LINE_BYTES:
            raise _malformed(path, number, "a line longer than 32 MiB")
        yield line


def verify_log(path: str | Path) -> tuple[KVState, int]:
    """Replay the log at ``path`` and check it reproduces its recorded final state.

    Returns:
        The replayed final state and the number of deltas replayed.

    Raises:
        CLIError: the file is missing or is not a well-formed log.
        ReplayFailed: a delta does not apply, or the final state differs.

    >>> import tempfile, pathlib
    >>> from kvfunc.core import FullAttention, allocate_slots
    >>> s0 = KVState.create({"f": FullAttention(num_blocks=4, block_size=4)}, 64)
    >>> r = allocate_slots(s0, 7, 0, 5)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = pathlib.Path(tmp) / "run.jsonl"
    ...     with path.open("w") as out:
    ...         log = DeltaLogWriter(out, s0)
    ...         log.write(0, r.delta)
    ...         log.close(r.state)
    ...     verify_log(path) == (r.state, 1)
    True
    """
    name = str(path)
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise CLIError(f"cannot read log {name!r}: {exc.strerror}") from None
    with handle:
        lines = _bounded_lines(handle, name)
        try:
            header = json.loads(next(lines, "null"))
        except UnicodeDecodeError:  # a ValueError: caught first
            raise CLIError(f"log {name!r} is not UTF-8 text") from None
        except (ValueError, RecursionError):
            raise _malformed(name, 1, "not valid JSON") from None
        state = _initial_state(header, name)
        reader = _Reader(name)
        count = 0

        def counted() -> Iterator[BlocksChanged]:
            nonlocal count
            for delta in reader.deltas(lines):
                count += 1
                yield delta
        try:
            final = replay(state, counted())
        except ReplayMismatchError as exc:
            msg = f"delta at line {reader.line} (step {reader.step}) does not apply: {exc}"
            raise ReplayFailed(msg) from None
        except UnicodeDecodeError:  # a ValueError: caught first
            raise CLIError(f"log {name!r} is not UTF-8 text") from None
        except (TypeError, ValueError) as exc:
            raise _malformed(name, reader.line, f"a delta column is malformed ({exc})") from None
    if reader.final is None:
        msg = (f"{name}: the log ends at line {reader.line} without its final-state record; "
               "was the run that wrote it interrupted?")
        raise CLIError(msg)
    if type(reader.final.get("num_deltas")) is not int:  # a bool is not a count
        raise _malformed(name, reader.line, "the final record's num_deltas is not an int")
    if not _is(reader.final.get("num_deltas"), count):
        raise ReplayFailed(f"the log holds {count} deltas, its final record says "
                           f"{show(reader.final.get('num_deltas'))}")
    _compare(state_content(final), reader.final.get("groups"), name)
    return final, count
