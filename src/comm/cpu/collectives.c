/* Collectives of CPU ranks, in staging rounds.
 *
 * A round moves at most one staging half per rank: each rank copies its part
 * into its own half (round & 1), publishes it (ready = round + 1, release),
 * reads the halves of all ranks once they are published (acquire), and marks
 * the round read (done = round + 1). One half is filled while peers may
 * still read the other. Before a rank refills a half it checks that every
 * peer has read it (done >= round - 1: the round two back). In the rounds
 * below, where every rank hears from every peer, that already follows from
 * having seen all peers' previous round (a peer publishes round g + 1 only
 * after it finished reading round g), so the check is one load per peer; it
 * keeps the protocol safe for rounds that do not hear from every peer.
 * Rounds are numbered across all calls of a communicator.
 *
 * Sums are fp32 over ranks in rank order 0, 1, ..., n-1, rounded once to the
 * dtype, so every rank computes bitwise the same all-reduce result, and runs
 * repeat bitwise: no order depends on timing. */
#include "comm/cpu/shm.h"

#include <string.h>

/* fp32 accumulators per block: small enough for the stack and the L1. */
#define ML_CPU_BLOCK 512

static const char *ml_cpu_op_name(uint32_t op) {
  switch (op) {
  case ML_CPU_OP_ALLREDUCE: return "allreduce";
  case ML_CPU_OP_ALLGATHER: return "allgather";
  case ML_CPU_OP_REDUCE_SCATTER: return "reduce_scatter";
  case ML_CPU_OP_ALLTOALLV: return "alltoallv";
  }
  return "an unknown collective";
}

void ml_cpu_call_init(ml_cpu_call *k, moelink_comm_t comm, ml_cpu_op op, moelink_dtype_t dtype,
                      size_t count) {
  static const char *const data[] = {"", "allreduce data", "allgather data",
                                     "reduce_scatter data", "alltoallv data"};
  static const char *const release[] = {"", "allreduce staging release",
                                        "allgather staging release",
                                        "reduce_scatter staging release",
                                        "alltoallv staging release"};
  k->c = ml_cpu_of(comm);
  k->op = op;
  k->dtype = dtype;
  k->count = count;
  k->data_what = data[op];
  k->release_what = release[op];
}

moelink_status_t ml_cpu_round_open(const ml_cpu_call *k, uint64_t round) {
  ml_cpu_comm *c = k->c;
  if (round < 2) return MOELINK_SUCCESS;
  for (int p = 0; p < c->nranks; ++p)
    if (p != c->rank) ML_TRY(ml_cpu_wait_word(c, &c->slots[p].done, round - 1, p, k->release_what));
  return MOELINK_SUCCESS;
}

void ml_cpu_round_publish(const ml_cpu_call *k, uint64_t round) {
  ml_cpu_slot *s = &k->c->slots[k->c->rank];
  ml_cpu_desc *d = &s->desc[round & 1];
  d->op = (uint32_t)k->op;
  d->dtype = (uint32_t)k->dtype;
  d->count = k->count;
  d->round = round;
  atomic_store_explicit(&s->ready, round + 1, memory_order_release);
}

moelink_status_t ml_cpu_round_await(const ml_cpu_call *k, uint64_t round, int p) {
  ml_cpu_comm *c = k->c;
  if (p == c->rank) return MOELINK_SUCCESS;
  ML_TRY(ml_cpu_wait_word(c, &c->slots[p].ready, round + 1, p, k->data_what));
  const ml_cpu_desc *d = &c->slots[p].desc[round & 1];
  if (d->op != (uint32_t)k->op || d->dtype != (uint32_t)k->dtype || d->count != k->count ||
      d->round != round)
    return ml_cpu_fail(c, MOELINK_ERR_INVALID_ARGUMENT,
                       "rank %d: %s(count %zu, %s) does not match rank %d's %s(count %llu, %s): "
                       "every rank must call the same collectives with the same counts and "
                       "dtypes in the same order",
                       c->rank, ml_cpu_op_name(k->op), k->count, moelink_dtype_name(k->dtype), p,
                       ml_cpu_op_name(d->op), (unsigned long long)d->count,
                       moelink_dtype_name((moelink_dtype_t)d->dtype));
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_round_await_all(const ml_cpu_call *k, uint64_t round) {
  for (int p = 0; p < k->c->nranks; ++p) ML_TRY(ml_cpu_round_await(k, round, p));
  return MOELINK_SUCCESS;
}

void ml_cpu_round_close(const ml_cpu_call *k, uint64_t round) {
  atomic_store_explicit(&k->c->slots[k->c->rank].done, round + 1, memory_order_release);
}

/* dst[i] = sum over ranks p = 0..n-1 in order of half(p)[at + i], i < n. */
static void ml_cpu_reduce(const ml_cpu_call *k, uint64_t round, size_t at, void *dst, size_t n) {
  ml_cpu_comm *c = k->c;
  size_t es = moelink_dtype_size(k->dtype);
  float acc[ML_CPU_BLOCK], tmp[ML_CPU_BLOCK];
  for (size_t b = 0; b < n; b += ML_CPU_BLOCK) {
    size_t m = n - b < ML_CPU_BLOCK ? n - b : ML_CPU_BLOCK;
    size_t byte = (at + b) * es;
    ml_to_f32(k->dtype, ml_cpu_stage(c, 0, round) + byte, acc, m);
    for (int p = 1; p < c->nranks; ++p) {
      ml_to_f32(k->dtype, ml_cpu_stage(c, p, round) + byte, tmp, m);
      for (size_t i = 0; i < m; ++i) acc[i] += tmp[i];
    }
    ml_from_f32(k->dtype, acc, (unsigned char *)dst + b * es, m);
  }
}

/* The start of a collective of count elements a rank: the call's record,
 * then, on a communicator of one rank, the whole operation (recv = send):
 * *done says so. */
static moelink_status_t ml_cpu_begin(ml_cpu_call *k, moelink_comm_t comm, ml_cpu_op op,
                                     moelink_dtype_t dtype, size_t count, const void *send,
                                     void *recv, int *done) {
  ml_cpu_call_init(k, comm, op, dtype, count);
  *done = 0;
  ML_TRY(ml_cpu_failed(k->c));
  if (k->c->nranks == 1) {
    if (send != recv) memcpy(recv, send, count * moelink_dtype_size(dtype));
    *done = 1;
  }
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_allreduce(moelink_comm_t comm, const void *send, void *recv,
                                  size_t count, moelink_dtype_t dtype, void *stream) {
  ml_cpu_call k;
  int done;
  ML_TRY(ml_cpu_begin(&k, comm, ML_CPU_OP_ALLREDUCE, dtype, count, send, recv, &done));
  if (done) return MOELINK_SUCCESS;
  ml_cpu_comm *c = k.c;
  size_t es = moelink_dtype_size(dtype);
  const unsigned char *s = (const unsigned char *)send;
  unsigned char *r = (unsigned char *)recv;
  size_t chunk = c->stage_bytes / es;
  for (size_t off = 0; off < count; off += chunk) {
    size_t n = count - off < chunk ? count - off : chunk;
    uint64_t round = c->round++;
    ML_TRY(ml_cpu_round_open(&k, round));
    /* In place is safe: this chunk of send is staged before recv's chunk
     * (the same bytes) is written, and later chunks are not touched. */
    memcpy(ml_cpu_stage(c, c->rank, round), s + off * es, n * es);
    ml_cpu_round_publish(&k, round);
    ML_TRY(ml_cpu_round_await_all(&k, round));
    ml_cpu_reduce(&k, round, 0, r + off * es, n);
    ml_cpu_round_close(&k, round);
  }
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_allgather(moelink_comm_t comm, const void *send, void *recv,
                                  size_t count, moelink_dtype_t dtype, void *stream) {
  ml_cpu_call k;
  int done;
  ML_TRY(ml_cpu_begin(&k, comm, ML_CPU_OP_ALLGATHER, dtype, count, send, recv, &done));
  if (done) return MOELINK_SUCCESS;
  ml_cpu_comm *c = k.c;
  size_t es = moelink_dtype_size(dtype);
  const unsigned char *s = (const unsigned char *)send;
  unsigned char *r = (unsigned char *)recv;
  size_t chunk = c->stage_bytes / es;
  for (size_t off = 0; off < count; off += chunk) {
    size_t n = count - off < chunk ? count - off : chunk;
    uint64_t round = c->round++;
    ML_TRY(ml_cpu_round_open(&k, round));
    memcpy(ml_cpu_stage(c, c->rank, round), s + off * es, n * es);
    ml_cpu_round_publish(&k, round);
    /* Copy each part as soon as it is there: order does not matter here. */
    for (int p = 0; p < c->nranks; ++p) {
      ML_TRY(ml_cpu_round_await(&k, round, p));
      const unsigned char *src = p == c->rank ? s + off * es : ml_cpu_stage(c, p, round);
      memcpy(r + ((size_t)p * count + off) * es, src, n * es);
    }
    ml_cpu_round_close(&k, round);
  }
  return MOELINK_SUCCESS;
}

moelink_status_t ml_cpu_reduce_scatter(moelink_comm_t comm, const void *send, void *recv,
                                       size_t count, moelink_dtype_t dtype, void *stream) {
  ml_cpu_call k;
  int done;
  ML_TRY(ml_cpu_begin(&k, comm, ML_CPU_OP_REDUCE_SCATTER, dtype, count, send, recv, &done));
  if (done) return MOELINK_SUCCESS;
  ml_cpu_comm *c = k.c;
  size_t es = moelink_dtype_size(dtype);
  const unsigned char *s = (const unsigned char *)send;
  unsigned char *r = (unsigned char *)recv;
  /* A half holds one sub-block per destination rank, at the same place on
   * every rank, so rank q reduces sub-block q of all halves. */
  size_t chunk = c->stage_bytes / ((size_t)c->nranks * es);
  for (size_t off = 0; off < count; off += chunk) {
    size_t n = count - off < chunk ? count - off : chunk;
    uint64_t round = c->round++;
    ML_TRY(ml_cpu_round_open(&k, round));
    unsigned char *mine = ml_cpu_stage(c, c->rank, round);
    for (int q = 0; q < c->nranks; ++q)
      memcpy(mine + (size_t)q * chunk * es, s + ((size_t)q * count + off) * es, n * es);
    ml_cpu_round_publish(&k, round);
    ML_TRY(ml_cpu_round_await_all(&k, round));
    ml_cpu_reduce(&k, round, (size_t)c->rank * chunk, r + off * es, n);
    ml_cpu_round_close(&k, round);
  }
  return MOELINK_SUCCESS;
}
