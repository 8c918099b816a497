/* MPI's datatypes and reductions for gradsync's dtypes and ops:
 * float16/bfloat16 reductions as user-defined ops accumulating in float32,
 * NaN-propagating float min/max, and one-message derived types for counts
 * past MPI's int. */
#include <limits.h>
#include <pthread.h>

#include "mpi/gs_mpi.h"

/* ---- MPI objects gradsync creates: its own reductions where MPI's would be
 * wrong (float16/bfloat16 math, NaN-propagating float min/max). Created on
 * first use, freed inside
 * MPI_Finalize through an attribute on MPI_COMM_SELF. */

#define USER_OP(name, dtype, op)                                        \
  static void name(void *in, void *inout, int *len, MPI_Datatype *dt) { \
    (void)dt;                                                           \
    gs_cpu_reduce(dtype, op, in, inout, *len);                          \
  }
USER_OP(f16_sum, GS_FLOAT16, GS_OP_SUM)
USER_OP(f16_min, GS_FLOAT16, GS_OP_MIN)
USER_OP(f16_max, GS_FLOAT16, GS_OP_MAX)
USER_OP(f16_prod, GS_FLOAT16, GS_OP_PROD)
USER_OP(bf16_sum, GS_BFLOAT16, GS_OP_SUM)
USER_OP(bf16_min, GS_BFLOAT16, GS_OP_MIN)
USER_OP(bf16_max, GS_BFLOAT16, GS_OP_MAX)
USER_OP(bf16_prod, GS_BFLOAT16, GS_OP_PROD)
/* MPI_MIN/MPI_MAX leave NaN handling to the implementation; a NaN gradient
 * must survive a min/max reduction as it survives a sum. */
USER_OP(f32_min, GS_FLOAT32, GS_OP_MIN)
USER_OP(f32_max, GS_FLOAT32, GS_OP_MAX)
USER_OP(f64_min, GS_FLOAT64, GS_OP_MIN)
USER_OP(f64_max, GS_FLOAT64, GS_OP_MAX)

/* Indexed by dtype, then op (sum, -, min, max, prod); NULL: MPI's own op. */
static MPI_User_function *const user_fns[GS_NUM_DTYPES][GS_NUM_OPS] = {
    [GS_FLOAT16] = {f16_sum, NULL, f16_min, f16_max, f16_prod, NULL},
    [GS_BFLOAT16] = {bf16_sum, NULL, bf16_min, bf16_max, bf16_prod, NULL},
    [GS_FLOAT32] = {NULL, NULL, f32_min, f32_max, NULL, NULL},
    [GS_FLOAT64] = {NULL, NULL, f64_min, f64_max, NULL, NULL},
};
static MPI_Op user_ops[GS_NUM_DTYPES][GS_NUM_OPS];
static int objects_ready;
static pthread_mutex_t objects_lock = PTHREAD_MUTEX_INITIALIZER;

static int free_objects(MPI_Comm comm, int keyval, void *attr, void *extra) {
  (void)comm;
  (void)attr;
  (void)extra;
  for (int d = 0; d < GS_NUM_DTYPES; d++)
    for (int o = 0; o < GS_NUM_OPS; o++)
      if (user_fns[d][o]) MPI_Op_free(&user_ops[d][o]);
  objects_ready = 0;
  MPI_Comm_free_keyval(&keyval);
  return MPI_SUCCESS;
}

static gs_status_t ensure_objects(void) {
  if (__atomic_load_n(&objects_ready, __ATOMIC_ACQUIRE)) return GS_SUCCESS;
  pthread_mutex_lock(&objects_lock);
  int e = MPI_SUCCESS, keyval = MPI_KEYVAL_INVALID;
  if (!objects_ready) {
    for (int d = 0; d < GS_NUM_DTYPES && e == MPI_SUCCESS; d++)
      for (int o = 0; o < GS_NUM_OPS && e == MPI_SUCCESS; o++)
        if (user_fns[d][o]) e = MPI_Op_create(user_fns[d][o], 1, &user_ops[d][o]);
    if (e == MPI_SUCCESS)
      e = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_objects, &keyval, NULL);
    if (e == MPI_SUCCESS) e = MPI_Comm_set_attr(MPI_COMM_SELF, keyval, NULL);
    if (e == MPI_SUCCESS) __atomic_store_n(&objects_ready, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&objects_lock);
  return e == MPI_SUCCESS ? GS_SUCCESS : gs_mpi_fail(e, "creating gradsync's MPI ops and types");
}

gs_status_t gs_mpi_datatype(gs_dtype_t dtype, MPI_Datatype *out) {
  switch (dtype) {
    case GS_FLOAT16:
    case GS_BFLOAT16: *out = MPI_UINT16_T; return GS_SUCCESS; /* bits; math in user ops */
    case GS_FLOAT32: *out = MPI_FLOAT; return GS_SUCCESS;
    case GS_FLOAT64: *out = MPI_DOUBLE; return GS_SUCCESS;
    case GS_INT8: *out = MPI_INT8_T; return GS_SUCCESS;
    case GS_UINT8: *out = MPI_UINT8_T; return GS_SUCCESS;
    case GS_INT32: *out = MPI_INT32_T; return GS_SUCCESS;
    case GS_INT64: *out = MPI_INT64_T; return GS_SUCCESS;
  }
  return gs_fail(GS_ERR_TYPE, "unknown dtype %d", (int)dtype);
}

gs_status_t gs_mpi_op(gs_dtype_t dtype, gs_op_t op, MPI_Op *out) {
  if (op == GS_OP_AVERAGE) op = GS_OP_SUM;
  if (!gs_dtype_valid(dtype) || (unsigned)op >= GS_NUM_OPS || gs_op_is_adasum(op))
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "op %s has no MPI reduction", gs_op_name(op));
  if (user_fns[dtype][op]) {
    GS_CHECK(ensure_objects());
    *out = user_ops[dtype][op];
    return GS_SUCCESS;
  }
  static const MPI_Op builtin[GS_NUM_OPS] = {MPI_SUM,  MPI_SUM,     MPI_MIN,    MPI_MAX,
                                             MPI_PROD, MPI_OP_NULL, MPI_OP_NULL};
  *out = builtin[op];
  return GS_SUCCESS;
}

int gs_mpi_op_is_builtin(gs_dtype_t dtype, gs_op_t op) {
  if (op == GS_OP_AVERAGE) op = GS_OP_SUM;
  return gs_dtype_valid(dtype) && (unsigned)op < GS_NUM_OPS && !gs_op_is_adasum(op) &&
         user_fns[dtype][op] == NULL;
}

gs_status_t gs_mpi_big_type(gs_dtype_t dtype, int64_t count, MPI_Datatype *type, int *n,
                            int *derived) {
  MPI_Datatype base = MPI_DATATYPE_NULL;
  GS_CHECK(gs_mpi_datatype(dtype, &base));
  int64_t chunk = gs_env_mpi_max_count();
  *derived = 0;
  if (count <= chunk) {
    *type = base;
    *n = (int)count;
    return GS_SUCCESS;
  }
  /* q blocks of `chunk` elements, then the rest: one element of a struct */
  int64_t q = count / chunk, rest = count % chunk;
  if (q > INT_MAX)
    return gs_fail(GS_ERR_INVALID_ARGUMENT, "%lld elements are too many for one message",
                   (long long)count);
  MPI_Datatype block, whole;
  GS_MPI_CHECK(MPI_Type_contiguous((int)chunk, base, &block), "MPI_Type_contiguous");
  int blens[2] = {(int)q, (int)rest};
  MPI_Aint displs[2] = {0, (MPI_Aint)(q * chunk * (int64_t)gs_dtype_size(dtype))};
  MPI_Datatype types[2] = {block, base};
  int e = MPI_Type_create_struct(rest ? 2 : 1, blens, displs, types, &whole);
  MPI_Type_free(&block);
  if (e != MPI_SUCCESS) return gs_mpi_fail(e, "MPI_Type_create_struct");
  e = MPI_Type_commit(&whole);
  if (e != MPI_SUCCESS) {
    MPI_Type_free(&whole);
    return gs_mpi_fail(e, "MPI_Type_commit");
  }
  *type = whole;
  *n = 1;
  *derived = 1;
  return GS_SUCCESS;
}
