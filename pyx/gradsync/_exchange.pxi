# All-to-all, gather, scatter, reduce, the explicit-output forms of allgather
# and reduce_scatter, and point-to-point messages: the methods of Comm's base
# _CommExchange (included by _core.pyx between _CommHandle and Comm). They
# convert and check arguments and call C with the GIL released;
# gradsync.communicator and gradsync.exchange compose them.
# Counts arrive in elements, rank-major (counts[r * n + i]), as C takes them.
# Array arguments are one array or a list/tuple (arguments()). A collective
# whose arguments fail to convert on one rank meets the others' check
# (Comm.converting), so they fail too instead of waiting; a point-to-point
# call has nobody to meet.

cdef int comm_size(_CommHandle c) except -1:
    cdef int size = 0
    CHKERR(gs_comm_size(c.live(), &size))
    return size


cdef int comm_rank(_CommHandle c) except -1:
    cdef int rank = 0
    CHKERR(gs_comm_rank(c.live(), &rank))
    return rank


cdef object as_counts(object counts, Py_ssize_t want, str name):
    """counts as a contiguous int64 array of `want` entries (at least one
    entry allocated, so its address can be taken)."""
    a = np.ascontiguousarray(counts, dtype=np.int64).reshape(-1)
    if a.shape[0] != want:
        raise ArgumentError(f"{name} must hold {want} counts, got {a.shape[0]}",
                            GS_ERR_INVALID_ARGUMENT)
    return a if want else np.zeros(1, dtype=np.int64)


cdef TensorList optional_arguments(object objs, str name, bint writable,
                                   TensorList after=None):
    return None if objs is None else arguments(objs, name, writable, None, None, after)


cdef Request pending(_CommHandle c, TensorList a, TensorList b, object result):
    cdef Request r = new_request(a, result)
    r.keep_also = b
    r.comm = c  # a request outliving its communicator's object would wait on freed state
    return r


cdef class _CommExchange(_CommHandle):
    """Comm's all-to-all, gather, scatter, reduce, explicit-output allgather
    and reduce_scatter, and point-to-point methods (Comm derives from this
    class: one binding class, its methods in two files)."""

    def alltoall_counts(self, inputs, object row_elems, object send_counts):
        """Every rank's send counts for this rank: recv[s * n + i]."""
        cdef gs_comm_t h = self.live()
        cdef TensorList tin
        cdef Py_ssize_t n = 0, size = comm_size(self)
        cdef int64_t[::1] send, rows, rv
        cdef const int64_t *prows = NULL
        with self.converting:
            tin = arguments(inputs, "tensors", False)
            n = tin.n
            send = as_counts(send_counts, n * size, "send_counts")
            if row_elems is not None:
                rows = as_counts(row_elems, n, "row_elems")
                prows = &rows[0]
        recv = np.zeros(max(n * size, 1), dtype=np.int64)
        rv = recv
        with nogil:
            CHKERR(gs_alltoall_counts(h, tin.t, n, prows, &send[0], &rv[0]))
        return recv[:n * size]

    def alltoallv(self, inputs, outputs, object send_counts, object recv_counts, bint run_async,
                  object result=None):
        cdef gs_comm_t h = self.live()
        cdef TensorList tin, tout
        cdef Py_ssize_t size = comm_size(self)
        cdef int64_t[::1] s, r
        cdef Request req
        with self.converting:
            tin = arguments(inputs, "tensors", False)
            tout = arguments(outputs, "out", True, None, None, tin)
            s = as_counts(send_counts, tin.n * size, "send_counts")
            r = as_counts(recv_counts, tin.n * size, "recv_counts")
        if run_async:
            req = pending(self, tin, tout, result)
            CHKERR(gs_alltoallv_async(h, tin.t, tout.t, tin.n, &s[0], &r[0], &req.req))
            return req
        with nogil:
            CHKERR(gs_alltoallv(h, tin.t, tout.t, tin.n, &s[0], &r[0]))
        return result

    def gatherv(self, inputs, object outputs, object counts, int root, bint run_async,
                object result=None):
        """outputs: the root's arrays (None elsewhere)."""
        cdef gs_comm_t h = self.live()
        cdef TensorList tin, tout
        cdef int64_t[::1] k
        cdef Request req
        with self.converting:
            tin = arguments(inputs, "tensors", False)
            tout = optional_arguments(outputs, "out", True, tin)
            k = as_counts(counts, tin.n * comm_size(self), "counts")
        cdef const gs_tensor_t *po = tout.t if tout is not None else NULL
        if run_async:
            req = pending(self, tin, tout, result)
            CHKERR(gs_gatherv_async(h, tin.t, po, tin.n, &k[0], root, &req.req))
            return req
        with nogil:
            CHKERR(gs_gatherv(h, tin.t, po, tin.n, &k[0], root))
        return result

    def scatterv(self, object inputs, outputs, object counts, int root, bint run_async,
                 object result=None):
        """inputs: the root's arrays (None elsewhere)."""
        cdef gs_comm_t h = self.live()
        cdef TensorList tin, tout
        cdef int64_t[::1] k
        cdef Request req
        with self.converting:
            tin = optional_arguments(inputs, "tensors", False)
            tout = arguments(outputs, "out", True, None, None, tin)
            k = as_counts(counts, tout.n * comm_size(self), "counts")
        cdef const gs_tensor_t *pi = tin.t if tin is not None else NULL
        if run_async:
            req = pending(self, tout, tin, result)
            CHKERR(gs_scatterv_async(h, pi, tout.t, tout.n, &k[0], root, &req.req))
            return req
        with nogil:
            CHKERR(gs_scatterv(h, pi, tout.t, tout.n, &k[0], root))
        return result

    def reduce(self, inputs, object outputs, op, double prescale, double postscale, int root,
               bint run_async, object result=None):
        """outputs None: in place at the root (its inputs are written)."""
        cdef gs_comm_t h = self.live()
        cdef gs_op_t cop
        cdef TensorList tin, tout
        cdef Request req
        with self.converting:
            cop = parse_op(op)
            tin = arguments(inputs, "tensors", outputs is None and comm_rank(self) == root)
            tout = optional_arguments(outputs, "out", True, tin)
        cdef const gs_tensor_t *po = tout.t if tout is not None else NULL
        if run_async:
            req = pending(self, tin, tout, result)
            CHKERR(gs_reduce_async(h, tin.t, po, tin.n, cop, prescale, postscale, root, &req.req))
            return req
        with nogil:
            CHKERR(gs_reduce(h, tin.t, po, tin.n, cop, prescale, postscale, root))
        return result

    def allgatherv(self, inputs, outputs, object counts, bint run_async, object result=None):
        """Allgather into given outputs; counts[r * n + i]: rank r's elements of tensor i."""
        cdef gs_comm_t h = self.live()
        cdef TensorList tin, tout
        cdef int64_t[::1] k
        cdef Request req
        with self.converting:
            tin = arguments(inputs, "tensors", False)
            tout = arguments(outputs, "out", True, None, None, tin)
            k = as_counts(counts, tin.n * comm_size(self), "counts")
        if run_async:
            req = pending(self, tin, tout, result)
            CHKERR(gs_allgatherv_async(h, tin.t, tout.t, tin.n, &k[0], &req.req))
            return req
        with nogil:
            CHKERR(gs_allgatherv(h, tin.t, tout.t, tin.n, &k[0]))
        return result

    def reduce_scatter_into(self, inputs, outputs, object rows, op, double prescale,
                            double postscale, bint run_async, object result=None):
        """Reduce_scatter into given outputs; rows[i]: dim 0 of inputs[i]."""
        cdef gs_comm_t h = self.live()
        cdef gs_op_t cop
        cdef TensorList tin, tout
        cdef int64_t[::1] k
        cdef Request req
        with self.converting:
            cop = parse_op(op)
            tin = arguments(inputs, "tensors", False)
            tout = arguments(outputs, "out", True, None, None, tin)
            k = as_counts(rows, tin.n, "rows")
        if run_async:
            req = pending(self, tin, tout, result)
            CHKERR(gs_reduce_scatter_async(h, tin.t, tout.t, tin.n, &k[0], cop, prescale,
                                           postscale, &req.req))
            return req
        with nogil:
            CHKERR(gs_reduce_scatter(h, tin.t, tout.t, tin.n, &k[0], cop, prescale, postscale))
        return result

    def p2p_max_tag(self):
        cdef int tag = 0
        CHKERR(gs_p2p_max_tag(self.live(), &tag))
        return tag

    def send(self, tensors, int dest, int tag, bint run_async,
             object result=None):
        cdef gs_comm_t h = self.live()
        cdef TensorList tl = arguments(tensors, "tensors", False)
        cdef Request req
        if run_async:
            req = new_request(tl, result)
            req.comm = self
            CHKERR(gs_isend(h, tl.t, tl.n, dest, tag, &req.req))
            return req
        with nogil:
            CHKERR(gs_send(h, tl.t, tl.n, dest, tag))
        return result

    def recv(self, tensors, int source, int tag, bint run_async,
             object result=None):
        cdef gs_comm_t h = self.live()
        cdef TensorList tl = arguments(tensors, "tensors", True)
        cdef Request req
        if run_async:
            req = new_request(tl, result)
            req.comm = self
            CHKERR(gs_irecv(h, tl.t, tl.n, source, tag, &req.req))
            return req
        with nogil:
            CHKERR(gs_recv(h, tl.t, tl.n, source, tag))
        return result

    def recv_any(self, tensors, int tag, bint run_async, object result=None):
        """A receive from any source: (result, sender) now, or a Request whose
        ``source`` is the sender once done."""
        cdef gs_comm_t h = self.live()
        cdef TensorList tl = arguments(tensors, "tensors", True)
        cdef Request req
        cdef int source = -1
        if run_async:
            req = new_request(tl, result)
            req.comm = self
            CHKERR(gs_irecv_any(h, tl.t, tl.n, tag, &req.source, &req.req))
            return req
        with nogil:
            CHKERR(gs_recv_any(h, tl.t, tl.n, tag, &source))
        return result, source

    def p2p_probe(self, int source, int tag):
        """The sender of a message with ``tag`` waiting here (source -1: from
        any rank), or -1."""
        cdef int found = -1
        cdef gs_comm_t h = self.live()
        with nogil:
            CHKERR(gs_p2p_probe(h, source, tag, &found))
        return found

    def give_up(self, exc):
        """This rank cannot make the collective the others are making: meet their
        check so they fail with MismatchError naming `exc` instead of waiting."""
        self.abandon(exc)


def views(tensors):
    """Each array as gradsync reads it, read once: a numpy.ndarray for host
    memory or a view of its memory (shape, dtype, ndim, size; it keeps the
    memory alive) that every gradsync call takes without reading the producer
    again. Checks dtype and layout; borrows, never copies."""
    return list(arguments(tensors, "tensors", False).arrays)


def describe(tensors):
    """(shape, numpy dtype) of each array as gradsync reads it (views())."""
    return [(tuple(a.shape), a.dtype) for a in views(tensors)]


def empty_like(obj, tuple shape):
    """A new array of obj's dtype in obj's kind of memory (host: numpy.ndarray,
    CUDA: a DeviceArray on obj's device)."""
    return new_array(arguments(obj, "tensors", False).arrays[0], shape)


def copy_(dst, src):
    """dst takes src's bytes (gs_memcpy; any memory to any memory, equal
    sizes); returns dst."""
    cdef TensorList tsrc = arguments(src, "src", False)
    cdef TensorList tdst = arguments(dst, "dst", True, None, None, tsrc)
    if tdst.t[0].count != tsrc.t[0].count or tdst.t[0].dtype != tsrc.t[0].dtype:
        raise ArgumentError(f"dst holds {tdst.t[0].count} x {tdst.arrays[0].dtype}, src "
                            f"{tsrc.t[0].count} x {tsrc.arrays[0].dtype}", GS_ERR_INVALID_ARGUMENT)
    copy_memory(tdst.arrays[0], tsrc, tdst.work_stream)
    return dst
