/* Communicator front end: every public comm entry point checks its arguments
 * here, so a backend (src/comm/cpu/, src/comm/cuda/) only ever sees a valid
 * communicator, valid ranks, a supported dtype, non-NULL and non-overlapping
 * buffers and a count >= 1. Nothing here knows how ranks talk. */
#include "comm/comm.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One reading of MOELINK_COMM_TIMEOUT_MS per process, shared by the backends
 * through ml_comm_timeout_ms(); a value below 1 would make every wait fail at
 * once, so it keeps the default like a malformed one does. */
MOELINK_PARAM(COMM_TIMEOUT_MS, ML_COMM_TIMEOUT_MS_DEFAULT)

/* Declared here because comm.h is shared with the CUDA backend; the CPU
 * backend repeats the declaration in comm/cpu/comm_cpu.h. */
int64_t ml_comm_timeout_ms(void);
int64_t ml_comm_timeout_ms(void) {
  int64_t t = ml_param_COMM_TIMEOUT_MS();
  return t >= 1 ? t : ML_COMM_TIMEOUT_MS_DEFAULT;
}

/* How long a rank of a CPU communicator waits for the others to join at
 * init: MOELINK_COMM_INIT_TIMEOUT_MS, by default the same as every other
 * wait. Processes often start far apart (a loaded machine, a model loaded
 * before init), while a collective's peers are already running: the two may
 * want different limits. */
MOELINK_PARAM(COMM_INIT_TIMEOUT_MS, 0)
int64_t ml_comm_init_timeout_ms(void);
int64_t ml_comm_init_timeout_ms(void) {
  int64_t t = ml_param_COMM_INIT_TIMEOUT_MS();
  return t >= 1 ? t : ml_comm_timeout_ms();
}

#ifndef MOELINK_HAVE_NCCL
const ml_comm_ops *ml_comm_cuda_ops(void) { return NULL; }
#endif

static moelink_status_t ml_comm_table(moelink_context_t ctx, const ml_comm_ops **ops) {
  *ops = NULL;
  switch (ctx->backend) {
  case MOELINK_BACKEND_CPU: *ops = ml_comm_cpu_ops(); break;
  case MOELINK_BACKEND_CUDA:
    *ops = ml_comm_cuda_ops();
    if (!*ops)
      return ml_fail(MOELINK_ERR_UNSUPPORTED,
                     "communicators on the cuda backend need NCCL: this library was built "
                     "without NCCL");
    break;
  }
  if (!*ops)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "context backend %d has no communicator",
                   (int)ctx->backend);
  return MOELINK_SUCCESS;
}

/* ---- unique ids --------------------------------------------------------- */

moelink_status_t moelink_get_unique_id(moelink_context_t ctx, moelink_unique_id_t *id) {
  ml_clear_error();
  if (!ctx) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "get_unique_id: context is NULL");
  if (!id) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "get_unique_id: id is NULL");
  const ml_comm_ops *ops;
  ML_TRY(ml_comm_table(ctx, &ops));
  memset(id, 0, sizeof *id);
  return ops->unique_id(ctx, id);
}

#define ML_HEX_CHARS (2 * MOELINK_UNIQUE_ID_BYTES)

moelink_status_t moelink_unique_id_to_hex(const moelink_unique_id_t *id, char *hex,
                                          size_t hex_size) {
  ml_clear_error();
  if (!id) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "unique_id_to_hex: id is NULL");
  if (!hex) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "unique_id_to_hex: hex is NULL");
  if (hex_size < ML_HEX_CHARS + 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "unique_id_to_hex: hex_size %zu < %d (%d hex digits and a NUL)", hex_size,
                   ML_HEX_CHARS + 1, ML_HEX_CHARS);
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < MOELINK_UNIQUE_ID_BYTES; ++i) {
    hex[2 * i] = digits[id->bytes[i] >> 4];
    hex[2 * i + 1] = digits[id->bytes[i] & 15];
  }
  hex[ML_HEX_CHARS] = '\0';
  return MOELINK_SUCCESS;
}

static int ml_hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* The message names `what` (the variable it came from, for init_from_env). */
static moelink_status_t ml_id_from_hex(const char *what, const char *hex,
                                       moelink_unique_id_t *id) {
  size_t len = strlen(hex);
  if (len != ML_HEX_CHARS)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s has %zu characters, expected %d hex digits (moelink_unique_id_to_hex)",
                   what, len, ML_HEX_CHARS);
  moelink_unique_id_t tmp;
  for (size_t i = 0; i < ML_HEX_CHARS; i += 2) {
    int hi = ml_hex_value(hex[i]), lo = ml_hex_value(hex[i + 1]);
    if (hi < 0 || lo < 0) {
      size_t bad = hi < 0 ? i : i + 1;
      unsigned char c = (unsigned char)hex[bad];
      if (c >= 0x20 && c < 0x7f)
        return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                       "%s: character %zu ('%c') is not a hex digit", what, bad, (char)c);
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "%s: character %zu (byte 0x%02x) is not a hex digit", what, bad, c);
    }
    tmp.bytes[i / 2] = (unsigned char)(hi << 4 | lo);
  }
  *id = tmp;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_unique_id_from_hex(const char *hex, moelink_unique_id_t *id) {
  ml_clear_error();
  if (!hex) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "unique_id_from_hex: hex is NULL");
  if (!id) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "unique_id_from_hex: id is NULL");
  return ml_id_from_hex("unique id text", hex, id);
}

/* ---- communicators ------------------------------------------------------ */

static moelink_status_t ml_comm_new(moelink_context_t ctx, const ml_comm_ops *ops, int rank,
                                    int nranks, moelink_comm_t *out) {
  moelink_comm_t comm = (moelink_comm_t)calloc(1, sizeof *comm);
  if (!comm) return ml_fail(MOELINK_ERR_OUT_OF_MEMORY, "communicator allocation failed");
  comm->ctx = ctx;
  comm->rank = rank;
  comm->nranks = nranks;
  comm->ops = ops;
  *out = comm;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_comm_init(moelink_context_t ctx, int rank, int nranks,
                                   const moelink_unique_id_t *id, moelink_comm_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init: out is NULL");
  *out = NULL;
  if (!ctx) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init: context is NULL");
  if (!id) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init: id is NULL");
  if (nranks < 1)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init: nranks %d must be >= 1", nranks);
  if (rank < 0 || rank >= nranks)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init: rank %d is out of range [0, %d)",
                   rank, nranks);
  const ml_comm_ops *ops;
  ML_TRY(ml_comm_table(ctx, &ops));
  moelink_comm_t comm = NULL;
  ML_TRY(ml_comm_new(ctx, ops, rank, nranks, &comm));
  moelink_status_t s = ops->init(comm, id);
  if (s != MOELINK_SUCCESS) {
    free(comm);
    return s;
  }
  *out = comm;
  return MOELINK_SUCCESS;
}

/* An integer environment variable, strictly: the whole value must parse. */
static moelink_status_t ml_env_rank_var(const char *name, long lo, int *out) {
  const char *v = getenv(name);
  if (!v || !*v)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s is not set: start the ranks with `moelink launch -n N -- CMD`, or set "
                   "MOELINK_RANK, MOELINK_WORLD_SIZE and MOELINK_UNIQUE_ID",
                   name);
  errno = 0;
  char *end = NULL;
  long x = strtol(v, &end, 10);
  if (errno || !end || *end || end == v)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s='%.40s' is not an integer", name, v);
  if (x < lo || x > INT32_MAX)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s=%ld is out of range (at least %ld)", name,
                   x, lo);
  *out = (int)x;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_comm_init_from_env(moelink_context_t ctx, moelink_comm_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init_from_env: out is NULL");
  *out = NULL;
  if (!ctx) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init_from_env: context is NULL");
  int rank, size;
  ML_TRY(ml_env_rank_var("MOELINK_WORLD_SIZE", 1, &size));
  ML_TRY(ml_env_rank_var("MOELINK_RANK", 0, &rank));
  if (rank >= size)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "MOELINK_RANK=%d is out of range [0, MOELINK_WORLD_SIZE=%d)", rank, size);
  const char *hex = getenv("MOELINK_UNIQUE_ID");
  if (!hex || !*hex)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "MOELINK_UNIQUE_ID is not set: start the ranks with `moelink launch -n N -- "
                   "CMD`, or pass rank 0's moelink_unique_id_to_hex text");
  moelink_unique_id_t id;
  ML_TRY(ml_id_from_hex("MOELINK_UNIQUE_ID", hex, &id));
  return moelink_comm_init(ctx, rank, size, &id, out);
}

moelink_status_t moelink_comm_init_from_nccl(moelink_context_t ctx, void *nccl_comm,
                                             moelink_comm_t *out) {
  ml_clear_error();
  if (!out) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init_from_nccl: out is NULL");
  *out = NULL;
  if (!ctx) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init_from_nccl: context is NULL");
  if (!nccl_comm)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_init_from_nccl: nccl_comm is NULL");
  if (ctx->backend != MOELINK_BACKEND_CUDA)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "comm_init_from_nccl needs a cuda context (this one runs on the cpu)");
  const ml_comm_ops *ops;
  ML_TRY(ml_comm_table(ctx, &ops));
  if (!ops->init_from_nccl)
    return ml_fail(MOELINK_ERR_UNSUPPORTED,
                   "comm_init_from_nccl: the %s communicator cannot wrap an NCCL communicator",
                   ops->name);
  moelink_comm_t comm = NULL;
  /* The backend learns rank and size from the NCCL communicator. */
  ML_TRY(ml_comm_new(ctx, ops, -1, 0, &comm));
  moelink_status_t s = ops->init_from_nccl(comm, nccl_comm);
  if (s == MOELINK_SUCCESS && (comm->nranks < 1 || comm->rank < 0 || comm->rank >= comm->nranks)) {
    ops->destroy(comm);
    s = ml_fail(MOELINK_ERR_INTERNAL, "comm_init_from_nccl: backend reported rank %d of %d",
                comm->rank, comm->nranks);
  }
  if (s != MOELINK_SUCCESS) {
    free(comm);
    return s;
  }
  *out = comm;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_comm_destroy(moelink_comm_t comm) {
  ml_clear_error();
  if (!comm) return MOELINK_SUCCESS;
  comm->ops->destroy(comm);
  free(comm);
  return MOELINK_SUCCESS;
}

int moelink_comm_rank(moelink_comm_t comm) { return comm ? comm->rank : -1; }

int moelink_comm_size(moelink_comm_t comm) { return comm ? comm->nranks : -1; }

moelink_status_t moelink_comm_check(moelink_comm_t comm, void *stream) {
  ml_clear_error();
  if (!comm) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "comm_check: communicator is NULL");
  return comm->ops->check(comm, stream);
}

/* ---- symmetric memory --------------------------------------------------- */

moelink_status_t moelink_symm_alloc(moelink_comm_t comm, size_t bytes, void **ptr) {
  ml_clear_error();
  if (!ptr) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "symm_alloc: ptr is NULL");
  *ptr = NULL;
  if (!comm) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "symm_alloc: communicator is NULL");
  if (bytes == 0) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "symm_alloc: bytes is 0");
  return comm->ops->symm_alloc(comm, bytes, ptr);
}

moelink_status_t moelink_symm_free(moelink_comm_t comm, void *ptr) {
  ml_clear_error();
  if (!comm) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "symm_free: communicator is NULL");
  if (!ptr) return MOELINK_SUCCESS;
  return comm->ops->symm_free(comm, ptr);
}

/* ---- collectives -------------------------------------------------------- */

typedef enum { ML_COLL_ALLREDUCE, ML_COLL_ALLGATHER, ML_COLL_REDUCE_SCATTER } ml_coll_kind;

static const char *const ml_coll_names[] = {"allreduce", "allgather", "reduce_scatter"};

/* The communicator and element type every data-moving call checks first;
 * *es is the element size. */
static moelink_status_t ml_comm_op_check(const char *op, moelink_comm_t comm,
                                         moelink_dtype_t dtype, size_t *es) {
  if (!comm) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: communicator is NULL", op);
  *es = moelink_dtype_size(dtype);
  if (*es == 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: dtype %d is not a moelink_dtype_t", op,
                   (int)dtype);
  if (dtype == MOELINK_DTYPE_FP8_E4M3)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: dtype %s is not supported (f32, bf16, f16)", op,
                   moelink_dtype_name(dtype));
  return MOELINK_SUCCESS;
}

/* Checks one collective call. *run is 0 when there is nothing to do
 * (count 0), so a rank never enters the backend for an empty call. */
static moelink_status_t ml_coll_check(ml_coll_kind kind, moelink_comm_t comm, const void *send,
                                      const void *recv, size_t count, moelink_dtype_t dtype,
                                      int *run) {
  const char *op = ml_coll_names[kind];
  *run = 0;
  size_t es = 0;
  ML_TRY(ml_comm_op_check(op, comm, dtype, &es));
  if (count == 0) return MOELINK_SUCCESS;
  if (!send) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: send is NULL", op);
  if (!recv) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: recv is NULL", op);
  size_t n = (size_t)comm->nranks;
  /* The larger side holds nranks * count elements for gather and scatter. */
  if (count > SIZE_MAX / es / n)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: count %zu of %s times %d ranks overflows the address space", op, count,
                   moelink_dtype_name(dtype), comm->nranks);
  size_t send_bytes = count * es, recv_bytes = count * es;
  if (kind == ML_COLL_ALLGATHER) recv_bytes *= n;
  if (kind == ML_COLL_REDUCE_SCATTER) send_bytes *= n;
  uintptr_t s = (uintptr_t)send, r = (uintptr_t)recv;
  if (s % es || r % es)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: %s %p is not aligned to the %zu bytes of a %s element", op,
                   s % es ? "send" : "recv", s % es ? send : recv, es, moelink_dtype_name(dtype));
  if (s > UINTPTR_MAX - send_bytes || r > UINTPTR_MAX - recv_bytes)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: a buffer wraps around the address space",
                   op);
  int overlap = s < r + recv_bytes && r < s + send_bytes;
  if (overlap && !(kind == ML_COLL_ALLREDUCE && s == r)) {
    if (kind == ML_COLL_ALLREDUCE)
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                     "allreduce: send %p and recv %p overlap without being the same buffer "
                     "(in place needs send == recv)",
                     send, recv);
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: send [%p, +%zu bytes) and recv [%p, +%zu bytes) overlap (only allreduce "
                   "runs in place)",
                   op, send, send_bytes, recv, recv_bytes);
  }
  *run = 1;
  return MOELINK_SUCCESS;
}

moelink_status_t moelink_allreduce(moelink_comm_t comm, const void *send, void *recv,
                                   size_t count, moelink_dtype_t dtype, void *stream) {
  ml_clear_error();
  int run;
  ML_TRY(ml_coll_check(ML_COLL_ALLREDUCE, comm, send, recv, count, dtype, &run));
  return run ? comm->ops->allreduce(comm, send, recv, count, dtype, stream) : MOELINK_SUCCESS;
}

moelink_status_t moelink_allgather(moelink_comm_t comm, const void *send, void *recv,
                                   size_t count, moelink_dtype_t dtype, void *stream) {
  ml_clear_error();
  int run;
  ML_TRY(ml_coll_check(ML_COLL_ALLGATHER, comm, send, recv, count, dtype, &run));
  return run ? comm->ops->allgather(comm, send, recv, count, dtype, stream) : MOELINK_SUCCESS;
}

moelink_status_t moelink_reduce_scatter(moelink_comm_t comm, const void *send, void *recv,
                                        size_t count, moelink_dtype_t dtype, void *stream) {
  ml_clear_error();
  int run;
  ML_TRY(ml_coll_check(ML_COLL_REDUCE_SCATTER, comm, send, recv, count, dtype, &run));
  return run ? comm->ops->reduce_scatter(comm, send, recv, count, dtype, stream)
             : MOELINK_SUCCESS;
}

/* The counts are in the backend's memory (device memory on CUDA), so only
 * what the host knows is checked here: pointers, dtype, alignment, and the
 * overlaps that the arrays' fixed sizes and recv's capacity let us see. The
 * backends handle counts and offsets (a bad one is sent as 0 and reported). */
static int ml_ranges_overlap(const void *a, size_t an, const void *b, size_t bn) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return a && b && an && bn && x < y + bn && y < x + an;
}

moelink_status_t moelink_alltoallv(moelink_comm_t comm, const void *send,
                                   const int64_t *send_counts, const int64_t *send_offsets,
                                   void *recv, size_t recv_capacity, int64_t *recv_counts,
                                   int64_t *recv_offsets, moelink_dtype_t dtype, void *stream) {
  ml_clear_error();
  const char *op = "alltoallv";
  size_t es = 0;
  ML_TRY(ml_comm_op_check(op, comm, dtype, &es));
  if (!send) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: send is NULL", op);
  if (!send_counts) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: send_counts is NULL", op);
  if (!recv_counts) return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: recv_counts is NULL", op);
  if (!recv && recv_capacity)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: recv is NULL with recv_capacity %zu", op,
                   recv_capacity);
  if (recv_capacity > SIZE_MAX / es)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: recv_capacity %zu of %s overflows the address space", op, recv_capacity,
                   moelink_dtype_name(dtype));
  const size_t recv_bytes = recv_capacity * es;
  uintptr_t s = (uintptr_t)send, r = (uintptr_t)recv;
  if (s % es || r % es)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: %s %p is not aligned to the %zu bytes of a %s element", op,
                   s % es ? "send" : "recv", s % es ? send : recv, es, moelink_dtype_name(dtype));
  if (recv && r > UINTPTR_MAX - recv_bytes)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: recv wraps around the address space", op);
  if (recv_capacity && s >= r && s < r + recv_bytes)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "%s: send %p lies inside recv [%p, +%zu bytes): alltoallv does not run in place",
                   op, send, recv, recv_bytes);
  const struct {
    const char *name;
    const void *p;
  } arr[] = {{"send_counts", send_counts},
             {"send_offsets", send_offsets},
             {"recv_counts", recv_counts},
             {"recv_offsets", recv_offsets}};
  const size_t ab = (size_t)comm->nranks * sizeof(int64_t);
  for (int i = 0; i < 4; ++i)
    if ((uintptr_t)arr[i].p % sizeof(int64_t))
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: %s %p is not 8-byte aligned", op,
                     arr[i].name, arr[i].p);
  /* The outputs are written while the inputs may still be read. */
  for (int o = 2; o < 4; ++o)
    for (int i = 0; i < 4; ++i)
      if (i != o && ml_ranges_overlap(arr[o].p, ab, arr[i].p, ab))
        return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                       "%s: %s %p and %s %p overlap (%d entries of 8 bytes each)", op,
                       arr[o].name, arr[o].p, arr[i].name, arr[i].p, comm->nranks);
  for (int o = 2; o < 4; ++o)
    if (ml_ranges_overlap(arr[o].p, ab, recv, recv_bytes))
      return ml_fail(MOELINK_ERR_INVALID_ARGUMENT, "%s: %s %p overlaps recv [%p, +%zu bytes)",
                     op, arr[o].name, arr[o].p, recv, recv_bytes);
  if (!comm->ops->alltoallv)
    return ml_fail(MOELINK_ERR_UNSUPPORTED, "%s: the %s communicator has no alltoallv", op,
                   comm->ops->name);
  return comm->ops->alltoallv(comm, send, send_counts, send_offsets, recv, recv_capacity,
                              recv_counts, recv_offsets, dtype, stream);
}
