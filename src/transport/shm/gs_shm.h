/* gradsync private, transport/shm/: the host's shared region (docs/DESIGN.md section 19).
 *
 * When every rank of a communicator is on one host, its ranks share one
 * anonymous memory region (memfd: it has no name, so nothing is ever left in
 * /dev/shm, whatever way the processes end; the kernel frees it with the last
 * mapping). Each rank owns two slots in it, used by turns (call k writes slot
 * k % 2), and one published counter. An exchange is: write into your slot,
 * publish k, wait until every rank has published k, read the peers' slots.
 * No other synchronisation is needed: a rank writes slot k % 2 again only at
 * call k + 2, which it reaches only after every peer has published k + 1,
 * that is, after every peer has finished reading call k.
 *
 * Validation and small allreduces ride on it (comm/check.c): one exchange
 * carries every rank's call signature and its data, each rank folds the
 * slots in rank order. The wait is the one wait loop (timeout, interrupt),
 * and it watches the peers it waits for: a peer process that is gone ends
 * the wait at once with GS_ERR_PEER_LOST naming it. */
#ifndef GRADSYNC_SHM_H
#define GRADSYNC_SHM_H

#include "mpi/gs_mpi.h"

typedef struct gs_shm gs_shm_t;

/* Makes the region of communicator c, collectively over c->mpi: every rank
 * calls it, and every rank gets a region or every rank gets *out = NULL (a
 * rank that cannot open or map it, a seccomp filter, another PID namespace,
 * GRADSYNC_SHM_BYTES=0; logged once at debug level). slot_bytes: what each
 * slot holds (rank 0's value is everyone's). Fails only on an MPI error. */
gs_status_t gs_shm_open(gs_comm_t c, int64_t slot_bytes, gs_shm_t **out);
/* Unmaps the region and closes the peers' process handles (NULL: nothing). */
void gs_shm_close(gs_shm_t *s);
/* What a slot holds, in bytes. */
size_t gs_shm_slot_bytes(const gs_shm_t *s);
/* This rank's slot for its next exchange: write into it, then exchange. */
void *gs_shm_mine(gs_shm_t *s);

/* Called about every millisecond while an exchange waits: arrived[r] is 1
 * for the ranks that have published (this one included). */
typedef void (*gs_shm_tick_fn)(void *ctx, const unsigned char *arrived, int p, double waited);
/* Publishes this rank's slot and waits until every rank has published its
 * own for the same exchange; then (*slots)[r] is rank r's slot, readable
 * until this rank's next exchange. `what` names the wait in errors; tick may
 * be NULL. A peer that is gone: GS_ERR_PEER_LOST naming it (the
 * communicator is then unusable). */
gs_status_t gs_shm_exchange(gs_shm_t *s, const char *what, gs_shm_tick_fn tick, void *ctx,
                            const void *const **slots);

/* A gs_fate_t watch (ctx: the region): GS_ERR_PEER_LOST naming the
 * communicator's peers whose processes are gone, or the status of a peer
 * that gave up on it (gs_shm_give_up), else GS_SUCCESS. Cheap (a poll of the
 * peers' process handles); every wait of the communicator asks it, so a
 * dead peer ends MPI's waits too, not only the region's. */
gs_status_t gs_shm_watch(void *ctx, const char *what);
/* A gs_fate_t tell (ctx: the region): this rank's wait gave up (`why`:
 * timeout, interrupt, a lost peer), so the communicator is unusable here;
 * the peers' waits on it, now or later, end with the same status instead of
 * completing with a rank that has left, or waiting for it. */
void gs_shm_give_up(void *ctx, gs_status_t why);

#endif
