"""The torch front door of the wire formats on CUDA (issue 32): a
DistributedOptimizer with wire= and error feedback trains a CUDA model, its
residuals kept on the GPU, to parameters within the wire's rounding of the
same optimizer without a wire (bitwise equality with a CPU run is not to be
had: torch's CUDA and CPU matmuls differ). Needs torch with CUDA; elsewhere
it skips."""
import pytest

from gsutil import collectively

pytestmark = pytest.mark.mpi


def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.parametrize("wire", ["bfloat16", "float8_e4m3"])
def test_optimizer_wire_on_cuda(comm, device, wire):
    torch = torch_cuda()
    import gradsync.torch as gst
    dev = torch.device("cuda", device)
    params, feedback = {}, None
    for w in (None, wire):
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(),
                                    torch.nn.Linear(65, 3)).to(dev)
        opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), comm=comm, wire=w)
        gen = torch.Generator().manual_seed(100 + comm.rank)
        for _ in range(3):
            x = torch.randn(16, 33, generator=gen).to(dev)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        params[w] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if w is not None:
            feedback = [r for b in opt._buckets if b.feedback is not None
                        for r in (b.feedback.state or [])]
    with collectively():
        diff = float((params[wire] - params[None]).abs().max())
        if comm.size == 1:  # one rank sends nothing: the gradients are exact
            assert diff == 0 and not feedback, diff
        else:
            assert feedback and all(r.is_cuda for r in feedback)
            assert torch.isfinite(params[wire]).all() and 0 < diff < 5e-3, diff
