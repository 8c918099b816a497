/* Point-to-point messages (gs_p2p.h).
 *
 * They travel on the communicator's second MPI communicator (c->notice),
 * whose only other traffic is the stall notices (tag 7), with user tag t
 * mapped to tags 8 + 2t (a 32-byte header) and 9 + 2t (the data, one
 * message whatever its count). Both receives are posted at once, so matching
 * is MPI's own, in posting order; the header lets the receiver name what the
 * sender sent when it differs from what it expected. Sends and receives are
 * posted on the caller's thread under the runtime lock but without waiting
 * for queued collectives, and completed by whoever tests or waits.
 *
 * A receive from any source posts nothing at first: whoever tests or waits
 * on it looks for a header from any rank with a matched probe, and under
 * the same hold of the runtime lock takes it and posts the rest from that
 * rank, so no other receive can come between a header and its data. Until
 * then there is nothing to cancel. */
#include <limits.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "coll/gs_collective.h"

#define P2P_TAG_BASE 8
#define P2P_MAGIC 0x67737032u /* "gsp2" */

typedef struct header {
  uint32_t magic, dtype;
  int64_t count, index, n;
} header_t;

typedef struct msg {
  header_t hdr;
  MPI_Request req[2]; /* header, data */
  void *staging;      /* host copy of device memory */
} msg_t;

typedef struct p2p {
  gs_comm_t comm;
  int recv, peer, tag;
  int64_t n;
  gs_tensor_t *t;
  msg_t *m;
  int unmatched; /* a receive from any source that has no sender yet */
  int *source;   /* where the matched sender goes (receives from any source) */
  uint64_t flight; /* its flight recorder entry */
} p2p_t;

gs_status_t gs_p2p_max_tag(gs_comm_t c, int *max_tag) {
  GS_CHECK(gs_comm_valid(c, "gs_p2p_max_tag"));
  if (!max_tag) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_p2p_max_tag: max_tag is NULL");
  int *ub = NULL, flag = 0;
  GS_MPI_CHECK(MPI_Comm_get_attr(c->notice, MPI_TAG_UB, &ub, &flag), "gs_p2p_max_tag");
  int top = flag && ub ? *ub : 32767; /* MPI guarantees at least 32767 */
  *max_tag = (top - P2P_TAG_BASE - 1) / 2;
  return GS_SUCCESS;
}

static void p2p_free(void *ctx) {
  p2p_t *p = ctx;
  if (!p) return;
  for (int64_t i = 0; p->m && i < p->n; i++) free(p->m[i].staging);
  free(p->m);
  free(p->t);
  free(p);
}

/* allow_any: GS_ANY_SOURCE is a valid source here. */
static gs_status_t check_peer_tag(const char *fn, gs_comm_t c, int peer, int tag, int allow_any) {
  const char *what = strcmp(fn + strlen(fn) - 4, "send") == 0 ? "dest" : "source";
  if ((peer < 0 || peer >= c->size) && !(allow_any && peer == GS_ANY_SOURCE))
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: %s %d is not a rank of a communicator of "
                   "size %d",
                   fn, what, peer, c->size);
  int max_tag = 0;
  GS_CHECK(gs_p2p_max_tag(c, &max_tag));
  if (tag < 0 || tag > max_tag)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: tag %d is outside 0..%d", fn, tag, max_tag);
  return GS_SUCCESS;
}

static gs_status_t check_args(const char *fn, gs_comm_t c, const gs_tensor_t *t, int64_t n,
                              int peer, int tag) {
  GS_CHECK(gs_check_tensors(fn, "tensors", t, n));
  return check_peer_tag(fn, c, peer, tag, strstr(fn, "_any") != NULL);
}

/* Posts message i's header and data (with_header 0: its data only, the
 * header having been taken by a matched probe). */
static gs_status_t post_one(p2p_t *p, int64_t i, int with_header) {
  gs_comm_t c = p->comm;
  msg_t *m = &p->m[i];
  const gs_tensor_t *t = &p->t[i];
  size_t bytes = (size_t)t->count * gs_dtype_size(t->dtype);
  int htag = P2P_TAG_BASE + 2 * p->tag;
  void *data = t->data;
  if (t->device.kind == GS_DEVICE_CUDA && bytes) { /* through host memory */
    m->staging = malloc(bytes);
    if (!m->staging) return gs_fail(GS_ERR_NO_MEMORY, "p2p: cannot stage %zu bytes", bytes);
    gs_device_t host = {GS_DEVICE_CPU, 0};
    if (!p->recv) GS_CHECK(gs_memcpy(m->staging, host, t->data, t->device, bytes));
    data = m->staging;
  }
  MPI_Datatype dt;
  int count, derived;
  GS_CHECK(gs_mpi_big_type(t->dtype, t->count, &dt, &count, &derived));
  int e;
  if (p->recv) {
    e = with_header
            ? MPI_Irecv(&m->hdr, (int)sizeof m->hdr, MPI_BYTE, p->peer, htag, c->notice, &m->req[0])
            : MPI_SUCCESS;
    if (e == MPI_SUCCESS) e = MPI_Irecv(data, count, dt, p->peer, htag + 1, c->notice, &m->req[1]);
  } else {
    m->hdr = (header_t){P2P_MAGIC, (uint32_t)t->dtype, t->count, i, p->n};
    e = MPI_Isend(&m->hdr, (int)sizeof m->hdr, MPI_BYTE, p->peer, htag, c->notice, &m->req[0]);
    if (e == MPI_SUCCESS) e = MPI_Isend(data, count, dt, p->peer, htag + 1, c->notice, &m->req[1]);
    c->stats.messages++;
    c->stats.bytes += bytes;
  }
  if (derived) MPI_Type_free(&dt); /* MPI keeps it until the message completes */
  return e == MPI_SUCCESS ? GS_SUCCESS
                          : gs_mpi_fail(e, p->recv ? "p2p: MPI_Irecv" : "p2p: MPI_Isend");
}

/* What arrived is what this rank expected, or a mismatch naming both. */
static gs_status_t check_header(const p2p_t *p, int64_t i) {
  const header_t *h = &p->m[i].hdr;
  const gs_tensor_t *t = &p->t[i];
  if (h->magic != P2P_MAGIC)
    return gs_fail(GS_ERR_MISMATCH,
                   "gs_recv: the message from rank %d with tag %d is not a "
                   "gradsync message",
                   p->peer, p->tag);
  if (h->n != p->n || h->index != i || h->dtype != (uint32_t)t->dtype || h->count != t->count)
    return gs_fail(GS_ERR_MISMATCH,
                   "gs_recv: rank %d sent tensor %lld of %lld with tag %d as "
                   "%lld %s elements, but this rank receives tensor %lld of %lld as %lld %s "
                   "elements",
                   p->peer, (long long)h->index, (long long)h->n, p->tag, (long long)h->count,
                   gs_dtype_name((gs_dtype_t)h->dtype), (long long)i, (long long)p->n,
                   (long long)t->count, gs_dtype_name(t->dtype));
  return GS_SUCCESS;
}

/* Completes message i (header, then data), or with wait == 0 only reports
 * whether it has. Returns the first error; a mismatched message is still
 * received to the end, so later messages stay matched. */
static gs_status_t finish_one(p2p_t *p, int64_t i, int wait, int *done) {
  msg_t *m = &p->m[i];
  const char *what = p->recv ? "gs_recv" : "gs_send";
  *done = 1;
  for (int k = 0; k < 2; k++) {
    if (m->req[k] == MPI_REQUEST_NULL) continue;
    if (!wait) {
      int flag = 0;
      GS_MPI_CHECK(MPI_Test(&m->req[k], &flag, MPI_STATUS_IGNORE), what);
      if (!flag) {
        *done = 0;
        return GS_SUCCESS;
      }
      continue;
    }
    gs_status_t s = gs_mpi_wait(&m->req[k], what, NULL, NULL);
    if (s == GS_ERR_MPI && k == 1 && p->recv && check_header(p, i) != GS_SUCCESS)
      return GS_ERR_MISMATCH; /* the data did not fit: the header says why */
    if (s != GS_SUCCESS) return s;
  }
  if (!p->recv) return GS_SUCCESS;
  GS_CHECK(check_header(p, i));
  if (m->staging) {
    gs_device_t host = {GS_DEVICE_CPU, 0};
    GS_CHECK(gs_memcpy(p->t[i].data, p->t[i].device, m->staging, host,
                       (size_t)p->t[i].count * gs_dtype_size(p->t[i].dtype)));
    free(m->staging);
    m->staging = NULL;
  }
  return GS_SUCCESS;
}

/* Gives up on what is still pending once a wait was abandoned (timeout,
 * interrupt): receives are cancelled, and no request is left to MPI that
 * points into memory about to be freed, except sends, which MPI finishes. */
static void drop_pending(p2p_t *p) {
  for (int64_t i = 0; i < p->n; i++)
    for (int k = 0; k < 2; k++) {
      MPI_Request *r = &p->m[i].req[k];
      if (*r == MPI_REQUEST_NULL) continue;
      if (p->recv) MPI_Cancel(r);
      MPI_Request_free(r);
    }
}

/* A receive from any source: takes the oldest header some rank sent with
 * the tag that no posted receive has taken, then posts the rest from that
 * rank (under the caller's hold of the runtime lock). *matched: 1 if found. */
static gs_status_t match_any(p2p_t *p, int *matched) {
  int htag = P2P_TAG_BASE + 2 * p->tag, flag = 0;
  MPI_Message msg;
  MPI_Status st;
  *matched = 0;
  GS_MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, htag, p->comm->notice, &flag, &msg, &st),
               "gs_recv_any: MPI_Improbe");
  if (!flag) return GS_SUCCESS;
  *matched = 1;
  p->unmatched = 0;
  p->peer = st.MPI_SOURCE;
  if (p->source) *p->source = p->peer;
  int e = MPI_Imrecv(&p->m[0].hdr, (int)sizeof p->m[0].hdr, MPI_BYTE, &msg, &p->m[0].req[0]);
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, "gs_recv_any: MPI_Imrecv");
  gs_status_t s = post_one(p, 0, 0);
  for (int64_t i = 1; i < p->n && s == GS_SUCCESS; i++) s = post_one(p, i, 1);
  return s;
}

static int match_poll(void *ctx, gs_status_t *err) {
  int matched = 0;
  *err = match_any(ctx, &matched);
  return *err != GS_SUCCESS ? -1 : matched;
}

/* Every message, in order; the first error is returned, and the others are
 * still completed (they are matched on their own) unless a wait was
 * abandoned. With wait == 0, stops at the first message still in flight. */
static gs_status_t finish_all(p2p_t *p, int wait, int *done) {
  gs_status_t first = GS_SUCCESS;
  char why[1024] = "";
  *done = 1;
  if (p->unmatched) { /* nothing posted yet: a failure here leaves nothing behind */
    int matched = 0;
    gs_status_t s;
    if (wait) {
      gs_wait_t w = {match_poll, NULL, NULL, NULL, p, "gs_recv_any"};
      s = gs_progress_wait(&w);
    } else {
      s = match_any(p, &matched);
      if (s == GS_SUCCESS && !matched) *done = 0;
    }
    if (s != GS_SUCCESS) p->unmatched = 0;
    if (s != GS_SUCCESS || !*done) return s;
  }
  for (int64_t i = 0; i < p->n && *done; i++) {
    gs_status_t s = finish_one(p, i, wait, done);
    if (s == GS_ERR_TIMEOUT || s == GS_ERR_INTERRUPTED || p->comm->fate.broken) {
      drop_pending(p);
      *done = 1;
      return s;
    }
    if (s != GS_SUCCESS && first == GS_SUCCESS) {
      first = s;
      snprintf(why, sizeof why, "%s", gs_last_error());
    }
    if (s != GS_SUCCESS) wait = 1; /* the rest must complete before the memory goes */
  }
  if (first != GS_SUCCESS) {
    gs_fail(first, "%s", why); /* the first message's error, not a later one's */
    *done = 1;
  }
  return first;
}

static gs_status_t p2p_poll(void *ctx, int wait, int *done) {
  p2p_t *p = ctx;
  gs_enter_runtime_unordered();
  gs_status_t s = gs_comm_valid(p->comm, p->recv ? "gs_recv" : "gs_send");
  if (s == GS_SUCCESS) {
    gs_runtime_bind(&p->comm->fate); /* a timeout marks it unusable */
    s = finish_all(p, wait, done);
    if (*done || s != GS_SUCCESS) gs_flight_end(p->flight, s);
  } else {
    *done = 1;
  }
  gs_leave_runtime();
  return s;
}

/* Checks, copies the descriptors and posts every message (a receive from
 * any source: none yet; `source` gets the sender once matched). */
static gs_status_t start(const char *fn, gs_comm_t c, const gs_tensor_t *t, int64_t n, int peer,
                         int tag, int recv, int *source, p2p_t **out) {
  *out = NULL;
  GS_CHECK(gs_comm_enter(c, fn));
  gs_clear_error();
  GS_CHECK(check_args(fn, c, t, n, peer, tag));
  p2p_t *p = calloc(1, sizeof *p);
  gs_tensor_t *copy = malloc((size_t)(n ? n : 1) * sizeof *copy);
  msg_t *m = calloc((size_t)(n ? n : 1), sizeof *m);
  if (!p || !copy || !m) {
    free(p);
    free(copy);
    free(m);
    return gs_fail(GS_ERR_NO_MEMORY, "%s: out of memory", fn);
  }
  *p = (p2p_t){c, recv, peer, tag, n, copy, m, peer == GS_ANY_SOURCE && n > 0, source, 0};
  p->flight = gs_coll_record(c, 1, fn + 3 /* past "gs_" */, t, n, GS_OP_SUM, peer, tag);
  if (n) memcpy(p->t, t, (size_t)n * sizeof *t);
  for (int64_t i = 0; i < n; i++) p->m[i].req[0] = p->m[i].req[1] = MPI_REQUEST_NULL;
  c->stats.calls++;
  if (source) *source = -1;
  gs_status_t s = GS_SUCCESS;
  for (int64_t i = 0; i < n && s == GS_SUCCESS && !p->unmatched; i++) s = post_one(p, i, 1);
  gs_flight_path(p->flight, "mpi");
  gs_flight_phase(p->flight, GS_FLIGHT_SENT);
  if (s != GS_SUCCESS) { /* what was posted must finish before the memory goes */
    char why[512];
    snprintf(why, sizeof why, "%s", gs_last_error());
    int done;
    finish_all(p, 1, &done);
    gs_fail(s, "%s", why);
    gs_flight_end(p->flight, s);
    p2p_free(p);
    return s;
  }
  *out = p;
  return GS_SUCCESS;
}

static gs_status_t blocking(const char *fn, gs_comm_t c, const gs_tensor_t *t, int64_t n, int peer,
                            int tag, int recv, int *source) {
  p2p_t *p = NULL;
  int done;
  gs_enter_runtime_unordered();
  gs_status_t s = start(fn, c, t, n, peer, tag, recv, source, &p);
  if (s == GS_SUCCESS) {
    s = finish_all(p, 1, &done);
    gs_flight_end(p->flight, s);
  }
  gs_leave_runtime();
  p2p_free(p);
  return s;
}

static gs_status_t nonblocking(const char *fn, gs_comm_t c, const gs_tensor_t *t, int64_t n,
                               int peer, int tag, int recv, int *source, gs_request_t *request) {
  if (!request) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: request is NULL", fn);
  *request = NULL;
  p2p_t *p = NULL;
  gs_enter_runtime_unordered();
  gs_status_t s = start(fn, c, t, n, peer, tag, recv, source, &p);
  gs_leave_runtime();
  if (s != GS_SUCCESS) return s;
  gs_job_t job = {NULL, p2p_poll, p2p_free, p};
  s = gs_async_submit_job(&job, NULL, 0, request, fn);
  if (s != GS_SUCCESS) { /* no request: finish here, the messages are out */
    char why[512];
    snprintf(why, sizeof why, "%s", gs_last_error());
    int done;
    gs_enter_runtime_unordered();
    finish_all(p, 1, &done);
    gs_leave_runtime();
    p2p_free(p);
    gs_fail(s, "%s", why);
  }
  return s;
}

gs_status_t gs_send(gs_comm_t c, const gs_tensor_t *t, int64_t n, int dest, int tag) {
  return blocking("gs_send", c, t, n, dest, tag, 0, NULL);
}

gs_status_t gs_recv(gs_comm_t c, const gs_tensor_t *t, int64_t n, int source, int tag) {
  return blocking("gs_recv", c, t, n, source, tag, 1, NULL);
}

gs_status_t gs_isend(gs_comm_t c, const gs_tensor_t *t, int64_t n, int dest, int tag,
                     gs_request_t *request) {
  return nonblocking("gs_isend", c, t, n, dest, tag, 0, NULL, request);
}

gs_status_t gs_irecv(gs_comm_t c, const gs_tensor_t *t, int64_t n, int source, int tag,
                     gs_request_t *request) {
  return nonblocking("gs_irecv", c, t, n, source, tag, 1, NULL, request);
}

gs_status_t gs_recv_any(gs_comm_t c, const gs_tensor_t *t, int64_t n, int tag, int *source) {
  return blocking("gs_recv_any", c, t, n, GS_ANY_SOURCE, tag, 1, source);
}

gs_status_t gs_irecv_any(gs_comm_t c, const gs_tensor_t *t, int64_t n, int tag, int *source,
                         gs_request_t *request) {
  return nonblocking("gs_irecv_any", c, t, n, GS_ANY_SOURCE, tag, 1, source, request);
}

static gs_status_t probe_impl(gs_comm_t c, int source, int tag, int *found) {
  GS_CHECK(gs_comm_enter(c, "gs_p2p_probe"));
  GS_CHECK(check_peer_tag("gs_p2p_probe", c, source, tag, 1));
  int flag = 0;
  MPI_Status st;
  GS_MPI_CHECK(MPI_Iprobe(source == GS_ANY_SOURCE ? MPI_ANY_SOURCE : source, P2P_TAG_BASE + 2 * tag,
                          c->notice, &flag, &st),
               "gs_p2p_probe: MPI_Iprobe");
  if (flag) *found = st.MPI_SOURCE;
  return GS_SUCCESS;
}

gs_status_t gs_p2p_probe(gs_comm_t c, int source, int tag, int *found) {
  if (!found) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_p2p_probe: found is NULL");
  *found = -1;
  gs_enter_runtime_unordered();
  gs_status_t s = probe_impl(c, source, tag, found);
  gs_leave_runtime();
  return s;
}
