/* All-to-all-v of CPU ranks, in the staging rounds of collectives.c.
 *
 * Round 0 exchanges the counts: every rank stages its row of send counts and
 * reads all rows, so every rank knows the whole matrix M[s][d] (elements s
 * sends to d). From it each rank derives, identically, the number of data
 * rounds (the largest count between two different ranks, in pieces of
 * `chunk`), and its own receive layout (packed in source-rank order).
 * A data round k: each rank's half holds one sub-block per destination d,
 * with elements [k * chunk, (k + 1) * chunk) of what it sends to d; rank d
 * copies sub-block d of every peer's half into recv. Every round hears from
 * every peer, as the round protocol asks. A rank's data for itself never
 * goes through staging.
 *
 * Bad counts and a too small recv do not break the exchange: a negative
 * count or offset is staged as count 0, elements past recv_capacity are
 * dropped, every rank still runs every round, and only the rank concerned
 * reports an error, after the exchange (the communicator stays usable). */
#include "comm/cpu/shm.h"

#include <string.h>

/* Copies n elements to position pos of recv, keeping what lies at or past
 * the capacity out. */
static void ml_a2a_put(unsigned char *recv, size_t cap, int64_t pos, const unsigned char *src,
                       int64_t n, size_t es) {
  if (n <= 0 || pos < 0 || (uint64_t)pos >= cap) return;
  uint64_t room = cap - (uint64_t)pos;
  uint64_t m = (uint64_t)n < room ? (uint64_t)n : room;
  memcpy(recv + (size_t)pos * es, src, (size_t)m * es);
}

/* Elements of piece k (pieces of chunk) of a run of total elements. */
static int64_t ml_a2a_piece(int64_t total, uint64_t k, size_t chunk) {
  uint64_t lo = k * (uint64_t)chunk;
  if (total <= 0 || lo >= (uint64_t)total) return 0;
  uint64_t left = (uint64_t)total - lo;
  return (int64_t)(left < chunk ? left : chunk);
}

/* Both >= 0; sums past INT64_MAX stay there (only positions are compared). */
static int64_t ml_a2a_sat_add(int64_t a, int64_t b) {
  return a > INT64_MAX - b ? INT64_MAX : a + b;
}

moelink_status_t ml_cpu_alltoallv(moelink_comm_t comm, const void *send,
                                  const int64_t *send_counts, const int64_t *send_offsets,
                                  void *recv, size_t recv_capacity, int64_t *recv_counts,
                                  int64_t *recv_offsets, moelink_dtype_t dtype, void *stream) {
  (void)stream;
  ml_cpu_comm *c = ml_cpu_of(comm);
  ML_TRY(ml_cpu_failed(c));
  const int n = c->nranks, me = c->rank;
  const size_t es = moelink_dtype_size(dtype);
  const unsigned char *s = (const unsigned char *)send;
  unsigned char *r = (unsigned char *)recv;
  /* Per rank: what this rank sends (count, offset) and receives. */
  int64_t cnt[ML_CPU_MAX_RANKS] = {0}, off[ML_CPU_MAX_RANKS] = {0};
  int64_t in_cnt[ML_CPU_MAX_RANKS] = {0};
  int bad = -1, bad_off = 0;
  int64_t bad_value = 0, packed = 0;
  for (int p = 0; p < n; ++p) {
    int64_t k = send_counts[p], o = send_offsets ? send_offsets[p] : packed;
    if (k < 0 || o < 0) {
      if (bad < 0) {
        bad = p;
        bad_off = k >= 0;
        bad_value = k < 0 ? k : o;
      }
      k = 0;
      o = 0;
    }
    cnt[p] = k;
    off[p] = o;
    packed = ml_a2a_sat_add(packed, k);
  }

  /* Round 0: the counts. */
  int64_t max_peer = 0;
  in_cnt[me] = cnt[me];
  if (n > 1) {
    ml_cpu_call k;
    ml_cpu_call_init(&k, comm, ML_CPU_OP_ALLTOALLV, dtype, 0);
    uint64_t round = c->round++;
    ML_TRY(ml_cpu_round_open(&k, round));
    memcpy(ml_cpu_stage(c, me, round), cnt, (size_t)n * sizeof(int64_t));
    ml_cpu_round_publish(&k, round);
    ML_TRY(ml_cpu_round_await_all(&k, round));
    for (int src = 0; src < n; ++src) {
      const int64_t *row = src == me ? cnt : (const int64_t *)ml_cpu_stage(c, src, round);
      if (src != me) in_cnt[src] = row[me];
      for (int d = 0; d < n; ++d)
        if (d != src && row[d] > max_peer) max_peer = row[d];
    }
    ml_cpu_round_close(&k, round);
  }

  /* Where each source's elements land: packed in source-rank order. */
  int64_t in_off[ML_CPU_MAX_RANKS] = {0}, total = 0;
  for (int src = 0; src < n; ++src) {
    in_off[src] = total;
    recv_counts[src] = in_cnt[src];
    if (recv_offsets) recv_offsets[src] = total;
    total = ml_a2a_sat_add(total, in_cnt[src]);
  }

  ml_a2a_put(r, recv_capacity, in_off[me], s + (size_t)off[me] * es, cnt[me], es);

  if (max_peer > 0) {
    /* One sub-block per destination, at the same place in every half. */
    const size_t chunk = c->stage_bytes / ((size_t)n * es);
    const uint64_t rounds = ((uint64_t)max_peer + chunk - 1) / chunk;
    ml_cpu_call k;
    ml_cpu_call_init(&k, comm, ML_CPU_OP_ALLTOALLV, dtype, (size_t)rounds);
    for (uint64_t j = 0; j < rounds; ++j) {
      uint64_t round = c->round++;
      ML_TRY(ml_cpu_round_open(&k, round));
      unsigned char *mine = ml_cpu_stage(c, me, round);
      for (int d = 0; d < n; ++d) {
        int64_t len = d == me ? 0 : ml_a2a_piece(cnt[d], j, chunk);
        if (len)
          memcpy(mine + (size_t)d * chunk * es, s + ((size_t)off[d] + j * chunk) * es,
                 (size_t)len * es);
      }
      ml_cpu_round_publish(&k, round);
      for (int src = 0; src < n; ++src) {
        if (src == me) continue;
        ML_TRY(ml_cpu_round_await(&k, round, src));
        int64_t len = ml_a2a_piece(in_cnt[src], j, chunk);
        ml_a2a_put(r, recv_capacity, ml_a2a_sat_add(in_off[src], (int64_t)(j * chunk)),
                   ml_cpu_stage(c, src, round) + (size_t)me * chunk * es, len, es);
      }
      ml_cpu_round_close(&k, round);
    }
  }

  if (bad >= 0)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "rank %d: alltoallv %s[%d] is %lld (negative): sent a count of 0 to rank %d",
                   me, bad_off ? "send_offsets" : "send_counts", bad, (long long)bad_value, bad);
  if ((uint64_t)total > recv_capacity)
    return ml_fail(MOELINK_ERR_INVALID_ARGUMENT,
                   "rank %d: alltoallv received %lld elements, recv_capacity is %zu: the %llu past "
                   "it were dropped (recv_counts has the full counts)",
                   me, (long long)total, recv_capacity,
                   (unsigned long long)((uint64_t)total - recv_capacity));
  return MOELINK_SUCCESS;
}
