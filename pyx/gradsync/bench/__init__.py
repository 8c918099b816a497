"""gradsync's benchmarks; this package's own command is gsbench, an
nccl-tests-style benchmark for gradsync collectives.

Run it as ``scripts/gsbench`` or ``python -m gradsync.bench`` under ``mpiexec``.
Layout: args (flags, sizes), data (tensor lists, check patterns, buffers),
timing (shared by every benchmark here), baselines (mpi4py, NumPy Adasum),
runners (rows, checks, latency), output (table, metadata, plot, the JSON
writer every benchmark uses), cli (main).

The research benchmarks are not part of the installed package: they live in
the checkout's bench/ folder and run from its root, each ``python -m
bench.NAME`` (kernels, cluster, overlap, torch_backend, horovod, gpu; make
targets run them; docs/PERFORMANCE.md and docs/GPU.md hold their results).
Importing this package changes no process state.
Only rank 0 prints; a progress line goes to rank 0's stderr.

The four performance targets (docs/PERFORMANCE.md), each one command at 2 ranks::

    # (a) 200 float32 tensors of 768 elements, fused allreduce_ vs a loop of
    #     mpi4py Allreduce over the same 200 tensors (target: >= 10x faster)
    mpiexec -n 2 python scripts/gsbench -b 614400 -e 614400 --tensors 200 \\
        --inplace-only -n 50 -w 10 --repeats 7 -c 1 --baseline mpi4py

    # (b) ResNet-50 gradient list (161 tensors, 25.6M float32) vs one mpi4py
    #     Allreduce of a pre-fused buffer ("fused1", within 15%) and vs the
    #     per-tensor loop ("mpi4py", faster)
    mpiexec -n 2 python scripts/gsbench --shapes resnet50 --inplace-only \\
        -n 10 -w 3 --repeats 7 -c 1 --baseline mpi4py

    # (c) one float32 tensor of 16M elements (64 MiB) vs mpi4py Allreduce on
    #     the same buffer (within 5%)
    mpiexec -n 2 python scripts/gsbench -b 64M -e 64M -n 10 -w 3 --repeats 7 \\
        -c 1 --baseline mpi4py

    # (d) small-message latency: one 16-element float32 tensor vs mpi4py
    #     (prefix GRADSYNC_CHECK=0 to see the cost without cross-rank validation)
    mpiexec -n 2 python scripts/gsbench --latency --repeats 7

Adasum (issue 3): ResNet-50's gradient list, ``op="adasum"`` vs a plain NumPy +
mpi4py Adasum (target: >= 5x faster) and vs gradsync's own sum allreduce of the
same list (target: at most 2x its time)::

    mpiexec -n 2 python scripts/gsbench --shapes resnet50 -o adasum --inplace-only \\
        -n 5 -w 2 --repeats 5 -c 1 --baseline mpi4py

Table columns (per mode, out-of-place then in-place)::

    size(B) count type op | time(us) algbw(GB/s) busbw(GB/s) #wrong
                            [mpi4py(us) ratio fused1(us) ratio]  with --baseline

* time: a barrier, then ``-n`` back-to-back iterations; the average per
  iteration is taken on every rank and the maximum over ranks is kept (as
  nccl-tests does). That measurement is repeated ``--repeats`` times (after
  ``-w`` warmup iterations) and the MEDIAN is reported. gradsync and the
  baselines are interleaved within each repeat (gradsync, mpi4py, fused1,
  gradsync, ...), so outside load on a shared machine hits them alike; every
  sample is kept in ``--json``.
* algbw = size / time; busbw = algbw * factor, factor 2(n-1)/n for allreduce,
  (n-1)/n for allgather and reduce_scatter, 1 for broadcast.
* size: allreduce/broadcast, the buffer; allgather, the gathered (output)
  buffer; reduce_scatter, the input buffer (nccl-tests' convention).
* #wrong (``-c 1``): one extra checked iteration per mode whose result is exact
  (small integers, so float sums are exact), the number of wrong elements summed
  over ranks (out-of-place also counts changes to the input).
* mpi4py: the same tensor list through plain mpi4py, one call per tensor
  (``Allreduce``, ``Bcast``, ``Allgather``, ``Reduce_scatter_block``);
  fused1: ONE mpi4py call on one pre-fused buffer of the total size (the
  speed-of-light of a fused design, no packing). ratio = gradsync_time /
  baseline_time (below 1: gradsync is faster). Out-of-place baselines reuse
  preallocated receive buffers; gradsync's out-of-place calls allocate their
  results (that is the API). op=average in the baselines is SUM followed by a
  numpy multiply by 1/n. float16/bfloat16 reductions have no mpi4py baseline
  ("n/a"); their broadcast/allgather go as MPI.SHORT.
* ``--tensors K`` splits each size into K separately allocated tensors of
  nearly equal size (not back to back in one allocation, so gradsync's fusion
  path is measured; ``--alloc contiguous`` carves them out of one allocation).
* ``-o adasum`` (allreduce, float16/bfloat16/float32/float64 only): busbw uses
  the allreduce factor 2(n-1)/n. Checked inputs: even-numbered tensors hold the
  same values on every rank (adasum(a, a) = a), odd-numbered ones hold values
  on disjoint elements per rank (orthogonal: adasum = sum), so the exact result
  is the pattern itself (bitwise; verified at 1 to 5 ranks, all four dtypes).
  With ``--baseline mpi4py`` the columns become ``np+mpi`` (a straightforward
  NumPy + mpi4py Adasum: one Allgather of every rank's list packed into one
  buffer in its own dtype, then the Adasum tree per tensor in NumPy float64,
  docs/GUIDE.md section 5) and ``gs sum`` (gradsync's own op=sum allreduce of a
  copy of the same list), each with the ratio adasum_time / its time.

Shard collectives (``--collective allgather_shards`` / ``reduce_scatter_shards``,
in place only): the size is the whole unpadded list, split into ``--tensors``
tensors laid out by ``gs.ShardLayout`` (a tensor that would cross a rank's
range is cut there, so there are at least as many tensors as ranks owning
data); busbw factor (n-1)/n. Checked: allgather_shards inputs hold the pattern
on the owner and 0 elsewhere; reduce_scatter_shards must reduce the owned
tensors and leave the others bitwise alone. Baselines: ``mpi4py``, one
Allgather(IN_PLACE) / Reduce_scatter_block on a flat buffer of
``ShardLayout.padded`` elements (the tensors taken to live in it), and
``mpi+pack``, the same with NumPy copies in and out of the tensors.

``--collective accumulate``: ``gs.accumulate_`` of the list (float32
accumulators += gradients of ``-d``'s dtype), every rank at once, in place only;
size = the gradients' bytes, algbw = busbw = bytes moved (4 + 4 + itemsize
per element) / time; #wrong exact (small integers); baseline ``numpy``, a
Python loop of ``acc += grad.astype(np.float32)``.

Every baseline is checked like gradsync and has a table of its own (printed
after gradsync's, and in ``--json`` under ``tables``: one row per size per
mode per table, with time, algbw, busbw, #wrong and every sample; gradsync's
rows carry the ratio to each baseline). The exit code is 1 when any checked
row has wrong elements. ``gradsync.bench.run(argv)`` runs the same thing in
a Python program and returns that JSON's contents on every rank.

Cross-rank validation (GRADSYNC_CHECK, default 1) is part of every gradsync
call; run with ``GRADSYNC_CHECK=0`` in the environment to measure without it.
The setting is recorded in the header and in ``--json``.
"""

from gradsync.bench.cli import UsageError, main, run

__all__ = ["main", "run", "UsageError"]
