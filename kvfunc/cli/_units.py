"""Byte sizes as people write them (``64GiB``, ``80GB``, ``1.5TiB``) and back."""

from __future__ import annotations

import re

from kvfunc.cli._errors import CLIError

__all__ = ["MAX_BYTES", "format_bytes", "parse_bytes"]

#: The largest size accepted (1 EiB): sizes stay exact in a float and far above any device.
MAX_BYTES = 2**60

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str, *, what: str = "memory") -> int:
    """Bytes in ``text``: a number and an optional unit (decimal ``GB`` or binary ``GiB``).

    Args:
        text: for example ``"64GiB"``, ``"80 GB"``, ``"1.5TiB"`` or ``"123456"``.
        what: the option's name, for the error message.

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        CLIError: the text is not a size from 0 to 1 EiB (:data:`MAX_BYTES`).

    >>> parse_bytes("64GiB"), parse_bytes("1.5 kB"), parse_bytes("512")
    (68719476736, 1500, 512)
    >>> parse_bytes("lots")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: memory 'lots' is not a size; write it like 64GiB or 80GB
    >>> parse_bytes("-5GiB", what="--memory")
    Traceback (most recent call last):
    ...
    kvfunc.cli._errors.CLIError: --memory '-5GiB' is negative; a size is 0 or more, like 64GiB
    """
    match = _PATTERN.fullmatch(text) if len(text) <= 64 else None
    factor = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or factor is None:
        shown = text if len(text) <= 64 else text[:60] + "..."
        if text.strip().startswith("-") and _PATTERN.fullmatch(text.strip()[1:]):
            msg = f"{what} {shown!r} is negative; a size is 0 or more, like 64GiB"
        else:
            msg = f"{what} {shown!r} is not a size; write it like 64GiB or 80GB"
        raise CLIError(msg)
    number: str = match.group(1)
    if "." in number:
        whole, _, frac = number.partition(".")
        # Exact decimal arithmetic: 1.1GB is 1_100_000_000 bytes, not one less.
        scale: int = 10 ** len(frac)
        size = (int(whole or "0") * scale + int(frac or "0")) * factor // scale
    else:
        size = int(number) * factor
    if size > MAX_BYTES:
        raise CLIError(f"{what} {text!r} is more than 1 EiB, the largest size kvfunc takes")
    return size


def format_bytes(num_bytes: int | float) -> str:
    """A short binary-unit rendering of a byte count.

    >>> format_bytes(68719476736), format_bytes(1536), format_bytes(12)
    ('64.00 GiB', '1.50 KiB', '12 B')
    """
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
