/* The NCCL transport's library, polling and communicators (the data
 * movement is nccl_ops.c's). NCCL is opened at run time (GRADSYNC_NCCL_LIBRARY, the
 * library found at build time, the nvidia-nccl-cu13 wheel beside an installed
 * gradsync, then libnccl.so.2 on the loader's path), so
 * one build runs on machines with and without it; only its header is needed
 * to compile. NCCL older than 2.14 is refused (no non-blocking communicators
 * to poll; bf16 came in 2.10), and the device path then stages through MPI.
 *
 * Nothing here blocks: communicators are created non-blocking and every NCCL
 * call that reports ncclInProgress is polled to completion through
 * gs_progress_wait, as is the work on the stream (the engine polls the
 * transport) and ncclCommFinalize at close (ncclCommDestroy then only frees
 * memory). A wait that gives up (GRADSYNC_TIMEOUT_SECONDS, an interrupt)
 * or an asynchronous NCCL error aborts the NCCL communicator, never
 * destroys it; the gradsync communicator is then unusable and the message
 * carries ncclGetLastError. The abort itself runs once the runtime lock is
 * released (it may take seconds; other threads' calls go on meanwhile):
 * under the lock the handle is only taken out of the communicator, so every
 * later poll, which runs under the lock, sees it gone and never touches a
 * communicator NCCL is freeing. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gs_info.h"
#include "transport/gs_transport.h"

#ifndef GS_NCCL_LIBRARY
#define GS_NCCL_LIBRARY ""
#endif

#ifdef GS_HAVE_NCCL
#include "transport/nccl/gs_nccl.h"

#define MIN_VERSION 21400 /* NCCL 2.14: ncclCommInitRankConfig with blocking = 0 */

gs_nccl_api_t gs_nccl_api;
#define api gs_nccl_api
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

static void refuse(const char *why) {
  snprintf(api.error, sizeof api.error, "%s", why);
  dlclose(api.handle);
  api.handle = NULL;
}

/* The nvidia-nccl-cu13 wheel's library in the site-packages folder this
 * library was installed into (site-packages/gradsync/libgradsync.so beside
 * site-packages/nvidia/nccl/lib/): a wheel built by pip found NCCL's header
 * in a build environment that is gone by run time, so the path it saw is
 * not where the user's NCCL is. Empty when the folder is unknown. */
static void wheel_beside_us(char *path, size_t size) {
  Dl_info self;
  path[0] = '\0';
  if (!dladdr((void *)wheel_beside_us, &self) || !self.dli_fname) return;
  const char *slash = strrchr(self.dli_fname, '/');
  if (slash)
    snprintf(path, size, "%.*s/../nvidia/nccl/lib/libnccl.so.2", (int)(slash - self.dli_fname),
             self.dli_fname);
}

static void open_library(void) {
  const char *env = gs_env_nccl_library();
  char beside[PATH_MAX + 64];
  wheel_beside_us(beside, sizeof beside);
  const char *candidates[] = {env, GS_NCCL_LIBRARY, beside, "libnccl.so.2", "libnccl.so"};
  for (size_t k = 0; k < sizeof candidates / sizeof *candidates && !api.handle; k++)
    if (candidates[k] && *candidates[k]) api.handle = dlopen(candidates[k], RTLD_NOW | RTLD_LOCAL);
  if (!api.handle) {
    snprintf(api.error, sizeof api.error,
             "cannot open NCCL (set GRADSYNC_NCCL_LIBRARY, or "
             "install nvidia-nccl-cu13): %s",
             dlerror());
    return;
  }
  if (!(api.ncclGetVersion = (__typeof__(ncclGetVersion) *)dlsym(api.handle, "ncclGetVersion")) ||
      api.ncclGetVersion(&api.version) != ncclSuccess || api.version < MIN_VERSION) {
    char why[256];
    snprintf(why, sizeof why,
             "NCCL %d.%d.%d is older than 2.14, the oldest gradsync uses "
             "(non-blocking communicators, bfloat16); device collectives use MPI",
             api.version / 10000, api.version / 100 % 100, api.version % 100);
    refuse(why);
    return;
  }
#define NCCL_LOAD(name)                                             \
  if (!(api.name = (__typeof__(name) *)dlsym(api.handle, #name))) { \
    refuse("the NCCL library lacks " #name);                        \
    return;                                                         \
  }
  NCCL_FUNCTIONS(NCCL_LOAD)
#undef NCCL_LOAD
}

int gs_nccl_loadable(void) {
  pthread_once(&api_once, open_library);
  if (!api.handle && (gs_env_debug_nccl() || gs_log_level() >= GS_LOG_INFO))
    gs_log(GS_LOG_INFO, "%s", api.error);
  return api.handle != NULL;
}

int gs_nccl_version(void) { return gs_nccl_loadable() ? api.version : 0; }

/* NCCL's words on the communicator's last error. */
static const char *last_error(gs_comm_t c) {
  const char *s = api.handle ? api.ncclGetLastError(c ? (ncclComm_t)c->nccl : NULL) : NULL;
  return s ? s : "";
}

static gs_status_t nccl_fail(gs_comm_t c, ncclResult_t r, const char *what) {
  const char *last = last_error(c);
  return gs_fail(GS_ERR_NCCL, "%s: %s%s%s", what, api.ncclGetErrorString(r), *last ? ": " : "",
                 last);
}

/* ---- polling a non-blocking communicator ------------------------------------------ */

typedef struct detached {
  ncclComm_t comm;
  int device;
} detached_t;

/* Outside the runtime lock, on the communicator's device. */
static void abort_detached(void *arg) {
  detached_t *d = arg;
  gs_cu_scope_t scope;
  int entered = gs_cu_enter(d->device, &scope) == GS_SUCCESS;
  api.ncclCommAbort(d->comm); /* ends its kernels; the handle is gone */
  if (entered) gs_cu_leave(&scope);
  free(d);
}

/* Under the runtime lock: the handle leaves c now (later polls see it gone),
 * the abort runs once this thread releases the lock. */
void gs_nccl_abort(gs_comm_t c, gs_status_t why) {
  if (!c->nccl) return;
  gs_log(GS_LOG_ERROR, "aborting the NCCL communicator (%s)", gs_status_string(why));
  detached_t *d = malloc(sizeof *d);
  ncclComm_t comm = (ncclComm_t)c->nccl;
  c->nccl = NULL;
  if (!d) {
    api.ncclCommAbort(comm); /* out of memory: at once */
    return;
  }
  d->comm = comm;
  d->device = c->dev_id;
  gs_runtime_after_unlock(abort_detached, d);
}

const char *gs_nccl_detail(gs_comm_t c) { return c->nccl ? last_error(c) : NULL; }

/* A poll of a communicator that another wait has aborted (the background
 * watcher polls handed-off requests while a caller may wait on the same
 * one): it reports that wait's reason, so whichever poll finishes the
 * request, it fails the same way (a timeout stays a timeout). -1. */
static int aborted_already(gs_comm_t c, const char *what, gs_status_t *err) {
  gs_status_t why = c->fate.broken ? c->fate.broken : GS_ERR_NCCL;
  *err = gs_fail(why, "%s: the NCCL communicator was aborted: %s", what, gs_status_string(why));
  return -1;
}

typedef struct settle_ctx {
  gs_comm_t c;
  const char *what;
} settle_ctx_t;

static int settle_poll(void *ctx, gs_status_t *err) {
  settle_ctx_t *s = ctx;
  if (!s->c->nccl) return aborted_already(s->c, s->what, err);
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = api.ncclCommGetAsyncError((ncclComm_t)s->c->nccl, &state);
  if (r == ncclSuccess && state == ncclInProgress) return 0;
  if (r == ncclSuccess && state == ncclSuccess) return 1;
  *err = nccl_fail(s->c, r != ncclSuccess ? r : state, s->what);
  gs_nccl_abort(s->c, GS_ERR_NCCL);
  s->c->fate.broken = GS_ERR_NCCL;
  return -1;
}

static void settle_abort(void *ctx, gs_status_t why) {
  gs_nccl_abort(((settle_ctx_t *)ctx)->c, why);
}
static const char *settle_detail(void *ctx) { return gs_nccl_detail(((settle_ctx_t *)ctx)->c); }

gs_status_t gs_nccl_settle(gs_comm_t c, ncclResult_t r, const char *what) {
  if (r == ncclSuccess) return GS_SUCCESS;
  if (r != ncclInProgress) {
    gs_status_t s = nccl_fail(c, r, what);
    gs_nccl_abort(c, GS_ERR_NCCL);
    c->fate.broken = GS_ERR_NCCL;
    return s;
  }
  settle_ctx_t ctx = {c, what};
  gs_wait_t w = {settle_poll, settle_abort, NULL, settle_detail, &ctx, what};
  return gs_progress_wait(&w);
}

int gs_nccl_poll(gs_comm_t c, void *event, const char *what, gs_status_t *err) {
  if (!c->nccl) return aborted_already(c, what, err);
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = api.ncclCommGetAsyncError((ncclComm_t)c->nccl, &state);
  if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
    char said[160];
    snprintf(said, sizeof said, "%s: NCCL reported an asynchronous error", what);
    *err = nccl_fail(c, r != ncclSuccess ? r : state, said);
    gs_nccl_abort(c, GS_ERR_NCCL);
    c->fate.broken = GS_ERR_NCCL;
    return -1;
  }
  int done = gs_cu_event_poll(event, what);
  if (done < 0) *err = GS_ERR_CUDA;
  return done;
}

/* ---- communicators ---------------------------------------------------------------------- */

/* The 2.14 layout of ncclConfig_t (fields are only appended): NCCL reads as
 * many bytes as `size` says, so this works with every NCCL from 2.14 on,
 * whichever nccl.h gradsync was built with. */
typedef struct config_2_14 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking, cgaClusterSize, minCTAs, maxCTAs;
  const char *netName;
  int splitShare;
} config_2_14_t;

gs_status_t gs_nccl_comm_init(gs_comm_t c) {
  if (!gs_nccl_loadable()) return gs_fail(GS_ERR_UNSUPPORTED, "%s", api.error);
  /* rank 0's id, and whether it has one (it broadcasts even after a failure,
   * so nobody waits); on the heap and kept if the wait gives up, as MPI may
   * still complete the broadcast into it */
  struct {
    ncclUniqueId id;
    int ok;
  } *boot = calloc(1, sizeof *boot);
  if (!boot) return gs_fail(GS_ERR_NO_MEMORY, "gradsync: out of memory");
  gs_status_t s = GS_SUCCESS;
  if (c->rank == 0) {
    ncclResult_t r = api.ncclGetUniqueId(&boot->id);
    if (r != ncclSuccess) s = nccl_fail(NULL, r, "ncclGetUniqueId");
  }
  boot->ok = s == GS_SUCCESS;
  MPI_Request req;
  GS_CHECK(gs_mpi_finish(MPI_Ibcast(boot, (int)sizeof *boot, MPI_BYTE, 0, c->mpi, &req), &req,
                         "gradsync: NCCL bootstrap (MPI_Ibcast)"));
  ncclUniqueId id = boot->id;
  int ok = boot->ok;
  free(boot);
  if (!ok) return s != GS_SUCCESS ? s : gs_fail(GS_ERR_NCCL, "ncclGetUniqueId failed on rank 0");
#ifndef NCCL_API_MAGIC /* headers before 2.30 write the magic out */
#define NCCL_API_MAGIC 0xcafebeef
#endif
  config_2_14_t cfg = {sizeof cfg,
                       NCCL_API_MAGIC,
                       MIN_VERSION,
                       0,
                       NCCL_CONFIG_UNDEF_INT,
                       NCCL_CONFIG_UNDEF_INT,
                       NCCL_CONFIG_UNDEF_INT,
                       NCCL_CONFIG_UNDEF_PTR,
                       NCCL_CONFIG_UNDEF_INT};
  ncclComm_t comm = NULL;
  ncclResult_t r = api.ncclCommInitRankConfig(&comm, c->size, id, c->rank, (ncclConfig_t *)&cfg);
  c->nccl = comm;
  if (r != ncclSuccess && r != ncclInProgress) {
    s = nccl_fail(c, r, "ncclCommInitRankConfig");
    if (comm) api.ncclCommAbort(comm);
    c->nccl = NULL;
    return s;
  }
  s = gs_nccl_settle(c, r, "ncclCommInitRankConfig"); /* polls the initialization */
  if (s != GS_SUCCESS) {
    gs_nccl_abort(c, s);
    if (s == GS_ERR_INTERRUPTED) { /* the interrupt goes up; c is unusable */
      c->fate.broken = s;
      return s;
    }
    c->fate.broken = GS_SUCCESS; /* the ranks agree on a fallback in choose_path */
    if (s == GS_ERR_TIMEOUT)
      s = gs_fail(s,
                  "ncclCommInitRankConfig did not complete within "
                  "GRADSYNC_TIMEOUT_SECONDS=%g s (NCCL's bootstrap did not reach every rank)",
                  gs_env_timeout_seconds());
  }
  return s;
}

/* At close, after the communicator's last work on its stream has finished:
 * ncclCommFinalize, polled like every wait (GRADSYNC_TIMEOUT_SECONDS,
 * interrupts), then ncclCommDestroy, which has nothing left to wait for. A
 * finalize that fails or gives up aborts instead (settle), and c is then
 * unusable. ncclCommDestroy alone would finalize first, blocking without
 * bound. */
gs_status_t gs_nccl_comm_free(gs_comm_t c) {
  if (!c->nccl || !api.handle) {
    c->nccl = NULL;
    return GS_SUCCESS;
  }
  gs_fate_t *saved = gs_runtime_bind(&c->fate); /* a finalize that gives up marks c */
  gs_status_t s = gs_nccl_settle(c, api.ncclCommFinalize((ncclComm_t)c->nccl), "ncclCommFinalize");
  gs_runtime_bind(saved);
  if (s == GS_SUCCESS && c->nccl) api.ncclCommDestroy((ncclComm_t)c->nccl);
  c->nccl = NULL;
  return s;
}

#else /* no NCCL header at build time */

int gs_nccl_loadable(void) { return 0; }
int gs_nccl_version(void) { return 0; }
static gs_status_t gs_nccl_comm_init(gs_comm_t c) {
  (void)c;
  return gs_fail(GS_ERR_UNSUPPORTED, "gradsync was built without NCCL");
}
static gs_status_t gs_nccl_comm_free(gs_comm_t c) {
  c->nccl = NULL;
  return GS_SUCCESS;
}
/* Never chosen: the engine takes NCCL only where gs_nccl_loadable() says so. */
const gs_transport_t gs_nccl_transport = {
    .name = "nccl", .init = gs_nccl_comm_init, .free = gs_nccl_comm_free};
#endif
