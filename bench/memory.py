"""Resident memory as a leak check can trust it.

glibc raises its mmap threshold to the size of the largest block freed (up to
32 MiB); blocks below it then come from the heap and stay in RSS after free(),
which makes a loop of large allocations "grow" with no leak behind it. Pinning
the threshold and trimming before each reading makes RSS show live memory.
Used by scripts/soak.py and tests/python/test_lifecycle.py. Importing this
module changes nothing: the threshold is pinned at the first rss_mb() call,
by the process that asked for a reading.

rss_mb(pin=False) trims but leaves the threshold alone: malloc as a user's
process has it. The per-call leak checks (bench/leaks.py) read it so;
scripts/soak.py pins it, for its ResNet-50 lists. With the threshold
pinned, every temporary buffer MPICH allocates inside a large reduction is
a new mapping, and MPI over UCX keeps about 150 bytes per new mapping it
moves data through (issue 34) -- a growth the pin itself would cause,
which no user sees."""
import ctypes

_LIBC = None
_PINNED = False


def _libc(pin):
    global _LIBC, _PINNED
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC and pin and not _PINNED:
        _LIBC.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD
        _PINNED = True
    return _LIBC


def rss_mb(pin=True):
    """This process's resident memory in MiB (NaN where /proc is missing).
    The first call with ``pin`` pins glibc's mmap threshold (see the
    module's docstring)."""
    if _libc(pin):
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")
