"""How many fused messages a call sends, from the communicator's counters,
against an independent model of docs/GUIDE.md section 2.3's schedule: tensors grouped by
dtype (groups in order of first appearance, list order inside a group), packed
until the next tensor would pass the threshold; a tensor over the threshold
goes alone; a call of at most the communicator's ride_bytes of one dtype rides
inside validation."""
import numpy as np
import pytest

import gradsync as gs
from gsutil import collective_assert, ride_bytes

pytestmark = pytest.mark.mpi
RIDE_BYTES = ride_bytes()  # every rank imports this module, so all make the communicator


def model_messages(arrays, threshold):
    """Number of non-empty data messages the schedule produces."""
    groups = []
    for a in arrays:
        if a.dtype not in groups:
            groups.append(a.dtype)
    messages = []
    for dt in groups:
        current = None
        for a in (x for x in arrays if x.dtype == dt):
            if a.nbytes > threshold:
                messages.append(a.nbytes)
                current = None
                continue
            if current is None or (messages[current] + a.nbytes > threshold
                                   and messages[current] > 0):
                messages.append(0)
                current = len(messages) - 1
            messages[current] += a.nbytes
    return sum(1 for m in messages if m > 0)


def rides(arrays, threshold):
    return (len(arrays) > 0 and len({a.dtype for a in arrays}) == 1
            and sum(a.nbytes for a in arrays) <= min(RIDE_BYTES, threshold))


def delta(comm, call):
    """The counters' changes over call(); "sent": the fused messages, those
    that rode inside validation (one exchange carried them) included."""
    before = comm.stats()
    call()
    after = comm.stats()
    d = {k: after[k] - before[k] for k in after}
    d["sent"] = d["messages"] + d["rode_in_check"]
    return d


def mixed_sizes(rng, n, dtype):
    sizes = rng.integers(0, 1200, size=n)
    sizes[:4] = [0, 1, 7, 1023]
    return [rng.standard_normal(s).astype(dtype) for s in sizes]


@pytest.mark.parametrize("threshold", [None, 4096, 65536])
def test_200_tensors_message_count(threshold):
    rng = np.random.default_rng(1234)
    arrays = mixed_sizes(rng, 200, np.float32)
    with gs.Communicator(fusion_threshold=threshold) as comm:
        d = delta(comm, lambda: comm.allreduce_(arrays, op="average"))
        expected = model_messages(arrays, comm.fusion_threshold)
        ride = rides(arrays, comm.fusion_threshold)
    collective_assert(d["sent"] == expected and d["calls"] == 1 and d["rode_in_check"] == ride,
                      f"200 tensors: {d}, model says {expected} messages, riding: {ride}")
    if threshold is None:
        collective_assert(expected == 1, "200 float32 tensors below 128 MiB are one message")


def test_mixed_dtypes_one_message_per_group():
    rng = np.random.default_rng(7)
    dtypes = [np.float32, np.float16, np.float32, np.int32, gs.bfloat16, np.float16] * 20
    arrays = [rng.integers(0, 3, size=rng.integers(1, 300)).astype(dt) for dt in dtypes]
    with gs.Communicator() as comm:
        d = delta(comm, lambda: comm.allreduce_(arrays))
    collective_assert(d["messages"] == 4,
                      f"4 dtype groups should be 4 messages, got {d['messages']}")


def test_tensor_over_threshold_goes_alone():
    arrays = [np.ones(100, np.float64), np.ones(5000, np.float64), np.ones(100, np.float64)]
    with gs.Communicator(fusion_threshold=4096) as comm:
        d = delta(comm, lambda: comm.allreduce_(arrays))
        expected = model_messages(arrays, 4096)
    collective_assert(d["messages"] == expected == 3, f"got {d['messages']}, model {expected}")


@pytest.mark.parametrize("nbytes", [4, 64, RIDE_BYTES, RIDE_BYTES + 4])
def test_small_calls_ride_in_validation(nbytes):
    a = np.ones(nbytes // 4, np.float32)
    with gs.Communicator() as comm:
        d = delta(comm, lambda: comm.allreduce_(a))
        ride = rides([a], comm.fusion_threshold)
    out = a
    ok = d["rode_in_check"] == int(ride) and d["messages"] == int(not ride)
    ok = ok and d["validations"] == 1 and bool(np.all(out == comm.size))
    collective_assert(ok, f"{nbytes} bytes: {d}")


def test_contiguous_list_needs_no_packing_and_is_one_message():
    flat = np.arange(3000, dtype=np.float32)
    views = [flat[0:1000], flat[1000:1001], flat[1001:3000]]
    with gs.Communicator() as comm:
        d = delta(comm, lambda: comm.allreduce_(views))
    collective_assert(d["sent"] == 1, f"{d}")
    collective_assert(bool(np.all(flat == np.arange(3000, dtype=np.float32) * comm.size)),
                      "contiguous views reduced wrongly")
