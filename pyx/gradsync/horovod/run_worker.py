"""One rank of horovod.run(): loads the pickled function from the folder
given, calls it, and writes (ok, result or traceback) to result.<rank>."""
import os
import sys
import traceback
import types

import gradsync as gs
from gradsync.horovod.run import _pickler


def _load_callers_main(folder):
    """The caller's main script as module __mp_main__, also known as
    __main__ here (multiprocessing's spawn does the same): plain pickle
    stores a function of the caller's script as "__main__.name", which must
    name the script's function, not this module's. Its ``if __name__ ==
    "__main__"`` block does not run."""
    path_file = os.path.join(folder, "main_path")
    if not os.path.exists(path_file):
        return
    with open(path_file) as f:
        path = f.read()
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module
    sys.path.insert(0, os.path.dirname(path))
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, module.__dict__)  # noqa: S102 - the caller's own script, as spawn runs it


def main(folder):
    _load_callers_main(folder)
    with open(os.path.join(folder, "func.pkl"), "rb") as f:
        func, args, kwargs = _pickler().load(f)
    try:
        outcome = (True, func(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - reported to the caller
        outcome = (False, traceback.format_exc())
    # gradsync's world as it is now: MPI's, or in an elastic run the one
    # the survivors (and newcomers) ended in
    world = gs.world()
    rank = world.Get_rank() if world.Get_size() > 1 or "RANK" not in os.environ else \
        int(os.environ["RANK"])
    with open(os.path.join(folder, f"result.{rank}"), "wb") as f:
        _pickler().dump(outcome, f)
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
