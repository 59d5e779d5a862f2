"""Cache tensors (spec §5.3) and the buffer description for P/D transfer (spec §4)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from kvfunc import (
    CacheAllocator,
    CacheEntry,
    InvalidArgumentError,
    InvalidCacheInfo,
    LayerCacheInfo,
    MambaCacheEntry,
    MissingKeyError,
    MissingTensorError,
    ModelCacheInfo,
    NotSupportedError,
)
from kvfunc.compat import (
    FullAttentionManager,
    KVCacheManager,
    allocate_cache_tensors,
    create_single_type_managers,
)
from kvfunc.shell import (
    ALIGNMENT_BYTES,
    cache_tensors_by_key,
    create_cache_tensors,
    plan_cache_tensors,
    with_cache_tensors,
)

MiB2 = 2 * 1024 * 1024


def ignore(tensor: torch.Tensor) -> None:
    """A tensor_setter that keeps nothing."""


def entry(name: str = "k", attn: str = "FullAttention", **kw: Any) -> CacheEntry:
    """A small paged entry with a no-op setter; keyword overrides for any field."""
    fields: dict[str, Any] = {"dim": 8, "num_head": 2, "dtype": torch.float16,
                              "needs_block": True, "block_size": 4, "tensor_setter": ignore}
    fields.update(kw)
    return CacheEntry(name, attn, fields.pop("dim"), fields.pop("num_head"),
                      fields.pop("dtype"), fields.pop("needs_block"), **fields)


def info_of(*layers: list[CacheEntry]) -> ModelCacheInfo:
    """A ModelCacheInfo with one layer per list, indices 0, 1, ..."""
    return ModelCacheInfo(len(layers), [LayerCacheInfo(i, c) for i, c in enumerate(layers)])


@pytest.mark.parametrize(("cache", "blocks", "shape"), [
    (entry(), 5, (5, 4, 2, 8)),
    (entry(cache_layout="BnNBsD"), 5, (5, 2, 4, 8)),
    (entry(dim=[3, 8]), 2, (2, 4, 2, 3, 8)),
    (entry(dim=[3, 8], cache_layout="BnNBsD"), 2, (2, 2, 4, 3, 8)),
    (entry(block_size=16, compress_ratio=4), 3, (3, 4, 2, 8)),
    (entry("s", "SlidingWindow", sliding_window=8, dtype="bf16"), 7, (7, 4, 2, 8)),
    (MambaCacheEntry(cache_name="ssm", dtype="fp32", needs_block=True, shape=[3, 5],
                     tensor_setter=ignore), 4, (4, 3, 5)),
])
def test_shapes_follow_layout_dims_and_storage_block_size(cache: CacheEntry, blocks: int,
                                                          shape: tuple[int, ...]) -> None:
    """(B, bs, N, *dims) or (B, N, bs, *dims), bs = block_size // ratio; Mamba (B, *shape)."""
    allocate_cache_tensors("cpu", info_of([cache]), {cache.group_key: blocks})
    assert (shape, True) == (tuple(cache.tensor.shape), cache.tensor.is_contiguous())


def test_tensors_are_aligned_typed_and_handed_to_the_setters_in_order() -> None:
    """Each paged entry gets a 2 MiB-aligned tensor of its dtype, set and passed to its setter."""
    seen: list[tuple[str, torch.Tensor]] = []

    def setter(name: str) -> Callable[[torch.Tensor], None]:
        return lambda t: seen.append((name, t))

    caches = [entry("k", tensor_setter=setter("k"), dtype="bf16"),
              entry("v", tensor_setter=setter("v"), dtype=torch.float32),
              entry("idx", needs_block=False, tensor_setter=None)]
    swa = entry("s", "SlidingWindow", sliding_window=8, tensor_setter=setter("s"))
    info = info_of(caches, [swa])
    allocate_cache_tensors("cpu", info, {"FullAttention": 3, "SlidingWindow": 2})
    paged = [caches[0], caches[1], swa]
    assert [(c.cache_name, c.tensor) for c in paged] == [(n, t) for n, t in seen]
    assert [0, 0, 0] == [c.tensor.data_ptr() % MiB2 for c in paged]
    assert [torch.bfloat16, torch.float32, torch.float16] == [c.tensor.dtype for c in paged]
    assert None is caches[2].tensor
    assert MiB2 == ALIGNMENT_BYTES


def test_swapped_memory_on_cpu_is_ordinary_host_memory() -> None:
    """On the CPU a swapped_memory cache is a plain host tensor of the usual shape."""
    cache = entry(allocator=CacheAllocator.SWAPPED_MEMORY)
    allocate_cache_tensors("cpu", info_of([cache]), {"FullAttention": 3})
    assert (torch.device("cpu"), (3, 4, 2, 8)) == (cache.tensor.device,
                                                    tuple(cache.tensor.shape))


@pytest.mark.parametrize(("cache", "nums", "error", "message"), [
    (entry(tensor_setter=None), None, InvalidCacheInfo,
     "CacheEntry k in layer 0 has no tensor_setter"),
    (entry(manager_key="full0"), None, MissingKeyError,
     "Missing block_num for manager_key=full0 when allocating k"),
    (entry(allocator="ddr"), None, InvalidArgumentError, "'ddr' is not a valid CacheAllocator"),
    (entry(block_size=10, compress_ratio=4), None, InvalidCacheInfo,
     "block_size must be divisible by compress_ratio when calculating storage_block_size, "
     "but got cache_name=k, block_size=10, compress_ratio=4."),
    (entry(cache_layout="BNSD"), None, InvalidCacheInfo,
     "Creating cache tensor with cache_layout='BNSD' is not supported. Supported layouts "
     "are: ['BnBsND', 'BnNBsD']"),
    (MambaCacheEntry(cache_name="ssm", dtype="fp32", needs_block=True, shape=[3],
                     allocator="swapped_memory", tensor_setter=ignore), None, InvalidCacheInfo,
     "Creating cache tensor with allocator='swapped_memory' is not supported for "
     "attn_type='Mamba'."),
    (MambaCacheEntry(cache_name="ssm", dtype="fp32", needs_block=True, shape=[3],
                     allocator=CacheAllocator.SWAPPED_MEMORY, tensor_setter=ignore), None,
     InvalidCacheInfo, "Creating cache tensor with allocator='CacheAllocator.SWAPPED_MEMORY' "
     "is not supported for attn_type='Mamba'."),
    (entry(attn="Linear"), {"FullAttention": 3, "Linear": 3}, InvalidCacheInfo,
     "Creating cache tensor for attn_type='Linear' is not supported. Please add support in "
     "allocate_cache_tensors function."),
    (entry(num_head=0), None, InvalidCacheInfo,
     "cache k in layer 0 must have positive num_head, but got 0"),
    (entry(dim=[4, 0]), None, InvalidCacheInfo,
     "cache k in layer 0 must have positive dim, but got [4, 0]"),
    (entry(dtype="float128"), None, InvalidArgumentError, "unknown dtype 'float128'"),
    (entry(), {"FullAttention": -1}, InvalidArgumentError,
     "block_num for manager_key=FullAttention must be a non-negative int, but got -1"),
])
def test_each_error_case_raises_the_seed_message_and_attaches_nothing(
        cache: CacheEntry, nums: dict[str, int] | None, error: type[Exception],
        message: str) -> None:
    """Every §5.3 error (and the checks kvfunc adds) raises its typed error; no tensor attached."""
    called: list[torch.Tensor] = []
    first = entry("first", tensor_setter=called.append)
    info = ModelCacheInfo(2, [LayerCacheInfo(0, [first]), LayerCacheInfo(1, [cache])])
    with pytest.raises(error) as exc_info:
        allocate_cache_tensors("cpu", info, nums or {"FullAttention": 3, "Mamba": 3})
    assert message in str(exc_info.value).replace("layer 1", "layer 0")
    assert (None, None, []) == (first.tensor, cache.tensor, called)


def test_a_failing_setter_leaves_no_tensor_attached() -> None:
    """A raising tensor_setter propagates and every entry gets its previous tensor back."""
    def broken(tensor: torch.Tensor) -> None:
        raise RuntimeError("setter failed")

    a, b = entry("a"), entry("b", tensor_setter=broken)
    with pytest.raises(RuntimeError, match="setter failed"):
        allocate_cache_tensors("cpu", info_of([a, b]), {"FullAttention": 2})
    assert (None, None) == (a.tensor, b.tensor)


def test_with_cache_tensors_returns_new_records_and_leaves_the_input_alone() -> None:
    """The pure twin returns new records with tensors (one per use of an entry); no setters."""
    shared = entry("k", tensor_setter=None)
    info = info_of([shared], [shared, entry("x", needs_block=False)])
    new = with_cache_tensors(info, {"FullAttention": 3}, "cpu")
    tensors = [c.tensor for _, c in new.iter_caches()]
    assert (True, None, None) == (new == info, shared.tensor, tensors[2])
    assert [(3, 4, 2, 8), (3, 4, 2, 8)] == [tuple(t.shape) for t in tensors[:2]]
    assert tensors[0] is not tensors[1]
    assert {"FullAttention": ["layer 0 k", "layer 1 k"]} == {
        k: list(v) for k, v in cache_tensors_by_key(new).items()}


def test_the_block_layout_puts_a_blocks_parts_side_by_side_one_buffer_per_key() -> None:
    """layout="block": per manager key one aligned buffer of pages, each page block b of every
    tensor of that key in order; swapped entries and other keys get tensors of their own."""
    swa = entry("s", "SlidingWindow", sliding_window=8)
    info = info_of([entry("k"), entry("v", dtype="fp32", dim=4), swa],
                   [entry("k"), entry("x", allocator=CacheAllocator.SWAPPED_MEMORY)])
    layer = with_cache_tensors(info, {"FullAttention": 5, "SlidingWindow": 3}, "cpu")
    block = with_cache_tensors(info, {"FullAttention": 5, "SlidingWindow": 3}, "cpu",
                               layout="block")
    got = [c.tensor for _, c in block.iter_caches()]
    want = [c.tensor for _, c in layer.iter_caches()]
    assert [(t.shape, t.dtype) for t in want] == [(t.shape, t.dtype) for t in got]
    k0, v0, s0, k1, x1 = got
    part = [t[0].numel() * t.element_size() for t in (k0, v0, k1)]  # 128, 128, 128 bytes
    page = sum(part)
    assert [page] * 3 == [t.stride(0) * t.element_size() for t in (k0, v0, k1)]
    assert [part[0], part[0] + part[1]] == [v0.data_ptr() - k0.data_ptr(),
                                            k1.data_ptr() - k0.data_ptr()]
    assert 0 == k0.data_ptr() % ALIGNMENT_BYTES
    assert all(t.is_contiguous() for t in (s0, x1))
    assert all(t.untyped_storage().data_ptr() != k0.untyped_storage().data_ptr()
               for t in (s0, x1))
    for b in range(5):  # writing one block of one tensor touches nothing else (as bytes:
        before = [t.view(torch.uint8).clone() for t in (k0, k1)]  # fresh memory may hold NaNs)
        v0[b].fill_(7.0)
        assert all(torch.equal(w, t.view(torch.uint8)) for w, t in zip(before, (k0, k1),
                                                                       strict=True))
        assert bool((v0[b] == 7.0).all())


def test_the_block_layout_refuses_what_it_cannot_lay_out() -> None:
    """An unknown layout, one key's specs of different block counts, and a part whose offset
    would break its alignment are InvalidArgumentErrors."""
    info = info_of([entry("k")])
    with pytest.raises(InvalidArgumentError, match="unknown layout 'page'"):
        with_cache_tensors(info, {"FullAttention": 3}, "cpu", layout="page")
    specs = plan_cache_tensors(info_of([entry("k")], [entry("k")]), {"FullAttention": 3})
    short = [specs[0], attrs.evolve(specs[1], shape=(2, *specs[1].shape[1:]))]
    with pytest.raises(InvalidArgumentError, match="different block counts"):
        create_cache_tensors(short, "cpu", layout="block")
    odd = info_of([entry("a", dim=3, num_head=1, block_size=1), entry("b", dtype="fp32")])
    with pytest.raises(InvalidArgumentError, match="layer 0 b would start at byte 6"):
        with_cache_tensors(odd, {"FullAttention": 3}, "cpu", layout="block")
    assert with_cache_tensors(odd, {"FullAttention": 3}, "cpu").layer_infos[0].caches[1].tensor \
        is not None


def test_cache_tensors_by_key_needs_tensors() -> None:
    """Asking for the tensors of records that have none is a MissingTensorError."""
    with pytest.raises(MissingTensorError, match="CacheEntry k in layer 0 has no tensor"):
        cache_tensors_by_key(info_of([entry()]))


# -- get_contiguous_buf_infos on real tensors (spec §4, §7) --------------------------

def pd_info() -> ModelCacheInfo:
    """Layers listed out of index order, mixed layouts, compression and a non-paged entry."""
    layer2 = LayerCacheInfo(2, [entry("k", dtype="bf16"), entry("v", dtype="bf16")])
    layer0 = LayerCacheInfo(0, [
        entry("kc", block_size=16, compress_ratio=4, cache_layout="BnNBsD", dim=[2, 8],
              manager_key="compressed"),
        entry("idx", needs_block=False, tensor_setter=None),
        entry("s", "SlidingWindow", sliding_window=8, num_head=1, dtype=torch.float32)])
    return ModelCacheInfo(2, [layer2, layer0])


def test_buf_infos_describe_each_tensor_in_layer_then_cache_order() -> None:
    """Five lists in layer then cache order: ptr, bytes, bytes per block, key, block rows."""
    info = pd_info()
    nums = {"FullAttention": 6, "SlidingWindow": 3, "compressed": 5}
    allocate_cache_tensors("cpu", info, nums)
    mgr = KVCacheManager(64, create_single_type_managers(info, nums, 64), info)
    ptrs, lens, items, keys, sizes = mgr.get_contiguous_buf_infos()
    layer0, layer2 = info.layer_infos[1].caches, info.layer_infos[0].caches
    order = [layer0[0], layer0[2], layer2[0], layer2[1]]
    tensors = [c.tensor for c in order]
    assert [t.data_ptr() for t in tensors] == ptrs
    assert [t.numel() * t.element_size() for t in tensors] == lens
    assert [t[0].numel() * t.element_size() for t in tensors] == items
    assert ["compressed", "SlidingWindow", "FullAttention", "FullAttention"] == keys
    assert [4, 4, 4, 4] == sizes
    # Block b of entry i starts at ptrs[i] + b * items[i]: what the RDMA triplets rely on.
    assert all(t[b].data_ptr() == p + b * n for t, p, n in zip(tensors, ptrs, items, strict=True)
               for b in range(t.shape[0]))


def test_buf_infos_refuse_mamba_and_missing_tensors() -> None:
    """A Mamba cache raises NotImplementedError; a missing tensor the seed's RuntimeError."""
    mamba = MambaCacheEntry(cache_name="ssm", dtype="fp32", needs_block=True, shape=[3],
                            tensor_setter=ignore)
    info = info_of([entry()], [mamba])
    allocate_cache_tensors("cpu", info, {"FullAttention": 2, "Mamba": 2})
    mgr = KVCacheManager(64, [FullAttentionManager("FullAttention", 2, 4)], info)
    with pytest.raises(NotSupportedError, match=re.escape(
            "does not support Mamba state cache yet: cache ssm in layer 1.")):
        mgr.get_contiguous_buf_infos()
    bare = info_of([entry()])
    with pytest.raises(RuntimeError, match=re.escape(
            "CacheEntry k in layer 0 has no tensor \u2014 allocate_cache_tensors must run first.")):
        KVCacheManager(64, [], bare).get_contiguous_buf_infos()


def test_buf_infos_refuse_caches_that_are_not_contiguous() -> None:
    """Block-major caches cannot be described as contiguous buffers: a NotSupportedError that
    says how far apart the blocks are, not item lengths that would address other tensors."""
    info = with_cache_tensors(info_of([entry("k"), entry("v")]), {"FullAttention": 3}, "cpu",
                              layout="block")
    mgr = KVCacheManager(64, [FullAttentionManager("FullAttention", 3, 4)], info)
    with pytest.raises(NotSupportedError, match=r"cache k in layer 0 is not one contiguous "
                                                r"tensor .* blocks 256 bytes apart"):
        mgr.get_contiguous_buf_infos()


def test_the_block_layout_checks_every_key_before_it_allocates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A later key's misaligned part is refused before an earlier key's buffer is allocated."""
    from kvfunc.shell import _tensors
    allocated: list[tuple[int, ...]] = []
    real = _tensors.empty_aligned
    monkeypatch.setattr(_tensors, "empty_aligned",
                        lambda shape, *a, **k: allocated.append(shape) or real(shape, *a, **k))
    swa = {"attn": "SlidingWindow", "sliding_window": 8, "dim": 3, "num_head": 1,
           "block_size": 1}
    info = info_of([entry("k"), entry("a", **swa), entry("b", dtype="fp32", **swa)])
    with pytest.raises(InvalidArgumentError, match="layer 0 b would start at byte 6"):
        with_cache_tensors(info, {"FullAttention": 4, "SlidingWindow": 4}, "cpu",
                           layout="block")
    assert [] == allocated
