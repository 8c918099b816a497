/* Communicator life cycle and accessors. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "comm/gs_comm_internal.h"
#include "gs_info.h"

gs_status_t gs_comm_valid(gs_comm_t comm, const char *where) {
  if (!comm) return gs_fail(GS_ERR_INVALID_ARGUMENT, "%s: comm is NULL", where);
  if (comm->magic != GS_COMM_MAGIC)
    return gs_fail(GS_ERR_CLOSED, "%s: comm was freed or is not a gradsync communicator", where);
  return GS_SUCCESS;
}

static gs_status_t mpi_ready(const char *where) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: MPI is %s; initialize it first (import mpi4py.MPI, or MPI_Init)", where,
                   fin ? "already finalized" : "not initialized");
  return GS_SUCCESS;
}

gs_status_t gs_comm_enter(gs_comm_t comm, const char *where) {
  GS_CHECK(gs_comm_valid(comm, where));
  if (comm->fate.broken)
    return gs_fail(comm->fate.broken,
                   "%s: this communicator is unusable: an earlier collective was "
                   "abandoned (%s) while other ranks may still be inside it; end the job or "
                   "create a new communicator after all ranks recovered",
                   where, gs_status_string(comm->fate.broken));
  gs_runtime_bind(&comm->fate);
  return GS_SUCCESS;
}

static int node_cores(void) {
  cpu_set_t cpus;
  int ncpu = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus)
                                                           : (int)sysconf(_SC_NPROCESSORS_ONLN);
  /* A rank pinned to one core says nothing about the node: count the node's. */
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > ncpu ? (int)online : ncpu;
}

/* gs_comm_set_world's communicator; MPI_COMM_NULL: MPI_COMM_WORLD. */
static MPI_Comm named_world = MPI_COMM_NULL;

gs_status_t gs_comm_set_world(MPI_Comm world) {
  gs_clear_error();
  if (world == MPI_COMM_NULL)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_set_world: world is MPI_COMM_NULL");
  named_world = world;
  int rank = -1;
  MPI_Comm_rank(world, &rank);
  gs_log_set_rank(rank);
  return GS_SUCCESS;
}

/* Names the communicator in the flight recorder by its members' ranks in
 * the world (gs_comm_set_world), which every member computes alike. */
static void flight_register(struct gs_comm *c) {
  c->flight = -1;
  MPI_Comm wc = named_world == MPI_COMM_NULL ? MPI_COMM_WORLD : named_world;
  int world = 0, world_size = 1, *in = malloc((size_t)c->size * sizeof *in),
      *out = malloc((size_t)c->size * sizeof *out);
  MPI_Group mine = MPI_GROUP_NULL, all = MPI_GROUP_NULL;
  MPI_Comm_rank(wc, &world);
  MPI_Comm_size(wc, &world_size);
  if (in && out && MPI_Comm_group(c->mpi, &mine) == MPI_SUCCESS &&
      MPI_Comm_group(wc, &all) == MPI_SUCCESS) {
    for (int r = 0; r < c->size; r++) in[r] = r;
    if (MPI_Group_translate_ranks(mine, c->size, in, all, out) == MPI_SUCCESS)
      c->flight = gs_flight_comm(c->size, c->rank, world, world_size, out);
  }
  if (mine != MPI_GROUP_NULL) MPI_Group_free(&mine);
  if (all != MPI_GROUP_NULL) MPI_Group_free(&all);
  free(in);
  free(out);
}

/* Takes ownership of `mine` (already a private communicator). */
/* The host's shared region, when every rank is on one host (collective):
 * validation and small allreduces ride on it, and every wait of the
 * communicator watches the peers' processes through it, ending at once
 * when one is gone or gave up (and telling them when this rank gives up). */
static gs_status_t share_host(struct gs_comm *c) {
  GS_CHECK(gs_shm_open(c, gs_env_shm_bytes(), &c->shm));
  if (c->shm) {
    c->fate.watch = gs_shm_watch;
    c->fate.tell = gs_shm_give_up;
    c->fate.watch_ctx = c->shm;
  }
  return GS_SUCCESS;
}

/* c's place: the notice channel, its rank and size, and among the ranks
 * sharing its node; an MPI error code. */
static int place(struct gs_comm *c) {
  MPI_Comm node = MPI_COMM_NULL;
  int e = MPI_Comm_dup(c->mpi, &c->notice);
  if (e == MPI_SUCCESS) e = MPI_Comm_rank(c->mpi, &c->rank);
  if (e == MPI_SUCCESS) e = MPI_Comm_size(c->mpi, &c->size);
  if (e == MPI_SUCCESS)
    e = MPI_Comm_split_type(c->mpi, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  if (e == MPI_SUCCESS) e = MPI_Comm_rank(node, &c->local_rank);
  if (e == MPI_SUCCESS) e = MPI_Comm_size(node, &c->local_size);
  if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
  return e;
}

static gs_status_t comm_adopt(MPI_Comm mine, const gs_config_t *cfg, gs_comm_t *out) {
  struct gs_comm *c = calloc(1, sizeof *c);
  if (!c) {
    MPI_Comm_free(&mine);
    return gs_fail(GS_ERR_NO_MEMORY, "gs_comm_create: out of memory");
  }
  c->mpi = mine;
  c->notice = MPI_COMM_NULL;
  int e = place(c);
  gs_status_t s = e == MPI_SUCCESS ? gs_mpi_transport.init(c) : gs_mpi_fail(e, "gs_comm_create");
  if (s != GS_SUCCESS) {
    if (c->notice != MPI_COMM_NULL) MPI_Comm_free(&c->notice);
    MPI_Comm_free(&c->mpi);
    free(c);
    return s;
  }
  /* Errors come back as codes so gradsync can turn them into statuses. */
  MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(c->notice, MPI_ERRORS_RETURN);
  int know_check = cfg && cfg->size >= offsetof(gs_config_t, check) + sizeof cfg->check;
  int know_stall =
      cfg && cfg->size >= offsetof(gs_config_t, stall_seconds) + sizeof cfg->stall_seconds;
  int know_direct =
      cfg && cfg->size >= offsetof(gs_config_t, direct_bytes) + sizeof cfg->direct_bytes;
  c->fusion_threshold =
      (cfg && cfg->fusion_threshold > 0) ? cfg->fusion_threshold : gs_env_fusion_threshold();
  c->direct_bytes = (know_direct && cfg->direct_bytes > 0)
                        ? cfg->direct_bytes
                        : gs_env_direct_bytes_for(c->host_max < c->size);
  c->pipeline_bytes = gs_env_pipeline_bytes_for(c->host_max < c->size);
  c->cma_bytes = gs_env_cma_bytes();
  c->check = (know_check && cfg->check >= 0) ? (cfg->check != 0) : gs_env_check();
  c->stall_seconds =
      (know_stall && cfg->stall_seconds >= 0) ? cfg->stall_seconds : gs_env_stall_seconds();
  c->fate.owns_core = c->local_size <= node_cores();
  s = share_host(c);
  if (s != GS_SUCCESS) {
    gs_mpi_transport.free(c);
    MPI_Comm_free(&c->notice);
    MPI_Comm_free(&c->mpi);
    free(c);
    return s;
  }
  flight_register(c);
  c->magic = GS_COMM_MAGIC;
  *out = c;
  gs_log(GS_LOG_INFO,
         "communicator: rank %d of %d (%d on this node), fusion threshold %lld "
         "bytes, direct from %lld bytes, pipeline pieces of %lld bytes, validation %s, stall "
         "warning after %.0f s",
         c->rank, c->size, c->local_size, (long long)c->fusion_threshold,
         (long long)c->direct_bytes, (long long)c->pipeline_bytes, c->check ? "on" : "off",
         c->stall_seconds);
  return GS_SUCCESS;
}

gs_status_t gs_comm_create(MPI_Comm mpi_comm, const gs_config_t *config, gs_comm_t *comm) {
  gs_timeline_from_env();
  if (!comm) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_create: comm (the output) is NULL");
  *comm = NULL;
  GS_CHECK(mpi_ready("gs_comm_create"));
  if (mpi_comm == MPI_COMM_NULL)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_create: mpi_comm is MPI_COMM_NULL");
  int inter = 0;
  GS_MPI_CHECK(MPI_Comm_test_inter(mpi_comm, &inter), "gs_comm_create: MPI_Comm_test_inter");
  if (inter)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "gs_comm_create: mpi_comm is an intercommunicator; pass an intracommunicator");
  MPI_Comm mine;
  GS_MPI_CHECK(MPI_Comm_dup(mpi_comm, &mine), "gs_comm_create: MPI_Comm_dup");
  return comm_adopt(mine, config, comm);
}

/* Notices of stalls that nobody read are dropped here, so they don't linger
 * in MPI's unexpected-message queue. */
static void drain_notices(MPI_Comm notice) {
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, notice, &flag, &st) != MPI_SUCCESS || !flag) return;
    uint64_t junk[2];
    MPI_Recv(junk, 2, MPI_UINT64_T, st.MPI_SOURCE, st.MPI_TAG, notice, MPI_STATUS_IGNORE);
  }
}

/* Abandoned communicators stay here, reachable: MPI or the device may still
 * complete work into their buffers (a bounded leak, not a lost one). */
static struct gs_comm *abandoned[64];
static int nabandoned;

static void abandoned_keep(struct gs_comm *c) {
  if (nabandoned < 64) abandoned[nabandoned++] = c;
}

/* What stays of a communicator that was abandoned: MPI may still complete
 * abandoned operations into its buffers and over its communicators, and the
 * device may still run what its stream holds (an aborted NCCL communicator
 * included): keep them (a bounded leak) rather than risk writes into freed
 * memory; only the handle dies. */
static void keep_abandoned(gs_comm_t c, gs_comm_t *comm) {
  /* a lost peer is already said by the error every survivor got, and a
   * shrink abandons such a communicator on purpose: no warning for it */
  gs_log(c->fate.broken == GS_ERR_PEER_LOST ? GS_LOG_INFO : GS_LOG_WARNING,
         "freeing a communicator abandoned after %s: its MPI "
         "communicators and buffers are kept",
         gs_status_string(c->fate.broken));
  /* volatile: a plain store before free() is a dead store the compiler may drop,
   * and a stale handle would then still pass gs_comm_valid */
  *(volatile uint32_t *)&c->magic = 0;
  abandoned_keep(c);
  *comm = NULL;
}

static gs_status_t comm_free_impl(gs_comm_t *comm) {
  if (!comm || !*comm) return GS_SUCCESS;
  gs_comm_t c = *comm;
  GS_CHECK(gs_comm_valid(c, "gs_comm_free")); /* a broken one can still be freed */
  gs_flight_comm_freed(c->flight); /* nobody waits on it any more: the doctor looks elsewhere */
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  gs_status_t s = GS_SUCCESS;
  if (!c->fate.broken) gs_async_settle_comm(c);
  /* its last GPU work, then NCCL's finalize: a wait that fails leaves c broken */
  if (!c->fate.broken) s = gs_device_path_free(c);
  if (c->fate.broken) {
    keep_abandoned(c, comm);
    return s;
  }
  gs_adasum_free(c);
  gs_mpi_transport.free(c); /* the host transport's state: its communicators first */
  gs_shm_close(c->shm);
  if (init && !fin) {
    drain_notices(c->notice);
    MPI_Comm_free(&c->notice);
    MPI_Comm_free(&c->mpi);
  }
  gs_buffers_free(c);
  /* volatile: a plain store before free() is a dead store the compiler may drop,
   * and a stale handle would then still pass gs_comm_valid */
  *(volatile uint32_t *)&c->magic = 0;
  free(c);
  *comm = NULL;
  return s;
}

static gs_status_t comm_split_impl(gs_comm_t comm, int color, int key, gs_comm_t *out) {
  if (!out) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_split: out is NULL");
  *out = NULL;
  GS_CHECK(gs_comm_enter(comm, "gs_comm_split"));
  MPI_Comm sub;
  GS_MPI_CHECK(MPI_Comm_split(comm->mpi, color < 0 ? MPI_UNDEFINED : color, key, &sub),
               "gs_comm_split: MPI_Comm_split");
  if (sub == MPI_COMM_NULL) return GS_SUCCESS;
  gs_config_t cfg = GS_CONFIG_INITIALIZER;
  cfg.fusion_threshold = comm->fusion_threshold;
  cfg.check = comm->check;
  cfg.stall_seconds = comm->stall_seconds;
  cfg.direct_bytes = comm->direct_bytes;
  gs_status_t s = comm_adopt(sub, &cfg, out);
  if (s == GS_SUCCESS) (*out)->fate.timeout = comm->fate.timeout;
  return s;
}

#define GETTER(fn, field)                                                            \
  gs_status_t fn(gs_comm_t comm, int *v) {                                           \
    GS_CHECK(gs_comm_valid(comm, #fn));                                              \
    if (!v) return gs_fail(GS_ERR_INVALID_ARGUMENT, #fn ": output pointer is NULL"); \
    *v = comm->field;                                                                \
    return GS_SUCCESS;                                                               \
  }
GETTER(gs_comm_rank, rank)
GETTER(gs_comm_size, size)
GETTER(gs_comm_local_rank, local_rank)
GETTER(gs_comm_local_size, local_size)
GETTER(gs_comm_check_enabled, check)
#undef GETTER

gs_status_t gs_comm_mpi(gs_comm_t comm, MPI_Comm *mpi_comm) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_mpi"));
  if (!mpi_comm) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_mpi: mpi_comm is NULL");
  *mpi_comm = comm->mpi;
  return GS_SUCCESS;
}

gs_status_t gs_comm_fusion_threshold(gs_comm_t comm, int64_t *bytes) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_fusion_threshold"));
  if (!bytes) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_fusion_threshold: bytes is NULL");
  *bytes = comm->fusion_threshold;
  return GS_SUCCESS;
}

gs_status_t gs_comm_ride_bytes(gs_comm_t comm, int64_t *bytes) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_ride_bytes"));
  if (!bytes) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_ride_bytes: bytes is NULL");
  *bytes = gs_check_payload_limit(comm);
  return GS_SUCCESS;
}

gs_status_t gs_comm_set_fusion_threshold(gs_comm_t comm, int64_t bytes) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_set_fusion_threshold"));
  if (bytes <= 0)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "gs_comm_set_fusion_threshold: bytes must be positive, got %lld",
                   (long long)bytes);
  comm->fusion_threshold = bytes;
  return GS_SUCCESS;
}

gs_status_t gs_comm_set_timeout(gs_comm_t comm, double seconds) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_set_timeout"));
  if (!(seconds >= 0))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_set_timeout: seconds must be >= 0, got %g",
                   seconds);
  comm->fate.timeout = seconds;
  return GS_SUCCESS;
}

gs_status_t gs_comm_timeout(gs_comm_t comm, double *seconds) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_timeout"));
  if (!seconds) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_timeout: seconds is NULL");
  *seconds = comm->fate.timeout;
  return GS_SUCCESS;
}

const char *gs_mpi_library_version(void) {
  static char version[MPI_MAX_LIBRARY_VERSION_STRING + 1];
  int len = 0;
  if (MPI_Get_library_version(version, &len) != MPI_SUCCESS) len = 0;
  version[len] = '\0';
  return version;
}

const char *gs_mpi_library_path(void) {
  Dl_info info;
  if (dladdr((void *)&MPI_Comm_rank, &info) && info.dli_fname) return info.dli_fname;
  return "";
}

int gs_mpi_thread_level(void) {
  int init = 0, level = -1;
  MPI_Initialized(&init);
  if (init) MPI_Query_thread(&level);
  return level;
}

gs_status_t gs_comm_device_transport(gs_comm_t comm, const char **name) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_device_transport"));
  if (!name) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_device_transport: name is NULL");
  *name = comm->dev_path == GS_PATH_NCCL         ? gs_nccl_transport.name
          : comm->dev_path == GS_PATH_CUDA_AWARE ? gs_cuda_aware_transport.name
          : comm->dev_path == GS_PATH_STAGED     ? gs_staged_transport.name
                                                 : "none";
  return GS_SUCCESS;
}

/* The communicator's stream: made with its device path, at its first
 * collective on CUDA memory (an asynchronous one runs on the background
 * thread, so it may not have yet). */
static gs_status_t comm_stream(gs_comm_t comm, const char *fn, void **stream) {
  GS_CHECK(gs_comm_valid(comm, fn));
  if (!comm->dev_stream)
    return gs_fail(GS_ERR_INVALID_ARGUMENT,
                   "%s: this communicator has run no collective on CUDA memory yet; its "
                   "stream is made by the first one, on that memory's device",
                   fn);
  *stream = comm->dev_stream;
  return GS_SUCCESS;
}

static gs_status_t cuda_stream_impl(gs_comm_t comm, void **stream) {
  if (!stream) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_cuda_stream: stream is NULL");
  *stream = NULL;
  return comm_stream(comm, "gs_comm_cuda_stream", stream);
}

static gs_status_t cuda_order_after_impl(gs_comm_t comm, uintptr_t stream) {
  void *ours = NULL;
  GS_CHECK(comm_stream(comm, "gs_comm_cuda_order_after", &ours));
  gs_cu_scope_t scope;
  GS_CHECK(gs_cu_enter(comm->dev_id, &scope));
  gs_status_t s = gs_cu_order(ours, gs_cu_as_stream(stream), "gs_comm_cuda_order_after");
  gs_cu_leave(&scope);
  return s;
}

/* The runtime lock, not the queue's order: the stream is made and freed
 * under it, and these do not follow queued asynchronous calls. */
gs_status_t gs_comm_cuda_stream(gs_comm_t comm, void **stream) {
  gs_enter_runtime_unordered();
  gs_status_t s = cuda_stream_impl(comm, stream);
  gs_leave_runtime();
  return s;
}

gs_status_t gs_comm_cuda_order_after(gs_comm_t comm, uintptr_t stream) {
  gs_enter_runtime_unordered();
  gs_status_t s = cuda_order_after_impl(comm, stream);
  gs_leave_runtime();
  return s;
}

gs_status_t gs_comm_get_stats(gs_comm_t comm, gs_comm_stats_t *stats) {
  GS_CHECK(gs_comm_valid(comm, "gs_comm_get_stats"));
  if (!stats) return gs_fail(GS_ERR_INVALID_ARGUMENT, "gs_comm_get_stats: stats is NULL");
  *stats = comm->stats;
  return GS_SUCCESS;
}

gs_status_t gs_comm_free(gs_comm_t *comm) {
  gs_enter_runtime();
  gs_status_t s = comm_free_impl(comm);
  gs_leave_runtime();
  return s;
}

gs_status_t gs_comm_split(gs_comm_t comm, int color, int key, gs_comm_t *out) {
  gs_enter_runtime();
  gs_status_t s = comm_split_impl(comm, color, key, out);
  gs_leave_runtime();
  return s;
}
