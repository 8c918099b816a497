
"""hvd.join(): Horovod's test_torch.py join tests (allreduce with a joined
rank contributing zeros, allgather and broadcast refused) and the use it
exists for: a DistributedOptimizer loop over uneven numbers of batches."""
import itertools

import pytest
import torch.nn.functional as F  # noqa: E402
from hvdtest import INTS, Checks, hvd, random_tensor, threshold, torch

pytestmark = pytest.mark.mpi
needs_two = pytest.mark.skipif(hvd.size() == 1, reason="needs two ranks")


def _check_ret(c, ret, first):
    if hvd.size() > 1:
        c.check(ret != first, f"join() returned {ret}, the first rank to join")
    c.check(hvd.allgather_object(ret) == [ret] * hvd.size(), "join() differs across ranks")


def test_join_allreduce():
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    for dtype, dim, first, caching in itertools.product(
            INTS + [torch.float32, torch.float64], [1, 2, 3], range(size), [False, True]):
        def div(t, s):
            # integers are scaled in float64 and truncated (Horovod's C++
            # conversion); floats are divided by the set size, correctly
            # rounded (the drop-in's Average, which Horovod's own tests
            # require to be exact at 3 ranks; at 2 and 4 ranks 1/size is exact)
            if dtype in INTS:
                return (t.double() * (1.0 / s)).trunc().to(dtype)
            return t / s
        tensor_a = random_tensor([5] * dim).to(dtype)
        tensor_b = random_tensor([17] * dim, seed=99).to(dtype)
        if caching:
            for h in [hvd.allreduce_async(tensor_a, name="tensor_a"),
                      hvd.allreduce_async(tensor_b, name="tensor_b")]:
                hvd.synchronize(h)
        if rank == first:
            ret = hvd.join()
        else:
            ha = hvd.allreduce_async(tensor_a, name="tensor_a")
            hb = hvd.allreduce_async(tensor_b, name="tensor_b")
            averaged_a, averaged_b = hvd.synchronize(ha), hvd.synchronize(hb)
            ret = hvd.join()
            t = threshold(size, dtype)
            c.check(torch.allclose(averaged_a, div(tensor_a * (size - 1), size), t),
                    f"{dtype} {dim} first {first}: a")
            c.check(torch.allclose(averaged_b, div(tensor_b * (size - 1), size), t),
                    f"{dtype} {dim} first {first}: b")
        _check_ret(c, ret, first)
    c.done()


@needs_two
@pytest.mark.parametrize("which", ["allgather", "broadcast"])
def test_join_refuses_allgather_and_broadcast(which):
    c, rank, size = Checks(), hvd.rank(), hvd.size()
    tensor = torch.FloatTensor(17, 17, 17).fill_(1)
    for first in range(size):
        if rank == first:
            ret = hvd.join()
        else:
            call = (lambda: hvd.allgather(tensor)) if which == "allgather" else \
                (lambda: hvd.broadcast(tensor, rank, name="test_horovod_join_broadcast"))
            c.raises(RuntimeError, call, f"{which} with rank {first} joined")
            ret = hvd.join()
        _check_ret(c, ret, first)
    c.done()


def _batches(rank, size):
    """Rank r has r + 2 batches: uneven data, Horovod's reason for join()."""
    out = []
    for b in range(rank + 2):
        g = torch.Generator().manual_seed(100 * rank + b)
        out.append((torch.randn(5, 4, generator=g, dtype=torch.float64),
                    torch.randn(5, 1, generator=g, dtype=torch.float64)))
    return out


def test_join_with_distributed_optimizer():
    """Each rank trains on its own number of batches and then joins. Step s
    averages the gradients of the ranks that still have batch s over ALL
    ranks (joined ones contribute zeros), as Horovod does; every rank ends
    with the parameters one process computes that way."""
    c, rank, size = Checks(), hvd.rank(), hvd.size()

    def net():
        torch.manual_seed(3)
        return torch.nn.Linear(4, 1).double()
    model, ref = net(), net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in _batches(rank, size):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    all_batches = [_batches(r, size) for r in range(size)]
    for s in range(size + 1):
        ref_opt.zero_grad()
        loss = sum(F.mse_loss(ref(b[s][0]), b[s][1]) for b in all_batches if s < len(b))
        (loss / size).backward()
        ref_opt.step()
    # ranks that ran out of batches must still hold the model: bring it over
    # from the rank that trained longest, as a Horovod script would
    hvd.broadcast_parameters(model.state_dict(), root_rank=size - 1)
    c.check(last == size - 1, f"last joined {last}")
    for p, q in zip(model.parameters(), ref.parameters()):
        c.check(torch.allclose(p, q, rtol=1e-12, atol=1e-14), (p - q).abs().max().item())
    c.done()
