"""Argument plumbing shared by the Communicator's methods (communicator.py,
exchange.py): every collective takes one array or a list of arrays and
answers in the same form."""
import numpy as np

from gradsync import _core


def _as_list(tensors):
    """(list, was_a_sequence): one array or a sequence of arrays."""
    if isinstance(tensors, (list, tuple)):
        return list(tensors), True
    return [tensors], False


def _answer(results, was_list):
    """results in the form the call was given: the list, or its one array."""
    return results if was_list else results[0]


def _label(name, i, was_list):
    return f"{name}[{i}]" if was_list else name


def _row_shape(shape, where, what):
    """(rows, elements per row) of an array split or joined along dim 0."""
    if len(shape) == 0:
        raise _core.ArgumentError(f"{where} is 0-d; {what} works along dim 0 and needs at "
                                  "least one dimension")
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))
