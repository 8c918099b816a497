/* Where a call's data lives. Host memory: the MPI transport and the host
 * kernels. CUDA memory: the communicator's device path (NCCL when every rank
 * can use it, CUDA-aware MPI, else MPI staged through pinned host memory),
 * the CUDA kernels on the communicator's own non-blocking stream (created
 * with its device path; one per communicator, since NCCL kernels block until
 * every rank joins and communicators sharing a stream deadlock when ranks
 * issue in different orders), ordered after the caller's work stream (and
 * the device's entry stream, gs_cuda_order_after) by an event, and one wait
 * at the end of the call that polls like every other wait (timeouts,
 * interrupts, the runtime lock released). An asynchronous call on the
 * background thread does not wait: it hands the event to its request
 * (gs_defer_device).
 *
 * The path is chosen once per communicator, collectively, at its first call
 * on CUDA memory: NCCL needs a usable library on every rank and one GPU per
 * rank (NCCL refuses two ranks on one device), so the ranks compare their
 * GPUs' UUIDs and agree by a MIN allreduce. GRADSYNC_NCCL=0 forces MPI. */
#include <stdlib.h>
#include <string.h>

#include "engine/gs_engine.h"

#ifdef GS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

_Thread_local gs_device_done_t *gs_defer_device;

gs_status_t gs_check_memory(gs_comm_t c, const char *fn, const gs_tensor_t *a, int64_t na,
                            const gs_tensor_t *b, int64_t nb) {
  if (na == 0 && nb == 0) return GS_SUCCESS;
  const gs_tensor_t *first = na ? &a[0] : &b[0];
  int cuda = first->device.kind == GS_DEVICE_CUDA;
  if (na && nb && (b[0].device.kind == GS_DEVICE_CUDA) != cuda)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: in is in %s memory but out is in %s memory", fn,
                   cuda ? "CUDA" : "host", cuda ? "host" : "CUDA");
  if (na && nb && cuda && b[0].device.id != a[0].device.id)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: in is on CUDA device %d but out on %d", fn,
                   (int)a[0].device.id, (int)b[0].device.id);
  if (cuda && (c->dev_path != GS_PATH_NONE || c->dev_stream) && first->device.id != c->dev_id)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: this communicator serves CUDA device %d (its "
                   "first device call), but the tensors are on device %d; use one "
                   "communicator per device",
                   fn, c->dev_id, (int)first->device.id);
  return GS_SUCCESS;
}

static const gs_transport_t *path_transport(gs_comm_t c) {
  return c->dev_path == GS_PATH_NCCL         ? &gs_nccl_transport
         : c->dev_path == GS_PATH_CUDA_AWARE ? &gs_cuda_aware_transport
                                             : &gs_staged_transport;
}

#ifdef GS_HAVE_CUDA
/* The agreements below are non-blocking MPI calls waited for by the one
 * wait loop (a rank that never comes ends in the timeout, not a hang). A
 * wait that gives up cannot take back a posted collective: MPI may still
 * complete it into its buffers, so they are on the heap and kept then. */

/* Whether every rank has a GPU of its own (collective over c->mpi). */
static gs_status_t distinct_gpus(gs_comm_t c, int device, int *yes) {
  unsigned char *uuids = calloc((size_t)c->size + 1, 16), *mine = uuids + 16 * (size_t)c->size;
  if (!uuids) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory");
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) memcpy(mine, prop.uuid.bytes, 16);
  else cudaGetLastError();
  MPI_Request req;
  gs_status_t s =
      gs_mpi_finish(MPI_Iallgather(mine, 16, MPI_BYTE, uuids, 16, MPI_BYTE, c->mpi, &req), &req,
                    "gradsync: comparing GPUs (MPI_Iallgather)");
  if (s != GS_SUCCESS) return s; /* uuids kept (above) */
  *yes = 1;
  for (int i = 0; i < c->size && *yes; i++)
    for (int j = i + 1; j < c->size && *yes; j++)
      if (memcmp(uuids + 16 * (size_t)i, uuids + 16 * (size_t)j, 16) == 0) *yes = 0;
  free(uuids);
  return GS_SUCCESS;
}

/* The minimum of `*v` over the ranks. */
static gs_status_t agree_min(gs_comm_t c, int *v, const char *what) {
  int *all = malloc(sizeof *all);
  if (!all) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory");
  *all = *v;
  MPI_Request req;
  gs_status_t s = gs_mpi_finish(
      MPI_Iallreduce(MPI_IN_PLACE, all, 1, MPI_INT, MPI_MIN, c->mpi, &req), &req, what);
  if (s != GS_SUCCESS) return s; /* `all` kept (above) */
  *v = *all;
  free(all);
  return GS_SUCCESS;
}

/* Collective over c->mpi: every rank reaches it in the same call. */
static gs_status_t choose_path(gs_comm_t c, int device) {
  int want = 0;
  GS_CHECK(distinct_gpus(c, device, &want));
  /* ranks sharing a GPU: NCCL refuses them unless its multi-rank mode is on
   * (2.30+); an older NCCL then fails its init and every rank takes MPI */
  want = (want || gs_env_nccl_multi_rank_gpu()) && !gs_env_nccl_off() && gs_nccl_loadable();
  GS_CHECK(agree_min(c, &want, "gradsync: choosing the device path"));
  c->dev_id = device;
  if (want) {
    gs_status_t init = gs_nccl_transport.init(c);
    /* an interrupt, or a bootstrap wait that gave up: c is unusable */
    if (init != GS_SUCCESS && c->fate.broken) return init;
    int ok = init == GS_SUCCESS;
    if (!ok) gs_log(GS_LOG_WARNING, "NCCL initialization failed (%s); using MPI", gs_last_error());
    GS_CHECK(agree_min(c, &ok, "gradsync: NCCL initialization"));
    /* some rank failed: all fall back (abort: the ranks are not all there
     * for a finalize) */
    if (!ok && gs_nccl_transport.abort) gs_nccl_transport.abort(c, GS_ERR_NCCL);
    want = ok;
  }
  int aware = gs_mpi_cuda_aware();
  if (!want) { /* every rank must take the same path */
    GS_CHECK(agree_min(c, &aware, "gradsync: asking the ranks whether MPI is CUDA-aware"));
  }
  c->dev_path = want ? GS_PATH_NCCL : aware ? GS_PATH_CUDA_AWARE : GS_PATH_STAGED;
  gs_log(GS_LOG_INFO, "CUDA device %d: collectives go through %s", device,
         want    ? "NCCL"
         : aware ? "CUDA-aware MPI (reductions MPI cannot do itself are staged)"
                 : "MPI staged through pinned host memory (NCCL unavailable, disabled by "
                   "GRADSYNC_NCCL=0, or ranks share a GPU)");
  return GS_SUCCESS;
}

/* The communicator's stream runs this call's work after what it depends
 * on: on the background thread, the work its request was submitted behind;
 * otherwise everything queued so far on the caller's work stream; and what
 * was ordered into the device's entry stream. */
static gs_status_t order_after_caller(gs_engine_t *e) {
  GS_CHECK(gs_cu_follow_entry(e->device, e->stream));
  if (gs_runtime_in_worker()) {
    if (!gs_defer_device || !gs_defer_device->ready) return GS_SUCCESS;
    return gs_cu_stream_wait_event(e->stream, gs_defer_device->ready,
                                   "gradsync: ordering after the caller");
  }
  return gs_cu_order(e->stream, gs_cu_work_stream(), "gradsync: ordering after the caller");
}

static gs_status_t open_device(gs_comm_t c, int device, gs_engine_t *e) {
  GS_CHECK(gs_cu_enter(device, &e->scope));
  e->device = device;
  gs_status_t s = GS_SUCCESS;
  if (!c->dev_stream) { /* the communicator's own, on the device it serves from now on */
    s = gs_cu_stream_create(&c->dev_stream, "gradsync: creating the communicator's CUDA stream");
    if (s == GS_SUCCESS) c->dev_id = device;
  }
  e->stream = c->dev_stream;
  if (s == GS_SUCCESS && c->dev_path == GS_PATH_NONE) s = choose_path(c, device);
  if (s == GS_SUCCESS) s = order_after_caller(e);
  if (s != GS_SUCCESS) {
    gs_cu_leave(&e->scope);
    e->device = -1;
    return s;
  }
  e->transport = path_transport(c);
  return GS_SUCCESS;
}
#endif

gs_status_t gs_engine_open(gs_comm_t c, const gs_tensor_t *t, int64_t n, gs_engine_t *e) {
  memset(e, 0, sizeof *e);
  e->comm = c;
  e->call = "collective";
  e->device = -1;
  e->transport = &gs_mpi_transport;
  if (n == 0 || t[0].device.kind != GS_DEVICE_CUDA) return GS_SUCCESS;
#ifdef GS_HAVE_CUDA
  return open_device(c, t[0].device.id, e);
#else
  return gs_fail(GS_ERR_UNSUPPORTED, "gradsync was built without CUDA");
#endif
}

/* ---- waiting for a device path's work ------------------------------------------ */

typedef struct device_wait {
  gs_comm_t comm;
  const gs_transport_t *transport;
  void *event;
  const char *what;
} device_wait_t;

static int device_poll(void *ctx, gs_status_t *err) {
  device_wait_t *w = ctx;
  return w->transport->poll(w->comm, w->event, w->what, err);
}

static void device_abort(void *ctx, gs_status_t why) {
  device_wait_t *w = ctx;
  if (w->transport->abort) w->transport->abort(w->comm, why);
}

static const char *device_detail(void *ctx) {
  device_wait_t *w = ctx;
  return w->transport->detail ? w->transport->detail(w->comm) : NULL;
}

gs_status_t gs_device_wait(gs_comm_t c, const gs_transport_t *tr, void *event, const char *what) {
  device_wait_t ctx = {c, tr, event, what};
  gs_wait_t w = {device_poll, device_abort, NULL, device_detail, &ctx, what};
  gs_fate_t *saved = gs_runtime_bind(&c->fate); /* a wait that gives up marks c */
  gs_status_t s = gs_progress_wait(&w);
  gs_runtime_bind(saved);
  return s;
}

gs_status_t gs_engine_close(gs_engine_t *e, gs_status_t s) {
  if (e->device < 0) return s;
  gs_comm_t c = e->comm;
  void *ev = NULL;
  gs_status_t w = gs_cu_record(e->stream, &ev, "gradsync: after the call's device work");
  if (w == GS_SUCCESS && s == GS_SUCCESS && gs_defer_device && gs_runtime_in_worker()) {
    /* the request waits (or has the caller's stream wait) for it */
    gs_defer_device->event = ev;
    gs_defer_device->stream = e->stream;
    gs_defer_device->comm = c;
    gs_defer_device->transport = e->transport;
    gs_defer_device->device = e->device;
    ev = NULL;
  } else if (w == GS_SUCCESS && (s == GS_SUCCESS || !c->fate.broken)) {
    /* after a failure too: the call's tensors may still be in use */
    w = gs_device_wait(c, e->transport, ev, e->call);
  }
  gs_cu_event_free(ev);
  gs_cu_leave(&e->scope);
  e->device = -1;
  return s != GS_SUCCESS ? s : w;
}

/* ---- copies in the engine's memory ------------------------------------ */

gs_status_t gs_scale_copy(const gs_engine_t *e, gs_dtype_t dtype, const void *src, void *dst,
                          int64_t count, double scale) {
  if (e->device < 0) {
    gs_cpu_scale_copy(dtype, src, dst, count, scale);
    return GS_SUCCESS;
  }
  if (count <= 0 || (scale == 1.0 && src == dst)) return GS_SUCCESS;
  gs_cu_run_t run = {dst, src, count, (int32_t)dtype, (int32_t)dtype};
  return gs_cu_elementwise(GS_CU_COPY_SCALE, &run, 1, scale, e->stream);
}

gs_status_t gs_copy_batch(const gs_engine_t *e, gs_dtype_t dtype, const gs_copy_t *copies,
                          int64_t n, double scale) {
  if (e->device < 0) {
    for (int64_t k = 0; k < n; k++)
      gs_cpu_scale_copy(dtype, copies[k].src, copies[k].dst, copies[k].count, scale);
    return GS_SUCCESS;
  }
  if (n == 0) return GS_SUCCESS;
  gs_cu_run_t *runs = malloc((size_t)n * sizeof *runs);
  if (!runs) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory for a copy batch");
  for (int64_t k = 0; k < n; k++)
    runs[k] = (gs_cu_run_t){copies[k].dst, copies[k].src, copies[k].count, (int32_t)dtype,
                            (int32_t)dtype};
  gs_status_t s = gs_cu_elementwise(GS_CU_COPY_SCALE, runs, n, scale, e->stream);
  free(runs);
  return s;
}

gs_status_t gs_zero_bytes(const gs_engine_t *e, void *dst, size_t bytes) {
  if (!bytes) return GS_SUCCESS;
  if (e->device < 0) {
    memset(dst, 0, bytes);
    return GS_SUCCESS;
  }
  gs_cu_run_t run = {dst, NULL, (int64_t)bytes, GS_UINT8, GS_UINT8};
  return gs_cu_elementwise(GS_CU_ZERO, &run, 1, 1.0, e->stream);
}

/* Waits for the last work queued on the communicator's stream, through its
 * transport (a wait that gives up aborts NCCL and marks c unusable). */
static gs_status_t last_work_done(gs_comm_t c) {
  const char *what = "gs_comm_free (the communicator's last GPU work)";
  if (c->dev_path == GS_PATH_NONE) return gs_cu_stream_wait(c->dev_stream, what);
  void *ev = NULL;
  GS_CHECK(gs_cu_record(c->dev_stream, &ev, what));
  gs_status_t s = gs_device_wait(c, path_transport(c), ev, what);
  gs_cu_event_free(ev);
  return s;
}

gs_status_t gs_device_path_free(gs_comm_t c) {
  if (c->dev_path == GS_PATH_NONE && !c->dev_stream) return GS_SUCCESS;
  gs_cu_scope_t scope;
  gs_status_t s = gs_cu_enter(c->dev_id, &scope);
  if (s != GS_SUCCESS) { /* nothing of its device can be freed: kept */
    if (!c->fate.broken) c->fate.broken = s;
    return s;
  }
  s = last_work_done(c);
  if (s != GS_SUCCESS) {
    /* the device may still run (or DMA into) what was queued: NCCL was
     * aborted, not destroyed, and the stream and buffers are kept */
    if (!c->fate.broken) c->fate.broken = s;
    gs_cu_leave(&scope);
    return s;
  }
  s = gs_nccl_transport.free(c); /* finalized and destroyed, or aborted */
  /* the buffers' last users, on the stream, have finished */
  gs_cu_free_async(c->dev_fusion, c->dev_stream);
  gs_cu_free_async(c->dev_tmp, c->dev_stream);
  gs_cu_free_async(c->dev_keys, c->dev_stream);
  gs_cu_release(c->pinned);
  gs_cu_stream_destroy(c->dev_stream);
  gs_cu_leave(&scope);
  c->dev_fusion = c->dev_tmp = c->dev_keys = c->pinned = c->dev_stream = NULL;
  c->dev_fusion_bytes = c->dev_tmp_bytes = c->dev_keys_bytes = c->pinned_bytes = 0;
  c->dev_path = GS_PATH_NONE;
  return s;
}
