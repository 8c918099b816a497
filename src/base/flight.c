/* The flight recorder's ring (gs_flight.h): a fixed array of entries made
 * once, a process-wide atomic index, and per entry an id that is 0 while the
 * entry is being written, so a dump from another thread skips torn entries
 * instead of locking the hot path. Communicators and call sites live in
 * small fixed tables next to it (flight_dump.c writes them all). */
#include <mpi.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/gs_base.h"
#include "base/gs_flight_ring.h"

gs_flight_state_t gs_flight = {.lock = PTHREAD_MUTEX_INITIALIZER};

const char gs_flight_shortcut[] = "shortcut";

static pthread_once_t flight_once = PTHREAD_ONCE_INIT;
static _Thread_local int32_t thread_site = -1;
static _Thread_local uint64_t thread_tid;

static void flight_init(void) {
  int64_t cap = gs_env_flight_entries();
  if (cap > 0) gs_flight.ring = calloc((size_t)cap, sizeof *gs_flight.ring);
  gs_flight.cap = gs_flight.ring ? cap : 0;
  gs_flight.stacks = gs_env_flight_stacks();
}

void gs_flight_start(void) { pthread_once(&flight_once, flight_init); }

int64_t gs_flight_capacity(void) {
  gs_flight_start();
  return gs_flight.cap;
}

uint64_t gs_flight_recorded(void) { return atomic_load(&gs_flight.next); }

int32_t gs_flight_comm(int size, int rank, int world_rank, int world_size, const int *members) {
  gs_flight_start();
  pthread_mutex_lock(&gs_flight.lock);
  uint64_t h = 0x6773666cu; /* the members' world ranks name the group on every rank */
  for (int r = 0; r < size; r++) h = gs_hash_mix(h, (uint64_t)(members ? members[r] : r));
  int32_t id = -1, ordinal = 0;
  for (int32_t k = 0; k < gs_flight.ncomms; k++)
    if (gs_flight.comms[k].hash == h) ordinal++; /* created again on the same ranks */
  if (gs_flight.ncomms < GS_FLIGHT_MAX_COMMS) {
    id = gs_flight.ncomms;
    gs_flight_comm_t *c = &gs_flight.comms[id];
    *c = (gs_flight_comm_t){h, ordinal, size, rank, 0, 0, {0}};
    int m = size < GS_FLIGHT_MEMBERS ? size : GS_FLIGHT_MEMBERS;
    for (int r = 0; r < m; r++) c->members[r] = members ? members[r] : r;
    gs_flight.world_rank = world_rank;
    gs_flight.world_size = world_size;
    atomic_store(&gs_flight.ncomms, id + 1);
  }
  pthread_mutex_unlock(&gs_flight.lock);
  return id;
}

void gs_flight_comm_seq(int32_t comm, uint64_t seq) {
  if (comm >= 0 && comm < GS_FLIGHT_MAX_COMMS) gs_flight.comms[comm].last_seq = seq;
}

void gs_flight_comm_freed(int32_t comm) {
  if (comm >= 0 && comm < GS_FLIGHT_MAX_COMMS) gs_flight.comms[comm].freed = 1;
}

int32_t gs_flight_site(const char *text) {
  if (!text || !gs_flight_capacity()) return -1;
  pthread_mutex_lock(&gs_flight.lock);
  int32_t id = -1;
  if (gs_flight.nsites < GS_FLIGHT_MAX_SITES) {
    char *copy = strdup(text); /* once per new site; calls reuse the id */
    if (copy) {
      id = gs_flight.nsites;
      gs_flight.sites[id] = copy;
      atomic_store(&gs_flight.nsites, id + 1);
    }
  }
  pthread_mutex_unlock(&gs_flight.lock);
  return id;
}

void gs_flight_set_site(int32_t site) { thread_site = site; }

int32_t gs_flight_current_site(void) { return thread_site; }

static uint64_t tid(void) {
  if (!thread_tid) thread_tid = (uint64_t)syscall(SYS_gettid);
  return thread_tid;
}

uint64_t gs_flight_enter(const gs_flight_call_t *call) {
  if (!gs_flight.cap) return 0;
  uint64_t k = atomic_fetch_add(&gs_flight.next, 1);
  gs_flight_slot_t *s = &gs_flight.ring[k % (uint64_t)gs_flight.cap];
  atomic_store_explicit(&s->id, 0, memory_order_relaxed); /* torn until the id is back */
  atomic_thread_fence(memory_order_release);
  gs_flight_entry_t *e = &s->e;
  int64_t bytes = 0;
  const gs_tensor_t *t = call->tensors;
  for (int64_t i = 0; t && i < call->n; i++)
    bytes += t[i].count * (int64_t)gs_dtype_size(t[i].dtype);
  *e = (gs_flight_entry_t){k + 1,   call->seq, call->comm,  call->p2p,   call->op,
                           "",      -1,        call->redop, call->root,  -1,
                           call->n, 0,         bytes,       gs_now(),    0,
                           0,       0,         tid(),       thread_site, call->tag};
  if (t && call->n > 0) {
    e->dtype = t[0].dtype;
    e->count = t[0].count;
  }
  if (!call->p2p) gs_flight_comm_seq(call->comm, call->seq);
  atomic_store_explicit(&s->id, k + 1, memory_order_release);
  return k + 1;
}

gs_flight_entry_t *gs_flight_live(uint64_t id) {
  if (!id) return NULL;
  gs_flight_slot_t *s = &gs_flight.ring[(id - 1) % (uint64_t)gs_flight.cap];
  return atomic_load_explicit(&s->id, memory_order_acquire) == id ? &s->e : NULL;
}

void gs_flight_phase(uint64_t id, int phase) {
  gs_flight_entry_t *e = gs_flight_live(id);
  if (!e) return;
  double t = gs_now();
  if (phase == GS_FLIGHT_VALIDATED) e->t_valid = t;
  if (phase == GS_FLIGHT_SENT) e->t_sent = t;
}

void gs_flight_path(uint64_t id, const char *path) {
  gs_flight_entry_t *e = gs_flight_live(id);
  if (e && path) e->path = path;
}

int64_t gs_flight_snapshot(gs_flight_entry_t *out, int64_t cap) {
  if (!out || cap <= 0 || !gs_flight_capacity()) return 0;
  uint64_t end = atomic_load(&gs_flight.next), n = (uint64_t)gs_flight.cap;
  uint64_t first = end > n ? end - n : 0;
  if (end - first > (uint64_t)cap) first = end - (uint64_t)cap;
  int64_t got = 0;
  for (uint64_t k = first; k < end; k++) {
    gs_flight_slot_t *s = &gs_flight.ring[k % n];
    if (atomic_load_explicit(&s->id, memory_order_acquire) != k + 1) continue;
    out[got] = s->e;
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&s->id, memory_order_relaxed) == k + 1) got++; /* not rewritten */
  }
  return got;
}
