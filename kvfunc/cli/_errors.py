"""The one error the command line turns into a one-line message and exit code 2."""

from __future__ import annotations

__all__ = ["CLIError"]


class CLIError(Exception):
    """Bad input from the user: what is wrong and how to fix it, in one line.

    The command line prints ``kvfunc: error: <message>`` and exits with 2;
    library callers (notebooks) catch it like any other exception.

    >>> str(CLIError("unknown preset 'x'; choose one of ['llama-3-8b']"))
    "unknown preset 'x'; choose one of ['llama-3-8b']"
    """
