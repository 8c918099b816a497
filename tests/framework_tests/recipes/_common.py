"""What the framework recipes share: the backend switch, a tiny model and
data set, and the record each rank writes for the comparison with gloo.

Each recipe runs as ``RECIPE.py BACKEND OUT_DIR`` under torchrun (or
mpiexec): with BACKEND "gloo" the framework is left to create its own group
(it picks gloo on the CPU); with "gradsync" the recipe does what
docs/TORCH_BACKEND.md "Frameworks" tells users to do.
"""
import os
import sys

import torch
import torch.distributed as dist

N_SAMPLES, N_IN, N_OUT = 64, 8, 2


def args():
    backend, out_dir = sys.argv[1], sys.argv[2]
    assert backend in ("gloo", "gradsync"), backend
    torch.set_num_threads(1)
    return backend, out_dir


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(N_IN, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, N_OUT))


def make_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    y = torch.randn(N_SAMPLES, N_OUT, generator=g)
    return x, y


def save(out_dir, params, extra=None):
    """Writes rank<R>.pt: the parameters (name -> CPU tensor), the backend
    of torch's default group, the world's rank and size, and ``extra``."""
    rank = dist.get_rank()
    record = {"params": {k: v.detach().cpu().clone() for k, v in params},
              "backend": dist.get_backend(), "rank": rank,
              "size": dist.get_world_size(), "extra": extra or {}}
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
