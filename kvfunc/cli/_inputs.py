"""Outside data, read as an attacker would write it: bounded sizes, checked text, short echoes.

Every file the command line reads (model files, traces, delta logs) goes
through :func:`read_bounded`, and every value echoed back in an error message
goes through :func:`show`.  The bounds, and why:

=========================  ==========  =============================================
what                       at most     why
=========================  ==========  =============================================
a model file               1 MiB       the largest real model is a few KiB
a trace (CSV or JSONL)     64 MiB      after decompression; the Mooncake
                                       conversation trace is 2.9 MiB
one line of a trace        1 MiB       a Mooncake line is ~2 KiB
one line of a delta log    32 MiB      a final record lists every free block
blocks of a simulated      2,097,152   each block costs host memory in the state
state, all groups                      (a Mooncake conversation run at 1.53
                                       million blocks peaks at 630 MiB)
=========================  ==========  =============================================

A file that is larger (``/dev/zero`` is endless) is refused after reading one
byte more than the bound, so memory stays bounded whatever the input.
"""

from __future__ import annotations

import gzip
import os
import reprlib
import zlib
from collections.abc import Mapping
from pathlib import Path

from kvfunc.cli._errors import CLIError

__all__ = ["MAX_LOG_LINE_BYTES", "MAX_MODEL_FILE_BYTES", "MAX_STATE_BLOCKS", "MAX_TRACE_BYTES",
           "MAX_TRACE_LINE_BYTES", "check_state_size", "check_writable", "decode_text",
           "read_bounded", "show"]

KIB, MIB = 2**10, 2**20
MAX_MODEL_FILE_BYTES = 1 * MIB
MAX_TRACE_BYTES = 64 * MIB
MAX_TRACE_LINE_BYTES = 1 * MIB
MAX_LOG_LINE_BYTES = 32 * MIB
MAX_STATE_BLOCKS = 2**21

_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6


def show(value: object) -> str:
    """``repr(value)``, cut short: deep nesting and long fields cannot flood a message.

    >>> show("x" * 1000)
    "'xxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx'"
    >>> show([[[[[1]]]]])
    '[[[[...]]]]'
    """
    return _SHORT.repr(value)


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB"


def read_bounded(path: str | Path, *, what: str, limit: int) -> bytes:
    """The bytes of ``path`` (decompressed if it ends in ``.gz``), refused past ``limit``.

    Args:
        path: a file; ``/dev/stdin`` and other streams work, and are bounded too.
        what: what the file is, for messages (``"model file"``).
        limit: the most bytes accepted (after decompression).

    Raises:
        CLIError: the file cannot be read, is larger than ``limit``, or is a
            broken gzip stream.

    >>> read_bounded("/dev/zero", what="trace", limit=1024)
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: trace '/dev/zero' is larger than 1 KiB, the most kvfunc reads
    """
    name = str(path)
    try:
        with open(path, "rb") as raw:
            if name.lower().endswith(".gz"):
                with gzip.GzipFile(fileobj=raw) as unzipped:
                    data = unzipped.read(limit + 1)
            else:
                data = raw.read(limit + 1)
    except IsADirectoryError:
        raise CLIError(f"{what} {name!r} is a directory, not a file") from None
    except OSError as exc:  # gzip.BadGzipFile is an OSError too
        reason = exc.strerror or str(exc)
        raise CLIError(f"cannot read {what} {name!r}: {reason}") from None
    except (EOFError, zlib.error) as exc:
        raise CLIError(f"{what} {name!r} is a broken gzip file ({exc})") from None
    if len(data) > limit:
        msg = f"{what} {name!r} is larger than {_size(limit)}, the most kvfunc reads"
        raise CLIError(msg)
    return data


def decode_text(data: bytes, *, what: str) -> str:
    """``data`` as UTF-8 text; anything else is a one-line error naming the first bad byte.

    >>> decode_text(b"ok", what="x")
    'ok'
    >>> decode_text(b"name = \\xff", what="model file m.toml")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: model file m.toml is not UTF-8 text (byte 0xff at offset 7)
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start]
        msg = f"{what} is not UTF-8 text (byte 0x{bad:02x} at offset {exc.start})"
        raise CLIError(msg) from None


def check_writable(path: str | Path, *, what: str) -> None:
    """Refuse, before any work, an output path that cannot be written.

    An existing file is opened for appending (so it is not changed); a new
    one is created and removed again.

    Raises:
        CLIError: the path is a directory, its folder is missing, or it is
            not writable.

    >>> check_writable("/nonexistent/dir/x.png", what="--plot")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: cannot write --plot '/nonexistent/dir/x.png': No such file or \
directory
    """
    out = Path(path)
    if out.is_dir():
        raise CLIError(f"cannot write {what} {str(out)!r}: it is a directory")
    existed = out.exists()
    try:
        with open(out, "ab"):
            pass
    except OSError as exc:
        raise CLIError(f"cannot write {what} {str(out)!r}: {exc.strerror or exc}") from None
    if not existed:
        os.unlink(out)


def check_state_size(num_blocks: Mapping[str, int], *, fix: str) -> None:
    """Refuse a state of more than :data:`MAX_STATE_BLOCKS` blocks before it is built.

    Args:
        num_blocks: ``{manager_key: num_blocks}``.
        fix: what the user can change, for the message.

    >>> check_state_size({"full": 1000}, fix="lower --memory")
    >>> check_state_size({"full": 2**40}, fix="lower --memory")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: the cache would hold 1,099,511,627,776 blocks; kvfunc \
simulates at most 2,097,152 (each costs host memory): lower --memory
    """
    total = sum(num_blocks.values())
    if total > MAX_STATE_BLOCKS:
        msg = (f"the cache would hold {total:,} blocks; kvfunc simulates at most "
               f"{MAX_STATE_BLOCKS:,} (each costs host memory): {fix}")
        raise CLIError(msg)
