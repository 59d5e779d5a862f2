"""Bytes per element of a cache dtype, without importing torch.

Cache entries carry their dtype as an opaque object: a ``torch.dtype`` in an
engine, or a plain name such as ``"bfloat16"`` in a planner or a test that
must not pay for importing torch.  Sizing only needs the element size, so
this module reads ``dtype.itemsize`` when the object has one (``torch.dtype``
and ``numpy.dtype`` do) and otherwise looks the name up in a table.
"""

from __future__ import annotations

from kvfunc.core._errors import InvalidArgumentError

__all__ = ["dtype_itemsize"]

# Names as torch spells them (``str(torch.bfloat16)`` minus the ``torch.``
# prefix), their torch aliases, and the short names used in engine configs.
_ITEMSIZE_BY_NAME: dict[str, int] = {
    "float64": 8, "double": 8, "fp64": 8,
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "fp8": 1,
    "complex128": 16, "cdouble": 16,
    "complex64": 8, "cfloat": 8,
    "int64": 8, "long": 8,
    "int32": 4, "int": 4,
    "int16": 2, "short": 2,
    "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
}


def dtype_itemsize(dtype: object) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype``-like object or a name).

    An object with a positive integer ``itemsize`` attribute is trusted;
    a string is looked up case-insensitively, with or without ``torch.``.

    Args:
        dtype: a ``torch.dtype``, any object with ``itemsize``, or a name such
            as ``"bfloat16"``, ``"fp32"`` or ``"torch.int8"``.

    Returns:
        The element size in bytes.

    Raises:
        InvalidArgumentError: the dtype is neither sized nor a known name.

    >>> dtype_itemsize("bfloat16"), dtype_itemsize("torch.float32"), dtype_itemsize("int8")
    (2, 4, 1)
    >>> dtype_itemsize("float128")
    Traceback (most recent call last):
    ...
    kvfunc.core._errors.InvalidArgumentError: unknown dtype 'float128': ...
    """
    itemsize = getattr(dtype, "itemsize", None)
    if type(itemsize) is int and itemsize > 0:
        return itemsize
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        size = _ITEMSIZE_BY_NAME.get(name)
        if size is not None:
            return size
    known = sorted(_ITEMSIZE_BY_NAME)
    msg = (f"unknown dtype {dtype!r}: expected an object with a positive int itemsize "
           f"(such as a torch.dtype) or one of {known}")
    raise InvalidArgumentError(msg)
