"""The torch shell: turns the pure core's states and deltas into tensors.

The shell has no policy.  Importing it checks that pyrsistent runs with its C
extension: without ``pvectorc`` the allocator's hot path is 2-6x slower, so a
build without it is an installation error, not a silent slowdown.
"""

from kvfunc.shell._memory import device_memory_info, host_memory_info


def _require_pvectorc() -> None:
    try:
        import pvectorc  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the installation
        msg = ("pyrsistent is installed without its C extension (pvectorc); reinstall it "
               "from a wheel or with a C compiler available")
        raise ImportError(msg) from exc


_require_pvectorc()

__all__ = ["device_memory_info", "host_memory_info"]
