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
The format, with a worked example, is documented in
``docs/reference/model-file.md``.

Bounds (a file is outside data): at most 1 MiB, at most
:data:`MAX_LAYERS` layers and :data:`MAX_CACHES` caches in all, integers
from 1 to :data:`MAX_FIELD` (``next_n`` up to :data:`MAX_NEXT_N`), and
``max_model_len`` up to :data:`MAX_MODEL_LEN`.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from kvfunc.cli._errors import CLIError
from kvfunc.cli._inputs import MAX_MODEL_FILE_BYTES, decode_text, read_bounded, show
from kvfunc.cli._presets import MAX_FIELD, MAX_MODEL_LEN, MAX_NEXT_N, ModelPreset
from kvfunc.core import (
    CacheEntry,
    LayerCacheInfo,
    MambaCacheEntry,
    ModelCacheInfo,
    dtype_itemsize,
    validate_cache_info,
)

__all__ = ["MAX_CACHES", "MAX_FIELD", "MAX_LAYERS", "MAX_MODEL_LEN", "MAX_NEXT_N",
           "load_model_file", "model_from_mapping"]

#: Layers a model file may describe, ``repeat`` included (the largest models have ~130).
MAX_LAYERS = 4096
#: Cache entries over all layers.
MAX_CACHES = 65536

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
        raise _fail(where, f"expected a table of keys, got {show(table)}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise _fail(where, f"unknown key(s) {show(unknown)}; allowed: {sorted(allowed)}")
    return table


def _int(where: str, key: str, value: object, minimum: int, maximum: int = MAX_FIELD) -> int:
    if type(value) is not int or not minimum <= value <= maximum:
        raise _fail(where, f"{key} must be an integer from {minimum} to {maximum:,}, got "
                           f"{show(value)}")
    return value


def _str(where: str, key: str, value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 200:
        raise _fail(where, f"{key} must be a string of 1 to 200 characters, got {show(value)}")
    return value


def _dims(where: str, key: str, value: object, *, allow_int: bool) -> int | list[int]:
    """A positive int (where allowed) or a non-empty list of them, each at most MAX_FIELD."""
    if allow_int and type(value) is int:
        return _int(where, key, value, 1)
    if not (isinstance(value, list) and 0 < len(value) <= 8 and all(
            type(d) is int and 1 <= d <= MAX_FIELD for d in value)):
        kind = "an integer or a list" if allow_int else "a list"
        raise _fail(where, f"{key} must be {kind} of 1 to 8 integers from 1 to {MAX_FIELD:,}, "
                           f"got {show(value)}")
    return value


def _cache(where: str, raw: object, next_n: int) -> CacheEntry:
    table = _check_keys(where, raw, _CACHE_KEYS)
    attn_type = table.get("attn_type", "FullAttention")
    required = _REQUIRED.get(attn_type) if isinstance(attn_type, str) else None
    if required is None:
        raise _fail(where, f"attn_type must be one of {sorted(_REQUIRED)}, got {show(attn_type)}")
    missing = [key for key in required if key not in table]
    if missing:
        raise _fail(where, f"a {attn_type} cache needs {missing}")
    name = _str(where, "name", table["name"])
    dtype = table["dtype"]
    try:
        if not isinstance(dtype, str):
            raise ValueError(dtype)
        dtype_itemsize(dtype)
    except ValueError:
        raise _fail(where, f"dtype {show(dtype)} is unknown; try bfloat16, fp8 or float32"
                    ) from None
    manager_key = table.get("manager_key")
    if manager_key is not None:
        manager_key = _str(where, "manager_key", manager_key)
    if attn_type == "Mamba":
        shape = _dims(where, "shape", table["shape"], allow_int=False)
        return MambaCacheEntry(cache_name=name, dtype=dtype, needs_block=True, shape=shape,
                               next_n=next_n, manager_key=manager_key)
    dim = _dims(where, "dim", table["dim"], allow_int=True)
    window = table.get("sliding_window")
    if window is not None:
        window = _int(where, "sliding_window", window, 0)
    return CacheEntry(
        name, attn_type, dim, _int(where, "num_head", table["num_head"], 1), dtype, True,
        block_size=_int(where, "block_size", table["block_size"], 1),
        manager_key=manager_key, sliding_window=window,
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
    if next_n is not None and (type(next_n) is not int or not 0 <= next_n <= MAX_NEXT_N):
        raise CLIError(f"--mtp must be an integer from 0 to {MAX_NEXT_N}, got {show(next_n)}")
    depth = (_int(source, "next_n", top.get("next_n", 0), 0, MAX_NEXT_N) if next_n is None
             else next_n)
    max_model_len = _int(source, "max_model_len", top["max_model_len"], 1, MAX_MODEL_LEN)
    mla = top.get("mla", False)
    if type(mla) is not bool:
        raise _fail(source, f"mla must be true or false, got {show(mla)}")
    raw_layers = top["layers"]
    if not isinstance(raw_layers, list) or not raw_layers:
        raise _fail(source, "layers must be a non-empty list of [[layers]] tables")
    layers: list[LayerCacheInfo] = []
    num_caches = 0
    for i, raw_layer in enumerate(raw_layers):
        where = f"{source} layers[{i}]"
        layer = _check_keys(where, raw_layer, _LAYER_KEYS)
        repeat = _int(where, "repeat", layer.get("repeat", 1), 1, MAX_LAYERS)
        raw_caches = layer.get("caches")
        if not isinstance(raw_caches, list) or not raw_caches:
            raise _fail(where, "caches must be a non-empty list of cache tables")
        num_caches += repeat * len(raw_caches)
        if len(layers) + repeat > MAX_LAYERS or num_caches > MAX_CACHES:
            msg = (f"the model has more than {MAX_LAYERS:,} layers or {MAX_CACHES:,} caches "
                   "in all (repeat included)")
            raise _fail(where, msg)
        caches = [_cache(f"{where}.caches[{j}]", raw, depth) for j, raw in enumerate(raw_caches)]
        layers.extend(LayerCacheInfo(len(layers) + r, caches) for r in range(repeat))
    info = ModelCacheInfo(len(layers), layers, is_mla_backend=mla)
    try:
        validate_cache_info(info)
    except ValueError as exc:
        raise _fail(source, str(exc)) from None
    sources = top.get("sources", [source])
    if not (isinstance(sources, list) and len(sources) <= 16
            and all(isinstance(s, str) and len(s) <= 1000 for s in sources)):
        raise _fail(source, f"sources must be a list of at most 16 strings, got {show(sources)}")
    name = _str(source, "name", top["name"])
    title = _str(source, "title", top.get("title", f"{name} (from {source})"))
    return ModelPreset(name, title, tuple(sources), info, max_model_len, depth)


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
    text = decode_text(read_bounded(path, what="model file", limit=MAX_MODEL_FILE_BYTES),
                       what=f"model file {path.name}")
    kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
    try:
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except RecursionError:
        raise CLIError(f"model file {path.name} nests too deeply to be a model") from None
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise CLIError(f"model file {path.name} is not valid {kind}: {show(str(exc))}") from None
    return model_from_mapping(data, source=path.name, next_n=next_n)
