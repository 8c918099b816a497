/* gradsync: communicators.
 *
 * A gs_comm_t owns a duplicate of an MPI communicator, its fusion buffer and
 * its validation state. gradsync never calls MPI_Init or MPI_Finalize: the
 * application (or mpi4py) owns MPI. */
#ifndef GRADSYNC_COMM_H
#define GRADSYNC_COMM_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gs_comm *gs_comm_t;

/* Options for gs_comm_create. Fields are only ever appended; `size` tells the
 * library which fields the caller knows about. Negative values mean "take the
 * environment variable, else the default" (src/base/env.c reads every variable; docs/GUIDE.md lists them). */
typedef struct gs_config {
  size_t size;                /* sizeof(gs_config_t), set by the initializer */
  int64_t fusion_threshold;   /* bytes per fused message; GRADSYNC_FUSION_THRESHOLD */
  int check;                  /* cross-rank validation 0/1; GRADSYNC_CHECK */
  double stall_seconds;       /* 0 disables the stall warning; GRADSYNC_STALL_SECONDS */
  int64_t direct_bytes;       /* tensors this large skip fusion; GRADSYNC_DIRECT_BYTES */
} gs_config_t;

#define GS_CONFIG_INITIALIZER {sizeof(gs_config_t), -1, -1, -1.0, -1}

/* The communicator whose ranks name processes in the flight record (its
 * file names, headers and the groups of every communicator): by default
 * MPI_COMM_WORLD. Processes started as MPI singletons and joined into one
 * intracommunicator (gs.init, docs/GUIDE.md "Launching") set that one, before
 * creating communicators on it; it must stay valid while they exist. */
GS_API gs_status_t gs_comm_set_world(MPI_Comm world);

/* Duplicates `mpi_comm` (collective over it). `config` may be NULL. */
GS_API gs_status_t gs_comm_create(MPI_Comm mpi_comm, const gs_config_t *config, gs_comm_t *comm);

/* Frees the communicator and its buffers; sets *comm to NULL. Safe on NULL.
 * Frees the duplicated MPI communicator only while MPI is still initialized.
 * On CUDA memory it first waits for the communicator's last GPU work and
 * finalizes NCCL (both polled: GRADSYNC_TIMEOUT_SECONDS, interrupts); if
 * that fails, NCCL is aborted rather than destroyed, the buffers and stream
 * the device may still use are kept, *comm is still set to NULL, and the
 * wait's status is returned. */
GS_API gs_status_t gs_comm_free(gs_comm_t *comm);

/* Collective: ranks with the same color form a new communicator, ordered by
 * (key, rank). color < 0 means "not in any": *out is set to NULL. The new
 * communicator inherits the parent's configuration. */
GS_API gs_status_t gs_comm_split(gs_comm_t comm, int color, int key, gs_comm_t *out);

GS_API gs_status_t gs_comm_rank(gs_comm_t comm, int *rank);
GS_API gs_status_t gs_comm_size(gs_comm_t comm, int *size);
/* Rank and size among the ranks that share this node's memory. */
GS_API gs_status_t gs_comm_local_rank(gs_comm_t comm, int *rank);
GS_API gs_status_t gs_comm_local_size(gs_comm_t comm, int *size);
/* The duplicated MPI communicator gradsync communicates on. */
GS_API gs_status_t gs_comm_mpi(gs_comm_t comm, MPI_Comm *mpi_comm);

GS_API gs_status_t gs_comm_fusion_threshold(gs_comm_t comm, int64_t *bytes);
/* Local setting; every rank must use the same value (validation checks it). */
GS_API gs_status_t gs_comm_set_fusion_threshold(gs_comm_t comm, int64_t bytes);
GS_API gs_status_t gs_comm_check_enabled(gs_comm_t comm, int *enabled);
/* The largest allreduce (bytes of one dtype, below the fusion threshold)
 * that travels inside its validation exchange, validated and reduced in one
 * step: gs_check_payload_bytes() through MPI; a slot of the host's shared
 * region (GRADSYNC_SHM_BYTES) when every rank is on one host. */
GS_API gs_status_t gs_comm_ride_bytes(gs_comm_t comm, int64_t *bytes);

/* What a communicator has done since it was created; local counts. */
typedef struct gs_comm_stats {
  uint64_t calls;         /* collectives called (validated or not)            */
  uint64_t validations;   /* cross-rank checks run                            */
  uint64_t rode_in_check; /* small allreduces completed inside their check    */
  uint64_t messages;      /* data messages sent: one per fused message        */
  uint64_t bytes;         /* bytes in those messages                          */
  uint64_t hierarchical;  /* of those, allreduces made host by host           */
  uint64_t peer_reads;    /* allreduces inside one host read from the peers   */
  uint64_t hugepage_bytes; /* of the tensors they read, gathered in 2 MiB pages */
} gs_comm_stats_t;

GS_API gs_status_t gs_comm_get_stats(gs_comm_t comm, gs_comm_stats_t *stats);

/* For bindings: this rank cannot make the collective the other ranks are
 * making (its arguments failed a check the binding does itself). Takes part
 * in the cross-rank check in its place, so the other ranks fail with
 * GS_ERR_MISMATCH naming this rank and `reason` instead of waiting. Returns
 * `status` with gs_last_error() set to `reason`. Collective when validation is
 * on; with validation off it only records the error. */
GS_API gs_status_t gs_comm_abandon(gs_comm_t comm, gs_status_t status, const char *reason);

/* The transport this communicator's collectives on CUDA memory take, chosen
 * (collectively) at its first such call: "nccl", "mpi-cuda-aware",
 * "mpi-staged", or "none" before that call. */
GS_API gs_status_t gs_comm_device_transport(gs_comm_t comm, const char **name);

/* The communicator's CUDA stream (a cudaStream_t): its collectives on CUDA
 * memory run there, each ordered after the caller's work stream. Every
 * communicator has its own, non-blocking, made at its first collective on
 * CUDA memory on that memory's device (GS_ERR_INVALID_ARGUMENT before) and
 * destroyed by gs_comm_free. Make a stream wait for it to follow the
 * collectives queued so far. */
GS_API gs_status_t gs_comm_cuda_stream(gs_comm_t comm, void **stream);
/* The communicator's later collectives follow everything queued so far on
 * `stream` (a cudaStream_t; 1: the legacy default stream, 2: the per-thread
 * default stream, as DLPack numbers them). */
GS_API gs_status_t gs_comm_cuda_order_after(gs_comm_t comm, uintptr_t stream);

/* Collective barrier that takes part in validation and the stall warning. */
GS_API gs_status_t gs_barrier(gs_comm_t comm);

/* Called about every 100 ms by a thread waiting inside a collective (not by
 * the background thread of asynchronous calls); a nonzero return abandons
 * the wait with GS_ERR_INTERRUPTED and leaves that communicator unusable.
 * The Python layer installs one that runs Python's signal handlers, so
 * Ctrl-C raises KeyboardInterrupt. NULL removes it. */
typedef int (*gs_interrupt_check_t)(void);
GS_API void gs_set_interrupt_check(gs_interrupt_check_t check);

/* A wait inside a collective longer than this many seconds fails with
 * GS_ERR_TIMEOUT naming the operation, and leaves that communicator unusable
 * (default GRADSYNC_TIMEOUT_SECONDS; 0: wait forever). Process-wide: for
 * every communicator without a timeout of its own. */
GS_API void gs_set_timeout_seconds(double seconds);
/* This communicator's own wait limit, in place of the process-wide one for
 * its collectives, receives and device work (0: follow the process-wide
 * setting again). Local: each rank sets its own; a wait uses the value it
 * finds when it begins. Communicators split from it inherit it. */
GS_API gs_status_t gs_comm_set_timeout(gs_comm_t comm, double seconds);
/* The value gs_comm_set_timeout set (0: none, the process-wide one applies). */
GS_API gs_status_t gs_comm_timeout(gs_comm_t comm, double *seconds);

/* The calling thread's call options (gs_call_options_t): every call this
 * thread starts from now on, on any communicator (collectives, barriers, and
 * asynchronous collectives, which take them when queued), carries them until
 * they are set again; NULL or {0, 0} ends them. Thread-local, so no other
 * thread's calls see them (the torch backend's per-call timeout, the Horovod
 * drop-in's operation names).
 * - tag: compared across ranks with the call's other arguments when
 *   validation is on: ranks whose tags differ fail with GS_ERR_MISMATCH
 *   naming "the call tag", and nothing is written. Not compared with
 *   GRADSYNC_CHECK=0.
 * - timeout: the wait limit of those calls' host waits, in place of the
 *   communicator's (gs_comm_set_timeout) and the process's; device work they
 *   queue keeps the communicator's. Must be >= 0 (GS_ERR_INVALID_ARGUMENT). */
GS_API gs_status_t gs_set_call_options(const gs_call_options_t *options);
/* The calling thread's call options ({0, 0}: none). */
GS_API void gs_get_call_options(gs_call_options_t *options);

/* The MPI library's version string as the library gradsync linked sees it,
 * and the path of the shared object that provides MPI (empty if unknown). */
GS_API const char *gs_mpi_library_version(void);
GS_API const char *gs_mpi_library_path(void);
/* The thread level MPI was initialized with (MPI_THREAD_*), or -1 before init. */
GS_API int gs_mpi_thread_level(void);

#ifdef __cplusplus
}
#endif
#endif
