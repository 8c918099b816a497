"""Resident memory as a leak check can trust it.

glibc raises its mmap threshold to the size of the largest block freed (up to
32 MiB); blocks below it then come from the heap and stay in RSS after free(),
which makes a loop of large allocations "grow" with no leak behind it. Pinning
the threshold and trimming before each reading makes RSS show live memory.
Used by scripts/soak.py and tests/python/test_lifecycle.py. Importing this
module changes nothing: the threshold is pinned at the first rss_mb() call,
by the process that asked for a reading."""
import ctypes

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
        except OSError:
            _LIBC = False
    return _LIBC


def rss_mb():
    """This process's resident memory in MiB (NaN where /proc is missing).
    The first call pins glibc's mmap threshold (see the module's docstring)."""
    if _libc():
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")
