/* The emulated CUDA runtime's internals, shared by its files. Not a header
 * of gradsync's: the emulation stands in for cudart, the driver entry
 * points gradsync asks for, and the kernel launchers of src/kernels/cuda.cu.
 *
 * What it models, so that a missing synchronization, a use after free or a
 * misaligned access fails `make test` on a machine without a GPU:
 * - every stream has a thread of its own that runs its work in order, later
 *   (GS_EMU_DELAY_US, default 100 microseconds per operation), so the host
 *   runs ahead of the device as it does on hardware;
 * - events, stream waits, synchronize and query; the legacy default stream's
 *   implicit ordering against blocking streams (not against non-blocking
 *   ones), per device;
 * - device memory is tracked: freed memory is poisoned and quarantined, and a
 *   kernel or copy that touches memory outside a live allocation, or an
 *   element at an address not aligned to its size, raises the sticky
 *   cudaErrorIllegalAddress / cudaErrorMisalignedAddress (the context is
 *   then unusable, as on hardware);
 * - cudaFree and cudaFreeHost do not wait for the device (code that uses
 *   them as a barrier fails); cudaFreeAsync frees in stream order;
 * - happens-before (emu_races.c): every operation carries a vector clock of
 *   what it is ordered after (its stream, stream waits on events, the legacy
 *   stream's implicit ordering, and whatever had already finished when it
 *   was queued: the host may have waited for it). A kernel or copy that
 *   touches device memory whose last writer, or (when it writes) whose
 *   readers, it is not ordered after, a use that is not ordered after the
 *   stream-ordered allocation (cudaMallocAsync), and a cudaFreeAsync that is
 *   not ordered after every use are races: reported on stderr and raised as
 *   the sticky cudaErrorIllegalAddress. Races are judged by order, so a
 *   test that holds a stream behind a gate finds them every time;
 * - a destroyed stream keeps running its work, but any later use of its
 *   handle fails and is counted (gs_emulated_destroyed_stream_uses);
 * - cudaMemcpy follows the runtime's documented host synchronization: from
 *   pageable memory to the device it returns once the source is read, the
 *   DMA still queued on the legacy stream (gs_emulated_hold_uploads holds
 *   it behind a gate); device to device it does not wait at all;
 * - primary contexts per device, per-thread current context (driver push
 *   and pop), and which devices ever had their context created;
 * - GS_EMU_DEVICES devices (default 2); GS_EMU_DISTINCT_GPUS=1 gives every
 *   process its own device UUIDs (so gradsync may choose NCCL).
 * Host-to-device copies from pageable memory are counted: gradsync must not
 * make them (their source may be freed before the copy runs). */
#ifndef GS_EMU_H
#define GS_EMU_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

typedef struct emu_stream emu_stream_t;

/* Work for a stream's thread. `fn` runs with `arg` (a private copy of
 * arg_bytes, freed after) and returns cudaSuccess or a sticky error. */
typedef cudaError_t (*emu_fn)(void *arg);
cudaError_t emu_enqueue(cudaStream_t stream, emu_fn fn, const void *arg, size_t arg_bytes);

/* How work touches memory, for the happens-before checks. */
enum { EMU_TOUCH = 0, EMU_READ = 1, EMU_WRITE = 2 };

/* Memory checks for work running on a stream: [p, p + bytes) must lie in
 * one live device, pinned or managed allocation (host: 1 also allows
 * ordinary host memory, for copies to and from pageable memory), p must be
 * aligned to `align`, and the access (EMU_READ or EMU_WRITE) must be
 * ordered after the conflicting accesses before it. Returns cudaSuccess or
 * the sticky error, after printing what was wrong to stderr. */
cudaError_t emu_check_range(const void *p, size_t bytes, size_t align, int host_ok, int access,
                            const char *what);

/* ---- happens-before (emu_streams.c keeps the clocks, emu_races.c judges) ---- */

/* A point in one stream's order: its index and an operation's sequence number. */
typedef struct emu_point {
  int stream;
  uint64_t seq;
} emu_point_t;

/* The clock of the operation running on the calling stream thread: its own
 * point, and for every stream the last sequence number it is ordered after.
 * 0 when the caller is not running a stream's operation. */
typedef struct emu_clock {
  emu_point_t self;
  const uint64_t *vc;
  int n;
} emu_clock_t;
int emu_running_clock(emu_clock_t *clock);
/* Queues an ordering point on `stream` (the stream's position now). */
cudaError_t emu_mark(cudaStream_t stream, emu_point_t *at);

/* Access records of one allocation (emu_races.c), kept by emu_memory.c
 * under its lock. */
typedef struct emu_accesses emu_accesses_t;
/* Checks an access of [lo, hi) by the running operation against the
 * records and adds it; 0 when it is ordered after what it conflicts with,
 * else prints what raced (naming `what`) and returns -1. */
int emu_races_access(emu_accesses_t **a, const char *lo, const char *hi, int write,
                     const char *what);
/* The allocation's stream-ordered birth: a write of all of it at `at`. */
void emu_races_born(emu_accesses_t **a, const char *lo, const char *hi, emu_point_t at);
/* A stream-ordered free by the running operation: every access must be
 * ordered before it; 0 or -1 as above. */
int emu_races_free(emu_accesses_t **a, const void *base, const char *what);
void emu_races_drop(emu_accesses_t **a);

/* A host call that waits for the device without bound (cudaFreeHost,
 * cudaFree, a synchronous cudaMemcpy, cudaStreamSynchronize, ...): counted
 * (emu_blocking_calls, gs_emulated_blocking_calls) when any stream of the
 * current device has work queued, where a spinning NCCL kernel hangs it.
 * emu_stream_sync is cudaStreamSynchronize uncounted, for the emulation's
 * own uses and the test hooks. */
void emu_blocking_call(const char *fn);
long emu_blocking_calls(void);
cudaError_t emu_stream_sync(cudaStream_t stream);

/* NCCL work is about to be queued on the current device (emu_kernels.cc
 * counts it when a kernel of gradsync's is not loaded there yet). */
void emu_nccl_launching(void);

/* Makes sure the calling thread has a current context (creating device 0's
 * primary context when it has none, as the runtime does); returns the
 * current device, or -1 with the sticky error recorded. */
int emu_current_device(void);
/* The sticky error, if the context was lost. */
cudaError_t emu_sticky(void);
/* Uses of destroyed streams' handles so far. */
long emu_destroyed_uses(void);
/* Queues a closed gate on `stream` (emu_hooks.c): it stays busy until the
 * next gs_emulated_release. */
int gs_emulated_hold(uintptr_t stream);

#endif
