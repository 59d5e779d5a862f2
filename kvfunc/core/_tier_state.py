"""The tiered state: the device state, a host tier, a remote tier and the moves in flight.

See :mod:`kvfunc.core._tiers` for the theory of operation.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import attrs
import immutables
from pyrsistent import PVector, pvector

from kvfunc.core._checks import MAX_NUM_BLOCKS, excerpt
from kvfunc.core._errors import InvalidArgumentError, InvalidTypeError, NotSupportedError
from kvfunc.core._policy import BY_WINDOW, KEEPS_ALL, skip_mode
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
    "group_tags",
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

    ``digest`` is the block's tier key (:meth:`TieredState.tier_key`: its hash,
    tagged with its group when the device has several); ``key`` is the group's
    manager key.  ``src`` and ``dst`` are block ids in the tiers the direction
    names; the remote tier has no block ids (``-1``: the block is named by its
    key).  ``request_id`` is the request a load is for (None for a store).

    >>> TierMove(HOST_TO_DEVICE, b"h", 3, 5, "a", 0, True, "full").dst
    5
    """

    direction: str
    digest: bytes
    src: int
    dst: int
    request_id: RequestId | None
    priority: int
    pinned: bool  # whether the move pins its source entry (a load; a store from an indexed block)
    key: str


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

    The device has prefix caching and one pool, whose groups (one, or several
    sharing the pool: vLLM's hybrid layout) are full attention or sliding
    windows, all of one block size.  A lower tier keeps each group's blocks
    apart, under :meth:`tier_key`.

    Attributes:
        device: the device state.
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
            device: a state with prefix caching and one pool, whose groups are
                full attention or sliding windows of one block size.
            host_blocks: host blocks (0 for none).
            remote: whether there is a remote tier.
            remote_blocks: the remote directory's capacity (None: unbounded).
            write_policy: ``"write-back"`` (a cached device block moves down when
                the device evicts it) or ``"write-through"`` (it is copied down
                when the device caches it).

        Raises:
            NotSupportedError: the device state has no prefix caching, or more
                than one pool, or groups of several block sizes, or a group that
                is neither full attention nor a sliding window.
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
        """The manager key of a device of one group.

        Raises:
            NotSupportedError: the device has several groups (see :attr:`keys`).
        """
        keys = self.device.manager_keys
        if len(keys) != 1:
            raise NotSupportedError(f"a device of groups {excerpt(keys)} has no one group_key: "
                                    "read keys, or a move's key")
        return keys[0]

    @property
    def keys(self) -> tuple[str, ...]:
        """The device groups' manager keys, in manager order."""
        return self.device.manager_keys

    @property
    def block_size(self) -> int:
        """Tokens per block, in every group and tier."""
        return int(self.device.groups[0].policy.block_size)

    def tier_key(self, key: str, digest: bytes) -> bytes:
        """The key under which the lower tiers keep group ``key``'s block of hash ``digest``.

        The hash itself when the device has one group, else the hash followed
        by one byte, the group's position in manager order (as a shared pool
        keys its own index).

        >>> from kvfunc.core import FullAttention, KVState, SlidingWindow
        >>> dev = KVState.create({"f": FullAttention(8, 4), "w": SlidingWindow(8, 4, 8)}, 64,
        ...                      enable_prefix_caching=True, layout="shared")
        >>> t = TieredState.create(dev, host_blocks=4)
        >>> t.tier_key("w", b"h"), t.split_key(b"h\\x01")
        (b'h\\x01', ('w', b'h'))
        """
        tags = group_tags(self.device.pools[0].members)
        return digest if tags is None else digest + tags[key]

    def split_key(self, tier_key: bytes) -> tuple[str, bytes]:
        """``(manager key, hash)`` of a tier key (the inverse of :meth:`tier_key`)."""
        members = self.device.pools[0].members
        if len(members) == 1:
            return members[0], tier_key
        return members[tier_key[-1]], tier_key[:-1]


@functools.cache
def group_tags(members: tuple[str, ...]) -> dict[str, bytes] | None:
    """The byte each group's tier keys end in (its position, as the shared pool tags its own
    keys: :func:`~kvfunc.core._pool.cache_key`), or None for one group (keys untagged).

    >>> group_tags(("f",)), group_tags(("f", "w"))
    (None, {'f': b'\\x00', 'w': b'\\x01'})
    """
    return {k: bytes((i,)) for i, k in enumerate(members)} if len(members) > 1 else None


def _check_device(device: KVState) -> None:
    if not device.prefix_caching:
        msg = "tiers need a device state created with enable_prefix_caching=True"
        raise NotSupportedError(msg)
    if len(device.pools) != 1:
        msg = (f"tiers need a device state of one pool (one group, or groups sharing a pool: "
               f"layout='shared'), got pools {excerpt([p.name for p in device.pools])}")
        raise NotSupportedError(msg)
    sizes = {g.policy.block_size for g in device.groups}
    modes = {skip_mode(g.policy) for g in device.groups}
    grows = all(g.policy.grows_with_tokens for g in device.groups)
    if len(sizes) != 1 or not modes <= {KEEPS_ALL, BY_WINDOW} or not grows:
        msg = (f"tiers need groups of full attention or sliding windows of one block size, "
               f"got {excerpt({g.key: type(g.policy).__name__ for g in device.groups})} of "
               f"block sizes {sorted(sizes)}")
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
