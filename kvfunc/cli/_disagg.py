"""Disaggregated serving: what ``kvfunc simulate --disaggregated P:D`` runs and reports.

:class:`DisaggConfig` is the colocated run's :class:`SimulationConfig` (its
``--memory`` is each instance's), how many prefill and decode instances, and
the link's bandwidth.  :func:`~kvfunc.cli._disagg_run.run_disaggregated`
runs it and returns a :class:`DisaggResult`, whose reports hold everything
the command prints and ``--json`` carries.  The flags' own parsers are here
too: :func:`parse_instances` and :func:`parse_bandwidth`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import show
from kvfunc.cli._layout import PoolUsage
from kvfunc.cli._simulate import PrefixReport, SimulationConfig

__all__ = ["DEFAULT_BANDWIDTH", "MAX_BANDWIDTH", "MAX_INSTANCES", "MIN_BANDWIDTH",
           "DisaggConfig", "DisaggResult", "LatencyReport", "Quantiles", "SideReport",
           "TransferReport", "parse_bandwidth", "parse_instances"]

#: The most instances on either side (each has a state and a scheduler of its own).
MAX_INSTANCES = 32
#: ``--link-bandwidth`` without the flag: one 200 Gb/s RDMA interface per instance.
DEFAULT_BANDWIDTH = "25GB/s"
#: The slowest and fastest links taken, in bytes per second (1 MB/s and 100 TB/s).
MIN_BANDWIDTH = 10**6
MAX_BANDWIDTH = 10**14

_INSTANCES = re.compile(r"\s*([0-9]{1,9})\s*:\s*([0-9]{1,9})\s*")
_RATE = re.compile(r"\s*([0-9]{1,15}(?:\.[0-9]{0,9})?|\.[0-9]{1,9})\s*([a-zA-Z]*)\s*(/\s*s)?\s*")
_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_instances(text: str) -> tuple[int, int]:
    """``"P:D"`` as ``(P, D)``: prefill and decode instances, each 1 to :data:`MAX_INSTANCES`.

    >>> parse_instances("2:1")
    (2, 1)
    >>> parse_instances("1:0")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: --disaggregated '1:0' needs at least one prefill and one \
decode instance
    """
    match = _INSTANCES.fullmatch(text) if len(text) <= 40 else None
    if match is None:
        raise CLIError(f"--disaggregated takes P:D, prefill and decode instances, like 1:1 or "
                       f"2:1; got {show(text)}")
    counts = int(match.group(1)), int(match.group(2))
    if min(counts) < 1:
        raise CLIError(f"--disaggregated {text.strip()!r} needs at least one prefill and one "
                       "decode instance")
    if max(counts) > MAX_INSTANCES:
        raise CLIError(f"--disaggregated {text.strip()!r}: at most {MAX_INSTANCES} instances on "
                       "either side")
    return counts


def parse_bandwidth(text: str) -> int:
    """Bytes per second in ``text``: ``25GB/s``, ``1.5TB/s``, ``200Gbit/s``, ``400Gbps``.

    Byte units are ``B``, ``KB`` .. ``TB`` (decimal) and ``KiB`` .. ``TiB``;
    bit units ``bit``, ``Kbit`` .. ``Tbit`` (``Gbps`` is gigabits).  ``Gb``
    alone is refused: bits or bytes?

    >>> parse_bandwidth("25GB/s"), parse_bandwidth("200Gbit/s"), parse_bandwidth("400Gbps")
    (25000000000, 25000000000, 50000000000)
    >>> parse_bandwidth("0GB/s")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: --link-bandwidth '0GB/s' is 0 bytes/s; it must lie between \
1 MB/s and 100 TB/s
    """
    match = _RATE.fullmatch(text) if len(text) <= 40 else None
    bits = _bits_per_unit(match.group(2), bool(match.group(3))) if match else None
    if match is None and text.strip().startswith("-"):
        raise CLIError(f"--link-bandwidth {show(text)} is negative; it must lie between 1 MB/s "
                       "and 100 TB/s")
    if match is None or bits is None:
        raise CLIError(f"--link-bandwidth {show(text)} is not a bandwidth; write it like 25GB/s "
                       "or 200Gbit/s")
    if bits == 0:
        raise CLIError(f"--link-bandwidth {text.strip()!r}: bits or bytes? write GB/s for "
                       "bytes or Gbit/s for bits")
    whole, _, frac = str(match.group(1)).partition(".")
    scale = 10 ** len(frac)
    rate: int = (int(whole or "0") * scale + int(frac or "0")) * bits // (scale * 8)
    if not MIN_BANDWIDTH <= rate <= MAX_BANDWIDTH:
        raise CLIError(f"--link-bandwidth {text.strip()!r} is {rate:,} bytes/s; it must lie "
                       "between 1 MB/s and 100 TB/s")
    return rate


def _bits_per_unit(unit: str, per_s: bool) -> int | None:
    """Bits in one ``unit`` (``GB``: 8e9, ``Gbit``, ``Gbps``: 1e9); 0 when ``b`` leaves it
    open (``Gb``); None when it is not a unit."""
    low = unit.lower()
    if (low.endswith("bps") and unit[-3] == "b" and not per_s) or low.endswith("bit"):
        prefix, bits = low[:-3], 1
    elif unit.endswith("B"):
        prefix, bits = low[:-1], 8
    elif not unit:
        prefix, bits = "", 8  # a plain number: bytes per second
    elif unit.endswith("b"):
        return 0 if low[:-1] in _PREFIXES else None
    else:
        return None
    return _PREFIXES[prefix] * bits if prefix in _PREFIXES else None


@attrs.frozen
class DisaggConfig:
    """A disaggregated run: the colocated run's settings, P:D, and the link.

    Attributes:
        base: model, trace, budget (of *one* instance) and engine settings,
            used by every instance.
        num_prefill: prefill instances.
        num_decode: decode instances.
        link_bandwidth: bytes per second each instance sends or receives.
    """

    base: SimulationConfig
    num_prefill: int = 1
    num_decode: int = 1
    link_bandwidth: int = 25 * 10**9

    def __attrs_post_init__(self) -> None:
        for name, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            if type(count) is not int or not 1 <= count <= MAX_INSTANCES:
                raise CLIError(f"{name} instances must be an integer from 1 to "
                               f"{MAX_INSTANCES}, got {show(count)}")
        rate = self.link_bandwidth
        if type(rate) is not int or not MIN_BANDWIDTH <= rate <= MAX_BANDWIDTH:
            raise CLIError(f"the link bandwidth must be an integer from {MIN_BANDWIDTH:,} to "
                           f"{MAX_BANDWIDTH:,} bytes/s, got {show(rate)}")

    @property
    def ratio(self) -> str:
        """``"P:D"``."""
        return f"{self.num_prefill}:{self.num_decode}"


class Quantiles(NamedTuple):
    """Mean, median, 99th percentile and maximum of some seconds (0.0 for none)."""

    mean: float
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Quantiles:
        """Quantiles of ``values``.

        >>> Quantiles.of([3.0, 1.0, 2.0, 4.0])
        Quantiles(mean=2.5, p50=3.0, p99=4.0, max=4.0)
        """
        return cls.weighted(Counter(values))

    @classmethod
    def weighted(cls, counts: Mapping[float, int]) -> Quantiles:
        """Quantiles of values given as ``{value: how many}``.

        >>> Quantiles.weighted({0.01: 98, 0.5: 2})
        Quantiles(mean=0.0198, p50=0.01, p99=0.5, max=0.5)
        """
        total = sum(counts.values())
        if not total:
            return cls(0.0, 0.0, 0.0, 0.0)
        ranks = [int(q * total) for q in (0.5, 0.99)]  # 0-based ranks, as colocated figures
        found: list[float] = []
        seen = 0
        values = sorted(counts)
        for value in values:
            seen += counts[value]
            while len(found) < len(ranks) and ranks[len(found)] < seen:
                found.append(value)
        mean = math.fsum(v * c for v, c in counts.items()) / total
        return cls(round(mean, 9), found[0], found[1], values[-1])

    def to_json(self) -> dict[str, float]:
        """Milliseconds, rounded to the microsecond."""
        return {k: round(v * 1000, 3) for k, v in self._asdict().items()}


@attrs.frozen
class SideReport:
    """One side (prefill or decode): each instance's block usage per pool, and the side's totals.

    ``counters`` holds ``preemptions``, ``refused_allocations``,
    ``prefill_tokens``, ``recomputed_tokens``, ``generated_tokens`` and
    ``steps``; ``prefix`` is the prefill side's prefix cache (``None`` on the
    decode side, and on a trace that names no prompt blocks).
    """

    role: str
    instances: tuple[tuple[PoolUsage, ...], ...]
    counters: dict[str, int]
    allocator_s: float
    prefix: PrefixReport | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``"prefill"`` or ``"decode"`` object of ``--json``."""
        instances = [[u.to_json() for u in pools] for pools in self.instances]
        return {"instances": len(self.instances), **self.counters,
                "allocator_s": round(self.allocator_s, 3),
                "prefix_cache": None if self.prefix is None else self.prefix.to_json(),
                "pools": instances}


@attrs.frozen
class TransferReport:
    """The KV hand-overs: how many, their bytes, and where their time went.

    Attributes:
        count: transfers done (requests of one output token need none).
        bytes_moved: KV bytes moved over the links.
        wait_room: per transfer, seconds from the prefill's end until a decode
            instance took it: had room (a seat and the prompt's blocks) and was
            between steps (its scheduler takes pulls then).
        wait_link: per transfer, seconds from then until both ends' links were free.
        transfer: per transfer, seconds on the link (bytes / bandwidth).
        waited_room: transfers that waited for decode room longer than one step.
        waited_link: transfers that waited for the link at all.
        send_busy: per prefill instance, the share of the run its link sent.
        recv_busy: per decode instance, the share of the run its link received.
        peak_held_bytes: the most KV bytes one prefill instance held for pulls.
        peak_keys: the most cache keys one prefill instance had bound at once.
    """

    count: int
    bytes_moved: int
    wait_room: Quantiles
    wait_link: Quantiles
    transfer: Quantiles
    waited_room: int
    waited_link: int
    send_busy: tuple[float, ...]
    recv_busy: tuple[float, ...]
    peak_held_bytes: int
    peak_keys: int

    def to_json(self) -> dict[str, Any]:
        """The ``"transfers"`` object of ``--json`` (times in ms)."""
        return {"count": self.count, "bytes_moved": self.bytes_moved,
                "wait_room_ms": self.wait_room.to_json(),
                "wait_link_ms": self.wait_link.to_json(),
                "transfer_ms": self.transfer.to_json(),
                "waited_room": self.waited_room, "waited_link": self.waited_link,
                "wait_room_total_s": round(self.wait_room.mean * self.count, 3),
                "wait_link_total_s": round(self.wait_link.mean * self.count, 3),
                "send_busy_fraction": [round(b, 4) for b in self.send_busy],
                "recv_busy_fraction": [round(b, 4) for b in self.recv_busy],
                "peak_held_bytes": self.peak_held_bytes, "peak_keys": self.peak_keys}


@attrs.frozen
class LatencyReport:
    """Time to first token and time between tokens under the fixed-step model.

    ``ttft_parts`` are the mean seconds of each part of the time to first
    token: ``prefill`` (arrival to the prefill's end: queueing, prefill
    steps), ``room``, ``link`` and ``transfer`` (see :class:`TransferReport`).
    """

    ttft: Quantiles
    tbt: Quantiles
    ttft_parts: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        """The ``"latency"`` object of ``--json`` (ms)."""
        return {"ttft_ms": self.ttft.to_json(), "tbt_ms": self.tbt.to_json(),
                "ttft_parts_mean_ms": {k: round(v * 1000, 3) for k, v in self.ttft_parts.items()}}


@attrs.frozen(eq=False)
class DisaggResult:
    """What a disaggregated run did; :meth:`to_json` is the ``--json`` summary.

    ``series`` holds the run's series for the plot, sampled at every step
    of every instance (``time`` and running totals or counts);
    ``usage`` each instance's ``(role, index, step end times, blocks held
    per pool)``.
    """

    config: DisaggConfig
    counters: dict[str, int]
    prefill: SideReport
    decode: SideReport
    transfers: TransferReport
    latency: LatencyReport
    simulated_s: float
    wall_s: float
    series: dict[str, Sequence[float]] = attrs.field(factory=dict)
    usage: tuple[tuple[str, int, tuple[float, ...], tuple[tuple[int, ...], ...]], ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Plain data: settings, counters, both sides, the transfers and the latencies."""
        cfg = self.config
        base = cfg.base
        return {
            "mode": "disaggregated", "prefill_instances": cfg.num_prefill,
            "decode_instances": cfg.num_decode, "link_bandwidth_bytes_per_s": cfg.link_bandwidth,
            "model": base.model.name, "trace": base.trace.description,
            "memory_bytes_per_instance": base.budget.memory_bytes,
            "mem_fraction": base.budget.mem_fraction, "used_bytes": base.budget.used_bytes,
            "concurrency": base.concurrency, "max_batched_tokens": base.max_batched_tokens,
            "max_model_len": base.model_len, "mtp_depth": base.model.next_n,
            "step_ms": base.step_ms, "speedup": base.speedup,
            "prefix_caching": base.caches_prefixes, "layout": base.layout, **self.counters,
            "prefill": self.prefill.to_json(), "decode": self.decode.to_json(),
            "transfers": self.transfers.to_json(), "latency": self.latency.to_json(),
            "simulated_s": round(self.simulated_s, 3), "wall_s": round(self.wall_s, 3)}
