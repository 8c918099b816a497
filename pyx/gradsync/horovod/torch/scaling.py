"""Horovod's arithmetic on the torch side: which reduction op the
``op``/``average`` arguments pick, and prescale/postscale applied as
Horovod applies them (gradsync.horovod.torch.mpi_ops's docstring)."""
import warnings

import torch

import gradsync as gs
from gradsync.horovod.basics import OP_NAMES, Average, Sum


def _op(op, average):
    """Horovod's rule: op=None and average=None is Average; average=True or
    False picks Average or Sum (deprecated); both given is an error."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if op not in OP_NAMES:
        raise ValueError(f"op must be one of hvd.Average, Sum, Adasum, Min, Max, Product; "
                         f"got {op!r}")
    return op


def _scale_(tensors, factor):
    """Horovod's ScaleBuffer: floats in float32 (float64 for float64) with
    one rounding (gradsync's scale kernel), integers in float64 truncated."""
    if factor == 1.0:
        return
    if isinstance(factor, _Divide):
        for t in tensors:
            t.div_(factor.n)
        return
    floats = [t for t in tensors if t.is_floating_point()]
    if floats:
        gs.scale_(floats, factor)
    for t in tensors:
        if not t.is_floating_point():
            t.copy_(t.to(torch.float64) * factor)


def _scales(tensors, op, prescale, postscale, set_size):
    """(gradsync op, gradsync prescale, postscale, shim prescale, postscale):
    gradsync scales floating tensors itself; integer lists are scaled here."""
    post = postscale / set_size if op == Average else postscale
    gs_op = "sum" if op == Average else OP_NAMES[op]
    if all(t.is_floating_point() for t in tensors):
        if op == Average and postscale == 1.0 and set_size & (set_size - 1):
            # the sum divided by the size, rounded once (1/size is not exact)
            return gs_op, prescale, 1.0, 1.0, _Divide(set_size)
        return gs_op, prescale, post, 1.0, 1.0
    return gs_op, 1.0, 1.0, prescale, post


class _Divide(float):
    """A postscale of 1/n applied as a division by n (correctly rounded)."""

    def __new__(cls, n):
        obj = super().__new__(cls, 1.0 / n)
        obj.n = n
        return obj
