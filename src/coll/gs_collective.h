/* gradsync private, coll/ (a layer: docs/ARCHITECTURE.md): every public collective fills
 * one call descriptor and hands it to one skeleton (skeleton.c), as NCCL's
 * collectives hand an info struct to one enqueue: enter the runtime, check
 * the arguments, validate across ranks, open the engine, plan, run the
 * messages, close. Each collective's file says only what is its own. */
#ifndef GRADSYNC_COLLECTIVE_H
#define GRADSYNC_COLLECTIVE_H

#include "gradsync.h"
#include "comm/gs_comm_internal.h"

typedef struct gs_coll gs_coll_t;
struct gs_coll {
  /* ---- the call, as the entry point received it */
  const char *fn;              /* "gs_allreduce": argument errors name it */
  const char *name;            /* "allreduce": the timeline's and device waits' name */
  gs_call_kind_t kind;
  const gs_tensor_t *in, *out; /* out NULL: in place, or none */
  const char *in_name;         /* "in" or "tensors", for messages */
  int64_t n;
  gs_op_t op;                  /* reductions only; the scales are reduction-only too */
  double pre, post;            /* post includes average's 1/size once validated */
  int root;
  const int64_t *counts;       /* the collective's count array, if any */
  const int64_t *counts2;      /* a second one (alltoallv's receive counts) */
  void *extra;                 /* the collective's own further arguments or state */
  /* ---- the collective's parts (NULL: none) */
  /* Its own argument checks after the common ones (in, out, op). May set
   * `call` fields and `plan_on`/`memory`. */
  gs_status_t (*check)(gs_comm_t c, gs_coll_t *d);
  /* out_required: out is an argument (NULL is an error, not "in place");
   * op_checked: the op and scales are checked (allow_adasum: Adasum too);
   * own_checks: `check` does every check (rank-dependent arguments). */
  int out_required, op_checked, allow_adasum, own_checks;
  /* Replaces the usual validation (gs_begin_call), e.g. to carry more in
   * the validation message (alltoallv's count balance). */
  gs_status_t (*validate)(gs_comm_t c, gs_coll_t *d, gs_status_t local);
  /* Runs instead of validation when it sets *taken (allreduce's small
   * calls, which validate and reduce in one message). */
  gs_status_t (*shortcut)(gs_comm_t c, gs_coll_t *d, int *taken);
  /* The work once validated: per message of the plan over `plan_on`, or
   * `run` once. e is NULL when `memory` is NULL (the call moves no tensor
   * data: count exchanges). */
  gs_status_t (*message)(const gs_engine_t *e, const gs_plan_t *plan, const gs_message_t *m,
                         gs_coll_t *d);
  gs_status_t (*run)(const gs_engine_t *e, gs_coll_t *d);
  int fuse_direct; /* plan with no direct-size tensor alone (gs_plan_tensors) */
  const char *record_as;       /* the flight record's name (NULL: the kind's) */
  /* Frees what `check` allocated into `extra`. */
  void (*release)(gs_coll_t *d);
  /* ---- set by the skeleton (check may adjust) */
  gs_comm_t comm;
  gs_call_t call;              /* what the ranks validate */
  const gs_tensor_t *plan_on;  /* the list planned: in unless changed */
  const gs_tensor_t *memory;   /* where the data lives (the engine): in unless changed */
};

/* Runs one collective call described by d (skeleton.c). */
gs_status_t gs_collective(gs_comm_t c, gs_coll_t *d);
/* For a call that exchanges counts only (no tensor data): the ranks
 * validate the row sizes, their element counts may differ, and no engine
 * opens. */
void gs_coll_counts_only(gs_coll_t *d, const int64_t *row_elems);
/* The flight recorder's one entry point (skeleton.c): counts the call in
 * the communicator's collective sequence (p2p: its point-to-point one) and
 * records it; returns the record's id for gs_flight_phase/_end. */
uint64_t gs_coll_record(gs_comm_t c, int p2p, const char *name, const gs_tensor_t *t, int64_t n,
                        gs_op_t op, int root_or_peer, int tag);
/* The postscale a reduction applies: average divides by the size. */
double gs_postscale(gs_comm_t c, gs_op_t op, double postscale);

#endif
