"""Run at N ranks by tests/embed/test_embed.py: embed_ext (built from
embed_ext.pyx into the folder named by argv[1]) sums two arrays over ranks
through gradsync's C API on a Communicator's c_handle; the result must equal
NumPy's sum of every rank's inputs (float64 reference) and gradsync's own
Python allreduce of the same inputs. Prints one OK line per rank."""
import sys

import numpy as np

import gradsync as gs

sys.path.insert(0, sys.argv[1])
import embed_ext  # noqa: E402


def inputs(rank):
    x = np.arange(1000, dtype=np.float64) * (rank + 1) / 3.0 - rank
    y = (np.arange(301, dtype=np.float32) % 17) * np.float32(rank + 0.5)
    return x, y


comm = gs.Communicator()
assert embed_ext.rank_and_size(comm) == (comm.rank, comm.size)
assert embed_ext.version() == gs.__version__
x, y = inputs(comm.rank)
want_x = np.sum([inputs(r)[0] for r in range(comm.size)], axis=0, dtype=np.float64)
want_y = np.sum([inputs(r)[1].astype(np.float64) for r in range(comm.size)], axis=0)
same_x, same_y = comm.allreduce([x.copy(), y.copy()], op="sum")
embed_ext.allreduce_sum_(comm, x, y)
np.testing.assert_allclose(x, want_x, rtol=1e-14, atol=1e-12)
np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=0)
assert np.array_equal(x, same_x) and np.array_equal(y, same_y), "differs from comm.allreduce"
comm.close()
try:
    handle = comm.c_handle
except gs.ClosedError:
    pass
else:
    raise AssertionError(f"a closed communicator's c_handle gave {handle:#x}, not ClosedError")
print(f"run_ext: OK on rank {comm.rank} of {comm.size}", flush=True)
