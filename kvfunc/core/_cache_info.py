"""Cache metadata: frozen records that describe every cache of every layer.

These are the seed's ``cache_info.py`` records (spec §1) with the same field
names, order and defaults, made immutable: lists given for ``dim``,
``shape``, ``caches`` and ``layer_infos`` are stored as tuples, so a record
can be hashed, shared between states and kept in a snapshot.  Two fields are
not metadata but attachments — ``tensor`` and ``tensor_setter`` — and are
left out of equality and hashing; a new tensor is attached with
``attrs.evolve(entry, tensor=t)``.

``dtype`` is any object (a ``torch.dtype`` or a name such as
``"bfloat16"``): this module must not import torch.  Constructors check no
more than the seed's do; :func:`kvfunc.core._validate.validate_cache_info`
does the rest.

Messages show values the way the seed printed them: the seed kept lists, so a
stored tuple is shown as a list (``[2, 64]``, not ``(2, 64)``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from kvfunc.core._errors import InvalidCacheInfo

__all__ = [
    "CacheAllocator",
    "CacheEntry",
    "LayerCacheInfo",
    "MambaCacheEntry",
    "MemoryBudgetItem",
    "ModelCacheInfo",
    "OffloadWorkspaceMemoryInfo",
]

Dim = int | tuple[int, ...]


# A (str, Enum) rather than StrEnum on purpose: the seed formats the member
# with an f-string in messages, which gives "CacheAllocator.SWAPPED_MEMORY".
class CacheAllocator(str, enum.Enum):  # noqa: UP042
    """Where a cache tensor lives: device HBM or swapped (host-backed) memory.

    >>> CacheAllocator("hbm") is CacheAllocator.HBM
    True
    >>> CacheAllocator("ddr")
    Traceback (most recent call last):
    ...
    ValueError: 'ddr' is not a valid CacheAllocator
    """

    HBM = "hbm"
    SWAPPED_MEMORY = "swapped_memory"


def as_listed(value: object) -> object:
    """``value`` as the seed printed it: a stored tuple shows as a list.

    >>> as_listed((2, 64)), as_listed(128)
    ([2, 64], 128)
    """
    return list(value) if isinstance(value, tuple) else value


def _to_dim(dim: int | Iterable[int] | None) -> Dim | None:
    # Seed callers pass lists; store a tuple so the record stays immutable.
    if isinstance(dim, list | tuple):
        return tuple(dim)
    return dim  # type: ignore[return-value]  # an int, None, or a bad value for validate


def _product(values: Iterable[int]) -> int:
    numel = 1
    for value in values:
        numel *= value
    return numel


@attrs.frozen
class MemoryBudgetItem:
    """One memory item a model reports for cache and workspace budgeting.

    >>> MemoryBudgetItem("indexer_workspace", 1 << 20)
    MemoryBudgetItem(name='indexer_workspace', bytes=1048576, location='npu')
    """

    name: str
    bytes: int
    location: str = "npu"


def _to_budget_items(items: Iterable[MemoryBudgetItem]) -> tuple[MemoryBudgetItem, ...]:
    return tuple(items)


@attrs.frozen
class OffloadWorkspaceMemoryInfo:
    """A model's offload workspace report; ``npu_bytes`` sums the device items.

    >>> info = OffloadWorkspaceMemoryInfo([MemoryBudgetItem("a", 3),
    ...                                    MemoryBudgetItem("b", 5, location="cpu")])
    >>> info.npu_bytes
    3
    """

    items: tuple[MemoryBudgetItem, ...] = attrs.field(converter=_to_budget_items)

    @property
    def npu_bytes(self) -> int:
        """Total bytes of the items whose ``location`` is ``"npu"``."""
        return sum(item.bytes for item in self.items if item.location == "npu")


@attrs.frozen
class CacheEntry:
    """One cache of one layer (for example the ``k_cache`` of layer 3).

    ``group_key`` (``manager_key``, else ``attn_type``) names the manager the
    cache belongs to everywhere else in the library.

    >>> e = CacheEntry("k", "FullAttention", [2, 64], 8, "bfloat16", True, block_size=16)
    >>> e.dim, e.group_key, e.cache_dim_numel(), e.storage_block_size
    ((2, 64), 'FullAttention', 128, 16)
    """

    cache_name: str
    attn_type: str
    dim: Dim | None = attrs.field(converter=_to_dim)
    num_head: int | None
    dtype: Any
    needs_block: bool
    block_size: int | None = None
    manager_key: str | None = None
    tensor_setter: Callable[[Any], None] | None = attrs.field(default=None, eq=False)
    sliding_window: int | None = None
    allocator: CacheAllocator | str = CacheAllocator.HBM
    compress_ratio: int = 1
    # Kept out of the repr too: printing a whole cache tensor is never wanted.
    tensor: Any = attrs.field(default=None, eq=False, repr=False)
    cache_layout: str = "BnBsND"

    @property
    def group_key(self) -> str:
        """The manager this cache belongs to: ``manager_key`` if set, else ``attn_type``.

        >>> CacheEntry("k", "SlidingWindow", 64, 1, "fp16", True, manager_key="swa0").group_key
        'swa0'
        """
        return self.manager_key if self.manager_key is not None else self.attn_type

    def cache_dim_numel(self) -> int:
        """Elements per token and head: the product of ``dim`` (an int is one dim).

        >>> CacheEntry("k", "FullAttention", [4, 8], 1, "fp16", True).cache_dim_numel()
        32
        """
        if self.dim is None:
            msg = f"cache {self.cache_name} has no dim to size, but got dim={self.dim}."
            raise InvalidCacheInfo(msg)
        return _product(self.dim if isinstance(self.dim, tuple) else (self.dim,))

    @property
    def storage_block_size(self) -> int:
        """Token rows one block really stores: ``block_size // compress_ratio``.

        >>> CacheEntry("k", "FullAttention", 64, 1, "fp16", True, block_size=128,
        ...            compress_ratio=4).storage_block_size
        32
        >>> CacheEntry("k", "FullAttention", 64, 1, "fp16", True, block_size=10,
        ...            compress_ratio=4).storage_block_size
        Traceback (most recent call last):
        ...
        kvfunc.core._errors.InvalidCacheInfo: block_size must be divisible by compress_ratio ...
        """
        block_size, ratio = self.block_size, self.compress_ratio
        if block_size is None or block_size % ratio > 0:
            msg = (
                "block_size must be divisible by compress_ratio when calculating "
                f"storage_block_size, but got cache_name={self.cache_name}, "
                f"block_size={block_size}, compress_ratio={ratio}."
            )
            raise InvalidCacheInfo(msg)
        return block_size // ratio


class _ListShape(tuple[Any, ...]):
    """A Mamba shape that was given as a list (the only form the seed accepts).

    The seed rejects a tuple ``shape`` but we store one, so the stored form
    must differ from a tuple a caller passes in: ``attrs.evolve`` feeds the
    stored value back through the constructor and has to pass the check.
    """

    __slots__ = ()


def _to_shape(shape: object) -> object:
    # Do not reject anything here: the seed checks attn_type and block_size
    # first, so the shape check belongs in __attrs_post_init__.
    if isinstance(shape, list):
        return _ListShape(shape)
    return shape


@attrs.frozen
class MambaCacheEntry(CacheEntry):
    """A fixed-shape recurrent state: one whole ``shape`` tensor per state block.

    Build it with keywords: the overridden fields are keyword-only, as in the
    seed.  ``shape`` must be a non-empty *list* of positive ints (a tuple is
    rejected, as in the seed); it is stored as a tuple.

    >>> m = MambaCacheEntry(cache_name="ssm", dtype="bfloat16", needs_block=True,
    ...                     shape=[4, 16], next_n=1)
    >>> m.shape == (4, 16), m.cache_dim_numel(), m.storage_block_size, m.group_key
    (True, 64, 1, 'Mamba')
    >>> MambaCacheEntry(cache_name="ssm", dtype="bfloat16", needs_block=True, shape=(4, 16))
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidCacheInfo: Mamba cache 'ssm' must define a non-empty shape list, ...
    """

    attn_type: str = attrs.field(default="Mamba", kw_only=True)
    dim: Dim | None = attrs.field(default=None, converter=_to_dim, kw_only=True)
    num_head: int | None = attrs.field(default=None, kw_only=True)
    block_size: int | None = attrs.field(default=1, kw_only=True)
    shape: tuple[int, ...] = attrs.field(factory=list, converter=_to_shape, kw_only=True)
    # Speculative depth: a request holds 1 + next_n state blocks after its first step.
    next_n: int = attrs.field(default=0, kw_only=True)

    def __attrs_post_init__(self) -> None:
        name = self.cache_name
        if self.attn_type != "Mamba":
            msg = f"Mamba cache '{name}' must keep attn_type='Mamba', but got '{self.attn_type}'."
            raise InvalidCacheInfo(msg)
        if self.block_size != 1:
            msg = f"Mamba cache '{name}' block_size must be 1, but got {self.block_size}."
            raise InvalidCacheInfo(msg)
        shape: object = self.shape
        shown = list(shape) if isinstance(shape, _ListShape) else shape
        if not isinstance(shape, _ListShape) or not shape:
            msg = f"Mamba cache '{name}' must define a non-empty shape list, but got {shown}."
            raise InvalidCacheInfo(msg)
        if any(not isinstance(d, int) or d <= 0 for d in shape):
            msg = (f"Mamba cache '{name}' shape dimensions must all be positive integers, "
                   f"but got {shown}.")
            raise InvalidCacheInfo(msg)
        if self.next_n < 0:
            msg = f"Mamba cache '{name}' next_n must be non-negative, but got {self.next_n}."
            raise InvalidCacheInfo(msg)

    def cache_dim_numel(self) -> int:
        """Elements of one state block: the product of ``shape``.

        >>> MambaCacheEntry(cache_name="c", dtype="fp32", needs_block=True,
        ...                 shape=[3, 5]).cache_dim_numel()
        15
        """
        return _product(self.shape)


def _to_entries(caches: Iterable[CacheEntry]) -> tuple[CacheEntry, ...]:
    return tuple(caches)


@attrs.frozen
class LayerCacheInfo:
    """The caches of one layer, in definition order.

    >>> layer = LayerCacheInfo(0, [CacheEntry("k", "FullAttention", 64, 1, "fp16", True)])
    >>> layer.caches[0].cache_name
    'k'
    """

    layer_idx: int
    caches: tuple[CacheEntry, ...] = attrs.field(converter=_to_entries)


def _to_layers(layer_infos: Iterable[LayerCacheInfo]) -> tuple[LayerCacheInfo, ...]:
    return tuple(layer_infos)


@attrs.frozen
class ModelCacheInfo:
    """Every layer's caches for one model (or one part, see :meth:`merge`).

    >>> e = CacheEntry("k", "FullAttention", 64, 1, "fp16", True, block_size=16)
    >>> info = ModelCacheInfo(2, [LayerCacheInfo(0, [e]), LayerCacheInfo(1, [e])])
    >>> [(idx, c.cache_name) for idx, c in info.iter_caches()]
    [(0, 'k'), (1, 'k')]
    """

    num_layers: int
    layer_infos: tuple[LayerCacheInfo, ...] = attrs.field(converter=_to_layers)
    # True for MLA backends (latent KV replicated across TP ranks); P/D
    # transfer uses it. It cannot be inferred from num_head == 1 (GQA too).
    is_mla_backend: bool = False

    def iter_caches(self) -> Iterator[tuple[int, CacheEntry]]:
        """``(layer_idx, cache)`` for every cache, layers and caches in list order."""
        for layer in self.layer_infos:
            for cache in layer.caches:
                yield layer.layer_idx, cache

    def merge(self, other: ModelCacheInfo) -> ModelCacheInfo:
        """This model's layers followed by ``other``'s, offset by ``len(self.layer_infos)``.

        The offset is added to whatever ``layer_idx`` the other layers have
        (they are not renumbered).  Unlike the seed, ``other`` is left as it
        was: new layer records carry the shifted indices.

        Raises:
            InvalidCacheInfo: the two disagree on ``is_mla_backend``.

        >>> e = CacheEntry("k", "FullAttention", 64, 1, "fp16", True)
        >>> main = ModelCacheInfo(2, [LayerCacheInfo(0, [e]), LayerCacheInfo(1, [e])])
        >>> mtp = ModelCacheInfo(2, [LayerCacheInfo(0, [e]), LayerCacheInfo(5, [e])])
        >>> [layer.layer_idx for layer in main.merge(mtp).layer_infos]
        [0, 1, 2, 7]
        >>> [layer.layer_idx for layer in mtp.layer_infos]
        [0, 5]
        """
        if self.is_mla_backend != other.is_mla_backend:
            msg = ("is_mla_backend mismatch across merged cache infos: "
                   f"{self.is_mla_backend} vs {other.is_mla_backend}")
            raise InvalidCacheInfo(msg)
        offset = len(self.layer_infos)
        shifted = tuple(LayerCacheInfo(layer.layer_idx + offset, layer.caches)
                        for layer in other.layer_infos)
        merged = self.layer_infos + shifted
        return ModelCacheInfo(num_layers=len(merged), layer_infos=merged,
                              is_mla_backend=self.is_mla_backend)
