/* gradsync private, base/: the flight recorder's ring and tables (flight.c,
 * flight_dump.c) and the calls every layer above records with. C only
 * (atomics): CUDA sources never include it. */
#ifndef GRADSYNC_FLIGHT_RING_H
#define GRADSYNC_FLIGHT_RING_H

#include <pthread.h>
#include <stdatomic.h>

#include "gs_flight.h"
#include "base/gs_base.h"

#define GS_FLIGHT_MAX_COMMS 256 /* communicators named in a dump; later ones go unrecorded */
#define GS_FLIGHT_MEMBERS 64    /* world ranks listed per communicator (all are hashed) */
#define GS_FLIGHT_MAX_SITES 4096 /* distinct Python call sites */

enum { GS_FLIGHT_VALIDATED = 1, GS_FLIGHT_SENT = 2 };
/* The path of calls that ride in validation: validated and sent when done
 * (two clock reads fewer on the latency-bound path). */
extern const char gs_flight_shortcut[];

typedef struct gs_flight_slot {
  _Atomic uint64_t id; /* the entry's id, 0 while it is written */
  gs_flight_entry_t e;
} gs_flight_slot_t;

typedef struct gs_flight_comm {
  uint64_t hash;    /* of the members' world ranks */
  int32_t ordinal;  /* earlier communicators of this process on the same ranks */
  int32_t size, rank;
  uint64_t last_seq; /* the last call entered */
  int32_t freed;     /* gs_comm_free was called */
  int32_t members[GS_FLIGHT_MEMBERS];
} gs_flight_comm_t;

typedef struct gs_flight_state {
  gs_flight_slot_t *ring; /* made once, at the first communicator */
  int64_t cap;
  int stacks;             /* GRADSYNC_FLIGHT_STACKS */
  _Atomic uint64_t next;  /* entries recorded so far */
  int world_rank, world_size; /* cached at the first communicator: the watcher makes no MPI call */
  pthread_mutex_t lock; /* the tables (not the ring) and the dump */
  _Atomic int32_t ncomms, nsites;
  gs_flight_comm_t comms[GS_FLIGHT_MAX_COMMS];
  char *sites[GS_FLIGHT_MAX_SITES];
} gs_flight_state_t;
extern gs_flight_state_t gs_flight;

/* What a call records at entry. */
typedef struct gs_flight_call {
  int32_t comm;
  int32_t p2p;
  uint64_t seq;
  const char *op;
  const gs_tensor_t *tensors; /* NULL when they failed this rank's checks */
  int64_t n;
  int32_t redop, root, tag;
} gs_flight_call_t;

int32_t gs_flight_current_site(void); /* the calling thread's (queued calls carry it along) */
void gs_flight_start(void); /* makes the ring once (GRADSYNC_FLIGHT_ENTRIES) */
/* Registers a communicator: its size, this process's rank in it, this
 * process's rank in the world and the world's size (gs_comm_set_world), the
 * members' world ranks. Returns its index, or -1. */
int32_t gs_flight_comm(int size, int rank, int world_rank, int world_size, const int *members);
void gs_flight_comm_seq(int32_t comm, uint64_t seq);
void gs_flight_comm_freed(int32_t comm);
/* O(1), no allocation: returns the entry's id (0 while the recorder is off). */
uint64_t gs_flight_enter(const gs_flight_call_t *call);
/* The entry `id` names, while the ring has not moved past it (else NULL). */
gs_flight_entry_t *gs_flight_live(uint64_t id);
void gs_flight_phase(uint64_t id, int phase);
void gs_flight_path(uint64_t id, const char *path);
/* Completes the entry; a timeout, mismatch, interrupt, MPI or NCCL error
 * dumps the ring and names the file in the last error. */
void gs_flight_end(uint64_t id, gs_status_t status);
/* The dump on failure (flight_dump.c): appends the file's name to the last error. */
void gs_flight_dump_failure(gs_status_t status);

#endif
