"""validate_cache_info: the seed's checks, order and messages (spec §5.2)."""

from __future__ import annotations

import pytest

from kvfunc.core import _validate
from kvfunc.core._cache_info import (
    CacheAllocator,
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
)
from kvfunc.core._errors import InvalidCacheInfo
from kvfunc.core._validate import (
    FIXED_BLOCK_ATTN_TYPES,
    SUPPORTED_CACHE_LAYOUTS,
    validate_cache_info,
)


def entry(name: str = "k", **changes: object) -> CacheEntry:
    fields: dict[str, object] = {"cache_name": name, "attn_type": "FullAttention", "dim": 64,
                                 "num_head": 2, "dtype": "bfloat16", "needs_block": True,
                                 "block_size": 16}
    fields.update(changes)
    return CacheEntry(**fields)  # type: ignore[arg-type]


def one_layer(*caches: CacheEntry, layer_idx: int = 3) -> ModelCacheInfo:
    return ModelCacheInfo(1, [LayerCacheInfo(layer_idx, list(caches))])


def message_of(info: ModelCacheInfo) -> str:
    with pytest.raises(InvalidCacheInfo) as raised:
        validate_cache_info(info)
    return str(raised.value)


def test_constants() -> None:
    """The fixed-block types and layouts are the seed's."""
    expected = (frozenset({"SlidingWindow", "Mamba"}), frozenset({"BnBsND", "BnNBsD"}))
    assert expected == (FIXED_BLOCK_ATTN_TYPES, SUPPORTED_CACHE_LAYOUTS)


def test_valid_hybrid_model_passes() -> None:
    """Full, sliding-window and Mamba entries with both allocators and layouts pass."""
    info = ModelCacheInfo(2, [
        LayerCacheInfo(0, [entry(dim=[2, 64], cache_layout="BnNBsD"),
                           entry("v", allocator="swapped_memory")]),
        LayerCacheInfo(1, [entry("w", attn_type="SlidingWindow", sliding_window=128,
                                 allocator=CacheAllocator.SWAPPED_MEMORY),
                           MambaCacheEntry(cache_name="ssm", dtype="fp32", needs_block=True,
                                           shape=[4, 8])]),
    ])
    expected = None
    assert expected == validate_cache_info(info)


def test_num_layers_mismatch() -> None:
    """num_layers must equal len(layer_infos)."""
    info = ModelCacheInfo(2, [LayerCacheInfo(0, [entry()])])
    expected = "ModelCacheInfo.num_layers mismatch: num_layers=2, len(layer_infos)=1"
    assert expected == message_of(info)


def test_layer_without_caches() -> None:
    """Every layer needs at least one cache entry."""
    expected = "Layer 3 must define at least one cache entry"
    assert expected == message_of(one_layer())


def test_entries_without_blocks_are_not_checked() -> None:
    """An entry with needs_block=False is skipped whatever its values."""
    odd = CacheEntry("idx", "Indexer", -1, 0, "fp16", False, block_size=None,
                     cache_layout="XY", allocator="ddr")
    expected = None
    assert expected == validate_cache_info(one_layer(odd))


@pytest.mark.parametrize("block_size", [None, 0, -16])
def test_block_size_must_be_positive(block_size: int | None) -> None:
    """A paged entry needs a positive block_size."""
    expected = f"cache k in layer 3 must have positive block_size, but got {block_size}"
    assert expected == message_of(one_layer(entry(block_size=block_size)))


def test_unsupported_attn_type() -> None:
    """An attention type without a registered policy is rejected, listing the registry."""
    expected = ("Unsupported attn_type 'Linear' found in layer 3, cache k. Supported attn types "
                "are: ['FullAttention', 'Mamba', 'SlidingWindow']")
    assert expected == message_of(one_layer(entry(attn_type="Linear")))


def test_supported_attn_types_come_from_the_policy_registry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A type is accepted once the policy registry lists it."""
    monkeypatch.setattr(_validate, "registered_attn_types",
                        lambda: ["FullAttention", "Linear", "Mamba", "SlidingWindow"])
    expected = None
    assert expected == validate_cache_info(one_layer(entry(attn_type="Linear")))


def test_unsupported_layout() -> None:
    """Only the BnBsND and BnNBsD layouts are supported."""
    expected = ("cache k in layer 3 has unsupported cache_layout 'BSND'. Supported layouts "
                "are: ['BnBsND', 'BnNBsD']")
    assert expected == message_of(one_layer(entry(cache_layout="BSND")))


def test_mamba_type_needs_a_mamba_entry() -> None:
    """attn_type='Mamba' on a plain CacheEntry is rejected."""
    expected = ("cache k in layer 3 declares attn_type='Mamba' and must be a MambaCacheEntry, "
                "but got CacheEntry")
    assert expected == message_of(one_layer(entry(attn_type="Mamba")))


def test_mamba_entry_skips_head_and_dim_checks() -> None:
    """A Mamba entry has no num_head or dim, and is not asked for them."""
    m = MambaCacheEntry(cache_name="ssm", dtype="fp32", needs_block=True, shape=[2])
    expected = None
    assert expected == validate_cache_info(one_layer(m))


@pytest.mark.parametrize("num_head", [0, -1, None])
def test_num_head_must_be_positive(num_head: int | None) -> None:
    """Full and sliding-window entries need a positive num_head."""
    expected = f"cache k in layer 3 must have positive num_head, but got {num_head}"
    assert expected == message_of(one_layer(entry(num_head=num_head)))


@pytest.mark.parametrize(("dim", "shown"), [(0, "0"), ([64, 0], "[64, 0]"), (None, "None")])
def test_dim_must_be_positive(dim: object, shown: str) -> None:
    """Every dim must be positive; a list dim is shown as the seed showed it."""
    expected = f"cache k in layer 3 must have positive dim, but got {shown}"
    assert expected == message_of(one_layer(entry(attn_type="SlidingWindow", dim=dim)))


def test_unsupported_allocator() -> None:
    """An allocator that is not a CacheAllocator value is rejected."""
    expected = ("cache k in layer 3 has unsupported allocator ddr. Supported allocators are: "
                "['hbm', 'swapped_memory']")
    assert expected == message_of(one_layer(entry(allocator="ddr")))


def test_checks_run_in_seed_order_within_an_entry() -> None:
    """block_size, attn type, layout, num_head, dim, allocator: the first failure wins."""
    bad = {"block_size": 0, "attn_type": "Linear", "cache_layout": "X", "num_head": 0,
           "dim": 0, "allocator": "ddr"}
    fragments = ["positive block_size", "Unsupported attn_type", "unsupported cache_layout",
                 "positive num_head", "positive dim", "unsupported allocator"]
    seen = []
    for i in range(len(fragments)):
        changes = dict(list(bad.items())[i:])
        message = message_of(one_layer(entry(**changes)))
        seen.append(next(f for f in fragments if f in message))
    assert fragments == seen


def test_first_failing_entry_in_layer_order_wins() -> None:
    """Layers in list order, caches in order: the first bad entry raises."""
    info = ModelCacheInfo(2, [
        LayerCacheInfo(7, [entry("a"), entry("b", num_head=0)]),
        LayerCacheInfo(1, [entry("c", block_size=0)]),
    ])
    expected = "cache b in layer 7 must have positive num_head, but got 0"
    assert expected == message_of(info)


def test_errors_are_value_errors() -> None:
    """validate_cache_info raises a ValueError, as the seed does."""
    with pytest.raises(ValueError, match="num_layers mismatch"):
        validate_cache_info(ModelCacheInfo(1, []))
