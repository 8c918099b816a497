/* Every buffer a communicator keeps: the fusion buffer and scratch, in host
 * or device memory. They grow by one rule (gs_grow_size: at least double,
 * so a slowly growing workload reallocates rarely) and are kept until the
 * communicator is freed. Device buffers are replaced in stream order
 * (gs_cu_grow), pinned staging after its stream drained (gs_cu_grow_pinned). */
#include <stdlib.h>

#include "engine/gs_engine.h"

/* A 64-byte aligned host buffer of at least `need` bytes. */
static gs_status_t host_grow(void **buf, size_t *have, size_t need, const char *what) {
  if (need <= *have && *buf) return GS_SUCCESS;
  size_t want = gs_grow_size(*have, need);
  void *p = NULL;
  if (posix_memalign(&p, 64, want) != 0)
    return gs_fail(GS_ERR_NO_MEMORY, "%s: cannot allocate %zu bytes", what, want);
  free(*buf);
  *buf = p;
  *have = want;
  return GS_SUCCESS;
}

gs_status_t gs_buffer_reserve(const gs_engine_t *e, size_t bytes, void **buf) {
  gs_comm_t c = e->comm;
  if (e->device < 0) GS_CHECK(host_grow(&c->fusion, &c->fusion_bytes, bytes, "fusion buffer"));
  else GS_CHECK(gs_cu_grow(&c->dev_fusion, &c->dev_fusion_bytes, bytes, e->stream));
  *buf = e->device < 0 ? c->fusion : c->dev_fusion;
  return GS_SUCCESS;
}

gs_status_t gs_scratch_reserve(const gs_engine_t *e, size_t bytes, void **buf) {
  gs_comm_t c = e->comm;
  if (e->device < 0) GS_CHECK(host_grow(&c->adasum_tmp, &c->adasum_tmp_bytes, bytes, "scratch"));
  else GS_CHECK(gs_cu_grow(&c->dev_tmp, &c->dev_tmp_bytes, bytes, e->stream));
  *buf = e->device < 0 ? c->adasum_tmp : c->dev_tmp;
  return GS_SUCCESS;
}

void gs_buffers_free(gs_comm_t c) {
  free(c->fusion);
  free(c->adasum_tmp);
  c->fusion = c->adasum_tmp = NULL;
  c->fusion_bytes = c->adasum_tmp_bytes = 0;
}
