"""Remote-store keys, per-block outcomes and Mooncake's error codes (no store needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfunc.core import InvalidArgumentError, InvalidTypeError, KVFuncError
from kvfunc.shell import (
    MOONCAKE_ERROR_CODES,
    MooncakeStoreConfig,
    StoreDataError,
    StoreError,
    StoreMissError,
    StoreRequestError,
    StoreUnavailableError,
    TransferResult,
    block_key,
    mooncake_error,
)
from kvfunc.shell._store_keys import outcome_of_get, outcome_of_put

names = st.text(min_size=1, max_size=20)
digests = st.binary(min_size=1, max_size=40)


@given(st.tuples(names, names, digests), st.tuples(names, names, digests))
def test_distinct_inputs_give_distinct_keys(a: tuple[str, str, bytes],
                                            b: tuple[str, str, bytes]) -> None:
    """Keys are injective in (namespace, group key, hash), whatever characters the names hold."""
    assert (a == b) == (block_key(a[0], a[1], "f", a[2]) == block_key(b[0], b[1], "f", b[2]))


def test_keys_are_readable_and_percent_encode_separators() -> None:
    """A key shows its parts; '/' and '%' in names cannot forge another key's boundaries."""
    assert "kvfunc/1/m/g/ff00/0aff" == block_key("m", "g", "ff00", b"\x0a\xff")
    assert block_key("a/b", "c", "f", b"\x01") != block_key("a", "b/c", "f", b"\x01")
    assert "kvfunc/1/a%2Fb/c%25/f/01" == block_key("a/b", "c%", "f", b"\x01")


@pytest.mark.parametrize("args, error", [
    (("", "g", "f", b"\x01"), InvalidArgumentError),
    (("m", "g" * 257, "f", b"\x01"), InvalidArgumentError),
    (("m", "g", "f", b""), InvalidArgumentError),
    (("m", "g", "f", b"\x01" * 129), InvalidArgumentError),
    ((1, "g", "f", b"\x01"), InvalidTypeError),
    (("m", "g", "f", "01"), InvalidTypeError),
])
def test_bad_key_parts_raise_typed_errors(args: tuple[object, ...], error: type) -> None:
    """Empty or over-long names and hashes, and wrong types, are refused."""
    with pytest.raises(error):
        block_key(*args)  # type: ignore[arg-type]


def test_outcomes_say_what_to_recompute() -> None:
    """A get is ok only at exactly one block's bytes; absent objects miss; the rest fail.
    A put is ok when stored or already stored."""
    assert ["ok", "failed", "failed", "miss", "miss", "miss", "miss", "failed", "failed"] == [
        outcome_of_get(c, 64) for c in (64, 63, 0, -704, -703, -710, -712, -600, -800)]
    assert ["ok", "ok", "failed", "failed"] == [outcome_of_put(c) for c in (0, -705, -200, -800)]
    r = TransferResult(("ok", "ok", "failed", "ok"), (64, 64, -600, 64), 64, reading=True)
    assert ((0, 1, 3), (), (2,), 2) == (r.ok, r.missed, r.failed, r.leading_ok)
    assert isinstance(r.error(2), StoreDataError)


def test_every_mooncake_code_maps_to_one_typed_error() -> None:
    """Each code of Mooncake's ErrorCode has a name and a StoreError class, and keeps its code."""
    assert len(MOONCAKE_ERROR_CODES) == len({n for n, _ in MOONCAKE_ERROR_CODES.values()})
    for code, (name, cls) in MOONCAKE_ERROR_CODES.items():
        err = mooncake_error(code, "op")
        assert (type(err), err.code, err.code_name) == (cls, code, name)
        assert isinstance(err, StoreError) and isinstance(err, KVFuncError)
    assert isinstance(mooncake_error(-704, "get"), KeyError)
    assert isinstance(mooncake_error(-900, "get"), StoreUnavailableError)
    assert isinstance(mooncake_error(-600, "put"), StoreRequestError)
    assert isinstance(mooncake_error(-600, "get", reading=True), StoreDataError)
    assert ("UNKNOWN", StoreError) == (mooncake_error(-12345, "x").code_name,
                                       type(mooncake_error(-12345, "x")))
    assert isinstance(mooncake_error(-703, "get"), StoreMissError)


def test_config_checks_its_fields() -> None:
    """Addresses must be strings, sizes ints >= 0, deadlines and batches positive."""
    ok = {"master_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata"}
    assert 64 == MooncakeStoreConfig(**ok).batch_objects
    for bad, error in [({"master_address": 5}, InvalidTypeError),
                       ({"global_segment_bytes": -1}, InvalidArgumentError),
                       ({"local_buffer_bytes": 1.5}, InvalidArgumentError),
                       ({"call_timeout_s": 0}, InvalidArgumentError),
                       ({"probe_timeout_s": True}, InvalidArgumentError),
                       ({"batch_objects": -3}, InvalidArgumentError),
                       ({"batch_objects": 2.5}, InvalidArgumentError)]:
        with pytest.raises(error):
            MooncakeStoreConfig(**(ok | bad))  # type: ignore[arg-type]


def test_importing_the_shell_does_not_import_mooncake() -> None:
    """Mooncake is imported when a store connects, never by ``import kvfunc.shell``."""
    code = "import sys, kvfunc.shell; print('mooncake' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "False" == out.stdout.strip()
