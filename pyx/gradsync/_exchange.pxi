# All-to-all, gather, scatter, reduce, the explicit-output forms of allgather
# and reduce_scatter, and point-to-point messages (included by _core.pyx after
# Comm). Module functions taking the Comm: they convert and check arguments
# and call C with the GIL released; gradsync.communicator composes them.
# Counts arrive in elements, rank-major (counts[r * n + i]), as C takes them.
# A collective whose arguments fail to convert on one rank meets the others'
# check (Comm.abandon), so they fail too instead of waiting; a point-to-point
# call has nobody to meet.

cdef int comm_size(Comm c) except -1:
    cdef int size = 0
    CHKERR(gs_comm_size(c.live(), &size))
    return size


cdef int comm_rank(Comm c) except -1:
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


cdef object converted(Comm c, object counts, Py_ssize_t want, str name):
    """as_counts inside a collective: a failure meets the other ranks' check."""
    try:
        return as_counts(counts, want, name)
    except BaseException as exc:
        c.abandon(exc)
        raise


cdef TensorList optional_tensors(Comm c, object objs, str name, bint indexed, bint writable):
    return None if objs is None else c.tensors(objs, name, indexed, writable)


cdef Request pending(TensorList a, TensorList b, object result):
    cdef Request r = new_request(a, result)
    r.keep_also = b
    return r


def alltoall_counts(Comm c, list inputs, object row_elems, object send_counts, bint indexed):
    """Every rank's send counts for this rank: recv[s * n + i]."""
    cdef gs_comm_t h = c.live()
    cdef TensorList tin = c.tensors(inputs, "tensors", indexed, False)
    cdef Py_ssize_t n = tin.n, size = comm_size(c)
    cdef int64_t[::1] send = converted(c, send_counts, n * size, "send_counts")
    cdef int64_t[::1] rows
    cdef const int64_t *prows = NULL
    if row_elems is not None:
        rows = converted(c, row_elems, n, "row_elems")
        prows = &rows[0]
    recv = np.zeros(max(n * size, 1), dtype=np.int64)
    cdef int64_t[::1] rv = recv
    with nogil:
        CHKERR(gs_alltoall_counts(h, tin.t, n, prows, &send[0], &rv[0]))
    return recv[:n * size]


def alltoallv(Comm c, list inputs, list outputs, object send_counts, object recv_counts,
              bint indexed, bint run_async, object result=None):
    cdef gs_comm_t h = c.live()
    cdef TensorList tin = c.tensors(inputs, "tensors", indexed, False)
    cdef TensorList tout = c.tensors(outputs, "out", indexed, True)
    cdef Py_ssize_t size = comm_size(c)
    cdef int64_t[::1] s = converted(c, send_counts, tin.n * size, "send_counts")
    cdef int64_t[::1] r = converted(c, recv_counts, tin.n * size, "recv_counts")
    cdef Request req
    if run_async:
        req = pending(tin, tout, result)
        CHKERR(gs_alltoallv_async(h, tin.t, tout.t, tin.n, &s[0], &r[0], &req.req))
        return req
    with nogil:
        CHKERR(gs_alltoallv(h, tin.t, tout.t, tin.n, &s[0], &r[0]))
    return result


def gatherv(Comm c, list inputs, object outputs, object counts, int root, bint indexed,
            bint run_async, object result=None):
    """outputs: the root's arrays (None elsewhere)."""
    cdef gs_comm_t h = c.live()
    cdef TensorList tin = c.tensors(inputs, "tensors", indexed, False)
    cdef TensorList tout = optional_tensors(c, outputs, "out", indexed, True)
    cdef int64_t[::1] k = converted(c, counts, tin.n * comm_size(c), "counts")
    cdef const gs_tensor_t *po = tout.t if tout is not None else NULL
    cdef Request req
    if run_async:
        req = pending(tin, tout, result)
        CHKERR(gs_gatherv_async(h, tin.t, po, tin.n, &k[0], root, &req.req))
        return req
    with nogil:
        CHKERR(gs_gatherv(h, tin.t, po, tin.n, &k[0], root))
    return result


def scatterv(Comm c, object inputs, list outputs, object counts, int root, bint indexed,
             bint run_async, object result=None):
    """inputs: the root's arrays (None elsewhere)."""
    cdef gs_comm_t h = c.live()
    cdef TensorList tin = optional_tensors(c, inputs, "tensors", indexed, False)
    cdef TensorList tout = c.tensors(outputs, "out", indexed, True)
    cdef int64_t[::1] k = converted(c, counts, tout.n * comm_size(c), "counts")
    cdef const gs_tensor_t *pi = tin.t if tin is not None else NULL
    cdef Request req
    if run_async:
        req = pending(tout, tin, result)
        CHKERR(gs_scatterv_async(h, pi, tout.t, tout.n, &k[0], root, &req.req))
        return req
    with nogil:
        CHKERR(gs_scatterv(h, pi, tout.t, tout.n, &k[0], root))
    return result


def reduce(Comm c, list inputs, object outputs, op, double prescale, double postscale,
           int root, bint indexed, bint run_async, object result=None):
    """outputs None: in place at the root (its inputs are written)."""
    cdef gs_comm_t h = c.live()
    cdef gs_op_t cop
    try:
        cop = parse_op(op)
    except BaseException as exc:
        c.abandon(exc)
        raise
    cdef bint writes_inputs = outputs is None and comm_rank(c) == root
    cdef TensorList tin = c.tensors(inputs, "tensors", indexed, writes_inputs)
    cdef TensorList tout = optional_tensors(c, outputs, "out", indexed, True)
    cdef const gs_tensor_t *po = tout.t if tout is not None else NULL
    cdef Request req
    if run_async:
        req = pending(tin, tout, result)
        CHKERR(gs_reduce_async(h, tin.t, po, tin.n, cop, prescale, postscale, root, &req.req))
        return req
    with nogil:
        CHKERR(gs_reduce(h, tin.t, po, tin.n, cop, prescale, postscale, root))
    return result


def allgatherv(Comm c, list inputs, list outputs, object counts, bint indexed, bint run_async,
               object result=None):
    """Allgather into given outputs; counts[r * n + i]: rank r's elements of tensor i."""
    cdef gs_comm_t h = c.live()
    cdef TensorList tin = c.tensors(inputs, "tensors", indexed, False)
    cdef TensorList tout = c.tensors(outputs, "out", indexed, True)
    cdef int64_t[::1] k = converted(c, counts, tin.n * comm_size(c), "counts")
    cdef Request req
    if run_async:
        req = pending(tin, tout, result)
        CHKERR(gs_allgatherv_async(h, tin.t, tout.t, tin.n, &k[0], &req.req))
        return req
    with nogil:
        CHKERR(gs_allgatherv(h, tin.t, tout.t, tin.n, &k[0]))
    return result


def reduce_scatter_into(Comm c, list inputs, list outputs, object rows, op, double prescale,
                        double postscale, bint indexed, bint run_async, object result=None):
    """Reduce_scatter into given outputs; rows[i]: dim 0 of inputs[i]."""
    cdef gs_comm_t h = c.live()
    cdef gs_op_t cop
    try:
        cop = parse_op(op)
    except BaseException as exc:
        c.abandon(exc)
        raise
    cdef TensorList tin = c.tensors(inputs, "tensors", indexed, False)
    cdef TensorList tout = c.tensors(outputs, "out", indexed, True)
    cdef int64_t[::1] k = converted(c, rows, tin.n, "rows")
    cdef Request req
    if run_async:
        req = pending(tin, tout, result)
        CHKERR(gs_reduce_scatter_async(h, tin.t, tout.t, tin.n, &k[0], cop, prescale,
                                       postscale, &req.req))
        return req
    with nogil:
        CHKERR(gs_reduce_scatter(h, tin.t, tout.t, tin.n, &k[0], cop, prescale, postscale))
    return result


def p2p_max_tag(Comm c):
    cdef int tag = 0
    CHKERR(gs_p2p_max_tag(c.live(), &tag))
    return tag


def send(Comm c, list tensors, int dest, int tag, bint indexed, bint run_async,
         object result=None):
    cdef gs_comm_t h = c.live()
    cdef TensorList tl = TensorList()
    tl.load(tensors, "tensors" if indexed else "tensor", indexed, False)
    cdef Request req
    if run_async:
        req = new_request(tl, result)
        CHKERR(gs_isend(h, tl.t, tl.n, dest, tag, &req.req))
        return req
    with nogil:
        CHKERR(gs_send(h, tl.t, tl.n, dest, tag))
    return result


def recv(Comm c, list tensors, int source, int tag, bint indexed, bint run_async,
         object result=None):
    cdef gs_comm_t h = c.live()
    cdef TensorList tl = TensorList()
    tl.load(tensors, "tensors" if indexed else "tensor", indexed, True)
    cdef Request req
    if run_async:
        req = new_request(tl, result)
        CHKERR(gs_irecv(h, tl.t, tl.n, source, tag, &req.req))
        return req
    with nogil:
        CHKERR(gs_recv(h, tl.t, tl.n, source, tag))
    return result


def abandon(Comm c, exc):
    """This rank cannot make the collective the others are making: meet their
    check so they fail with MismatchError naming `exc` instead of waiting."""
    c.abandon(exc)


def describe(list objs, str name, bint indexed):
    """(shape, numpy dtype) of each array as gradsync reads it (checks the
    dtype and layout; borrows, never copies)."""
    cdef TensorList tl = TensorList()
    tl.load(objs, name, indexed, False)
    return [(tuple(a.shape), a.dtype) for a in tl.arrays]


def empty_like(obj, tuple shape):
    """A new array of obj's dtype in obj's kind of memory (host: numpy.ndarray,
    CUDA: a DeviceArray on obj's device)."""
    cdef TensorList tl = TensorList()
    tl.load([obj], "tensor", False, False)
    return new_array(tl.arrays[0], shape)
