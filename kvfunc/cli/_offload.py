"""Offload tiers in the simulator: host memory and a Mooncake Store behind the device cache.

Theory of operation
-------------------
``--host-memory SIZE`` puts a host tier of ``SIZE // block bytes`` blocks
behind the device cache, and ``--remote mooncake[:SIZE]`` a remote tier (a
Mooncake Store of ``SIZE``, unbounded without one) behind the host; the run
drives a :class:`kvfunc.TieredState` (:func:`kvfunc.allocate_tiered`,
:func:`kvfunc.lookup_tiers`, :func:`kvfunc.complete_moves`) instead of the
device state alone.  Blocks reach the remote tier through host memory, so
``--remote`` needs ``--host-memory``.

Every move a step starts is settled, done, at the end of that step: the
simulated clock does not wait for copies.  What they cost is a separate,
simple model of time to first token: an admission that loads ``h`` host
blocks and ``r`` remote blocks of ``B`` bytes each, for ``t`` tokens, spends

    load  = h * B / host_bandwidth + r * B / remote_bandwidth
    recompute = t / prefill_rate,   prefill_rate = max_batched_tokens / step

and the report sums ``recompute - load`` over the run: the time to first
token the tiers save against prefilling those tokens again.  The bandwidths
are flags (``--host-bandwidth``, PCIe; ``--remote-bandwidth``, the network).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import show
from kvfunc.cli._plan import entry_block_bytes
from kvfunc.cli._presets import ModelPreset
from kvfunc.cli._units import format_bytes, parse_bytes
from kvfunc.core import MAX_NUM_BLOCKS, WRITE_POLICIES, KVState, NotSupportedError, TieredState
from kvfunc.core._shared_sizing import shared_page_layout

__all__ = ["OffloadConfig", "TierCounts", "TierReport", "block_bytes", "parse_remote",
           "tiered_state"]

#: Default bandwidths in GB/s: PCIe 4.0 x16 for host memory, 100 Gb/s Ethernet remote.
HOST_GBPS = 25.0
REMOTE_GBPS = 12.5


def parse_remote(text: str) -> int | None:
    """The capacity in bytes of ``--remote mooncake[:SIZE]`` (None: unbounded).

    >>> parse_remote("mooncake"), parse_remote("mooncake:2TiB")
    (None, 2199023255552)
    >>> parse_remote("redis")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: --remote must be mooncake or mooncake:SIZE, got 'redis'
    """
    kind, _, size = text.partition(":")
    if kind != "mooncake" or (_ and not size):
        raise CLIError(f"--remote must be mooncake or mooncake:SIZE, got {show(text)}")
    if not size:
        return None
    value = parse_bytes(size, what="--remote size")
    if value <= 0:
        raise CLIError(f"--remote size must be more than 0, got {show(size)}")
    return value


def _bandwidth(name: str) -> Any:
    def check(_: Any, attr: Any, value: Any) -> None:
        if not (type(value) in (int, float) and 1e-3 <= value <= 1e6):
            raise CLIError(f"{name} must be a number of GB/s from 0.001 to 1e6, got "
                           f"{show(value)}")
    return check


@attrs.frozen
class OffloadConfig:
    """The tiers of a run (none by default).

    Attributes:
        host_bytes: host memory for KV blocks (0: no host tier).
        remote: whether a Mooncake Store is behind the host tier.
        remote_bytes: its capacity (None: unbounded).
        host_gbps: host <-> device bandwidth in GB/s (PCIe).
        remote_gbps: remote -> device bandwidth in GB/s (the network).
        write_policy: ``"write-back"`` or ``"write-through"``.

    >>> OffloadConfig().enabled, OffloadConfig(2**30).enabled
    (False, True)
    >>> OffloadConfig(remote=True)
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: --remote needs --host-memory: blocks reach the remote tier \
through host memory
    """

    host_bytes: int = 0
    remote: bool = False
    remote_bytes: int | None = None
    host_gbps: float = attrs.field(default=HOST_GBPS, validator=_bandwidth("--host-bandwidth"))
    remote_gbps: float = attrs.field(default=REMOTE_GBPS,
                                     validator=_bandwidth("--remote-bandwidth"))
    write_policy: str = "write-back"

    def __attrs_post_init__(self) -> None:
        if type(self.host_bytes) is not int or self.host_bytes < 0:
            raise CLIError(f"--host-memory must be a size, got {show(self.host_bytes)}")
        if self.remote and not self.host_bytes:
            raise CLIError("--remote needs --host-memory: blocks reach the remote tier "
                           "through host memory")
        if self.write_policy not in WRITE_POLICIES:
            raise CLIError(f"--write-policy must be one of {', '.join(WRITE_POLICIES)}, got "
                           f"{show(self.write_policy)}")

    @property
    def enabled(self) -> bool:
        """Whether the run has any tier below the device."""
        return bool(self.host_bytes) or self.remote


def block_bytes(model: ModelPreset, layout: str = "per-type") -> int:
    """Bytes of one device block, as a tier below the device holds it.

    In a pool per type, a block of the model's one group over every layer;
    in a shared pool, a page (it holds one group's block over that group's
    layers, and the page is sized for the largest group).

    >>> from kvfunc.cli._presets import build_preset
    >>> block_bytes(build_preset("llama-3-8b")), block_bytes(build_preset("deepseek-v3"))
    (2097152, 4571136)
    >>> block_bytes(build_preset("gpt-oss-120b"), "shared")
    589824
    """
    if layout == "shared":
        return shared_page_layout(model.cache_info).page_bytes
    return sum(entry_block_bytes(c) for _, c in model.cache_info.iter_caches()
               if c.needs_block)


def tiered_state(device: KVState, offload: OffloadConfig, block_bytes: int) -> TieredState:
    """The tiers of ``offload`` behind ``device``, blocks of ``block_bytes`` each.

    Raises:
        CLIError: tiers cannot serve the device (a pool per group, a group
            that is neither full attention nor a sliding window), or a tier
            holds no block or too many.

    >>> from kvfunc.core import FullAttention
    >>> dev = KVState.create({"f": FullAttention(num_blocks=8, block_size=16)}, 1024,
    ...                      enable_prefix_caching=True)
    >>> t = tiered_state(dev, OffloadConfig(2**20, True, 2**21), 2**16)
    >>> t.host.num_blocks, t.remote.capacity
    (16, 32)
    """
    sizes = {"--host-memory": offload.host_bytes, "--remote size": offload.remote_bytes}
    blocks: dict[str, int | None] = {}
    for name, size in sizes.items():
        n = None if size is None else size // block_bytes
        if n is not None and size and not 0 < n <= MAX_NUM_BLOCKS:
            raise CLIError(f"{name} {format_bytes(size)} holds {n:,} blocks of "
                           f"{format_bytes(block_bytes)}; it must hold 1 to {MAX_NUM_BLOCKS:,}")
        blocks[name] = n
    try:
        return TieredState.create(device, host_blocks=blocks["--host-memory"] or 0,
                                  remote=offload.remote, remote_blocks=blocks["--remote size"],
                                  write_policy=offload.write_policy)
    except NotSupportedError as exc:
        hint = " (try --layout shared)" if len(device.pools) > 1 else ""
        raise CLIError(f"--host-memory cannot serve this model's groups "
                       f"{', '.join(device.manager_keys)}: {exc}{hint}") from exc


class TierCounts:
    """What the tiers did over a run (the scheduler adds to it).

    >>> c = TierCounts()
    >>> c.moved(("device->host", "host->device", "host->remote")); c.stored_blocks
    {'host': 1, 'remote': 1}
    """

    def __init__(self) -> None:
        #: Prompt tokens hit at first admission, by tier.
        self.hit_tokens = {"device": 0, "host": 0, "remote": 0}
        #: Blocks loaded to the device, by source; admissions that loaded any.
        self.loaded_blocks = {"host": 0, "remote": 0}
        self.loading_admissions = 0
        #: Blocks stored down, by destination.
        self.stored_blocks = {"host": 0, "remote": 0}

    def moved(self, directions: tuple[str, ...]) -> None:
        """Count the stores a delta started."""
        for d in directions:
            if d == "device->host":
                self.stored_blocks["host"] += 1
            elif d == "host->remote":
                self.stored_blocks["remote"] += 1


@attrs.frozen
class TierReport:
    """The tiers of a run: sizes, hits by tier, traffic, and time to first token saved.

    A load of ``B`` bytes costs ``B / bandwidth``; recomputing its tokens costs
    them over ``prefill_tokens_per_s``:

    >>> r = TierReport(100, None, True, 10**9, 64, "write-back", 25.0, 12.5, 6400.0,
    ...                {"device": 0, "host": 640, "remote": 640}, {"host": 10, "remote": 10},
    ...                {"host": 30, "remote": 5}, 2)
    >>> round(r.load_s, 2), r.recompute_s, round(r.ttft_saved_s, 2)
    (1.2, 0.2, -1.0)
    """

    host_blocks: int
    remote_blocks: int | None
    remote: bool
    block_bytes: int
    block_size: int
    write_policy: str
    host_gbps: float
    remote_gbps: float
    prefill_tokens_per_s: float
    hit_tokens: dict[str, int]
    loaded_blocks: dict[str, int]
    stored_blocks: dict[str, int]
    loading_admissions: int

    @property
    def load_s(self) -> float:
        """Seconds the loads take at the configured bandwidths."""
        b = self.block_bytes
        return (self.loaded_blocks["host"] * b / (self.host_gbps * 1e9)
                + self.loaded_blocks["remote"] * b / (self.remote_gbps * 1e9))

    @property
    def recompute_s(self) -> float:
        """Seconds prefilling the loaded tokens again would take."""
        tokens = (self.loaded_blocks["host"] + self.loaded_blocks["remote"]) * self.block_size
        return tokens / self.prefill_tokens_per_s

    @property
    def ttft_saved_s(self) -> float:
        """Time to first token saved in all: recompute minus load."""
        return self.recompute_s - self.load_s

    def to_json(self) -> dict[str, Any]:
        """The ``"tiers"`` object of ``--json``."""
        per = self.ttft_saved_s / self.loading_admissions if self.loading_admissions else 0.0
        return {"host_blocks": self.host_blocks, "remote": self.remote,
                "remote_blocks": self.remote_blocks, "block_bytes": self.block_bytes,
                "write_policy": self.write_policy, "host_gbps": self.host_gbps,
                "remote_gbps": self.remote_gbps, "hit_tokens": self.hit_tokens,
                "loaded_blocks": self.loaded_blocks,
                "loaded_bytes": {k: v * self.block_bytes for k, v in self.loaded_blocks.items()},
                "stored_blocks": self.stored_blocks,
                "loading_admissions": self.loading_admissions,
                "load_s": round(self.load_s, 3), "recompute_s": round(self.recompute_s, 3),
                "ttft_saved_s": round(self.ttft_saved_s, 3),
                "ttft_saved_ms_per_loading_admission": round(per * 1e3, 2)}

    def lines(self, prompt_tokens: int) -> list[str]:
        """The report's lines: hits by tier, traffic, time to first token."""
        def share(n: int) -> str:
            return f"{n / prompt_tokens:.1%}" if prompt_tokens else "0.0%"
        h, lb, sb, b = self.hit_tokens, self.loaded_blocks, self.stored_blocks, self.block_bytes
        remote = "no remote tier"
        if self.remote:
            remote = ("remote unbounded" if self.remote_blocks is None
                      else f"remote {self.remote_blocks:,} blocks")
        per = self.ttft_saved_s / self.loading_admissions if self.loading_admissions else 0.0
        return [
            f"tiers: host {self.host_blocks:,} blocks of {format_bytes(b)}, {remote}, "
            f"{self.write_policy}",
            f"hits by tier: device {h['device']:,} ({share(h['device'])}), host {h['host']:,} "
            f"({share(h['host'])}), remote {h['remote']:,} ({share(h['remote'])}) prompt tokens",
            f"loads: {lb['host']:,} blocks from host ({format_bytes(lb['host'] * b)}), "
            f"{lb['remote']:,} from remote ({format_bytes(lb['remote'] * b)}); stores: "
            f"{sb['host']:,} to host, {sb['remote']:,} to remote",
            f"time to first token: loads take {self.load_s:,.1f} s at {self.host_gbps:g} GB/s "
            f"(host) and {self.remote_gbps:g} GB/s (remote), recomputing would take "
            f"{self.recompute_s:,.1f} s: {self.ttft_saved_s:,.1f} s saved, {per * 1e3:,.1f} ms "
            f"per admission that loads ({self.loading_admissions:,})",
        ]
