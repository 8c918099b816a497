/* gradsync: point-to-point messages between two ranks of a communicator.
 *
 * Matching: a receive from `source` with `tag` takes the oldest message that
 * rank sent to this one with that tag on this communicator, in the order the
 * sends were made (MPI's rule); a list of n tensors is n messages, tensor by
 * tensor. Messages never match a collective's traffic. The receiving rank
 * checks each message against its tensor: another dtype or element count
 * returns GS_ERR_MISMATCH there naming both sides (the sender has finished
 * by then; the receive tensor's contents are then unspecified).
 *
 * Completion: a send returns once its tensor may be reused (small messages
 * before the receiver has asked for them). A receive that no rank ever
 * sends to waits like a collective: it fails with GS_ERR_TIMEOUT after
 * GRADSYNC_TIMEOUT_SECONDS (gs_set_timeout_seconds), or GS_ERR_INTERRUPTED
 * on Ctrl-C, and the communicator is unusable afterwards; with no timeout
 * set it waits. A blocking send to this rank itself needs its receive posted
 * first (gs_irecv).
 *
 * Point-to-point calls are not ordered with collectives: they neither wait
 * for queued asynchronous collectives nor hold them up, so gs_isend/gs_irecv
 * overlap with them and with each other. Device tensors go through host
 * memory. Counts are 64-bit; one message carries any count. */
#ifndef GRADSYNC_P2P_H
#define GRADSYNC_P2P_H

#include <stdint.h>

#include "gs_async.h"
#include "gs_comm.h"
#include "gs_export.h"
#include "gs_status.h"
#include "gs_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest tag this MPI allows for gradsync's messages (at least 16383). */
GS_API gs_status_t gs_p2p_max_tag(gs_comm_t comm, int *max_tag);

GS_API gs_status_t gs_send(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int dest,
                           int tag);
GS_API gs_status_t gs_recv(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int source,
                           int tag);

/* Post the messages now and return; the request completes when they have.
 * Test or wait on it to make it finish (waiting also reports mismatches and
 * timeouts). The memory must stay untouched until then. */
GS_API gs_status_t gs_isend(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int dest,
                            int tag, gs_request_t *request);
GS_API gs_status_t gs_irecv(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int source,
                            int tag, gs_request_t *request);

/* Any rank, where a source is asked for (gs_recv_any, gs_p2p_probe). */
#define GS_ANY_SOURCE (-1)

/* Receives from whichever rank sent a message with `tag` to this one: the
 * oldest such message no receive posted for its sender has taken is
 * matched when the receive is first tested or waited on, and the n
 * messages all come from that rank. *source (may be NULL; it must stay
 * valid until the receive completes) is -1 until then, and then the
 * sender's rank (n == 0: stays -1). Receives from any source pending at
 * once are matched in the order they are tested or waited on. A wait with
 * no message ever coming ends like any receive's (GRADSYNC_TIMEOUT_SECONDS,
 * interrupts). */
GS_API gs_status_t gs_recv_any(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int tag,
                               int *source);
GS_API gs_status_t gs_irecv_any(gs_comm_t comm, const gs_tensor_t *tensors, int64_t n, int tag,
                                int *source, gs_request_t *request);

/* Whether a message with `tag` from `source` (GS_ANY_SOURCE: any rank)
 * waits here that no posted receive has taken: *found is its sender, else
 * -1. Never waits, receives nothing, and leaves nothing pending (a caller
 * can poll it with a deadline of its own and give up without breaking the
 * communicator). */
GS_API gs_status_t gs_p2p_probe(gs_comm_t comm, int source, int tag, int *found);

#ifdef __cplusplus
}
#endif
#endif
