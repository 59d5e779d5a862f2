"""Cache metadata records (seed §1) and dtype sizes (seed §5.1)."""

from __future__ import annotations

import inspect

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfunc.core._cache_info import (
    CacheAllocator,
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    MemoryBudgetItem,
    ModelCacheInfo,
    OffloadWorkspaceMemoryInfo,
)
from kvfunc.core._dtypes import dtype_itemsize
from kvfunc.core._errors import InvalidArgumentError, InvalidCacheInfo, KVFuncError


def full(name: str = "k", **changes: object) -> CacheEntry:
    fields: dict[str, object] = {"cache_name": name, "attn_type": "FullAttention", "dim": 64,
                                 "num_head": 2, "dtype": "bfloat16", "needs_block": True,
                                 "block_size": 16}
    fields.update(changes)
    return CacheEntry(**fields)  # type: ignore[arg-type]


def mamba(**changes: object) -> MambaCacheEntry:
    fields: dict[str, object] = {"cache_name": "ssm", "dtype": "bfloat16",
                                 "needs_block": True, "shape": [4, 8]}
    fields.update(changes)
    return MambaCacheEntry(**fields)  # type: ignore[arg-type]


def test_allocator_values() -> None:
    """CacheAllocator is a str enum with the seed's two values."""
    expected = ["hbm", "swapped_memory"]
    assert expected == [a.value for a in CacheAllocator]
    assert CacheAllocator.SWAPPED_MEMORY == "swapped_memory"


def test_allocator_bad_value_message() -> None:
    """A bad allocator value raises Python's own enum message."""
    with pytest.raises(ValueError) as info:
        CacheAllocator("ddr")
    expected = "'ddr' is not a valid CacheAllocator"
    assert expected == str(info.value)


def test_memory_budget_records() -> None:
    """MemoryBudgetItem defaults to the npu; npu_bytes sums only npu items."""
    items = [MemoryBudgetItem("a", 10), MemoryBudgetItem("b", 7, "cpu"),
             MemoryBudgetItem("c", 5, "npu")]
    expected = "npu"
    assert expected == items[0].location
    report = OffloadWorkspaceMemoryInfo(items)
    expected = 15
    assert expected == report.npu_bytes
    assert tuple(items) == report.items


def test_cache_entry_fields_in_seed_order() -> None:
    """CacheEntry has the seed's fields, in order, with the seed's defaults."""
    names = [f.name for f in attrs.fields(CacheEntry)]
    expected = ["cache_name", "attn_type", "dim", "num_head", "dtype", "needs_block",
                "block_size", "manager_key", "tensor_setter", "sliding_window", "allocator",
                "compress_ratio", "tensor", "cache_layout"]
    assert expected == names
    e = CacheEntry("k", "FullAttention", 64, 2, "bfloat16", True)
    defaults = (e.block_size, e.manager_key, e.tensor_setter, e.sliding_window, e.allocator,
                e.compress_ratio, e.tensor, e.cache_layout)
    expected = (None, None, None, None, CacheAllocator.HBM, 1, None, "BnBsND")
    assert expected == defaults


def test_lists_are_stored_as_tuples_and_records_hash() -> None:
    """List dims, caches and layer_infos become tuples; records are hashable."""
    e = full(dim=[2, 64])
    layer = LayerCacheInfo(0, [e])
    info = ModelCacheInfo(1, [layer])
    assert ((2, 64), (e,), (layer,)) == (e.dim, layer.caches, info.layer_infos)
    assert {info: 1}[ModelCacheInfo(1, [LayerCacheInfo(0, [full(dim=[2, 64])])])] == 1


def test_records_are_frozen() -> None:
    """Assigning a field raises: records never change after construction."""
    e = full()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        e.block_size = 32  # type: ignore[misc]


def test_tensor_and_setter_left_out_of_equality() -> None:
    """Two entries differing only in tensor or tensor_setter are equal, with equal hashes."""
    a = full()
    b = attrs.evolve(a, tensor=object(), tensor_setter=lambda t: None)
    assert a == b
    assert hash(a) == hash(b)
    assert a.tensor is None


def test_group_key() -> None:
    """group_key is manager_key when set, else attn_type."""
    expected = ("FullAttention", "mla")
    assert expected == (full().group_key, full(manager_key="mla").group_key)


def test_cache_dim_numel() -> None:
    """cache_dim_numel is the product of dim; an int dim is one dimension."""
    expected = (64, 384)
    assert expected == (full().cache_dim_numel(), full(dim=[2, 3, 64]).cache_dim_numel())


def test_storage_block_size() -> None:
    """storage_block_size is block_size // compress_ratio."""
    expected = 32
    assert expected == full(block_size=128, compress_ratio=4).storage_block_size


def test_storage_block_size_indivisible_message() -> None:
    """An indivisible block_size raises the seed's message."""
    with pytest.raises(InvalidCacheInfo) as info:
        _ = full(block_size=10, compress_ratio=4).storage_block_size
    expected = ("block_size must be divisible by compress_ratio when calculating "
                "storage_block_size, but got cache_name=k, block_size=10, compress_ratio=4.")
    assert expected == str(info.value)


def test_constructors_validate_no_more_than_the_seed() -> None:
    """An entry without blocks, of an unknown type and with odd values, still constructs."""
    e = CacheEntry("idx", "Indexer", None, None, object(), False, allocator="ddr")
    expected = ("Indexer", "ddr")
    assert expected == (e.group_key, e.allocator)


def test_allocator_string_kept_as_given() -> None:
    """A plain-string allocator is stored as given (the seed formats it in messages)."""
    e = full(allocator="swapped_memory")
    assert ("swapped_memory", str) == (e.allocator, type(e.allocator))


def test_mamba_defaults() -> None:
    """MambaCacheEntry defaults: Mamba type, no dim/num_head, block_size 1, next_n 0."""
    m = mamba()
    expected = ("Mamba", None, None, 1, 0)
    assert expected == (m.attn_type, m.dim, m.num_head, m.block_size, m.next_n)
    expected = ((4, 8), 32, 1)
    assert expected == (m.shape, m.cache_dim_numel(), m.storage_block_size)


def test_mamba_overrides_are_keyword_only() -> None:
    """The fields MambaCacheEntry overrides or adds are keyword-only, as in the seed."""
    params = inspect.signature(MambaCacheEntry).parameters.values()
    kw_only = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    expected = ["attn_type", "dim", "num_head", "block_size", "shape", "next_n"]
    assert expected == kw_only


@pytest.mark.parametrize(("changes", "message"), [
    ({"attn_type": "FullAttention"},
     "Mamba cache 'ssm' must keep attn_type='Mamba', but got 'FullAttention'."),
    ({"block_size": 16}, "Mamba cache 'ssm' block_size must be 1, but got 16."),
    ({"shape": (4, 8)}, "Mamba cache 'ssm' must define a non-empty shape list, but got (4, 8)."),
    ({"shape": []}, "Mamba cache 'ssm' must define a non-empty shape list, but got []."),
    ({"shape": None}, "Mamba cache 'ssm' must define a non-empty shape list, but got None."),
    ({"shape": [4, 0]},
     "Mamba cache 'ssm' shape dimensions must all be positive integers, but got [4, 0]."),
    ({"shape": [4, 2.0]},
     "Mamba cache 'ssm' shape dimensions must all be positive integers, but got [4, 2.0]."),
    ({"next_n": -1}, "Mamba cache 'ssm' next_n must be non-negative, but got -1."),
])
def test_mamba_construction_checks(changes: dict[str, object], message: str) -> None:
    """Each of the seed's five Mamba checks raises its exact message."""
    with pytest.raises(InvalidCacheInfo) as info:
        mamba(**changes)
    assert message == str(info.value)


def test_mamba_default_shape_is_rejected() -> None:
    """Without a shape, the seed's empty default list fails the shape check."""
    with pytest.raises(InvalidCacheInfo) as info:
        MambaCacheEntry(cache_name="s", dtype="fp32", needs_block=True)
    expected = "Mamba cache 's' must define a non-empty shape list, but got []."
    assert expected == str(info.value)


def test_mamba_checks_run_in_seed_order() -> None:
    """attn_type is checked before block_size, block_size before shape, shape before next_n."""
    cases = [({"attn_type": "X", "block_size": 2}, "must keep attn_type"),
             ({"block_size": 2, "shape": ()}, "block_size must be 1"),
             ({"shape": [0], "next_n": -1}, "shape dimensions")]
    for changes, fragment in cases:
        with pytest.raises(InvalidCacheInfo) as info:
            mamba(**changes)
        assert fragment in str(info.value)


def test_mamba_errors_are_value_errors() -> None:
    """Construction errors are InvalidCacheInfo, so seed-style except ValueError works."""
    assert issubclass(InvalidCacheInfo, ValueError)
    assert issubclass(InvalidCacheInfo, KVFuncError)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=4), st.integers(0, 3))
def test_mamba_evolve_keeps_a_valid_entry(shape: list[int], next_n: int) -> None:
    """Attaching a tensor with attrs.evolve re-runs the checks and passes them."""
    m = mamba(shape=shape, next_n=next_n)
    evolved = attrs.evolve(m, tensor="t")
    assert (m, "t", tuple(shape)) == (evolved, evolved.tensor, evolved.shape)


def test_merge_offsets_layers_without_renumbering() -> None:
    """merge adds len(self.layer_infos) to other's layer_idx values."""
    main = ModelCacheInfo(2, [LayerCacheInfo(0, [full()]), LayerCacheInfo(1, [full()])],
                          is_mla_backend=True)
    mtp = ModelCacheInfo(2, [LayerCacheInfo(0, [full("a")]), LayerCacheInfo(5, [full("b")])],
                         is_mla_backend=True)
    merged = main.merge(mtp)
    expected = [0, 1, 2, 7]
    assert expected == [layer.layer_idx for layer in merged.layer_infos]
    expected = (4, True)
    assert expected == (merged.num_layers, merged.is_mla_backend)
    assert mtp.layer_infos[1].caches == merged.layer_infos[3].caches


@given(st.lists(st.integers(0, 100), max_size=5), st.lists(st.integers(0, 100), max_size=5))
def test_merge_leaves_other_unchanged(first: list[int], second: list[int]) -> None:
    """Unlike the seed, merge does not mutate other (nor self)."""
    a = ModelCacheInfo(len(first), [LayerCacheInfo(i, [full()]) for i in first])
    b = ModelCacheInfo(len(second), [LayerCacheInfo(i, [full()]) for i in second])
    merged = a.merge(b)
    assert second == [layer.layer_idx for layer in b.layer_infos]
    assert first == [layer.layer_idx for layer in a.layer_infos]
    assert first + [i + len(first) for i in second] == [
        layer.layer_idx for layer in merged.layer_infos]


def test_merge_mla_mismatch_message() -> None:
    """Merging infos that disagree on is_mla_backend raises the seed's message."""
    with pytest.raises(InvalidCacheInfo) as info:
        ModelCacheInfo(0, []).merge(ModelCacheInfo(0, [], is_mla_backend=True))
    expected = "is_mla_backend mismatch across merged cache infos: False vs True"
    assert expected == str(info.value)


@pytest.mark.parametrize(("dtype", "size"), [
    ("float32", 4), ("fp32", 4), ("torch.float32", 4), ("bfloat16", 2), ("float16", 2),
    ("int8", 1), ("uint8", 1), ("float8_e4m3fn", 1), ("int32", 4), ("int64", 8),
    ("float64", 8), ("bool", 1), ("BF16", 2),
])
def test_dtype_itemsize_by_name(dtype: str, size: int) -> None:
    """dtype_itemsize knows torch's dtype names and the usual short names."""
    assert size == dtype_itemsize(dtype)


def test_dtype_itemsize_uses_itemsize_attribute() -> None:
    """An object with an itemsize (as torch.dtype has) is sized by it."""
    class Sized:
        itemsize = 2
    expected = 2
    assert expected == dtype_itemsize(Sized())


@pytest.mark.parametrize("dtype", ["float128", None, 4])
def test_dtype_itemsize_unknown(dtype: object) -> None:
    """An unknown dtype raises InvalidArgumentError naming the value."""
    with pytest.raises(InvalidArgumentError) as info:
        dtype_itemsize(dtype)
    assert str(info.value).startswith(f"unknown dtype {dtype!r}: ")
