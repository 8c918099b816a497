"""All-to-all, gather, scatter, reduce and point-to-point messages: the
Communicator methods beyond docs/GUIDE.md section 2.3 (mixed into Communicator).

Counts here are rows along dim 0, one per rank; the C runtime takes elements
(rows times the elements per row). Like the other collectives, every method
takes one array or a list of arrays and answers in the same shape. The
asynchronous forms write into outputs the caller provides (a collective
running in the background cannot allocate after learning sizes) and return a
gs.Request whose ``wait()`` returns those outputs.
"""
import numpy as np

from gradsync import _core
from gradsync._args import _answer, _as_list, _label, _row_shape

_DTYPES = _core._NP_DTYPES  # gs_dtype_t code -> numpy dtype


def _given(arrays, was_list):
    """A list of arrays in the form the call was given (None stays None)."""
    return None if arrays is None else _answer(arrays, was_list)


def _per_tensor(counts, n, was_list, name):
    """counts for n tensors: None, one sequence (one tensor) or a list of them."""
    if counts is None:
        return [None] * n
    if not was_list:
        return [counts]
    if len(counts) != n:
        raise _core.ArgumentError(f"{name} must hold one sequence of counts per tensor "
                                  f"({n}), got {len(counts)}")
    return list(counts)


def _rank_counts(counts, size, where, name):
    """A sequence of `size` non-negative row counts as a list of ints."""
    values = [int(v) for v in np.asarray(counts, dtype=np.int64).reshape(-1)]
    if len(values) != size:
        raise _core.ArgumentError(f"{name} for {where} must hold one count per rank ({size}), "
                                  f"got {len(values)}")
    if any(v < 0 for v in values):
        raise _core.ArgumentError(f"{name} for {where} holds a negative count: {values}")
    return values


def _equal_split(rows, size, where, what):
    if rows % size:
        raise _core.ArgumentError(f"{where} has {rows} rows, which {size} ranks cannot split "
                                  f"evenly; pass {what} (rows per rank)")
    return [rows // size] * size


def _elements(rows_by_tensor, row_elems):
    """C's rank-major element counts from per-tensor lists of rows."""
    n, size = len(rows_by_tensor), len(rows_by_tensor[0]) if rows_by_tensor else 0
    out = np.zeros((size, n), dtype=np.int64)
    for i, rows in enumerate(rows_by_tensor):
        out[:, i] = np.asarray(rows, dtype=np.int64) * row_elems[i]
    return out.reshape(-1)


class ExchangeCollectives:
    """Mixed into Communicator (needs self.handle, self.rank, self.size)."""

    def _checked(self, prepare):
        """Runs argument preparation before a collective; a failure here meets
        the other ranks' check, so they raise MismatchError instead of waiting."""
        try:
            return prepare()
        except Exception as exc:
            self.handle.give_up(exc)
            raise

    # ---- all-to-all -----------------------------------------------------------
    def alltoall_counts(self, send_counts):
        """What every rank sends this one: ``recv[r]`` is rank r's
        ``send_counts[self.rank]`` (any unit). Collective."""
        send = self._checked(lambda: _rank_counts(send_counts, self.size, "alltoall_counts",
                                                  "send_counts"))
        got = self.handle.alltoall_counts([np.empty(0, np.int64)], None, send)
        return np.asarray(got, dtype=np.int64)

    def _alltoall_plan(self, arrays, was_list, send_counts, recv_counts, outs):
        shapes = _core.describe(_answer(arrays, was_list))
        sends, recvs, row_elems = [], [], []
        for i, ((shape, _), sc, rc) in enumerate(zip(
                shapes, _per_tensor(send_counts, len(arrays), was_list, "send_counts"),
                _per_tensor(recv_counts, len(arrays), was_list, "recv_counts"))):
            where = _label("tensor", i, was_list)
            rows, per_row = _row_shape(shape, where, "alltoall")
            sc = (_equal_split(rows, self.size, where, "send_counts") if sc is None
                  else _rank_counts(sc, self.size, where, "send_counts"))
            if sum(sc) != rows:
                raise _core.ArgumentError(f"send_counts for {where} add up to {sum(sc)} rows, "
                                          f"but it has {rows}")
            if rc is None and outs is not None:  # equal split of the given output
                out_rows = _row_shape(_core.describe(outs[i])[0][0],
                                      _label("out", i, was_list), "alltoall")[0]
                rc = _equal_split(out_rows, self.size, _label("out", i, was_list),
                                  "recv_counts")
            elif rc is not None:
                rc = _rank_counts(rc, self.size, where, "recv_counts")
            sends.append(sc)
            recvs.append(rc)
            row_elems.append(per_row)
        return shapes, sends, recvs, row_elems

    def alltoall(self, tensor, send_counts=None, *, recv_counts=None, out=None):
        """Rank r gets block r of every rank's dim 0; the blocks are
        concatenated in rank order. ``send_counts[d]``: rows for rank d
        (default: an equal split, an error if dim 0 does not divide).
        ``recv_counts``, when known, saves the exchange of counts
        (alltoall_counts) that otherwise comes first. ``out``: arrays to
        receive into (new ones when None)."""
        arrays, was_list = _as_list(tensor)
        outs = None if out is None else _as_list(out)[0]
        shapes, sends, recvs, row_elems = self._checked(
            lambda: self._alltoall_plan(arrays, was_list, send_counts, recv_counts, None))
        if any(rc is None for rc in recvs):
            got = self.handle.alltoall_counts(_given(arrays, was_list), row_elems,
                                        np.asarray(sends, dtype=np.int64).T.reshape(-1)
                                        ).reshape(self.size, len(arrays))
            recvs = [[int(v) for v in got[:, i]] for i in range(len(arrays))]
        if outs is None:
            outs = self._checked(lambda: [
                _core.empty_like(a, (sum(recvs[i]),) + shapes[i][0][1:])
                for i, a in enumerate(arrays)])
        self.handle.alltoallv(_given(arrays, was_list), _given(outs, was_list),
                        _elements(sends, row_elems), _elements(recvs, row_elems), False)
        return _answer(outs, was_list)

    def alltoall_async(self, tensor, out, send_counts=None, recv_counts=None):
        """Starts alltoall into ``out``; returns a Request whose wait()
        returns ``out``. Without recv_counts, each rank's block of ``out`` is
        an equal split of its dim 0."""
        arrays, was_list = _as_list(tensor)
        outs = _as_list(out)[0]
        _, sends, recvs, row_elems = self._checked(
            lambda: self._alltoall_plan(arrays, was_list, send_counts, recv_counts, outs))
        return self.handle.alltoallv(_given(arrays, was_list), _given(outs, was_list),
                               _elements(sends, row_elems), _elements(recvs, row_elems), True,
                               out)

    # ---- gather and scatter --------------------------------------------------
    def _gather_rows(self, arrays, was_list, counts):
        """Every rank's rows of every tensor: from `counts`, else exchanged."""
        shapes = _core.describe(_answer(arrays, was_list))
        per = [_row_shape(s, _label("tensor", i, was_list), "gather")
               for i, (s, _) in enumerate(shapes)]
        given = _per_tensor(counts, len(arrays), was_list, "counts")
        rows = [None if c is None else _rank_counts(c, self.size, _label("tensor", i, was_list),
                                                    "counts")
                for i, c in enumerate(given)]
        for i, r in enumerate(rows):
            if r is not None and r[self.rank] != per[i][0]:
                raise _core.ArgumentError(f"counts say this rank has {r[self.rank]} rows of "
                                          f"{_label('tensor', i, was_list)}, it has {per[i][0]}")
        return shapes, per, rows

    def gather(self, tensor, root=0, *, counts=None, out=None):
        """At ``root``: every rank's tensor concatenated along dim 0 in rank
        order (dim 0 may differ by rank); None on the other ranks.
        ``counts`` (rows per rank), when known, saves an exchange of counts.
        ``out``: the root's arrays to gather into."""
        arrays, was_list = _as_list(tensor)
        shapes, per, rows = self._checked(lambda: self._gather_rows(arrays, was_list, counts))
        if any(r is None for r in rows):
            send = np.repeat(np.array([[p[0] for p in per]], dtype=np.int64), self.size, 0)
            got = self.handle.alltoall_counts(_given(arrays, was_list),
                                        [p[1] for p in per], send.reshape(-1)
                                        ).reshape(self.size, len(arrays))
            rows = [[int(v) for v in got[:, i]] for i in range(len(arrays))]
        root = int(root)
        outs = None
        if self.rank == root:
            outs = _as_list(out)[0] if out is not None else self._checked(lambda: [
                _core.empty_like(a, (sum(rows[i]),) + shapes[i][0][1:])
                for i, a in enumerate(arrays)])
        self.handle.gatherv(_given(arrays, was_list), _given(outs, was_list),
                      _elements(rows, [p[1] for p in per]), root, False)
        return None if outs is None else _answer(outs, was_list)

    def gather_async(self, tensor, out=None, root=0, counts=None):
        """Starts gather into the root's ``out``; ``counts`` default to every
        rank having this rank's rows."""
        arrays, was_list = _as_list(tensor)
        shapes, per, rows = self._checked(lambda: self._gather_rows(arrays, was_list, counts))
        rows = [[p[0]] * self.size if r is None else r for r, p in zip(rows, per)]
        outs = None if out is None else _as_list(out)[0]
        return self.handle.gatherv(_given(arrays, was_list), _given(outs, was_list),
                             _elements(rows, [p[1] for p in per]), int(root), True, out)

    def _scatter_meta(self, tensor, root, counts):
        """The root's description of a scatter as int64s: tensors, then per
        tensor dtype code, device kind, ndim, 9 trailing dims, rows per rank."""
        arrays, was_list = _as_list(tensor)
        shapes = _core.describe(_answer(arrays, was_list))
        given = _per_tensor(counts, len(arrays), was_list, "counts")
        meta = [len(arrays), int(was_list)]
        for i, ((shape, dtype), c) in enumerate(zip(shapes, given)):
            where = _label("tensor", i, was_list)
            rows, _ = _row_shape(shape, where, "scatter")
            if len(shape) > 9:
                raise _core.ArgumentError(f"{where} has {len(shape)} dimensions; scatter takes "
                                          "at most 9")
            rc = (_equal_split(rows, self.size, where, "counts") if c is None
                  else _rank_counts(c, self.size, where, "counts"))
            if sum(rc) != rows:
                raise _core.ArgumentError(f"counts for {where} add up to {sum(rc)} rows, but "
                                          f"it has {rows}")
            on_cuda = hasattr(arrays[i], "__cuda_array_interface__") or (
                hasattr(arrays[i], "__dlpack_device__")
                and int(arrays[i].__dlpack_device__()[0]) == _core.DLPACK_CUDA)
            meta += [_DTYPES.index(np.dtype(dtype)), 2 if on_cuda else 1, len(shape)]
            meta += list(shape[1:]) + [0] * (10 - len(shape)) + rc
        return arrays, np.array(meta, dtype=np.int64)

    def scatter(self, tensor, root=0, counts=None, *, out=None):
        """Rank r gets rows block r of root's tensor along dim 0 (``counts``:
        rows per rank, default an equal split). Other ranks pass None; they
        learn dtype and shape from the root. ``out``: arrays to receive into."""
        root = int(root)
        arrays, meta = None, None
        if self.rank == root:
            arrays, meta = self._checked(lambda: self._scatter_meta(tensor, root, counts))
            head = np.array([meta.size], dtype=np.int64)
        else:
            head = np.zeros(1, dtype=np.int64)
        self.broadcast_(head, root=root)
        if meta is None:
            meta = np.zeros(int(head[0]), dtype=np.int64)
        self.broadcast_(meta, root=root)
        n, was_list = int(meta[0]), bool(meta[1])
        per_tensor = 12 + self.size
        rows, trailing, outs = [], [], []
        for i in range(n):
            m = meta[2 + i * per_tensor: 2 + (i + 1) * per_tensor]
            dtype, cuda, ndim = _DTYPES[int(m[0])], int(m[1]) == 2, int(m[2])
            trailing.append(tuple(int(d) for d in m[3:3 + ndim - 1]))
            rows.append([int(v) for v in m[12:]])
            shape = (rows[-1][self.rank],) + trailing[-1]
            if out is None:
                outs.append(_core.DeviceArray(shape, dtype) if cuda else np.empty(shape, dtype))
        if out is not None:
            outs = _as_list(out)[0]
        row_elems = [int(np.prod(t, dtype=np.int64)) for t in trailing]
        self.handle.scatterv(_given(arrays, was_list), _given(outs, was_list),
                       _elements(rows, row_elems), root, False)
        return _answer(outs, was_list)

    def scatter_async(self, tensor, out, root=0, counts=None):
        """Starts a scatter from root's ``tensor`` (ignored elsewhere) into
        ``out``; ``counts`` (rows per rank) default to every rank receiving
        this rank's rows of ``out``."""
        outs, was_list = _as_list(out)
        shapes = self._checked(lambda: _core.describe(_answer(outs, was_list)))
        per = [_row_shape(s, _label("out", i, was_list), "scatter") for i, (s, _) in
               enumerate(shapes)]
        given = _per_tensor(counts, len(outs), was_list, "counts")
        rows = [[p[0]] * self.size if c is None else list(c) for c, p in zip(given, per)]
        arrays = _as_list(tensor)[0] if self.rank == int(root) else None
        return self.handle.scatterv(_given(arrays, was_list), _given(outs, was_list),
                              _elements(rows, [p[1] for p in per]), int(root), True, out)

    # ---- reduce -------------------------------------------------------------
    def reduce(self, tensors, op="sum", root=0, *, prescale=1.0, postscale=1.0):
        """At ``root``: new arrays holding the reduction (allreduce's ops and
        arithmetic, no Adasum); None on the other ranks. Inputs unchanged."""
        arrays, was_list = _as_list(tensors)
        root = int(root)
        outs = None
        if self.rank == root:
            outs = self._checked(lambda: [_core.empty_like(a, s) for a, (s, _) in zip(
                arrays, _core.describe(_answer(arrays, was_list)))])
        self.handle.reduce(tensors, _given(outs, was_list), op, float(prescale),
                     float(postscale), root, False)
        return None if outs is None else _answer(outs, was_list)

    def reduce_(self, tensors, op="sum", root=0, *, prescale=1.0, postscale=1.0):
        """Reduces into root's tensors in place (the others' are only read);
        returns ``tensors``."""
        self.handle.reduce(tensors, None, op, float(prescale), float(postscale),
                     int(root), False)
        return tensors

    def reduce_async_(self, tensors, op="sum", root=0, *, prescale=1.0, postscale=1.0):
        """Starts reduce_; returns a Request."""
        return self.handle.reduce(tensors, None, op, float(prescale), float(postscale),
                            int(root), True, tensors)

    # ---- allgather and reduce_scatter into given outputs --------------------
    def allgather_async(self, tensor, out, counts=None):
        """Starts an allgather into ``out`` (dim 0: every rank's rows);
        ``counts`` (rows per rank) default to an equal split of ``out``."""
        arrays, was_list = _as_list(tensor)

        def prepare():
            shapes = _core.describe(tensor)
            oshapes = _core.describe(out)
            per = [_row_shape(s, _label("tensor", i, was_list), "allgather")[1]
                   for i, (s, _) in enumerate(shapes)]
            given = _per_tensor(counts, len(arrays), was_list, "counts")
            rows = [_equal_split(o[0][0], self.size, _label("out", i, was_list), "counts")
                    if c is None else _rank_counts(c, self.size, _label("tensor", i, was_list),
                                                   "counts")
                    for i, (c, o) in enumerate(zip(given, oshapes))]
            return _elements(rows, per)
        return self.handle.allgatherv(tensor, out, self._checked(prepare), True, out)

    def reduce_scatter_async(self, tensor, out, op="sum", *, prescale=1.0, postscale=1.0):
        """Starts a reduce_scatter into ``out`` (this rank's balanced block)."""
        was_list = isinstance(tensor, (list, tuple))
        rows = self._checked(lambda: [
            _row_shape(s, _label("tensor", i, was_list), "reduce_scatter")[0]
            for i, (s, _) in enumerate(_core.describe(tensor))])
        return self.handle.reduce_scatter_into(tensor, out, rows, op, float(prescale),
                                         float(postscale), True, out)

    # ---- point to point -----------------------------------------------------
    @property
    def max_tag(self):
        """The largest tag send/recv accept here (at least 16383)."""
        return self.handle.p2p_max_tag()

    def send(self, tensor, dest, tag=0):
        """Sends to rank ``dest``; returns once ``tensor`` may be reused. A
        list is sent as that many messages, in order. Not collective."""
        return self.handle.send(tensor, int(dest), int(tag), False, tensor)

    def recv_(self, tensor, source, tag=0):
        """Receives rank ``source``'s oldest unreceived message with ``tag``
        into ``tensor`` (same dtype and size as sent, else MismatchError here);
        returns ``tensor``. Waits like a collective (gs.set_timeout)."""
        return self.handle.recv(tensor, int(source), int(tag), False, tensor)

    def send_async(self, tensor, dest, tag=0):
        """Posts the send now; returns a Request (wait() returns ``tensor``).
        Point-to-point requests do not queue behind collectives."""
        return self.handle.send(tensor, int(dest), int(tag), True, tensor)

    def recv_async_(self, tensor, source, tag=0):
        """Posts the receive now; returns a Request (wait() returns ``tensor``)."""
        return self.handle.recv(tensor, int(source), int(tag), True, tensor)

    def recv_any_(self, tensor, tag=0):
        """Receives the oldest message with ``tag`` that any rank sent here
        (and no receive from its sender has taken) into ``tensor``; returns
        ``(tensor, sender)``. A list takes that many messages, all from the
        rank whose first message matched. Waits like ``recv_``."""
        return self.handle.recv_any(tensor, int(tag), False, tensor)

    def recv_any_async_(self, tensor, tag=0):
        """A receive from any source that returns at once: the Request's
        ``source`` is the sender once it is done (-1 before). The message is
        matched when the Request is first tested or waited on."""
        return self.handle.recv_any(tensor, int(tag), True, tensor)

    def probe(self, source=None, tag=0):
        """The rank whose message with ``tag`` is waiting to be received here
        (from ``source``; None: any rank), or None. Never waits and receives
        nothing, so a caller can poll it against a deadline of its own."""
        found = self.handle.p2p_probe(-1 if source is None else int(source), int(tag))
        return None if found < 0 else found
