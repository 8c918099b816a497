"""One rank of a join-fault test (tests/torch_tests/test_launch.py):
``python join_fault.py RANK WORLD_SIZE STORE STARTED`` waits (through the
store, outside the join) until the STARTED processes the test launched are
all up, so the join's short timeout never measures a slow start, then joins
gradsync's world through that torch store with gs.init (STORE: a FileStore's
path, or tcp:PORT for a TCPStore client of 127.0.0.1:PORT) and prints the outcome as its last
line: "joined R of N" or "JoinError: <message>". Exit status 0 either way,
3 on any other exception. With a fifth argument RETRY_SIZE, a JoinError is
followed by a second gs.init in the same process, told WORLD_SIZE=RETRY_SIZE,
and its outcome is printed as well (the retry's "joined" or "JoinError"
line is then the last)."""
import sys
import time
from datetime import timedelta

import torch.distributed as dist

import gradsync as gs


def main(rank, size, path, started, retry_size=None):
    rank, size = int(rank), int(size)
    if path.startswith("tcp:"):
        store = dist.TCPStore("127.0.0.1", int(path[4:]), is_master=False,
                              timeout=timedelta(seconds=30))
    else:
        store = dist.FileStore(path, -1)
    store.set(f"test/started/{rank}", b"1")
    store.wait([f"test/started/{r}" for r in range(int(started))], timedelta(seconds=600))
    for attempt_size in [size] + ([int(retry_size)] if retry_size else []):
        start = time.monotonic()
        try:
            world = gs.init(store, rank=rank, world_size=attempt_size)
        except gs.JoinError as e:
            print(f"after {time.monotonic() - start:.1f} s JoinError: {e}", flush=True)
            continue
        print(f"joined {world.Get_rank()} of {world.Get_size()}", flush=True)
        # one allreduce on the joined world, against the sum of the ranks
        total = world.allreduce(world.Get_rank())
        print(f"joined {world.Get_rank()} of {world.Get_size()}, sum {total}", flush=True)
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
