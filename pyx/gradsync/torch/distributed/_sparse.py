"""Sparse COO allreduce for the gradsync backend: the ranks' indices and
values gathered, then coalesced, so every rank adds the same terms in the
same order."""
import zlib

import numpy as np
import torch

MAX_SPARSE_DIMS = 16


def sparse_sum(comm, x):
    """The sum over ``comm``'s ranks of coalesced sparse COO tensors ``x``
    (same size, sparse dims and dtype on every rank, else ValueError on
    every rank): indices and values gathered, then coalesced, so every rank
    adds the same terms in the same order."""
    if x.dim() > MAX_SPARSE_DIMS:
        raise ValueError(f"gradsync backend: sparse allreduce takes at most "
                         f"{MAX_SPARSE_DIMS} dims, got {x.dim()}")
    meta = np.full((1, 3 + MAX_SPARSE_DIMS), -1, np.int64)
    meta[0, :3] = (x.sparse_dim(), zlib.crc32(str(x.dtype).encode()), x.dim())
    meta[0, 3:3 + x.dim()] = x.shape
    every = comm.allgather(meta)
    if not (every == every[0]).all():
        raise ValueError("gradsync backend: sparse allreduce: the ranks' tensors differ in "
                         "size, sparse dims or dtype (Sparse dimensions do not match): "
                         f"rank by rank {[list(m[3:3 + m[2]]) for m in every]}")
    nnz, dense = x._nnz(), x.shape[x.sparse_dim():]
    width = int(np.prod(dense, dtype=np.int64))
    indices = comm.allgather(x.indices().t().contiguous())
    values = x.values().contiguous().reshape(nnz, width)
    values = comm.allgather(values.view(torch.uint8))  # any dtype, as bytes
    total = indices.shape[0]
    values = torch.from_numpy(values).view(x.dtype).reshape((total,) + tuple(dense))
    return torch.sparse_coo_tensor(torch.from_numpy(indices).t(), values, x.shape).coalesce()
