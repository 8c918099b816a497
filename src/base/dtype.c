/* The dtype and op tables. */
#include "base/gs_base.h"

static const struct {
  const char *name;
  size_t size;
  int is_float;
} dtype_table[GS_NUM_DTYPES] = {
    [GS_FLOAT16] = {"float16", 2, 1}, [GS_BFLOAT16] = {"bfloat16", 2, 1},
    [GS_FLOAT32] = {"float32", 4, 1}, [GS_FLOAT64] = {"float64", 8, 1},
    [GS_INT8] = {"int8", 1, 0},       [GS_UINT8] = {"uint8", 1, 0},
    [GS_INT32] = {"int32", 4, 0},     [GS_INT64] = {"int64", 8, 0},
};

static const char *const op_names[GS_NUM_OPS] = {
    [GS_OP_SUM] = "sum",
    [GS_OP_AVERAGE] = "average",
    [GS_OP_MIN] = "min",
    [GS_OP_MAX] = "max",
    [GS_OP_PROD] = "prod",
    [GS_OP_ADASUM] = "adasum",
    [GS_OP_ADASUM_HIERARCHICAL] = "adasum_hierarchical",
};

int gs_dtype_valid(gs_dtype_t d) { return (unsigned)d < GS_NUM_DTYPES; }
int gs_dtype_is_float(gs_dtype_t d) { return gs_dtype_valid(d) && dtype_table[d].is_float; }
size_t gs_dtype_size(gs_dtype_t d) { return gs_dtype_valid(d) ? dtype_table[d].size : 0; }
const char *gs_dtype_name(gs_dtype_t d) {
  return gs_dtype_valid(d) ? dtype_table[d].name : "unknown";
}
const char *gs_op_name(gs_op_t op) { return (unsigned)op < GS_NUM_OPS ? op_names[op] : "unknown"; }

static const char *const wire_names[GS_NUM_WIRES] = {"none", "bfloat16", "float16", "float8_e4m3",
                                                     "float8_e5m2"};
const char *gs_wire_name(gs_wire_t wire) {
  return (unsigned)wire < GS_NUM_WIRES ? wire_names[wire] : "unknown";
}
