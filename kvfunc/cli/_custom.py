"""Custom models: a small TOML or JSON file that describes a model's caches.

The file lists groups of identical layers, each with its caches::

    name = "toy-hybrid"
    max_model_len = 4096
    sources = ["https://example.org/toy/config.json"]   # optional
    next_n = 0                                         # optional MTP depth
    mla = false                                        # optional

    [[layers]]
    repeat = 3                       # this many identical layers (default 1)
    caches = [
      { name = "k_cache", attn_type = "FullAttention", dim = 128, num_head = 8,
        dtype = "bfloat16", block_size = 16 },
      { name = "v_cache", attn_type = "FullAttention", dim = 128, num_head = 8,
        dtype = "bfloat16", block_size = 16 },
    ]

    [[layers]]
    caches = [{ name = "state", attn_type = "Mamba", shape = [32, 128, 128],
                dtype = "float32" }]

A ``SlidingWindow`` cache also needs ``sliding_window``; optional keys are
``manager_key`` and ``compress_ratio``.  JSON files have the same structure.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from kvfunc.cli._errors import CLIError
from kvfunc.cli._presets import ModelPreset
from kvfunc.core import (
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    dtype_itemsize,
    validate_cache_info,
)

__all__ = ["load_model_file", "model_from_mapping"]

_TOP_KEYS = {"name", "max_model_len", "sources", "next_n", "mla", "layers", "title"}
_LAYER_KEYS = {"repeat", "caches"}
_CACHE_KEYS = {"name", "attn_type", "dim", "num_head", "dtype", "block_size", "manager_key",
               "sliding_window", "compress_ratio", "shape"}
_REQUIRED = {
    "FullAttention": ("name", "dim", "num_head", "dtype", "block_size"),
    "SlidingWindow": ("name", "dim", "num_head", "dtype", "block_size", "sliding_window"),
    "Mamba": ("name", "shape", "dtype"),
}


def _fail(where: str, what: str) -> CLIError:
    return CLIError(f"{where}: {what}")


def _check_keys(where: str, table: object, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _fail(where, f"expected a table of keys, got {table!r}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(where, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    return table


def _int(where: str, key: str, value: object, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise _fail(where, f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _cache(where: str, raw: object, next_n: int) -> CacheEntry:
    table = _check_keys(where, raw, _CACHE_KEYS)
    attn_type = table.get("attn_type", "FullAttention")
    required = _REQUIRED.get(attn_type)
    if required is None:
        raise _fail(where, f"attn_type must be one of {sorted(_REQUIRED)}, got {attn_type!r}")
    missing = [key for key in required if key not in table]
    if missing:
        raise _fail(where, f"a {attn_type} cache needs {missing}")
    try:
        dtype_itemsize(table["dtype"])
    except ValueError:
        raise _fail(where, f"dtype {table['dtype']!r} is unknown; try bfloat16, fp8 or float32"
                    ) from None
    if attn_type == "Mamba":
        shape = table["shape"]
        if not isinstance(shape, list) or not all(type(d) is int and d > 0 for d in shape):
            raise _fail(where, f"shape must be a list of positive integers, got {shape!r}")
        return MambaCacheEntry(cache_name=str(table["name"]), dtype=table["dtype"],
                               needs_block=True, shape=shape, next_n=next_n,
                               manager_key=table.get("manager_key"))
    dim = table["dim"]
    if not (type(dim) is int or (isinstance(dim, list) and all(type(d) is int for d in dim))):
        raise _fail(where, f"dim must be an integer or a list of integers, got {dim!r}")
    window = table.get("sliding_window")
    if window is not None:
        window = _int(where, "sliding_window", window, 0)
    return CacheEntry(
        str(table["name"]), attn_type, dim, _int(where, "num_head", table["num_head"], 1),
        table["dtype"], True, block_size=_int(where, "block_size", table["block_size"], 1),
        manager_key=table.get("manager_key"), sliding_window=window,
        compress_ratio=_int(where, "compress_ratio", table.get("compress_ratio", 1), 1))


def model_from_mapping(data: object, *, source: str = "model", next_n: int | None = None
                       ) -> ModelPreset:
    """A :class:`ModelPreset` from the parsed file (see the module docstring).

    Args:
        data: the parsed TOML or JSON document.
        source: the file name, for messages and the preset's ``sources``.
        next_n: overrides the file's MTP depth (``--mtp``).

    Raises:
        CLIError: a missing or unknown key, a bad value, or caches that
            :func:`kvfunc.validate_cache_info` rejects.

    >>> kv = {"name": "k", "dim": 64, "num_head": 2, "dtype": "fp16", "block_size": 16}
    >>> m = model_from_mapping({"name": "toy", "max_model_len": 1024,
    ...                         "layers": [{"repeat": 2, "caches": [kv]}]})
    >>> m.name, m.cache_info.num_layers
    ('toy', 2)
    >>> model_from_mapping({"name": "toy", "max_model_len": 1024, "layers": [{"caches": [
    ...     {"name": "k", "attn_type": "Linear"}]}]}, source="toy.toml")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: toy.toml layers[0].caches[0]: attn_type must be one of ...
    """
    top = _check_keys(source, data, _TOP_KEYS)
    for key in ("name", "max_model_len", "layers"):
        if key not in top:
            raise _fail(source, f"missing key {key!r} (a model file needs name, "
                                "max_model_len and at least one [[layers]] table)")
    if next_n is not None and (type(next_n) is not int or next_n < 0):
        raise CLIError(f"--mtp must be a non-negative integer, got {next_n!r}")
    depth = _int(source, "next_n", top.get("next_n", 0), 0) if next_n is None else next_n
    max_model_len = _int(source, "max_model_len", top["max_model_len"], 1)
    raw_layers = top["layers"]
    if not isinstance(raw_layers, list) or not raw_layers:
        raise _fail(source, "layers must be a non-empty list of [[layers]] tables")
    layers: list[LayerCacheInfo] = []
    for i, raw_layer in enumerate(raw_layers):
        where = f"{source} layers[{i}]"
        layer = _check_keys(where, raw_layer, _LAYER_KEYS)
        repeat = _int(where, "repeat", layer.get("repeat", 1), 1)
        raw_caches = layer.get("caches")
        if not isinstance(raw_caches, list) or not raw_caches:
            raise _fail(where, "caches must be a non-empty list of cache tables")
        caches = [_cache(f"{where}.caches[{j}]", raw, depth) for j, raw in enumerate(raw_caches)]
        layers.extend(LayerCacheInfo(len(layers) + r, caches) for r in range(repeat))
    info = ModelCacheInfo(len(layers), layers, is_mla_backend=bool(top.get("mla", False)))
    try:
        validate_cache_info(info)
    except ValueError as exc:
        raise _fail(source, str(exc)) from None
    sources = top.get("sources", [source])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise _fail(source, f"sources must be a list of strings, got {sources!r}")
    name = str(top["name"])
    return ModelPreset(name, str(top.get("title", f"{name} (from {source})")), tuple(sources),
                       info, max_model_len, depth)


def load_model_file(path: str | Path, *, next_n: int | None = None) -> ModelPreset:
    """Read a ``.toml`` or ``.json`` model file (see the module docstring).

    Raises:
        CLIError: the file is missing, unreadable, not TOML/JSON, or invalid.

    >>> load_model_file("missing.toml")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: cannot read model file 'missing.toml': No such file or directory
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot read model file {str(path)!r}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        raise CLIError(f"model file {path.name} is not valid {kind}: {exc}") from None
    return model_from_mapping(data, source=path.name, next_n=next_n)
