/* The emulated CUDA runtime's internals, shared by its files. Not a header
 * of gradsync's: the emulation stands in for cudart, the driver entry
 * points gradsync asks for, and the kernel launchers of cuda_kernels.cu.
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
 *   them as a barrier fails); cudaFreeAsync frees in stream order, and
 *   cudaMallocAsync's memory becomes usable only when its stream reaches the
 *   allocation (a use on a stream not ordered after it is an illegal address);
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

/* Memory checks for work running on a stream: [p, p + bytes) must lie in
 * one live device, pinned or managed allocation (host: 1 also allows
 * ordinary host memory, for copies to and from pageable memory), and p must
 * be aligned to `align`. Returns cudaSuccess or the sticky error, after
 * printing what was wrong to stderr. */
cudaError_t emu_check_range(const void *p, size_t bytes, size_t align, int host_ok,
                            const char *what);

/* Makes sure the calling thread has a current context (creating device 0's
 * primary context when it has none, as the runtime does); returns the
 * current device, or -1 with the sticky error recorded. */
int emu_current_device(void);
/* The sticky error, if the context was lost. */
cudaError_t emu_sticky(void);

#endif
