"""The tiered state: the device state, a host tier, a remote tier and the moves in flight.

See :mod:`kvfunc.core._tiers` for the theory of operation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs
import immutables
from pyrsistent import PVector, pvector

from kvfunc.core._checks import MAX_NUM_BLOCKS, excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, NotSupportedError
from kvfunc.core._policy import KEEPS_ALL, skip_mode
from kvfunc.core._state import KVState, RequestId, check_state
from kvfunc.core._tier_index import TierIndex
from kvfunc.core._untracked import atomic

__all__ = [
    "DEVICE_TO_HOST",
    "DIRECTIONS",
    "HOST_TO_DEVICE",
    "HOST_TO_REMOTE",
    "MEDIUMS",
    "REMOTE_TO_DEVICE",
    "WRITE_POLICIES",
    "HostTier",
    "RemoteTier",
    "TierMove",
    "TieredState",
    "check_tiered",
]

#: The write policies a tiered state may be created with.
WRITE_POLICIES = ("write-back", "write-through")
DEVICE_TO_HOST = "device->host"
HOST_TO_DEVICE = "host->device"
HOST_TO_REMOTE = "host->remote"
REMOTE_TO_DEVICE = "remote->device"
#: Every move direction, in the order a delta's readers may rely on.
DIRECTIONS = (DEVICE_TO_HOST, HOST_TO_DEVICE, HOST_TO_REMOTE, REMOTE_TO_DEVICE)
#: The medium of each tier, as KV events name it (vLLM's ``"GPU"`` and ``"CPU"``).
MEDIUMS = {"device": "GPU", "host": "CPU", "remote": "REMOTE"}


class TierMove(NamedTuple):
    """A move in flight: what it copies, from where to where, for whom, at what priority.

    ``src`` and ``dst`` are block ids in the tiers the direction names; the
    remote tier has no block ids (``-1``: the block is named by its hash).
    ``request_id`` is the request a load is for (None for a store).

    >>> TierMove(HOST_TO_DEVICE, b"h", 3, 5, "a", 0, True).dst
    5
    """

    direction: str
    digest: bytes
    src: int
    dst: int
    request_id: RequestId | None
    priority: int
    pinned: bool  # whether the move pins its source entry (a load; a store from an indexed block)


@attrs.frozen(slots=True)
class HostTier:
    """Host blocks ``0 .. num_blocks - 1``: an index, free blocks, blocks being written.

    Attributes:
        num_blocks: host blocks in all.
        index: the blocks that hold a hash (hits, evictable unless pinned).
        free: a stack of free host blocks; its first ``num_free`` items count.
        num_free: free host blocks.
        pending: hash -> host block being written by a store in flight.

    >>> h = HostTier.create(4)
    >>> h.num_free, h.free[h.num_free - 1], len(h.index)     # block 0 is handed out first
    (4, 0, 0)
    """

    num_blocks: int
    index: TierIndex
    free: PVector[int]
    num_free: int
    pending: immutables.Map[bytes, int]

    @classmethod
    def create(cls, num_blocks: int) -> HostTier:
        """An empty host tier of ``num_blocks`` blocks (block 0 is handed out first)."""
        free: PVector[int] = atomic(pvector(range(num_blocks - 1, -1, -1)))
        return cls(num_blocks, TierIndex.create(), free, num_blocks, immutables.Map())


@attrs.frozen(slots=True)
class RemoteTier:
    """A directory of hashes believed stored remotely (a hint: the store evicts on its own).

    Attributes:
        capacity: blocks the directory keeps at most (None: unbounded).
        index: the hashes believed stored (hits, droppable unless pinned).
        pending: hash -> move id of a store in flight.

    >>> import immutables
    >>> RemoteTier(8, TierIndex.create(), immutables.Map({b"h": 0})).num_blocks
    1
    """

    capacity: int | None
    index: TierIndex
    pending: immutables.Map[bytes, int]

    @property
    def num_blocks(self) -> int:
        """Hashes believed stored or being stored."""
        return len(self.index) + len(self.pending)


@attrs.frozen(slots=True)
class TieredState:
    """A device :class:`~kvfunc.KVState` with an optional host tier and remote tier.

    Attributes:
        device: the device state (one full-attention group with prefix caching).
        write_policy: ``"write-back"`` or ``"write-through"``.
        host: the host tier, or None.
        remote: the remote tier, or None.
        moves: move id -> :class:`TierMove`, every move in flight.
        next_move_id: the id the next move gets.
        priorities: request id -> retention priority (requests without one: 0).
        block_priorities: device block -> priority of the request that cached it
            (only priorities other than 0).
        device_pending: device block -> id of the load that writes it.
        loads: request id -> loads in flight for it.

    >>> from kvfunc.core import FullAttention, KVState
    >>> dev = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64,
    ...                      enable_prefix_caching=True)
    >>> t = TieredState.create(dev, host_blocks=16, remote=True)
    >>> t.host.num_free, t.remote.capacity, t.write_policy
    (16, None, 'write-back')
    """

    device: KVState
    write_policy: str
    host: HostTier | None
    remote: RemoteTier | None
    moves: immutables.Map[int, TierMove]
    next_move_id: int
    priorities: immutables.Map[Any, int]
    block_priorities: immutables.Map[int, int]
    device_pending: immutables.Map[int, int]
    loads: immutables.Map[Any, int]

    @classmethod
    def create(cls, device: KVState, *, host_blocks: int = 0, remote: bool = False,
               remote_blocks: int | None = None, write_policy: str = "write-back"
               ) -> TieredState:
        """Tiers behind ``device``: ``host_blocks`` host blocks (0: no host tier), a remote tier.

        Args:
            device: a state with prefix caching and one full-attention group.
            host_blocks: host blocks (0 for none).
            remote: whether there is a remote tier.
            remote_blocks: the remote directory's capacity (None: unbounded).
            write_policy: ``"write-back"`` (a cached device block moves down when
                the device evicts it) or ``"write-through"`` (it is copied down
                when the device caches it).

        Raises:
            NotSupportedError: the device state has no prefix caching, or more
                than one group, or a group that does not keep every token.
            InvalidTypeError, InvalidArgumentError: a bad count or policy.

        >>> from kvfunc.core import FullAttention, KVState
        >>> dev = KVState.create({"full": FullAttention(num_blocks=8, block_size=4)}, 64)
        >>> TieredState.create(dev, host_blocks=4)
        Traceback (most recent call last):
        ...
        kvfunc.core._errors.NotSupportedError: tiers need a device state created with \
enable_prefix_caching=True
        """
        check_state(device, "device")
        _check_device(device)
        host_blocks = _count("host_blocks", host_blocks, 0)
        if type(remote) is not bool:
            raise InvalidTypeError(f"remote must be a bool, got {excerpt(remote)}")
        if remote_blocks is not None:
            remote_blocks = _count("remote_blocks", remote_blocks, 1)
            if not remote:
                raise InvalidArgumentError("remote_blocks needs remote=True")
        if write_policy not in WRITE_POLICIES or type(write_policy) is not str:
            msg = f"write_policy must be one of {WRITE_POLICIES}, got {excerpt(write_policy)}"
            raise InvalidArgumentError(msg)
        empty: immutables.Map[Any, Any] = immutables.Map()
        return cls(device, write_policy,
                   HostTier.create(host_blocks) if host_blocks else None,
                   RemoteTier(remote_blocks, TierIndex.create(), empty) if remote else None,
                   empty, 0, empty, empty, empty, empty)

    @property
    def group_key(self) -> str:
        """The device group's manager key."""
        return self.device.groups[0].key

    @property
    def block_size(self) -> int:
        """Tokens per block, in every tier."""
        return int(self.device.groups[0].policy.block_size)


def _check_device(device: KVState) -> None:
    if not device.prefix_caching:
        msg = "tiers need a device state created with enable_prefix_caching=True"
        raise NotSupportedError(msg)
    if len(device.groups) != 1 or skip_mode(device.groups[0].policy) != KEEPS_ALL:
        msg = (f"tiers need a device state of one full-attention group, got "
               f"{excerpt(device.manager_keys)}")
        raise NotSupportedError(msg)


def _count(name: str, value: object, minimum: int) -> int:
    if type(value) is not int:
        raise InvalidTypeError(f"{name} must be an int, got {excerpt(value)}")
    if not minimum <= value <= MAX_NUM_BLOCKS:
        msg = f"{name} must be between {minimum} and {MAX_NUM_BLOCKS}, got {value}"
        raise InvalidArgumentError(msg)
    return value


def check_tiered(value: object) -> TieredState:
    """``value`` if it is a :class:`TieredState`; else :class:`~kvfunc.InvalidTypeError`.

    >>> check_tiered("state")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidTypeError: state must be a TieredState, got 'state'
    """
    if type(value) is not TieredState:
        raise InvalidTypeError(f"state must be a TieredState, got {excerpt(value)}")
    return value
