/* gradsync: element types, reduction ops and the tensor descriptor. */
#ifndef GRADSYNC_TYPES_H
#define GRADSYNC_TYPES_H

#include <stddef.h>
#include <stdint.h>

#include "gs_export.h"
#include "gs_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Explicit values, append-only. */
typedef enum gs_dtype {
  GS_FLOAT16 = 0,
  GS_BFLOAT16 = 1,
  GS_FLOAT32 = 2,
  GS_FLOAT64 = 3,
  GS_INT8 = 4,
  GS_UINT8 = 5,
  GS_INT32 = 6,
  GS_INT64 = 7
} gs_dtype_t;
#define GS_NUM_DTYPES 8

typedef enum gs_op {
  GS_OP_SUM = 0,
  GS_OP_AVERAGE = 1, /* sum, then one multiply by postscale / size */
  GS_OP_MIN = 2,
  GS_OP_MAX = 3,
  GS_OP_PROD = 4,
  GS_OP_ADASUM = 5,  /* allreduce only, floating dtypes only */
  /* Adasum across groups of ranks, average inside each group (docs/DESIGN.md section 4's
   * hierarchical mode): groups are the ranks of a node, or consecutive
   * blocks of GRADSYNC_HIERARCHY_SIZE ranks; equal power-of-two sizes. */
  GS_OP_ADASUM_HIERARCHICAL = 6
} gs_op_t;
#define GS_NUM_OPS 7

/* Low-precision wire formats for gs_allreduce_wire (explicit values,
 * append-only). float8 formats carry one power-of-two scale per block of
 * GS_WIRE_BLOCK elements (an E8M0 byte, as the OCP MX formats do). */
typedef enum gs_wire {
  GS_WIRE_NONE = 0, /* the tensors' own dtype: gs_allreduce */
  GS_WIRE_BFLOAT16 = 1,
  GS_WIRE_FLOAT16 = 2,
  GS_WIRE_FLOAT8_E4M3 = 3, /* OCP e4m3fn: no infinities, max 448 */
  GS_WIRE_FLOAT8_E5M2 = 4
} gs_wire_t;
#define GS_NUM_WIRES 5
#define GS_WIRE_BLOCK 32

/* Device kinds use DLPack's numbering so descriptors convert directly. */
typedef enum gs_device_kind {
  GS_DEVICE_CPU = 1,
  GS_DEVICE_CUDA = 2,
  GS_DEVICE_CUDA_HOST = 3 /* pinned host memory: treated as host memory */
} gs_device_kind_t;

typedef struct gs_device {
  gs_device_kind_t kind;
  int32_t id;
} gs_device_t;

/* One tensor: a C-contiguous run of `count` elements of `dtype` at `data`. */
typedef struct gs_tensor {
  void *data;
  int64_t count;
  gs_dtype_t dtype;
  gs_device_t device;
} gs_tensor_t;

/* What a thread's calls carry besides their arguments (gs_set_call_options
 * in gs_comm.h): a tag the ranks' calls must agree on, and a wait limit. */
typedef struct gs_call_options {
  uint64_t tag;   /* 0: none; else every rank's call must carry the same */
  double timeout; /* seconds (> 0) in place of the communicator's; 0: its */
} gs_call_options_t;

/* Convenience constructor for host tensors. */
#define GS_HOST_TENSOR(ptr, n, dt) \
  ((gs_tensor_t){(void *)(ptr), (int64_t)(n), (dt), {GS_DEVICE_CPU, 0}})

/* Bytes per element of a dtype, or 0 for an unknown dtype. */
GS_API size_t gs_dtype_size(gs_dtype_t dtype);
/* "float16", "bfloat16", ... or "unknown". */
GS_API const char *gs_dtype_name(gs_dtype_t dtype);
/* "none", "bfloat16", "float16", "float8_e4m3", "float8_e5m2" or "unknown". */
GS_API const char *gs_wire_name(gs_wire_t wire);
/* "sum", "average", "min", "max", "prod", "adasum" or "unknown". */
GS_API const char *gs_op_name(gs_op_t op);

#ifdef __cplusplus
}
#endif
#endif
