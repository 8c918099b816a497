/* Where a call's data lives. Host memory: the MPI transport and the host
 * kernels, exactly as before engines existed. CUDA memory: the communicator's
 * device path (NCCL when every rank can use it, else MPI staged through
 * pinned host memory), the CUDA kernels, and one wait at the end of the call.
 *
 * The path is chosen once per communicator, collectively, at its first call
 * on CUDA memory: NCCL needs the library on every rank and one GPU per rank
 * (NCCL refuses two ranks on one device), so the ranks compare their GPUs'
 * UUIDs and agree by a MIN allreduce. GRADSYNC_NCCL=0 forces staged MPI. */
#include <stdlib.h>
#include <string.h>

#include "gs_cuda.h"
#include "gs_internal.h"

#ifdef GS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

gs_status_t gs_check_memory(gs_comm_t c, const char *fn, const gs_tensor_t *a, int64_t na,
                            const gs_tensor_t *b, int64_t nb) {
  if (na == 0 && nb == 0) return GS_SUCCESS;
  const gs_tensor_t *first = na ? &a[0] : &b[0];
  int cuda = first->device.kind == GS_DEVICE_CUDA;
  if (na && nb && (b[0].device.kind == GS_DEVICE_CUDA) != cuda)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: in is in %s memory but out is in %s memory",
                   fn, cuda ? "CUDA" : "host", cuda ? "host" : "CUDA");
  if (na && nb && cuda && b[0].device.id != a[0].device.id)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: in is on CUDA device %d but out on %d", fn,
                   (int)a[0].device.id, (int)b[0].device.id);
  if (cuda && c->dev_path != GS_PATH_NONE && first->device.id != c->dev_id)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: this communicator serves CUDA device %d (its "
                   "first device call), but the tensors are on device %d; use one "
                   "communicator per device", fn, c->dev_id, (int)first->device.id);
  return GS_SUCCESS;
}

#ifdef GS_HAVE_CUDA
static int env_nccl_off(void) {
  const char *s = getenv("GRADSYNC_NCCL");
  return s && strcmp(s, "0") == 0;
}

/* Collective over c->mpi: every rank reaches it in the same call. */
static gs_status_t choose_path(gs_comm_t c, int device) {
  unsigned char *uuids = malloc(16 * (size_t)c->size);
  if (!uuids) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory");
  unsigned char mine[16] = {0};
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) memcpy(mine, prop.uuid.bytes, 16);
  else cudaGetLastError();
  int e = MPI_Allgather(mine, 16, MPI_BYTE, uuids, 16, MPI_BYTE, c->mpi);
  int want = !env_nccl_off() && gs_nccl_loadable();
  for (int i = 0; e == MPI_SUCCESS && i < c->size && want; i++)
    for (int j = i + 1; j < c->size && want; j++)
      if (memcmp(uuids + 16 * (size_t)i, uuids + 16 * (size_t)j, 16) == 0) want = 0;
  free(uuids);
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, "gradsync: comparing GPUs (MPI_Allgather)");
  GS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &want, 1, MPI_INT, MPI_MIN, c->mpi),
               "gradsync: choosing the device path");
  c->dev_id = device;
  if (want) {
    int ok = gs_nccl_comm_init(c) == GS_SUCCESS;
    GS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, c->mpi),
                 "gradsync: NCCL initialization");
    if (!ok) gs_nccl_comm_free(c); /* some rank failed: all fall back */
    want = ok;
  }
  int aware = gs_mpi_cuda_aware();
  if (!want) { /* every rank must take the same path */
    GS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &aware, 1, MPI_INT, MPI_MIN, c->mpi),
                 "gradsync: asking the ranks whether MPI is CUDA-aware");
  }
  c->dev_path = want ? GS_PATH_NCCL : aware ? GS_PATH_CUDA_AWARE : GS_PATH_STAGED;
  gs_log(GS_LOG_INFO, "CUDA device %d: collectives go through %s", device,
         want    ? "NCCL"
         : aware ? "CUDA-aware MPI (reductions MPI cannot do itself are staged)"
                 : "MPI staged through pinned host memory (NCCL unavailable, disabled by "
                   "GRADSYNC_NCCL=0, or ranks share a GPU)");
  return GS_SUCCESS;
}
#endif

gs_status_t gs_engine_open(gs_comm_t c, const gs_tensor_t *t, int64_t n, gs_engine_t *e) {
  e->comm = c;
  e->call = "collective";
  e->device = -1;
  e->previous = -1;
  e->stream = NULL;
  e->transport = &gs_mpi_transport;
  if (n == 0 || t[0].device.kind != GS_DEVICE_CUDA) return GS_SUCCESS;
#ifdef GS_HAVE_CUDA
  GS_CHECK(gs_cu_enter(t[0].device.id, &e->stream, &e->previous));
  e->device = t[0].device.id;
  gs_status_t s = GS_SUCCESS;
  if (c && c->dev_path == GS_PATH_NONE) s = choose_path(c, e->device);
  if (s != GS_SUCCESS) {
    gs_cu_leave(e->previous);
    e->device = -1;
    return s;
  }
  if (c) {
    c->dev_stream = e->stream;
    e->transport = c->dev_path == GS_PATH_NCCL         ? &gs_nccl_transport
                   : c->dev_path == GS_PATH_CUDA_AWARE ? &gs_cuda_aware_transport
                                                       : &gs_staged_transport;
  }
  return GS_SUCCESS;
#else
  return gs_fail(GS_ERR_UNSUPPORTED, "gradsync was built without CUDA");
#endif
}

gs_status_t gs_engine_close(gs_engine_t *e, gs_status_t s) {
  if (e->device < 0) return s;
  gs_status_t w = gs_cu_sync(e->stream, "gradsync: waiting for the call's device work");
  gs_cu_leave(e->previous);
  e->device = -1;
  return s != GS_SUCCESS ? s : w;
}

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

/* Pack and unpack on a device: every slot of the message in one launch. */
static gs_status_t device_copy_slots(const gs_engine_t *e, const gs_plan_t *plan,
                                     const gs_message_t *m, const gs_tensor_t *t, void *buf,
                                     double scale, int unpack) {
  size_t es = gs_dtype_size(m->dtype);
  gs_cu_run_t small[GS_PLAN_INLINE];
  gs_cu_run_t *runs = m->nslots <= GS_PLAN_INLINE ? small : malloc((size_t)m->nslots * sizeof *runs);
  if (!runs) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory packing a message");
  for (int64_t k = 0; k < m->nslots; k++) {
    const gs_slot_t *s = &plan->slots[m->first + k];
    char *slot = (char *)buf + (size_t)s->offset * es;
    void *tensor = t[s->tensor].data;
    runs[k] = (gs_cu_run_t){unpack ? tensor : slot, unpack ? slot : tensor, s->count,
                            (int32_t)m->dtype, (int32_t)m->dtype};
  }
  gs_status_t st = gs_cu_elementwise(GS_CU_COPY_SCALE, runs, m->nslots, scale, e->stream);
  if (runs != small) free(runs);
  return st;
}

gs_status_t gs_pack(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                    const gs_tensor_t *t, void *buf, double scale) {
  double t0 = GS_TL_START();
  size_t es = gs_dtype_size(m->dtype);
  gs_status_t s = GS_SUCCESS;
  if (e->device >= 0) {
    s = device_copy_slots(e, plan, m, t, buf, scale, 0);
  } else {
    for (int64_t k = m->first; k < m->first + m->nslots; k++) {
      const gs_slot_t *sl = &plan->slots[k];
      gs_cpu_scale_copy(m->dtype, t[sl->tensor].data, (char *)buf + (size_t)sl->offset * es,
                        sl->count, scale);
    }
  }
  GS_TL_END("pack", e->call, 1 + (m - plan->msgs), t0, m->count * (int64_t)es);
  return s;
}

gs_status_t gs_unpack(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                      const void *buf, const gs_tensor_t *t, double scale) {
  double t0 = GS_TL_START();
  size_t es = gs_dtype_size(m->dtype);
  gs_status_t s = GS_SUCCESS;
  if (e->device >= 0) {
    s = device_copy_slots(e, plan, m, t, (void *)buf, scale, 1);
  } else {
    for (int64_t k = m->first; k < m->first + m->nslots; k++) {
      const gs_slot_t *sl = &plan->slots[k];
      gs_cpu_scale_copy(m->dtype, (const char *)buf + (size_t)sl->offset * es,
                        t[sl->tensor].data, sl->count, scale);
    }
  }
  GS_TL_END("unpack", e->call, 1 + (m - plan->msgs), t0, m->count * (int64_t)es);
  return s;
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

gs_status_t gs_buffer_reserve(const gs_engine_t *e, size_t bytes, void **buf) {
  gs_comm_t c = e->comm;
  if (e->device < 0) return gs_fusion_reserve(c, bytes, buf);
  /* grow geometrically, as the host buffer does */
  size_t want = bytes > c->dev_fusion_bytes && bytes < 2 * c->dev_fusion_bytes
                    ? 2 * c->dev_fusion_bytes : bytes;
  GS_CHECK(gs_cu_reserve(&c->dev_fusion, &c->dev_fusion_bytes, want, 0));
  *buf = c->dev_fusion;
  return GS_SUCCESS;
}

gs_status_t gs_scratch_reserve(const gs_engine_t *e, size_t bytes, void **buf) {
  gs_comm_t c = e->comm;
  if (e->device < 0) {
    if (bytes > c->adasum_tmp_bytes) {
      void *p = NULL;
      if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return gs_fail(GS_ERR_NO_MEMORY, "gradsync: cannot allocate %zu bytes of scratch", bytes);
      free(c->adasum_tmp);
      c->adasum_tmp = p;
      c->adasum_tmp_bytes = bytes;
    }
    *buf = c->adasum_tmp;
    return GS_SUCCESS;
  }
  GS_CHECK(gs_cu_reserve(&c->dev_tmp, &c->dev_tmp_bytes, bytes, 0));
  *buf = c->dev_tmp;
  return GS_SUCCESS;
}

void gs_device_path_free(gs_comm_t c) {
  gs_nccl_comm_free(c);
  gs_cu_release(c->dev_fusion, 0);
  gs_cu_release(c->dev_tmp, 0);
  gs_cu_release(c->pinned, 1);
  c->dev_fusion = c->dev_tmp = c->pinned = NULL;
  c->dev_fusion_bytes = c->dev_tmp_bytes = c->pinned_bytes = 0;
  c->dev_path = GS_PATH_NONE;
}

/* ---- the kernels API on CUDA memory ---------------------------------------- */

/* Runs `mode` over pairs (a[i], b[i]) (b may be NULL) on a's device. */
static gs_status_t device_elementwise(gs_cu_mode_t mode, const gs_tensor_t *a,
                                      const gs_tensor_t *b, int64_t n, double scale) {
  if (n == 0) return GS_SUCCESS;
  gs_engine_t e;
  GS_CHECK(gs_engine_open(NULL, a, n, &e));
  gs_cu_run_t *runs = malloc((size_t)n * sizeof *runs);
  gs_status_t s = runs ? GS_SUCCESS : gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory");
  for (int64_t i = 0; s == GS_SUCCESS && i < n; i++)
    runs[i] = (gs_cu_run_t){a[i].data, b ? b[i].data : a[i].data, a[i].count,
                            (int32_t)a[i].dtype, (int32_t)(b ? b[i].dtype : a[i].dtype)};
  if (s == GS_SUCCESS) s = gs_cu_elementwise(mode, runs, n, scale, e.stream);
  free(runs);
  return gs_engine_close(&e, s);
}

gs_status_t gs_device_zero(const gs_tensor_t *t, int64_t n) {
  return device_elementwise(GS_CU_ZERO, t, NULL, n, 1.0);
}

gs_status_t gs_device_accumulate(const gs_tensor_t *acc, const gs_tensor_t *grad, int64_t n,
                                 int overwrite) {
  for (int64_t i = 0; i < n; i++)
    if (grad[i].device.kind != GS_DEVICE_CUDA || grad[i].device.id != acc[0].device.id)
      return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_accumulate: grad[%lld] is not on acc's CUDA "
                     "device %d", (long long)i, (int)acc[0].device.id);
  return device_elementwise(overwrite ? GS_CU_OVERWRITE : GS_CU_ACCUMULATE, acc, grad, n, 1.0);
}

gs_status_t gs_device_scale(const gs_tensor_t *t, int64_t n, double factor) {
  if (factor == 1.0) return GS_SUCCESS;
  return device_elementwise(GS_CU_COPY_SCALE, t, NULL, n, factor);
}

gs_status_t gs_device_all_finite(const gs_tensor_t *t, int64_t n, int *finite) {
  *finite = 1;
  if (n == 0) return GS_SUCCESS;
  gs_engine_t e;
  GS_CHECK(gs_engine_open(NULL, t, n, &e));
  int bad = 0;
  gs_status_t s = gs_cu_nonfinite(t, n, &bad, e.stream);
  *finite = !bad;
  return gs_engine_close(&e, s);
}
