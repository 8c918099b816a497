/* Host memory that MPI is handed (issue 34). MPI over UCX keeps about 150
 * bytes for every buffer it moves a large message from or into that it has
 * not seen before (its registration cache; MPICH 5.0.2 with ch4:ucx, as
 * docs/RELIABILITY.md measures), and never gives them back: a loop that
 * gets a new output array per call grows by that much per call. So the
 * host transport hands MPI only memory the communicator owns and keeps --
 * the fusion buffer, Adasum's scratch, the staging memory, or this bounce
 * buffer -- and copies the caller's arrays through it. The copies are
 * cheap next to the transfer; the calls MPI gets, and so the results, are
 * the same as before, only at other addresses. */
#include <stdlib.h>

#include "transport/mpi/gs_mpi_transport.h"

static int inside(const void *p, size_t bytes, const void *buf, size_t have) {
  const char *a = p, *b = buf;
  return b && a >= b && a + bytes <= b + have;
}

int gs_mpi_owned(gs_comm_t c, const void *p, size_t bytes) {
  if (!p || bytes == 0) return 1;
  const gs_mpi_state_t *s = gs_mpi_state(c);
  return inside(p, bytes, s->bounce, s->bounce_bytes) ||
         inside(p, bytes, c->fusion, c->fusion_bytes) ||
         inside(p, bytes, c->adasum_tmp, c->adasum_tmp_bytes) ||
         inside(p, bytes, s->wire_scratch, s->wire_scratch_bytes) ||
         inside(p, bytes, c->pinned, c->pinned_bytes);
}

gs_status_t gs_owned_grow(void **buf, size_t *have, size_t bytes, const char *what) {
  if (bytes > *have || !*buf) {
    size_t want = gs_grow_size(*have, bytes ? bytes : 64);
    void *p = NULL;
    if (posix_memalign(&p, 64, want) != 0)
      return gs_fail(GS_ERR_NO_MEMORY, "%s: cannot allocate %zu bytes", what, want);
    free(*buf);
    *buf = p;
    *have = want;
  }
  return GS_SUCCESS;
}

gs_status_t gs_bounce_reserve(gs_comm_t c, size_t bytes, void **buf) {
  gs_mpi_state_t *s = gs_mpi_state(c);
  GS_CHECK(gs_owned_grow(&s->bounce, &s->bounce_bytes, bytes, "MPI bounce buffer"));
  *buf = s->bounce;
  return GS_SUCCESS;
}
