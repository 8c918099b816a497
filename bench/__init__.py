"""gradsync's research benchmarks, run from the checkout (not installed):
each ``python -m bench.NAME`` from the repository's root, under mpiexec
where it says so. Its docstring says what it measures; docs/PERFORMANCE.md
and docs/GPU.md hold the results. They build on the installed package's
gsbench helpers (gradsync.bench.args, .data, .output, .timing).

  kernels        the gradient kernels against NumPy (no MPI)
  cluster        allreduce across scripts/simcluster hosts
  overlap        DistributedOptimizer's overlap with backward
  torch_backend  the torch.distributed backend against gloo
  horovod        the Horovod drop-in's cost
  gpu            the GPU figures (gpu_train: its training step, gpu_latency:
                 small-message latency, gpu_figures: its table)
  rendezvous     starts torch.distributed for those that compare with gloo
  memory         resident memory a leak check can trust
"""
