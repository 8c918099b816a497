"""Tensors that persist from call to call are gathered into 2 MiB pages
before the ranks of one host copy each other's memory (issue 33,
src/transport/mpi/cma_pages.c): exactly the 2 MiB blocks every page of which
holds a tensor's bytes, on the block's second call and never again, with
the results of a fold in rank order computed here, bit for bit, at every
call; GRADSYNC_CMA_HUGEPAGES=0 leaves the memory as it was. The kernel's
own account (/proc/self/smaps' AnonHugePages) is the witness."""
import ctypes
import mmap

import numpy as np
import pytest
from mpi4py import MPI

import gradsync as gs
from gsutil import collectively, environment

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
MIB = 1 << 20
HUGE = 2 * MIB
PAGE = 4096
MADV_COLLAPSE = 25
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def private_region(nbytes):
    """Anonymous private memory on 4 KiB pages (no MADV_HUGEPAGE, unlike
    NumPy's large arrays) with a 2 MiB-aligned start: (mapping, byte array
    from that start, its address)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)
    addr = raw.ctypes.data
    skip = -addr % HUGE
    return m, raw[skip:skip + nbytes], addr + skip


def anon_huge_kib(lo, hi):
    """AnonHugePages of the mappings overlapping [lo, hi), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, z = (int(x, 16) for x in head.split("-"))
                inside = a < hi and lo < z
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def collapse_works():
    """Whether this kernel gathers anonymous memory on request (Linux 6.1)
    and faults give 4 KiB pages unless asked: with huge pages "always", the
    page counts below would be the faults', not gradsync's."""
    if thp_mode() != "madvise":
        return False
    m, raw, addr = private_region(HUGE)
    raw[::PAGE] = 1
    ok = _libc.madvise(addr, HUGE, MADV_COLLAPSE) == 0
    del raw
    m.close()
    return WORLD.allreduce(int(ok), op=MPI.MIN) == 1


# Four float32 tensors in one 4 MiB region at B (2 MiB-aligned), in bytes:
#   [B, B+1M) and [B+1M+4K, B+2M): a whole page between them holds neither,
#       so block [B, B+2M) is not gathered (the page is not the tensors');
#   [B+2M, B+3M-16) and [B+3M+4080, B+4M): a page's length apart but no
#       whole page between them (as malloc lays out tensors it maps one by
#       one), one span, so block [B+2M, B+4M) is gathered.
LAYOUT = [(0, MIB), (MIB + PAGE, 2 * MIB), (2 * MIB, 3 * MIB - 16), (3 * MIB + PAGE - 16, 4 * MIB)]


def tensors(raw):
    return [raw[lo:hi].view(np.float32) for lo, hi in LAYOUT]


def values(rank, call):
    rng = np.random.default_rng(1000 * rank + call)
    return [rng.standard_normal((hi - lo) // 4).astype(np.float32) for lo, hi in LAYOUT]


def fold(call):
    """x0 + x1 + ... from the left in float32: the host path's order."""
    acc = [v.copy() for v in values(0, call)]
    for r in range(1, WORLD.size):
        acc = [a + v for a, v in zip(acc, values(r, call))]
    return acc


needs_peers = pytest.mark.skipif(WORLD.size < 2, reason="the ranks copy each other's memory")


@needs_peers
@pytest.mark.parametrize("enabled", [True, False], ids=["gathered", "off"])
def test_persistent_blocks_gathered_once(enabled):
    if not collapse_works():
        pytest.skip("no MADV_COLLAPSE, or huge pages not on request (%s)" % thp_mode())
    with environment("GRADSYNC_CMA_HUGEPAGES", int(enabled)):
        comm = gs.Communicator(MPI.COMM_WORLD)
    m, raw, base = private_region(4 * MIB)
    grads = tensors(raw)
    huge_before = anon_huge_kib(base, base + 4 * MIB)
    gathered = []
    try:
        with collectively() as blk:
            for call in range(3):
                for g, v in zip(grads, values(WORLD.rank, call)):
                    g[...] = v
                before = comm.stats()["hugepage_bytes"]
                comm.allreduce_(grads)
                gathered.append(comm.stats()["hugepage_bytes"] - before)
                for i, (g, ref) in enumerate(zip(grads, fold(call))):
                    assert g.tobytes() == ref.tobytes(), (call, i)
            assert comm.stats()["peer_reads"] == 3
            # first sight: remembered; second: the one whole block gathered; then never again
            want = [0, HUGE, 0] if enabled else [0, 0, 0]
            assert gathered == want, gathered
            assert anon_huge_kib(base, base + 4 * MIB) - huge_before == (
                HUGE // 1024 if enabled else 0)
            blk.same(grads)
    finally:
        comm.close()  # the mapping goes with its last view


def vm_flags(addr):
    """The VmFlags of the mapping holding addr."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                a, z = (int(x, 16) for x in head.split("-"))
                inside = a <= addr < z
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds %#x" % addr)


@needs_peers
@pytest.mark.parametrize("mark", ["hugepage", "nohugepage"])
def test_block_straddling_two_mappings(mark):
    """One 4 MiB tensor at B whose [B+1M, B+2M) the program marked: the first
    block straddles two mappings, which MADV_COLLAPSE refuses. Marked
    MADV_HUGEPAGE (as NumPy marks large arrays), gradsync marks the rest of
    the block the same and gathers it: 4 MiB. Marked MADV_NOHUGEPAGE, the
    program's word stands: only the second block, and the mark is kept."""
    if not collapse_works():
        pytest.skip("no MADV_COLLAPSE, or huge pages not on request (%s)" % thp_mode())
    comm = gs.Communicator(MPI.COMM_WORLD)
    m, raw, base = private_region(4 * MIB)
    grad = raw.view(np.float32)
    advice = MADV_HUGEPAGE if mark == "hugepage" else MADV_NOHUGEPAGE
    rng = np.random.default_rng(WORLD.rank)
    per_call = [rng.standard_normal(grad.size).astype(np.float32) for _ in range(2)]
    grad[...] = 0  # every page touched before the mark, as a gradient's are
    assert _libc.madvise(base + MIB, MIB, advice) == 0
    huge_before = anon_huge_kib(base, base + 4 * MIB)
    everyone = [WORLD.allgather(v) for v in per_call]
    try:
        with collectively() as blk:
            for call in range(2):
                grad[...] = per_call[call]
                comm.allreduce_([grad])
                ref = everyone[call][0].copy()
                for v in everyone[call][1:]:
                    ref += v
                assert grad.tobytes() == ref.tobytes(), call
            want = 2 * HUGE if mark == "hugepage" else HUGE
            assert comm.stats()["hugepage_bytes"] == want
            assert anon_huge_kib(base, base + 4 * MIB) - huge_before == want // 1024
            assert ("nh" in vm_flags(base + MIB)) == (mark == "nohugepage")
            blk.same([grad])
    finally:
        comm.close()
