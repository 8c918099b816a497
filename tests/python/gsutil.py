"""Shared helpers for the gradsync pytest suite (re-exported by conftest.py).

Every test runs on every rank of ``mpiexec -n N python -m mpi4py -m pytest
--with-mpi``.  Two rules keep a failing test from hanging the whole job:

* every rank makes the same sequence of collective calls, and
* a check that can fail on some ranks only is made collective: the local
  outcome is exchanged with mpi4py (``collective_assert`` / ``collectively``)
  so that all ranks fail together, with every rank's message.

Inputs are random but deterministic: the seed is derived from the test's node
id, a tag and a rank, so every rank can regenerate every other rank's inputs
locally and build the float64 (int64 for integers) NumPy reference of the
reduction without communicating.
"""

import contextlib
import hashlib
import os
import subprocess
import sys
import traceback

import ml_dtypes
import numpy as np
from mpi4py import MPI

import gradsync as gs

WORLD = MPI.COMM_WORLD

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32),
                np.dtype(np.float64)]
INT_DTYPES = [np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int32),
              np.dtype(np.int64)]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
OPS = ["sum", "average", "min", "max", "prod"]


def dtype_name(dt):
    return np.dtype(dt).name


def is_float(dt):
    return np.dtype(dt) in FLOAT_DTYPES


def is_int(dt):
    return np.dtype(dt) in INT_DTYPES


def finfo(dt):
    return ml_dtypes.finfo(np.dtype(dt))


# ---------------------------------------------------------------- collectives

def _as_mpi(comm):
    """The mpi4py communicator to check on: an mpi4py comm as given, else
    COMM_WORLD (a gs.Communicator is assumed to span COMM_WORLD)."""
    if isinstance(comm, MPI.Comm):
        return comm
    return WORLD


def collective_assert(ok, msg="", comm=None):
    """Raise AssertionError on EVERY rank if ``ok`` is false on ANY rank.

    One allgather of (ok, msg): cheap, and the failure message lists what went
    wrong on each failing rank."""
    mpi = _as_mpi(comm)
    results = mpi.allgather((bool(ok), "" if ok else str(msg)))
    _raise_failures([(r, m) for r, (o, m) in enumerate(results) if not o], mpi.size)


def _raise_failures(failed, size):
    """AssertionError listing each failing rank's message, if any failed."""
    if failed:
        lines = ["failed on rank(s) %s of %d:" % ([r for r, _ in failed], size)]
        for r, m in failed:
            lines.append("--- rank %d: %s" % (r, m))
        raise AssertionError("\n".join(lines))


class _Block:
    """Yielded by ``collectively()``; ``same(arrays)`` registers arrays that
    must be bitwise identical on every rank, checked in the block's single
    exchange (one collective instead of two)."""

    def __init__(self):
        self.digest = None

    def same(self, arrays):
        self.digest = _digest(arrays)


@contextlib.contextmanager
def collectively(comm=None, what=""):
    """Run a block whose failure may be local; fail on all ranks together.

    Put at most ONE gradsync collective call in a block (followed by any number
    of local checks): if it raises on some ranks only, the others still reach
    the exchange at the end of the block instead of entering the next
    collective alone.  ``with collectively() as blk: ...; blk.same(out)``
    also checks that ``out`` is bitwise identical on all ranks."""
    ok, msg = True, ""
    blk = _Block()
    try:
        yield blk
    except BaseException as exc:  # noqa: BLE001 - reported collectively below
        # pytest.raises/pytest.fail raise OutcomeException, which is not an
        # Exception subclass: it must be caught too, or this rank would leave
        # the others waiting in the exchange below.
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        ok = False
        tb = traceback.format_exc(limit=6)
        msg = "%s%s: %s\n%s" % (what + ": " if what else "",
                                type(exc).__name__, exc, tb)
    mpi = _as_mpi(comm)
    results = mpi.allgather((ok, msg, blk.digest))
    _raise_failures([(r, m) for r, (o, m, _) in enumerate(results) if not o], mpi.size)
    digests = [d for _, _, d in results]
    if len(set(digests)) != 1:
        groups = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise AssertionError(
            "%sresults differ across ranks; ranks grouped by identical "
            "bytes: %s" % (what + ": " if what else "",
                           sorted(groups.values())))


def _digest(arrays):
    try:
        if isinstance(arrays, np.ndarray):
            arrays = [arrays]
        arrays = [np.asarray(a) for a in arrays]
        h = hashlib.sha256()
        h.update(repr([(str(a.dtype), a.shape) for a in arrays]).encode())
        h.update(b"".join(a.tobytes() for a in arrays))
        return h.hexdigest()
    except Exception as exc:  # noqa: BLE001
        return "unhashable: %r" % (exc,)


def assert_same_on_all_ranks(arrays, comm=None):
    """Bitwise equality (dtype, shape and bytes) of ``arrays`` across ranks.

    ``arrays`` is one array or a sequence; ``comm`` an mpi4py communicator or
    a gs.Communicator spanning COMM_WORLD (None: COMM_WORLD)."""
    mpi = _as_mpi(comm)
    digests = mpi.allgather(_digest(arrays))
    if len(set(digests)) != 1:
        groups = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise AssertionError(
            "results differ across ranks; ranks grouped by identical bytes: %s"
            % sorted(groups.values()))


# ---------------------------------------------------------------- inputs

def seed_for(*parts):
    """A 64-bit seed from strings/ints (stable across processes, unlike
    hash())."""
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:8], "little")


def _int_range(dt, kind, nranks):
    dt = np.dtype(dt)
    info = np.iinfo(dt)
    if kind == "full":
        return int(info.min), int(info.max)
    if kind == "small":
        return (0, 16) if info.min == 0 else (-8, 8)
    # "normal": sums over nranks ranks never leave the dtype's range.
    if dt == np.int8:
        lim = 127 // max(nranks, 1)
        return -lim, lim
    if dt == np.uint8:
        return 0, 255 // max(nranks, 1)
    if dt == np.int32:
        return -(1 << 20), 1 << 20
    return -(1 << 40), 1 << 40


def random_array(rng, shape, dtype, kind="normal", nranks=1):
    """Random values of ``dtype``.

    kind: "normal" (floats ~ N(0, 4^2); ints in a range whose nranks-fold sum
    cannot overflow), "full" (ints over the whole range; floats ~ N(0, 100^2)),
    "prod" (floats in {+-2, +-1, +-0.5}, signed ints in {-1, 1, 2}, unsigned in
    {1, 2}: products over 4 ranks are exact), "small" (integer values in
    [-8, 8] ([0, 16] unsigned) in any dtype: sums are exact in every dtype),
    "bits" (uniformly random bytes, NaN payloads included)."""
    dt = np.dtype(dtype)
    shape = tuple(shape)
    n = int(np.prod(shape, dtype=np.int64))
    if kind == "bits":
        raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
        return raw.view(dt).reshape(shape).copy()
    if is_int(dt):
        if kind == "prod":
            choices = [1, 2] if np.iinfo(dt).min == 0 else [-1, 1, 2]
            return rng.choice(np.array(choices, dtype=dt), size=shape)
        lo, hi = _int_range(dt, kind, nranks)
        return rng.integers(lo, hi, size=shape, endpoint=True, dtype=dt)
    if kind == "prod":
        choices = np.array([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])
        return rng.choice(choices, size=shape).astype(dt)
    if kind == "small":
        return rng.integers(-8, 8, size=shape, endpoint=True).astype(dt)
    scale = 100.0 if kind == "full" else 4.0
    return (rng.standard_normal(size=shape) * scale).astype(np.float32).astype(dt)


class Inputs:
    """Deterministic per-test, per-rank random inputs.

    ``key`` is the test's node id, so every test gets fresh values while every
    rank can regenerate every other rank's inputs."""

    def __init__(self, key, nranks):
        self.key = key
        self.nranks = nranks

    def rng(self, rank=None, tag=""):
        """rank=None: a rank-independent stream (shapes, choices that every
        rank must agree on)."""
        return np.random.default_rng(seed_for(self.key, tag, rank))

    def arrays(self, rank, shapes, dtypes, kind="normal", tag=""):
        """One array per shape for ``rank``; ``dtypes`` is one dtype or one
        per shape."""
        if not isinstance(dtypes, (list, tuple)):
            dtypes = [dtypes] * len(shapes)
        assert len(dtypes) == len(shapes)
        rng = self.rng(rank, tag)
        if len(shapes) > 8 and len({np.dtype(d) for d in dtypes}) == 1:
            # one draw for the whole list (cheap for 200 tensors), split
            # into separate arrays
            sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
            flat = random_array(rng, (sum(sizes),), dtypes[0], kind,
                                self.nranks)
            bounds = np.cumsum([0] + sizes)
            return [flat[bounds[i]:bounds[i + 1]].reshape(s).copy()
                    for i, s in enumerate(shapes)]
        return [random_array(rng, s, d, kind, self.nranks)
                for s, d in zip(shapes, dtypes)]

    def all_ranks(self, shapes, dtypes, kind="normal", tag=""):
        """[rank][i] -> array: every rank's inputs, computed locally."""
        return [self.arrays(r, shapes, dtypes, kind, tag)
                for r in range(self.nranks)]


# ---------------------------------------------------------------- references

def op_name(op):
    if isinstance(op, str):
        return op
    return {int(gs.Op.SUM): "sum", int(gs.Op.AVERAGE): "average",
            int(gs.Op.MIN): "min", int(gs.Op.MAX): "max",
            int(gs.Op.PROD): "prod"}[int(op)]


def reduce_reference(per_rank, op, prescale=1.0, postscale=1.0):
    """Exact-as-possible reduction of one tensor over ranks.

    per_rank: list over ranks of arrays of one dtype and shape.  Integers are
    reduced in int64 (exact), floats in float64 (prescale applied to every
    input, postscale -- and 1/size for average -- to the result)."""
    op = op_name(op)
    dt = per_rank[0].dtype
    if is_int(dt):
        st = np.stack([np.asarray(a).astype(np.int64) for a in per_rank])
    else:
        st = np.stack([np.asarray(a).astype(np.float64) for a in per_rank])
        st = st * prescale
    if op in ("sum", "average"):
        res = st.sum(axis=0)
    elif op == "min":
        res = st.min(axis=0)
    elif op == "max":
        res = st.max(axis=0)
    elif op == "prod":
        res = st.prod(axis=0)
    else:
        raise ValueError(op)
    if not is_int(dt):
        scale = postscale / len(per_rank) if op == "average" else postscale
        res = res * scale
    return res


def reduce_tolerance(per_rank, op, prescale=1.0, postscale=1.0):
    """Elementwise bound on |result - reference| for a float reduction.

    Each rounding step (prescale on pack, every accumulation step -- float16 /
    bfloat16 accumulate in float32 and round once per step --, the final
    postscale) costs at most half an ulp of a value bounded by
    sum_r |prescale * x_r|.  Integers, min and max are exact (0); prod is
    exact for the power-of-two inputs the tests use."""
    op = op_name(op)
    dt = per_rank[0].dtype
    if is_int(dt) or op in ("min", "max", "prod"):
        return 0.0
    P = len(per_rank)
    fi = finfo(dt)
    eps = float(fi.eps)
    sub = float(fi.tiny) * eps  # smallest subnormal
    absum = np.sum([np.abs(np.asarray(a).astype(np.float64) * prescale)
                    for a in per_rank], axis=0)
    scale = abs(postscale / P if op == "average" else postscale)
    return (P + 2) * eps * absum * scale + (2 * P + 2) * sub * max(scale, 1.0)


# ---- the rank-order fold, as gradsync's host kernels compute it (cma.c's and
# the shared region's reductions; test_intrahost.py, test_shared_region.py)

def combine(op, a, b):
    """a op b in a's dtype as gradsync's kernels compute it: float16 and
    bfloat16 in float32, rounded once."""
    dt = a.dtype
    if dt in (np.dtype(np.float16), BF16):
        a, b = a.astype(np.float32), b.astype(np.float32)
    f = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum,
         "prod": np.multiply}[op]
    with np.errstate(over="ignore"):
        return f(a, b).astype(dt)


def scaled(x, scale):
    """gs_cpu_scale_copy's arithmetic: float64 times the scale; the others
    widened to float32, times the scale rounded to float32, rounded once."""
    if x.dtype == np.float64:
        return x * scale
    return (x.astype(np.float32) * np.float32(scale)).astype(x.dtype)


def left_fold(per_rank, op, prescale=1.0):
    """Each input times prescale, then x0 op x1 op ... from the left, then
    average's 1/p."""
    if prescale != 1.0:
        per_rank = [scaled(x, prescale) for x in per_rank]
    acc = per_rank[0].copy()
    for x in per_rank[1:]:
        acc = combine(op, acc, x)
    if op == "average":
        acc = scaled(acc, 1.0 / len(per_rank))
    return acc


def bits(a):
    """The bytes of an array as uint8 (for bitwise comparisons)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


def check_result(got, ref, tol, dtype, shape, what="result"):
    """Local check (raises AssertionError): type, dtype, shape and values."""
    dtype = np.dtype(dtype)
    assert isinstance(got, np.ndarray), "%s: expected numpy.ndarray, got %r" % (
        what, type(got))
    assert got.dtype == dtype, "%s: dtype %s, expected %s" % (
        what, got.dtype, dtype)
    assert got.shape == tuple(shape), "%s: shape %s, expected %s" % (
        what, got.shape, tuple(shape))
    if is_int(dtype):
        g = got.astype(np.int64)
        bad = g != ref
    else:
        g = got.astype(np.float64)
        if np.all(np.asarray(tol) == 0):
            bad = g != ref
        else:
            bad = ~(np.abs(g - ref) <= tol)  # NaN counts as bad
    if np.any(bad):
        idx = np.argwhere(bad)[:5]
        samples = []
        for ix in idx:
            ix = tuple(ix)
            t = tol if np.ndim(tol) == 0 else np.asarray(tol)[ix]
            samples.append("at %s: got %r expected %r (tol %g)" % (
                ix, g[ix].item(), np.asarray(ref)[ix].item(), float(t)))
        raise AssertionError("%s (%s %s): %d of %d elements wrong; %s" % (
            what, dtype, got.shape, int(np.count_nonzero(bad)), got.size,
            "; ".join(samples)))


def check_unchanged(arrays, copies, what="input"):
    assert len(arrays) == len(copies)
    meta = [(a.dtype, a.shape) for a in arrays]
    assert meta == [(c.dtype, c.shape) for c in copies], (
        "%s dtype/shape changed" % what)
    if b"".join(a.tobytes() for a in arrays) == b"".join(
            c.tobytes() for c in copies):
        return
    for i, (a, c) in enumerate(zip(arrays, copies)):
        assert a.tobytes() == c.tobytes(), (
            "%s %d was modified by the call" % (what, i))


def check_reduction(outs, per_rank, op, shapes, dtype, prescale=1.0,
                    postscale=1.0, what="tensor", cache=None):
    """Check a list of results of one dtype against the reduction of
    ``per_rank[rank][i]`` in one vectorized pass (per-tensor dtype/shape
    checks, then all values at once), so 200-tensor lists stay cheap."""
    dtype = np.dtype(dtype)
    assert len(outs) == len(shapes), "%d results for %d tensors" % (
        len(outs), len(shapes))
    for i, (o, s) in enumerate(zip(outs, shapes)):
        assert isinstance(o, np.ndarray), "%s %d: not an ndarray: %r" % (
            what, i, type(o))
        assert o.dtype == dtype and o.shape == tuple(s), (
            "%s %d: %s %s, expected %s %s" % (what, i, o.dtype, o.shape,
                                               dtype, tuple(s)))
    if not shapes:
        return
    got = np.concatenate([o.reshape(-1) for o in outs])
    if cache is not None and "ref" in cache:
        ref, tol = cache["ref"], cache["tol"]
    else:
        flat = [np.concatenate([np.asarray(a).reshape(-1)
                                for a in rank_arrays])
                for rank_arrays in per_rank]
        ref = reduce_reference(flat, op, prescale, postscale)
        tol = reduce_tolerance(flat, op, prescale, postscale)
        if cache is not None:
            cache.update(ref=ref, tol=tol)
    try:
        check_result(got, ref, tol, dtype, got.shape, what="all values")
    except AssertionError as exc:
        # name the first tensor that is wrong
        bounds = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        g = got.astype(np.int64 if is_int(dtype) else np.float64)
        bad = (g != ref) if np.all(np.asarray(tol) == 0) else \
            ~(np.abs(g - ref) <= tol)
        first = int(np.argmax(bad))
        i = int(np.searchsorted(bounds, first, side="right") - 1)
        raise AssertionError("%s %d (shape %s, element %d) is the first "
                             "wrong one; %s" % (what, i, tuple(shapes[i]),
                                                first - bounds[i], exc)) from exc


# ---- children run without mpiexec -------------------------------------------

TESTS_PYTHON_DIR = os.path.dirname(os.path.abspath(__file__))


def ride_bytes():
    """The largest allreduce a communicator of every rank (made with the
    environment as it is) validates and reduces in one exchange: 128 bytes
    through MPI, a slot of the host's shared region when the ranks share a
    host. Collective: call it on every rank."""
    with gs.Communicator() as c:
        return c.ride_bytes


def child_env():
    """Environment for a python child run without mpiexec (singleton MPI):
    no PMI/Hydra variables (the child must not talk to the launcher) and
    gradsync + tests/python importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL",
                                "OMPI_", "I_MPI_"))}
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(gs.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        [pkg_parent, TESTS_PYTHON_DIR] + ([env["PYTHONPATH"]]
                                          if env.get("PYTHONPATH") else []))
    return env


def run_child(script, env_extra=None, timeout=180, args=()):
    """Runs ``python -c script *args`` as a singleton MPI process."""
    env = child_env()
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", script, *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def start_joined(script, label, env_extra, args=()):
    """Starts ``python -c script LABEL *args`` as a singleton MPI process (one
    of those that join one world through gs.init), its output merged."""
    env = child_env()
    env.update(env_extra)
    return subprocess.Popen([sys.executable, "-c", script, str(label), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs, timeout=180):
    """Each process's output once it has ended; a hung one killed and
    marked "<hung>"."""
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "<hung>")
    return outs


def run_joined(script, nprocs, env_extra, args=(), timeout=180):
    """Starts ``python -c script RANK *args`` nprocs times at once
    (start_joined); returns (processes, outputs), as finish() gives them."""
    procs = [start_joined(script, r, env_extra, args) for r in range(nprocs)]
    return procs, finish(procs, timeout)


def shm_entries():
    """What /dev/shm holds now (a test compares before and after)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def run_pair(job, tmp_path, mode, extra_env=None):
    """run_joined(job) as two processes given tmp_path/store as their
    rendezvous folder and `mode`; the join's timeout 60 s, and a flight
    dump goes where tmp_path removes it."""
    store = tmp_path / "store"
    store.mkdir()
    env = {"GRADSYNC_TIMEOUT_SECONDS": "60", "GRADSYNC_FLIGHT_DIR": str(tmp_path / "flight")}
    env.update(extra_env or {})
    return run_joined(job, 2, env, args=(store, mode))


@contextlib.contextmanager
def environment(name, value):
    """os.environ[name] = str(value) inside the block (gradsync reads its
    knobs when a communicator is made), restored after."""
    before = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
