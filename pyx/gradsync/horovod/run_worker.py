"""One rank of horovod.run(): loads the pickled function from the folder
given, calls it, and writes (ok, result or traceback) to result.<rank>."""
import os
import sys
import traceback

from gradsync import MPI
from gradsync.horovod.run import _pickler


def main(folder):

    rank = MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(folder, "func.pkl"), "rb") as f:
        func, args, kwargs = _pickler().load(f)
    try:
        outcome = (True, func(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - reported to the caller
        outcome = (False, traceback.format_exc())
    with open(os.path.join(folder, f"result.{rank}"), "wb") as f:
        _pickler().dump(outcome, f)
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
