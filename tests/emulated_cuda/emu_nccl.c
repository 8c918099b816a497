/* Emulated NCCL, linked into the emulated libgradsync.so and found there by
 * GRADSYNC_NCCL_LIBRARY=build/emulated/libgradsync.so (with
 * GS_EMU_DISTINCT_GPUS=1, so the ranks may choose NCCL). It runs gradsync's
 * NCCL path on a machine without GPUs, with NCCL's semantics where gradsync
 * must cope with them:
 * - communicators are created non-blocking: ncclCommInitRankConfig returns
 *   ncclInProgress and the ranks connect on a thread of their own; the
 *   bootstrap gives up after 20 s, as NCCL's does (ncclSystemError), and
 *   GS_EMU_NCCL_STALL_INIT_RANK=r makes rank r's bootstrap never reach the
 *   others (a peer NCCL cannot connect to);
 * - collectives run later, on the stream's emulated thread, exchanging the
 *   ranks' buffers over Unix sockets (abstract names, nothing on disk), and
 *   reduce in rank order (every rank gets the same bits);
 * - min and max are fmin/fmax: a NaN is dropped, as NCCL drops it;
 * - a peer that disappears sets the asynchronous error ncclRemoteError, and
 *   the operation waiting on it stays blocked until ncclCommAbort (with
 *   GS_EMU_NCCL_SILENT_LOSS=1 no error is set: the wait only ends by abort);
 * - an operation blocks its stream until every rank has joined it, as an
 *   NCCL kernel does: two communicators whose operations share a stream and
 *   are issued in different orders on different ranks deadlock;
 * - ncclCommAbort and ncclCommDestroy free the communicator: any later call
 *   with that handle (from another thread during the abort too) is reported
 *   on stderr as a use after free and fails. An abort takes
 *   GS_EMU_NCCL_ABORT_NAP_MS (default 50 ms), as NCCL's takes time (it stops
 *   kernels and proxy threads), so a call racing with it is caught;
 *   gs_emulated_nccl_hold_aborts(1) makes every abort last until
 *   gs_emulated_nccl_hold_aborts(0) (or 30 s), so a test can ask what else
 *   proceeds meanwhile;
 * - ncclCommFinalize (non-blocking: ncclInProgress, then polled through
 *   ncclCommGetAsyncError) completes once the communicator's queued
 *   operations have; ncclCommDestroy without it finalizes first and so
 *   waits for them, like NCCL's (it gives up after 30 s, saying so, where
 *   NCCL would hang);
 * - test hooks count operations queued, finalizes, destroys and aborts;
 * - GS_EMU_NCCL_VERSION (default 22300) is the version it reports. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <nccl.h>

#include "emu.h"
#include "base/half.h"

#define API __attribute__((visibility("default")))

struct ncclComm {
  int rank, size;
  int *fd;              /* fd[peer] */
  char token[160];
  pthread_t init_thread;
  int blocking;         /* config.blocking */
  volatile int aborted; /* by ncclCommAbort/Destroy: NCCL has freed the handle */
  volatile ncclResult_t state; /* ncclInProgress while connecting, then the async error */
  volatile int finalizing;     /* ncclCommFinalize was called */
  long inflight;        /* operations queued and not yet finished (atomic) */
  char last[256];
};

#define HOOK __attribute__((visibility("default")))

/* What the tests count (atomics). */
static long launches, finalizes, destroys, aborts_started, aborts_done;
HOOK long gs_emulated_nccl_launches(void) { return __atomic_load_n(&launches, 0); }
HOOK long gs_emulated_nccl_finalizes(void) { return __atomic_load_n(&finalizes, 0); }
HOOK long gs_emulated_nccl_destroys(void) { return __atomic_load_n(&destroys, 0); }
HOOK long gs_emulated_nccl_aborts_started(void) { return __atomic_load_n(&aborts_started, 0); }
HOOK long gs_emulated_nccl_aborts_done(void) { return __atomic_load_n(&aborts_done, 0); }

/* Aborts held: each lasts until the hold is lifted (at most 30 s). */
static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_lifted = PTHREAD_COND_INITIALIZER;
static int aborts_held;

HOOK void gs_emulated_nccl_hold_aborts(int on) {
  pthread_mutex_lock(&hold_mu);
  aborts_held = on;
  pthread_cond_broadcast(&hold_lifted);
  pthread_mutex_unlock(&hold_mu);
}

static void wait_for_hold(void) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 30;
  pthread_mutex_lock(&hold_mu);
  int r = 0;
  while (aborts_held && r == 0) r = pthread_cond_timedwait(&hold_lifted, &hold_mu, &until);
  pthread_mutex_unlock(&hold_mu);
}

/* A call with a handle NCCL has freed: the struct is kept (the stream
 * threads still read it), so the emulation can say so instead of crashing. */
static int freed(ncclComm_t comm, const char *fn) {
  if (!comm->aborted) return 0;
  fprintf(stderr, "emulated NCCL: %s on a communicator already aborted or destroyed "
          "(NCCL has freed it: a use after free)\n", fn);
  return 1;
}

static _Thread_local int group_depth;
typedef struct op op_t;
static _Thread_local op_t *group_ops; /* queued while a group is open */

/* ---- sockets -------------------------------------------------------------------- */

static void sock_name(struct sockaddr_un *a, socklen_t *len, const char *token, int rank) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "gsnccl-%s-%d", token, rank);
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static int send_all(int fd, const void *p, size_t n) {
  for (size_t done = 0; done < n;) {
    ssize_t k = send(fd, (const char *)p + done, n - done, MSG_NOSIGNAL);
    if (k <= 0) return -1;
    done += (size_t)k;
  }
  return 0;
}

#define BOOTSTRAP_SECONDS 20

static double seconds_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Whether the bootstrap must stop: aborted, or past its deadline (then the
 * communicator's error says so). */
static int bootstrap_over(struct ncclComm *c, double deadline) {
  if (c->aborted) return 1;
  if (seconds_now() < deadline) return 0;
  snprintf(c->last, sizeof c->last, "emulated NCCL: bootstrap timed out after %d s",
           BOOTSTRAP_SECONDS);
  c->state = ncclSystemError;
  return 1;
}

static int stalled(const struct ncclComm *c) {
  const char *r = getenv("GS_EMU_NCCL_STALL_INIT_RANK");
  return r && *r && atoi(r) == c->rank;
}

static void *connect_peers(void *arg) {
  struct ncclComm *c = arg;
  struct sockaddr_un a;
  socklen_t len;
  double deadline = seconds_now() + BOOTSTRAP_SECONDS;
  if (stalled(c)) { /* never reaches the others */
    while (!bootstrap_over(c, deadline)) usleep(1000);
    if (c->state == ncclInProgress) c->state = ncclInvalidUsage; /* aborted */
    return NULL;
  }
  int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
  sock_name(&a, &len, c->token, c->rank);
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, len) != 0 || listen(lfd, c->size) != 0) {
    snprintf(c->last, sizeof c->last, "emulated NCCL: cannot listen (%s)", strerror(errno));
    c->state = ncclSystemError;
    return NULL;
  }
  for (int p = 0; p < c->rank && !c->aborted; p++) { /* connect to the lower ranks */
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un b;
    socklen_t blen;
    sock_name(&b, &blen, c->token, p);
    int over = 0;
    while (!(over = bootstrap_over(c, deadline)) && connect(fd, (struct sockaddr *)&b, blen) != 0)
      usleep(1000);
    if (over) {
      close(fd);
      break;
    }
    send_all(fd, &c->rank, sizeof c->rank);
    c->fd[p] = fd;
  }
  for (int k = c->rank + 1; k < c->size && c->state == ncclInProgress && !c->aborted; k++) {
    /* accept the higher ranks, polling so an abort or the deadline ends it */
    struct pollfd pl = {lfd, POLLIN, 0};
    int ready = 0;
    while (!bootstrap_over(c, deadline) && (ready = poll(&pl, 1, 10)) <= 0)
      if (ready < 0 && errno != EINTR) break;
    if (ready < 0 && c->state == ncclInProgress && !c->aborted) {
      snprintf(c->last, sizeof c->last, "emulated NCCL: poll failed (%s)", strerror(errno));
      c->state = ncclSystemError;
    }
    if (c->state != ncclInProgress || c->aborted || ready <= 0) break;
    int fd = accept(lfd, NULL, NULL);
    int peer = -1;
    if (fd < 0 || recv(fd, &peer, sizeof peer, MSG_WAITALL) != sizeof peer || peer <= c->rank ||
        peer >= c->size) {
      c->state = ncclSystemError;
      snprintf(c->last, sizeof c->last, "emulated NCCL: bad connection from a peer");
      break;
    }
    c->fd[peer] = fd;
  }
  close(lfd);
  if (c->state == ncclInProgress) c->state = c->aborted ? ncclInvalidUsage : ncclSuccess;
  return NULL;
}

/* Sends `out[p]` (bytes sb[p]) to and receives `in[p]` (rb[p]) from every
 * peer at once (non-blocking, so large buffers cannot deadlock). A peer's
 * end of file sets ncclRemoteError (unless silent) and then waits for the
 * abort, as a NCCL kernel would hang. Returns 0, or -1 once aborted. */
static int exchange(struct ncclComm *c, const void **out, const size_t *sb, void **in,
                    const size_t *rb) {
  size_t sent[64] = {0}, got[64] = {0};
  struct pollfd pf[64];
  for (;;) {
    int n = 0, idx[64];
    for (int p = 0; p < c->size; p++) {
      if (p == c->rank || (sent[p] == sb[p] && got[p] == rb[p])) continue;
      pf[n].fd = c->fd[p];
      pf[n].events = (sent[p] < sb[p] ? POLLOUT : 0) | (got[p] < rb[p] ? POLLIN : 0);
      idx[n++] = p;
    }
    if (n == 0) return 0;
    if (c->aborted) return -1;
    if (poll(pf, (nfds_t)n, 10) < 0 && errno != EINTR) return -1;
    for (int k = 0; k < n; k++) {
      int p = idx[k];
      if ((pf[k].revents & POLLOUT) && sent[p] < sb[p]) {
        ssize_t w = send(pf[k].fd, (const char *)out[p] + sent[p], sb[p] - sent[p],
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) sent[p] += (size_t)w;
      }
      if ((pf[k].revents & (POLLIN | POLLHUP | POLLERR)) && got[p] < rb[p]) {
        ssize_t r = recv(pf[k].fd, (char *)in[p] + got[p], rb[p] - got[p], MSG_DONTWAIT);
        if (r > 0) {
          got[p] += (size_t)r;
        } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
          const char *silent = getenv("GS_EMU_NCCL_SILENT_LOSS");
          if (!(silent && strcmp(silent, "1") == 0) && c->state == ncclSuccess) {
            snprintf(c->last, sizeof c->last, "emulated NCCL: rank %d lost its connection to "
                     "rank %d (the peer is gone)", c->rank, p);
            c->state = ncclRemoteError;
          }
          while (!c->aborted) usleep(1000); /* the kernel hangs until the abort */
          return -1;
        }
      }
    }
  }
}

/* ---- element arithmetic ---------------------------------------------------------------- */

static size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

static double load(ncclDataType_t t, const void *p, size_t i) {
  switch (t) {
    case ncclInt8: return ((const int8_t *)p)[i];
    case ncclUint8: return ((const uint8_t *)p)[i];
    case ncclFloat16: return gs_half_to_float(((const uint16_t *)p)[i]);
    case ncclBfloat16: return gs_bf16_to_float(((const uint16_t *)p)[i]);
    case ncclInt32: return ((const int32_t *)p)[i];
    case ncclUint32: return ((const uint32_t *)p)[i];
    case ncclFloat32: return ((const float *)p)[i];
    case ncclFloat64: return ((const double *)p)[i];
    default: return 0; /* 64-bit integers: combine_int64 */
  }
}

static void store(ncclDataType_t t, void *p, size_t i, double v) {
  switch (t) {
    case ncclInt8: ((int8_t *)p)[i] = (int8_t)(int64_t)v; break;
    case ncclUint8: ((uint8_t *)p)[i] = (uint8_t)(int64_t)v; break;
    case ncclFloat16: ((uint16_t *)p)[i] = gs_float_to_half((float)v); break;
    case ncclBfloat16: ((uint16_t *)p)[i] = gs_float_to_bf16((float)v); break;
    case ncclInt32: ((int32_t *)p)[i] = (int32_t)(int64_t)v; break;
    case ncclUint32: ((uint32_t *)p)[i] = (uint32_t)v; break;
    case ncclFloat32: ((float *)p)[i] = (float)v; break;
    case ncclFloat64: ((double *)p)[i] = v; break;
    default: break;
  }
}

static int is_float(ncclDataType_t t) {
  return t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64;
}

/* acc = acc op x, element i; NCCL's min and max are fmin and fmax. Narrow
 * integer sums wrap (computed wide, stored narrow). */
static void combine(ncclDataType_t t, ncclRedOp_t op, void *acc, const void *x, size_t i) {
  if (t == ncclInt64 || t == ncclUint64) {
    uint64_t a = ((uint64_t *)acc)[i], b = ((const uint64_t *)x)[i];
    int s = t == ncclInt64;
    uint64_t r = op == ncclSum ? a + b : op == ncclProd ? a * b
                 : op == ncclMin ? (s ? ((int64_t)a < (int64_t)b ? a : b) : (a < b ? a : b))
                                 : (s ? ((int64_t)a > (int64_t)b ? a : b) : (a > b ? a : b));
    ((uint64_t *)acc)[i] = r;
    return;
  }
  double a = load(t, acc, i), b = load(t, x, i), r;
  if (op == ncclSum) r = a + b;
  else if (op == ncclProd) r = a * b;
  else if (op == ncclMin) r = is_float(t) ? fmin(a, b) : (a < b ? a : b);
  else r = is_float(t) ? fmax(a, b) : (a > b ? a : b);
  if (t == ncclFloat32 || t == ncclFloat16 || t == ncclBfloat16) r = (float)r;
  if (!is_float(t) && op == ncclSum) { /* wrap like the narrow type */
    int64_t w = (int64_t)a + (int64_t)b;
    if (t == ncclInt8) r = (int8_t)w;
    else if (t == ncclUint8) r = (uint8_t)w;
    else if (t == ncclInt32) r = (int32_t)w;
    else r = (uint32_t)w;
  }
  store(t, acc, i, r);
}

/* ---- operations, queued on the stream -------------------------------------------------- */

typedef enum { OP_ALLREDUCE, OP_BROADCAST, OP_ALLGATHER, OP_REDUCE_SCATTER, OP_REDUCE, OP_SEND,
               OP_RECV } kind_t;

struct op {
  kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t red;
  int root; /* root, or the peer of a send/recv */
  struct ncclComm *comm;
  op_t *next;
};

/* Everyone's `bytes` of `mine`, in rank order, into `all` (size * bytes). */
static int gather_all(struct ncclComm *c, const void *mine, size_t bytes, char *all) {
  const void *out[64];
  void *in[64];
  size_t sb[64], rb[64];
  for (int p = 0; p < c->size; p++) {
    out[p] = mine;
    in[p] = all + (size_t)p * bytes;
    sb[p] = rb[p] = p == c->rank ? 0 : bytes;
  }
  memmove(all + (size_t)c->rank * bytes, mine, bytes);
  return exchange(c, out, sb, in, rb);
}

static int run_collective(op_t *o) {
  struct ncclComm *c = o->comm;
  size_t es = type_size(o->type), n = o->count;
  size_t block = o->kind == OP_REDUCE_SCATTER ? n * (size_t)c->size : n;
  char *all = malloc((size_t)c->size * block * es + 1);
  if (!all) return -1;
  const void *mine = o->kind == OP_BROADCAST ? o->recv : o->send;
  int r = gather_all(c, mine, block * es, all);
  if (r == 0 && o->kind == OP_BROADCAST) {
    memmove(o->recv, all + (size_t)o->root * block * es, block * es);
  } else if (r == 0 && o->kind == OP_ALLGATHER) {
    memmove(o->recv, all, (size_t)c->size * n * es);
  } else if (r == 0 && (o->kind != OP_REDUCE || c->rank == o->root)) {
    size_t first = o->kind == OP_REDUCE_SCATTER ? (size_t)c->rank * n : 0;
    char *acc = malloc(n * es + 1);
    memcpy(acc, all + first * es, n * es); /* rank 0's part, then the others in order */
    for (int p = 1; p < c->size; p++)
      for (size_t i = 0; i < n; i++)
        combine(o->type, o->red, acc, all + ((size_t)p * block + first) * es, i);
    memcpy(o->recv, acc, n * es);
    free(acc);
  }
  free(all);
  return r;
}

/* A group's sends and receives, pairwise, all at once. */
static int run_p2p(op_t *ops) {
  struct ncclComm *c = ops->comm;
  const void *out[64] = {0};
  void *in[64] = {0};
  size_t sb[64] = {0}, rb[64] = {0};
  for (op_t *o = ops; o; o = o->next) {
    size_t bytes = o->count * type_size(o->type);
    if (o->kind == OP_SEND) out[o->root] = o->send, sb[o->root] = bytes;
    else in[o->root] = o->recv, rb[o->root] = bytes;
  }
  return exchange(c, out, sb, in, rb);
}

static cudaError_t run_ops(void *arg) {
  op_t *ops = *(op_t **)arg;
  int p2p = ops && (ops->kind == OP_SEND || ops->kind == OP_RECV);
  int failed = 0;
  if (p2p && !ops->comm->aborted) failed = run_p2p(ops) != 0;
  for (op_t *o = ops; o && !p2p && !failed; o = o->next)
    if (!o->comm->aborted) failed = run_collective(o) != 0;
  while (ops) {
    op_t *next = ops->next;
    __atomic_sub_fetch(&ops->comm->inflight, 1, __ATOMIC_SEQ_CST);
    free(ops);
    ops = next;
  }
  return cudaSuccess; /* an aborted NCCL kernel exits; the stream goes on */
}

static ncclResult_t submit(op_t proto, cudaStream_t stream) {
  struct ncclComm *c = proto.comm;
  if (!c) return ncclInvalidArgument;
  if (freed(c, "an NCCL collective")) return ncclInvalidUsage;
  if (c->state == ncclInProgress) return ncclInvalidUsage; /* not yet initialized */
  op_t *o = malloc(sizeof *o);
  if (!o) return ncclSystemError;
  *o = proto;
  o->next = NULL;
  __atomic_add_fetch(&c->inflight, 1, __ATOMIC_SEQ_CST);
  if (group_depth > 0) { /* appended in call order */
    op_t **p = &group_ops;
    while (*p) p = &(*p)->next;
    *p = o;
    o->recv = proto.recv;
    return ncclSuccess;
  }
  emu_nccl_launching();
  __atomic_add_fetch(&launches, 1, __ATOMIC_SEQ_CST);
  return emu_enqueue(stream, run_ops, &o, sizeof o) == cudaSuccess ? ncclSuccess
                                                                   : ncclUnhandledCudaError;
}

static _Thread_local cudaStream_t group_stream;

#define SUBMIT(...)                                                  \
  do {                                                               \
    if (group_depth > 0) group_stream = stream;                      \
    return submit((op_t){__VA_ARGS__}, stream);                      \
  } while (0)

/* ---- the API ---------------------------------------------------------------------------- */

API ncclResult_t ncclGetVersion(int *version) {
  const char *v = getenv("GS_EMU_NCCL_VERSION");
  *version = v && *v ? atoi(v) : 22300;
  return ncclSuccess;
}

API const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInvalidUsage: return "invalid usage";
    default: return "emulated NCCL error";
  }
}

API const char *ncclGetLastError(ncclComm_t comm) {
  if (comm && freed(comm, "ncclGetLastError")) return "emulated NCCL: use after free";
  return comm ? comm->last : "";
}

API ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id, 0, sizeof *id);
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  snprintf(id->internal, sizeof id->internal, "%d-%ld-%ld", (int)getpid(), (long)t.tv_sec,
           t.tv_nsec);
  return ncclSuccess;
}

API ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId id, int rank,
                                        ncclConfig_t *config) {
  if (!config || config->magic != NCCL_API_MAGIC || config->size < 2 * sizeof(size_t))
    return ncclInvalidArgument;
  if (nranks < 1 || nranks > 64 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  struct ncclComm *c = calloc(1, sizeof *c);
  c->fd = calloc((size_t)nranks, sizeof *c->fd);
  c->rank = rank;
  c->size = nranks;
  c->state = ncclInProgress;
  c->blocking = config->blocking != 0;
  snprintf(c->token, sizeof c->token, "%s", id.internal);
  *out = c;
  if (config->blocking != 0) { /* blocking: connect here */
    connect_peers(c);
    return c->state;
  }
  pthread_create(&c->init_thread, NULL, connect_peers, c);
  pthread_detach(c->init_thread);
  return ncclInProgress;
}

static int drained(ncclComm_t comm) { return __atomic_load_n(&comm->inflight, 0) == 0; }

API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  if (!comm) return ncclInvalidArgument;
  if (freed(comm, "ncclCommGetAsyncError")) return ncclInvalidUsage;
  *state = comm->state;
  if (*state == ncclSuccess && comm->finalizing && !drained(comm)) *state = ncclInProgress;
  return ncclSuccess;
}

/* Waits up to 30 s for the communicator's operations; 0 once they ended. */
static int wait_drained(ncclComm_t comm) {
  double give_up = seconds_now() + 30;
  while (!drained(comm) && !comm->aborted && seconds_now() < give_up) usleep(1000);
  return drained(comm) || comm->aborted ? 0 : -1;
}

API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!comm) return ncclInvalidArgument;
  if (freed(comm, "ncclCommFinalize")) return ncclInvalidUsage;
  if (comm->state == ncclInProgress) return ncclInvalidUsage; /* not yet initialized */
  __atomic_add_fetch(&finalizes, 1, __ATOMIC_SEQ_CST);
  comm->finalizing = 1;
  if (!comm->blocking) return ncclInProgress; /* polled with ncclCommGetAsyncError */
  return wait_drained(comm) == 0 ? comm->state : ncclInternalError;
}

static void close_comm(struct ncclComm *c) {
  for (int p = 0; p < c->size; p++)
    if (p != c->rank && c->fd[p] > 0) shutdown(c->fd[p], SHUT_RDWR);
}

static ncclResult_t release_comm(ncclComm_t comm, const char *fn, int nap_ms) {
  if (!comm) return ncclSuccess;
  if (freed(comm, fn)) return ncclInvalidUsage;
  comm->aborted = 1; /* operations blocked on it end; the struct is kept (a test harness) */
  close_comm(comm);
  if (nap_ms > 0) usleep((useconds_t)nap_ms * 1000);
  return ncclSuccess;
}

/* An abort takes its time (the window a racing call would fall into);
 * destroying an idle communicator, at close, does not need to. */
API ncclResult_t ncclCommAbort(ncclComm_t comm) {
  const char *nap = getenv("GS_EMU_NCCL_ABORT_NAP_MS");
  __atomic_add_fetch(&aborts_started, 1, __ATOMIC_SEQ_CST);
  ncclResult_t r = release_comm(comm, "ncclCommAbort", nap && *nap ? atoi(nap) : 50);
  wait_for_hold();
  __atomic_add_fetch(&aborts_done, 1, __ATOMIC_SEQ_CST);
  return r;
}

/* Without ncclCommFinalize first, NCCL's destroy finalizes: it waits for
 * the communicator's operations, which may never end (a peer that never
 * joins); here it gives up after 30 s and says so. */
API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (freed(comm, "ncclCommDestroy")) return ncclInvalidUsage;
  __atomic_add_fetch(&destroys, 1, __ATOMIC_SEQ_CST);
  if (wait_drained(comm) != 0)
    fprintf(stderr, "emulated NCCL: ncclCommDestroy waited 30 s for operations that never "
            "finished (NCCL would hang here)\n");
  return release_comm(comm, "ncclCommDestroy", 0);
}

API ncclResult_t ncclGroupStart(void) {
  group_depth++;
  return ncclSuccess;
}

API ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return ncclInvalidUsage;
  if (--group_depth > 0 || !group_ops) return ncclSuccess;
  op_t *ops = group_ops;
  group_ops = NULL;
  emu_nccl_launching();
  __atomic_add_fetch(&launches, 1, __ATOMIC_SEQ_CST);
  return emu_enqueue(group_stream, run_ops, &ops, sizeof ops) == cudaSuccess
             ? ncclSuccess : ncclUnhandledCudaError;
}

API ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  SUBMIT(.kind = OP_ALLREDUCE, .send = s, .recv = r, .count = n, .type = t, .red = op, .comm = comm);
}

API ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, ncclDataType_t t, int root,
                               ncclComm_t comm, cudaStream_t stream) {
  (void)s;
  SUBMIT(.kind = OP_BROADCAST, .recv = r, .count = n, .type = t, .root = root, .comm = comm);
}

API ncclResult_t ncclAllGather(const void *s, void *r, size_t n, ncclDataType_t t,
                               ncclComm_t comm, cudaStream_t stream) {
  SUBMIT(.kind = OP_ALLGATHER, .send = s, .recv = r, .count = n, .type = t, .comm = comm);
}

API ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, ncclDataType_t t,
                                   ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  SUBMIT(.kind = OP_REDUCE_SCATTER, .send = s, .recv = r, .count = n, .type = t, .red = op,
         .comm = comm);
}

API ncclResult_t ncclReduce(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                            int root, ncclComm_t comm, cudaStream_t stream) {
  SUBMIT(.kind = OP_REDUCE, .send = s, .recv = r, .count = n, .type = t, .red = op, .root = root,
         .comm = comm);
}

API ncclResult_t ncclSend(const void *s, size_t n, ncclDataType_t t, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
  SUBMIT(.kind = OP_SEND, .send = s, .count = n, .type = t, .root = peer, .comm = comm);
}

API ncclResult_t ncclRecv(void *r, size_t n, ncclDataType_t t, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
  SUBMIT(.kind = OP_RECV, .recv = r, .count = n, .type = t, .root = peer, .comm = comm);
}
