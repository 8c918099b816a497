"""The "gradsync" torch.distributed backend: every collective against float64
references built locally from every rank's deterministic inputs, at any rank
count (sizes 0, 1, odd and past the group's 4 KiB fusion threshold), the
asynchronous Work/Future semantics, point-to-point messages, the object
collectives, subgroups, and the error paths (unsupported ops, mismatched
calls raising on every rank)."""
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gradsync as gs  # noqa: E402
from gsutil import collective_assert, collectively, seed_for  # noqa: E402

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
SIZES = [0, 1, 17, 3001]  # 3001 float32: 12 KiB, past the 4 KiB threshold
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
R = dist.ReduceOp


def inp(tag, rank, n, dtype, kind="normal"):
    """Rank `rank`'s input (any rank can compute any rank's), exact in dtype."""
    rng = np.random.default_rng(seed_for("backend", tag, rank))
    if kind == "prod":
        vals = rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0] if dtype.is_floating_point
                          else ([1, 2] if dtype == torch.uint8 else [-1, 1, 2]), size=n)
    elif dtype.is_floating_point:
        vals = rng.standard_normal(n) * 4
    else:
        hi = 127 // SIZE if dtype in (torch.int8, torch.uint8) else 1 << 20
        vals = rng.integers(0 if dtype == torch.uint8 else -hi, hi, size=n, endpoint=True)
    return torch.from_numpy(np.asarray(vals, dtype=np.float64)).to(dtype)


def reference(tensors, op, factor=1.0):
    """(float64 result, tolerance) of reducing the ranks' tensors."""
    st = torch.stack([t.double() * (factor if op == R.PREMUL_SUM else 1.0) for t in tensors])
    if op in (R.SUM, R.AVG, R.PREMUL_SUM):
        res = st.sum(0) / (len(tensors) if op == R.AVG else 1)
    elif op == R.PRODUCT:
        res = st.prod(0)
    else:
        res = st.min(0).values if op == R.MIN else st.max(0).values
    tol = 0.0
    dt = tensors[0].dtype
    if dt.is_floating_point and op in (R.SUM, R.AVG, R.PREMUL_SUM):
        tol = (SIZE + 2) * torch.finfo(dt).eps * st.abs().sum(0) + 1e-30
    return res, tol


def check(got, ref, tol, what):
    bad = (got.double() - ref).abs() > tol
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {got.numel()} elements wrong; " \
        f"first at {int(bad.nonzero()[0][0])}: got {got.reshape(-1)[bad.reshape(-1)][0]} " \
        f"expected {ref.reshape(-1)[bad.reshape(-1)][0]}"


def test_init_takes_rank_and_size_from_mpi(torch_pg):
    with collectively():
        assert dist.is_initialized() and dist.get_backend() == "gradsync"
        assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
        assert dist.Backend.GRADSYNC == "gradsync"


# ---------------------------------------------------------------- allreduce

ALLREDUCE_CASES = [(op, dt) for op in (R.SUM, R.AVG, R.PREMUL_SUM, R.MIN, R.MAX, R.PRODUCT)
                   for dt in FLOATS] + \
                  [(op, dt) for op in (R.SUM, R.MIN, R.MAX, R.PRODUCT) for dt in INTS]


@pytest.mark.parametrize("op,dtype", ALLREDUCE_CASES, ids=lambda v: str(v).split(".")[-1])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_reduce(op, dtype, async_op, torch_pg):
    kind = "prod" if op == R.PRODUCT else "normal"
    red = dist._make_nccl_premul_sum(0.25) if op == R.PREMUL_SUM else op
    for n in SIZES:
        per_rank = [inp(f"ar{n}", r, n, dtype, kind) for r in range(SIZE)]
        ref, tol = reference(per_rank, op, 0.25)
        with collectively(what=f"{n} elements"):
            t = per_rank[RANK].clone()
            work = dist.all_reduce(t, op=red, async_op=async_op)
            if async_op:
                assert work.wait() is True and work.is_completed()
            check(t, ref, tol, f"all_reduce {n}")


def test_all_reduce_other_dtypes(torch_pg):
    """bool (OR for SUM/MAX, AND for MIN), int16 (through int32), complex
    (sum/average as real pairs), and non-contiguous tensors (written back)."""
    b = torch.tensor([RANK == 0, False, True, RANK % 2 == 1])
    mn = b.clone()
    c = torch.complex(torch.tensor([1.0, RANK]), torch.tensor([RANK, -1.0]))
    i16 = torch.tensor([RANK, -RANK, 30000 // SIZE], dtype=torch.int16)
    nc = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    with collectively():
        dist.all_reduce(b)
        dist.all_reduce(mn, op=R.MIN)
        dist.all_reduce(c, op=R.AVG)
        dist.all_reduce(i16)
        dist.all_reduce(nc)
        assert b.tolist() == [True, False, True, SIZE > 1]
        assert mn.tolist() == [SIZE == 1, False, True, False]
        assert torch.allclose(c, torch.complex(torch.tensor([1.0, (SIZE - 1) / 2]),
                                               torch.tensor([(SIZE - 1) / 2, -1.0])))
        assert i16.tolist() == [SIZE * (SIZE - 1) // 2, -SIZE * (SIZE - 1) // 2,
                                30000 // SIZE * SIZE]
        assert torch.equal(nc, torch.arange(12.).reshape(3, 4).t() * SIZE)


def test_all_reduce_coalesced(torch_pg):
    shapes = [(0,), (5,), (3, 7), (2001,)]
    dtypes = [torch.float32] * 4  # torch wants one dtype here
    per_rank = [[inp(f"co{i}", r, int(np.prod(s)), d).reshape(s) for i, (s, d) in
                 enumerate(zip(shapes, dtypes))] for r in range(SIZE)]
    with collectively():
        mine = [t.clone() for t in per_rank[RANK]]
        dist.all_reduce_coalesced(mine, op=R.SUM)
        for i in range(len(shapes)):
            ref, tol = reference([p[i] for p in per_rank], R.SUM)
            check(mine[i], ref, tol, f"tensor {i}")


def test_async_work_and_future(torch_pg):
    x = torch.full((1000,), float(RANK + 1))
    with collectively():
        work = dist.all_reduce(x, async_op=True)
        fut = work.get_future().then(lambda f: f.value()[0] * 2)
        doubled = fut.wait()
        assert work.is_completed() and work.is_success() and work.exception() is None
        assert work.wait() is True
        total = SIZE * (SIZE + 1) / 2
        assert torch.all(x == total) and torch.all(doubled == 2 * total)
        works = [dist.broadcast(torch.full((7,), float(RANK)), src=SIZE - 1, async_op=True)
                 for _ in range(5)]
        values = torch.futures.collect_all([w.get_future() for w in works]).wait()
        assert all(torch.all(v.value()[0] == SIZE - 1) for v in values)


def test_mismatch_raises_on_every_rank(torch_pg):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    with collectively(what="blocking"):
        with pytest.raises(gs.MismatchError):
            dist.all_reduce(torch.zeros(3 + (RANK == 0)))
    with collectively(what="asynchronous: raised by wait() and the future"):
        work = dist.all_reduce(torch.zeros(3 + (RANK == 0)), async_op=True)
        fut = work.get_future()
        with pytest.raises(gs.MismatchError):
            work.wait()
        with pytest.raises(Exception, match="differs"):
            fut.wait()
    with collectively(what="usable afterwards"):
        y = torch.ones(2)
        dist.all_reduce(y)
        assert torch.all(y == SIZE)


def test_unsupported_raises_not_implemented(torch_pg):
    with collectively():
        with pytest.raises(NotImplementedError, match="BAND"):
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.BAND)
        with pytest.raises(NotImplementedError, match="sparse"):  # sparse sums only, as gloo
            dist.all_reduce(torch.eye(3).to_sparse(), op=R.MAX)
        with pytest.raises(NotImplementedError, match="sparse"):
            dist.broadcast(torch.eye(3).to_sparse(), src=0)


# ---------------------------------------------------------------- broadcast, gather

@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool, torch.int16, torch.complex64],
                         ids=str)
def test_broadcast_every_root(dtype, torch_pg):
    for root in range(SIZE):
        data = [inp("bc", r, 3001, torch.float64).to(dtype) for r in range(SIZE)]
        with collectively(what=f"root {root}"):
            t = data[RANK].clone()
            dist.broadcast(t, src=root)
            assert torch.equal(t, data[root])


def test_all_gather_forms(torch_pg):
    data = [inp("ag", r, 3001, torch.float32).reshape(-1) for r in range(SIZE)]
    expected = torch.cat(data)
    with collectively():
        outs = [torch.empty(3001) for _ in range(SIZE)]
        dist.all_gather(outs, data[RANK])
        assert torch.equal(torch.cat(outs), expected)
        flat = torch.empty(3001 * SIZE)
        dist.all_gather_into_tensor(flat, data[RANK])
        assert torch.equal(flat, expected)
        nc = torch.empty(SIZE, 3001).t()  # outputs that are views of one buffer, strided
        outs = [nc[:, r] for r in range(SIZE)]
        dist.all_gather(outs, data[RANK])
        assert torch.equal(nc.t().reshape(-1), expected)
        work = dist.all_gather_into_tensor(flat.zero_(), data[RANK], async_op=True)
        work.wait()
        assert torch.equal(flat, expected)


@pytest.mark.parametrize("op", [R.SUM, R.AVG, R.MAX], ids=str)
def test_reduce_scatter_forms(op, torch_pg):
    n = 1001
    data = [inp(f"rs{op}", r, n * SIZE, torch.float64) for r in range(SIZE)]
    ref, tol = reference(data, op)
    mine = ref[RANK * n:(RANK + 1) * n]
    with collectively():
        out = torch.empty(n, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, data[RANK], op=op)
        check(out, mine, tol if isinstance(tol, float) else tol[RANK * n:(RANK + 1) * n], "tensor")
        out2 = torch.empty(n, dtype=torch.float64)
        dist.reduce_scatter(out2, list(data[RANK].split(n)), op=op)
        assert torch.equal(out, out2)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_gather_scatter_reduce_every_root(async_op, torch_pg):
    data = [inp("gsr", r, 999, torch.float32) for r in range(SIZE)]
    for root in range(SIZE):
        with collectively(what=f"root {root}"):
            outs = [torch.empty(999) for _ in range(SIZE)] if RANK == root else None
            w = dist.gather(data[RANK], outs, dst=root, async_op=async_op)
            if async_op:
                w.wait()
            if RANK == root:
                assert all(torch.equal(outs[r], data[r]) for r in range(SIZE))
            got = torch.empty(999)
            w = dist.scatter(got, data if RANK == root else None, src=root, async_op=async_op)
            if async_op:
                w.wait()
            assert torch.equal(got, data[RANK])
            red = data[RANK].clone()
            w = dist.reduce(red, dst=root, op=R.MAX, async_op=async_op)
            if async_op:
                w.wait()
            if RANK == root:
                assert torch.equal(red, torch.stack(data).max(0).values)
            else:
                assert torch.equal(red, data[RANK]), "reduce changed a non-root tensor"


# ---------------------------------------------------------------- all-to-all

def splits(tag):
    """send[s][d]: rows rank s sends rank d (zeros included); every rank
    computes the same matrix."""
    rng = np.random.default_rng(seed_for("a2a", tag))
    return rng.integers(0, 4, size=(SIZE, SIZE)).tolist()


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_all_to_all_single(async_op, torch_pg):
    rows = 3
    x = torch.arange(SIZE * rows * 2, dtype=torch.float32).reshape(SIZE * rows, 2) + 1000 * RANK
    with collectively(what="equal split"):
        y = torch.empty_like(x)
        w = dist.all_to_all_single(y, x, async_op=async_op)
        if async_op:
            w.wait()
        for s in range(SIZE):
            src = torch.arange(SIZE * rows * 2, dtype=torch.float32).reshape(SIZE * rows, 2)
            assert torch.equal(y[s * rows:(s + 1) * rows],
                               src[RANK * rows:(RANK + 1) * rows] + 1000 * s)
    send = splits("uneven")
    mine = [inp(f"a2a{s}", s, sum(send[s]) * 3, torch.float64).reshape(-1, 3)
            for s in range(SIZE)]
    with collectively(what="uneven split"):
        recv = [send[s][RANK] for s in range(SIZE)]
        y = torch.full((sum(recv), 3), float("nan"), dtype=torch.float64)
        w = dist.all_to_all_single(y, mine[RANK], output_split_sizes=recv,
                                   input_split_sizes=send[RANK], async_op=async_op)
        if async_op:
            w.wait()
        blocks = [mine[s][sum(send[s][:RANK]):sum(send[s][:RANK + 1])] for s in range(SIZE)]
        assert torch.equal(y, torch.cat(blocks))


def test_all_to_all_list(torch_pg):
    send = splits("list")
    ins = [torch.full((send[RANK][d], 2), float(10 * RANK + d)) for d in range(SIZE)]
    outs = [torch.empty(send[s][RANK], 2) for s in range(SIZE)]
    with collectively():
        dist.all_to_all(outs, ins)
        for s in range(SIZE):
            assert torch.all(outs[s] == 10 * s + RANK)


def test_all_to_all_single_errors(torch_pg):
    if SIZE == 1:
        pytest.skip("every dim 0 divides by one rank")
    with collectively():
        with pytest.raises(ValueError, match="divisible"):
            dist.all_to_all_single(torch.empty(SIZE + 1), torch.empty(SIZE + 1))


# ---------------------------------------------------------------- point to point, objects

def test_send_recv_and_batch(torch_pg):
    nxt, prev = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    with collectively():
        got = torch.zeros(70001)
        ops = [dist.P2POp(dist.irecv, got, prev, tag=2),
               dist.P2POp(dist.isend, torch.full((70001,), float(RANK)), nxt, tag=2)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert torch.all(got == prev)
        if SIZE > 1 and RANK < 2:
            t = torch.arange(5.) if RANK == 0 else torch.zeros(5)
            if RANK == 0:
                dist.send(t, 1, tag=7)
            else:
                dist.recv(t, 0, tag=7)
                assert torch.equal(t, torch.arange(5.))
        req = dist.irecv(got, prev, tag=3)
        dist.isend(torch.full((70001,), -1.0), nxt, tag=3).wait()
        req.wait()
        assert torch.all(got == -1)


def test_object_collectives(torch_pg):
    with collectively():
        objs = [None] * SIZE
        dist.all_gather_object(objs, {"rank": RANK, "data": list(range(RANK))})
        assert objs == [{"rank": r, "data": list(range(r))} for r in range(SIZE)]
        lst = [{"root": "yes"}, 3] if RANK == SIZE - 1 else [None, None]
        dist.broadcast_object_list(lst, src=SIZE - 1)
        assert lst == [{"root": "yes"}, 3]
        gathered = [None] * SIZE if RANK == 0 else None
        dist.gather_object(("r", RANK), gathered, dst=0)
        if RANK == 0:
            assert gathered == [("r", r) for r in range(SIZE)]
        out = [None]
        dist.scatter_object_list(out, [f"to {r}" for r in range(SIZE)] if RANK == 0 else None,
                                 src=0)
        assert out == [f"to {RANK}"]


# ---------------------------------------------------------------- groups

def test_subgroups(torch_pg):
    evens = dist.new_group([r for r in range(SIZE) if r % 2 == 0])
    odds = dist.new_group([r for r in range(SIZE) if r % 2 == 1]) if SIZE > 1 else None
    mine = evens if RANK % 2 == 0 else odds
    members = [r for r in range(SIZE) if r % 2 == RANK % 2]
    with collectively():
        assert dist.get_rank(mine) == members.index(RANK)
        assert dist.get_world_size(mine) == len(members)
        t = torch.tensor([float(RANK)])
        dist.all_reduce(t, group=mine)
        assert t.item() == sum(members)
        b = torch.tensor([float(RANK)])
        dist.broadcast(b, src=members[-1], group=mine)  # a global rank
        assert b.item() == members[-1]
        objs = [None] * len(members)
        dist.all_gather_object(objs, RANK, group=mine)
        assert objs == members
        dist.barrier(group=mine)
    if SIZE % 2 == 0:
        sub, _ = dist.new_subgroups(group_size=2)
        with collectively(what="new_subgroups"):
            t = torch.tensor([float(RANK)])
            dist.all_reduce(t, group=sub)
            assert t.item() == 2 * (RANK // 2 * 2) + 1


def test_barrier_waits_for_queued_work(torch_pg):
    x = torch.ones(100000)
    with collectively():
        work = dist.all_reduce(x, async_op=True)
        dist.barrier()
        assert work.is_completed()
        assert torch.all(x == SIZE)
    collective_assert(True)


# ---------------------------------------------------------------- rendezvous

def test_rendezvous_takes_rank_and_size_from_mpi(torch_pg, monkeypatch):
    """The env:// rendezvous without a master name, as init_process_group runs
    it under mpiexec: MPI's rank and size and a store that refuses every use."""
    import importlib
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    store, rank, size = next(rdzv.rendezvous("env://"))
    assert (rank, size) == (RANK, SIZE)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        store.set("key", "value")
    store2, rank2, size2 = next(rdzv.rendezvous("gradsync://"))
    assert (rank2, size2) == (RANK, SIZE)
    monkeypatch.setenv("RANK", str(RANK + 1))
    with pytest.raises(ValueError, match="RANK"):
        next(rdzv.rendezvous("env://"))


def test_creator_refuses_ranks_other_than_mpis(torch_pg):
    """A launch where torch's rank or size is not MPI's (a pure torchrun launch)."""
    from datetime import timedelta

    from torch._C._distributed_c10d import _DistributedBackendOptions

    import gradsync.torch.distributed as gtd
    opts = _DistributedBackendOptions()
    opts.group_rank, opts.group_size = RANK, SIZE + 1
    opts.global_ranks_in_group = []
    opts.timeout = timedelta(seconds=60)
    opts.group_id = "test"
    with pytest.raises(RuntimeError, match="mpiexec"):
        gtd._create(opts)
