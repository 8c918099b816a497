"""monitored_barrier on a gradsync group, with the semantics torch documents
(and its gloo backend implements): group rank 0 waits for every other rank
within ``timeout`` and names the ranks that did not arrive; the others wait
for rank 0's answer and fail if rank 0 failed.

Messages travel as gradsync point-to-point messages on the group's
communicator, on the two highest tags (which the backend keeps from user
messages). Rank 0 never posts a receive it might abandon: it polls
``comm.probe`` against its deadline and receives only what has arrived, so
a barrier that fails leaves the group usable. A rank that did arrive when
rank 0 gave up is told at once (gloo's ranks learn it only when their
connection to rank 0 closes); a rank that arrives after that is answered by
rank 0's next monitored_barrier, or gives up after the group's timeout.
Error texts follow gloo's, which torch's tests match.
"""
import time

import numpy as np


def tags(comm):
    """(arrive, answer): the tags monitored_barrier uses on ``comm``."""
    top = comm.max_tag
    return top - 1, top


def _poll(found, deadline):
    """Calls found() until it is true (True) or ``deadline`` (monotonic
    seconds; None: none) has passed (then its last answer)."""
    nap = 0.0002
    while not found():
        if deadline is not None and time.monotonic() >= deadline:
            return found()
        time.sleep(nap)
        nap = min(2 * nap, 0.005)
    return True


def _ms(seconds):
    return int(round(seconds * 1000))


def monitored_barrier(comm, seconds, wait_all_ranks, group_seconds):
    """The barrier on ``comm`` (a gs.Communicator): ``seconds`` is rank 0's
    limit, ``group_seconds`` how long the other ranks wait for rank 0 (None:
    as long as it takes)."""
    if comm.rank != 0:
        return _member(comm, group_seconds)
    arrive, answer = tags(comm)
    start = time.monotonic()
    deadline = start + seconds
    processed, waiting, failure = [], list(range(1, comm.size)), None

    def arrived(r):
        return comm.probe(r, tag=arrive) is not None

    def take(r):
        comm.recv_(np.zeros(1, np.int64), r, tag=arrive)
        waiting.remove(r)
        processed.append(r)

    if wait_all_ranks:  # one deadline for all (gloo gives each rank the whole timeout)
        def sweep():
            for r in list(waiting):
                if arrived(r):
                    take(r)
            return not waiting
        _poll(sweep, deadline)
        if waiting:
            failure = (f"[Rank 0]: Ranks {', '.join(map(str, waiting))} failed to pass "
                       f"monitoredBarrier in {_ms(seconds)} ms")
    else:  # rank by rank, in order: the first missing one is named
        for r in range(1, comm.size):
            if deadline - time.monotonic() <= 0:
                done = (f"Successfully processed ranks: {', '.join(map(str, processed))}"
                        if processed else "No ranks successfully processed in monitoredBarrier.")
                failure = (f"Rank 0 timed out in monitoredBarrier after {_ms(seconds)} ms.\n"
                           f"{done}")
                break
            if not _poll(lambda: arrived(r), deadline):
                failure = (f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in "
                           f"{_ms(seconds)} ms")
                break
            take(r)
    if failure is not None:
        for r in list(waiting):  # arrived by now: they hear of the failure at once
            if arrived(r):
                take(r)
    verdict = np.array([0 if failure else 1], np.int64)
    for r in processed:
        comm.send(verdict, r, tag=answer)
    if failure is not None:
        raise RuntimeError(f"{failure} (gradsync backend: waited {time.monotonic() - start:.3f} "
                           "s; the group stays usable)")


def _member(comm, group_seconds):
    arrive, answer = tags(comm)
    me = comm.rank
    comm.send(np.array([me], np.int64), 0, tag=arrive)
    deadline = None if group_seconds is None else time.monotonic() + group_seconds
    reached = (f"Rank {me} successfully reached monitoredBarrier, but received errors while "
               "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.")
    if not _poll(lambda: comm.probe(0, tag=answer) is not None, deadline):
        raise RuntimeError(f"{reached}\n gradsync backend: rank 0 did not answer within the "
                           f"group's timeout ({_ms(group_seconds)} ms)")
    verdict = np.zeros(1, np.int64)
    comm.recv_(verdict, 0, tag=answer)
    if verdict[0] != 1:
        raise RuntimeError(f"{reached}\n gradsync backend: rank 0 found a rank that did not "
                           "arrive within its timeout")
