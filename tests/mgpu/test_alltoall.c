/* moelink_alltoallv of the CUDA communicator (counts in device memory)
 * against NCCL's grouped ncclSend/ncclRecv of the same data and against the
 * inputs regenerated on the host: bitwise (it is a copy). Every rank builds
 * the same count matrix and send layouts from shared seeds, so it knows
 * what every peer sends it. Cases: 1 element to 256 MiB per rank, random
 * per-pair counts with zeros, odd sizes, scattered and packed send offsets,
 * misaligned runs, f32/bf16/f16; outputs poisoned (past the received total
 * they must stay poison); a too small recv and a negative count (reported by
 * moelink_comm_check, nothing written past the capacity, the communicator
 * still usable); host counts rejected; 1000 back-to-back calls with random
 * counts, dtypes and CTA counts; two calls captured in a CUDA graph and
 * replayed with new counts written to the device between replays.
 *
 *   moelink launch -n 2 -- mgpu_test_alltoall
 * (bandwidth beside NCCL: moelink launch -n 2 -- moelink bench comm) */
#include "mgpu.h"

static mg_world W;

static ncclDataType_t nccl_type(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_F32 ? ncclFloat32 : dt == MOELINK_DTYPE_BF16 ? ncclBfloat16
                                                                          : ncclFloat16;
}

static void *to_host(const void *dev, size_t bytes) {
  void *h = mg_host(bytes);
  MG_CUDA(cudaMemcpy(h, dev, bytes, cudaMemcpyDeviceToHost));
  return h;
}

static void sync_stream(void) { MG_CUDA(cudaStreamSynchronize(W.stream)); }

/* ---- a case: the count matrix and every rank's send layout ----------------- */

typedef enum { K_TINY, K_SMALL, K_MIXED, K_LARGE, K_EQUAL } count_kind;

typedef struct plan {
  int n;
  moelink_dtype_t dt;
  int packed;
  int64_t m[8][8];   /* m[s][d]: elements s sends d */
  int64_t off[8][8]; /* off[s][d]: where in s's send buffer */
  int64_t send_n[8]; /* s's send buffer, elements */
  int64_t recv_n[8]; /* elements d receives */
} plan;

/* Per-pair counts: zeros about a quarter of the time except for K_EQUAL
 * (`scale` elements per pair) and K_LARGE (scale +- 1/8, odd). */
static int64_t pair_count(uint64_t seed, count_kind kind, int64_t scale, int s, int d) {
  uint64_t st = seed * 131 + (uint64_t)s * 8 + (uint64_t)d;
  uint64_t r = mg_next(&st);
  switch (kind) {
  case K_EQUAL: return scale;
  case K_LARGE: return (scale - scale / 8 + (int64_t)(r % (uint64_t)(scale / 4 + 1))) | 1;
  default: break;
  }
  if (r % 4 == 0) return 0;
  switch (kind) {
  case K_TINY: return (int64_t)((r >> 8) % 3);
  case K_SMALL: return (int64_t)((r >> 8) % 100);
  default: return (int64_t)((r >> 8) % (uint64_t)scale);
  }
}

static void build_plan(plan *p, uint64_t seed, count_kind kind, int64_t scale,
                       moelink_dtype_t dt, int packed) {
  memset(p, 0, sizeof *p);
  p->n = W.size;
  p->dt = dt;
  p->packed = packed;
  for (int s = 0; s < p->n; ++s)
    for (int d = 0; d < p->n; ++d) p->m[s][d] = pair_count(seed, kind, scale, s, d);
  for (int s = 0; s < p->n; ++s) {
    int64_t at = 0;
    if (packed) {
      for (int d = 0; d < p->n; ++d) {
        p->off[s][d] = at;
        at += p->m[s][d];
      }
    } else {
      /* Reverse order with gaps of 0..4 elements: offsets neither sorted nor
       * packed, runs at every alignment. */
      uint64_t st = seed ^ 0xabcdef;
      for (int d = p->n - 1; d >= 0; --d) {
        at += (int64_t)(mg_next(&st) % 5);
        p->off[s][d] = at;
        at += p->m[s][d];
      }
    }
    p->send_n[s] = at;
  }
  for (int d = 0; d < p->n; ++d)
    for (int s = 0; s < p->n; ++s) p->recv_n[d] += p->m[s][d];
}

/* Device copies of this rank's arrays. */
typedef struct dev_counts {
  int64_t *sc, *so, *rc, *ro;
} dev_counts;

static void dev_counts_make(dev_counts *c, const plan *p) {
  const size_t b = sizeof(int64_t) * 8;
  c->sc = (int64_t *)mg_dev(b);
  c->so = (int64_t *)mg_dev(b);
  c->rc = (int64_t *)mg_dev(b);
  c->ro = (int64_t *)mg_dev(b);
  int64_t sc[8], so[8];
  for (int d = 0; d < p->n; ++d) {
    sc[d] = p->m[W.rank][d];
    so[d] = p->off[W.rank][d];
  }
  MG_CUDA(cudaMemcpy(c->sc, sc, sizeof(int64_t) * (size_t)p->n, cudaMemcpyHostToDevice));
  MG_CUDA(cudaMemcpy(c->so, so, sizeof(int64_t) * (size_t)p->n, cudaMemcpyHostToDevice));
  MG_CUDA(cudaMemset(c->rc, 0xff, b));
  MG_CUDA(cudaMemset(c->ro, 0xff, b));
}

static void dev_counts_free(dev_counts *c) {
  cudaFree(c->sc);
  cudaFree(c->so);
  cudaFree(c->rc);
  cudaFree(c->ro);
}

/* NCCL's grouped send/recv of the same plan into ref (packed by source). */
static void nccl_alltoallv(const plan *p, const void *send, void *ref) {
  const size_t es = moelink_dtype_size(p->dt);
  const int r = W.rank;
  MG_NCCL(W.nccl, ncclGroupStart());
  int64_t at = 0;
  for (int q = 0; q < p->n; ++q) {
    if (p->m[r][q])
      MG_NCCL(W.nccl, ncclSend((const char *)send + (size_t)p->off[r][q] * es,
                               (size_t)p->m[r][q], nccl_type(p->dt), q, W.nccl, W.stream));
    if (p->m[q][r])
      MG_NCCL(W.nccl, ncclRecv((char *)ref + (size_t)at * es, (size_t)p->m[q][r],
                               nccl_type(p->dt), q, W.nccl, W.stream));
    at += p->m[q][r];
  }
  MG_NCCL(W.nccl, ncclGroupEnd());
}

/* The bits of element i of a host buffer of dtype size es. */
static uint32_t bits_at(const void *h, size_t i, size_t es) {
  if (es == 2) return ((const uint16_t *)h)[i];
  return ((const uint32_t *)h)[i];
}

/* The input element s's send buffer holds at position pos (fill_random with
 * s's seed), as bits. */
static uint32_t input_bits(moelink_dtype_t dt, uint64_t seed, size_t pos) {
  const float v = mg_input(dt, seed, pos);
  if (dt == MOELINK_DTYPE_F32) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
  }
  return dt == MOELINK_DTYPE_BF16 ? ml_f32_to_bf16(v) : ml_f32_to_f16(v);
}

/* Checks recv (host copy, alloc_n elements) against the regenerated inputs
 * and the poison past min(total, cap); counts and offsets too. Returns the
 * number of wrong elements; prints the first few. */
static size_t check_recv(const char *what, const plan *p, const void *h_recv, size_t alloc_n,
                         size_t cap, const int64_t *h_rc, const int64_t *h_ro, int case_id) {
  const size_t es = moelink_dtype_size(p->dt);
  const int r = W.rank;
  size_t bad = 0;
  int64_t at = 0;
  for (int s = 0; s < p->n; ++s) {
    if (h_rc[s] != p->m[s][r] || (h_ro && h_ro[s] != at)) {
      CHECK(0, "%s: from rank %d count %lld offset %lld, want %lld at %lld", what, s,
            (long long)h_rc[s], (long long)(h_ro ? h_ro[s] : -1), (long long)p->m[s][r],
            (long long)at);
      ++bad;
    }
    const uint64_t seed = mg_seed(s, case_id);
    const int64_t cnt = p->m[s][r], base = p->off[s][r];
    size_t b = 0;
    int64_t first = -1;
#pragma omp parallel for reduction(+ : b) reduction(max : first)
    for (int64_t i = 0; i < cnt; ++i) {
      if ((size_t)(at + i) >= cap) continue;
      if (bits_at(h_recv, (size_t)(at + i), es) != input_bits(p->dt, seed, (size_t)(base + i))) {
        ++b;
        if (first < 0) first = i;
      }
    }
    if (b) {
      ml_t_diag("%s: %zu wrong from rank %d, e.g. element %lld: bits %08x, want %08x", what, b,
                s, (long long)first, bits_at(h_recv, (size_t)(at + first), es),
                input_bits(p->dt, seed, (size_t)(base + first)));
      bad += b;
    }
    at += cnt;
  }
  const size_t from = (size_t)at < cap ? (size_t)at : cap;
  size_t stray = 0;
  const unsigned char *hb = (const unsigned char *)h_recv;
  for (size_t i = from * es; i < alloc_n * es; ++i) stray += hb[i] != 0xff;
  if (stray) {
    ml_t_diag("%s: %zu bytes written past element %zu (received %lld, capacity %zu)", what,
              stray, from, (long long)at, cap);
    bad += stray;
  }
  return bad;
}

/* ---- one call ------------------------------------------------------------- */

static int g_case = 1;

/* send_shift: elements the send buffer starts past a 256-byte boundary
 * (misaligned runs). cap_delta: recv_capacity = received + cap_delta. */
static void run_case(const char *name, count_kind kind, int64_t scale, moelink_dtype_t dt,
                     int packed, int send_shift, int64_t cap_delta, int with_nccl) {
  const int c = g_case++;
  plan p;
  build_plan(&p, 1000 + (uint64_t)c, kind, scale, dt, packed);
  const size_t es = moelink_dtype_size(dt);
  const int r = W.rank;
  int64_t capi = p.recv_n[r] + cap_delta;
  const size_t cap = capi < 0 ? 0 : (size_t)capi;
  const size_t guard = 4096;
  const size_t alloc_n = cap + guard;
  char *send_base = (char *)mg_dev(((size_t)p.send_n[r] + (size_t)send_shift) * es);
  char *send = send_base + (size_t)send_shift * es;
  char *recv = (char *)mg_dev(alloc_n * es);
  char *ref = (char *)mg_dev(((size_t)p.recv_n[r] + 1) * es);
  if (p.send_n[r])
    MG_MUST(moelink_fill_random(W.ctx, dt, send, (size_t)p.send_n[r], mg_seed(r, c), 1.0f, 0.0f,
                                W.stream),
            "fill_random");
  MG_CUDA(cudaMemsetAsync(recv, 0xff, alloc_n * es, W.stream));
  MG_CUDA(cudaMemsetAsync(ref, 0xff, ((size_t)p.recv_n[r] + 1) * es, W.stream));
  dev_counts dc;
  dev_counts_make(&dc, &p);
  char what[200];
  snprintf(what, sizeof what, "%s: %s, %lld elements out, %lld in, capacity %zu%s", name,
           moelink_dtype_name(dt), (long long)p.send_n[r], (long long)p.recv_n[r], cap,
           packed ? ", packed" : "");
  const double t0 = mg_now();
  CHECK_OK(moelink_alltoallv(W.comm, send, dc.sc, packed ? NULL : dc.so, recv, cap, dc.rc, dc.ro,
                             dt, W.stream),
           what);
  if (with_nccl) nccl_alltoallv(&p, send, ref);
  moelink_status_t st = moelink_comm_check(W.comm, W.stream);
  const char *msg = moelink_last_error();
  const int overflow = (int64_t)cap < p.recv_n[r];
  if (overflow)
    CHECK(st == MOELINK_ERR_INVALID_ARGUMENT && strstr(msg, "recv_capacity"),
          "%s: moelink_comm_check reports the overflow (%s: %s)", what, moelink_status_string(st),
          msg);
  else
    CHECK(st == MOELINK_SUCCESS, "%s: moelink_comm_check%s%s", what, st ? ": " : "",
          st ? msg : "");
  void *h_recv = to_host(recv, alloc_n * es);
  int64_t h_rc[8], h_ro[8];
  MG_CUDA(cudaMemcpy(h_rc, dc.rc, sizeof(int64_t) * (size_t)p.n, cudaMemcpyDeviceToHost));
  MG_CUDA(cudaMemcpy(h_ro, dc.ro, sizeof(int64_t) * (size_t)p.n, cudaMemcpyDeviceToHost));
  size_t bad = check_recv(what, &p, h_recv, alloc_n, cap, h_rc, h_ro, c);
  CHECK(bad == 0, "%s: bitwise the inputs, counts and offsets right, nothing past %s (%.3f s)",
        what, overflow ? "the capacity" : "the data", mg_now() - t0);
  if (with_nccl && !overflow && p.recv_n[r]) {
    void *h_ref = to_host(ref, (size_t)p.recv_n[r] * es);
    CHECK(memcmp(h_ref, h_recv, (size_t)p.recv_n[r] * es) == 0, "%s: bitwise NCCL's", what);
    free(h_ref);
  }
  free(h_recv);
  dev_counts_free(&dc);
  cudaFree(send_base);
  cudaFree(recv);
  cudaFree(ref);
}

static void run_sizes(void) {
  static const moelink_dtype_t dts[3] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16,
                                         MOELINK_DTYPE_F16};
  for (int d = 0; d < 3; ++d) {
    run_case("tiny counts", K_TINY, 0, dts[d], 0, 1, 0, 1);
    run_case("small counts", K_SMALL, 0, dts[d], d == 1, 3, 5, 1);
    run_case("mixed counts", K_MIXED, 70001, dts[d], 0, 0, 17, 1);
    run_case("mixed counts, packed", K_MIXED, 1000003, dts[d], 1, 1, 0, 1);
  }
  /* One element per pair. */
  run_case("equal counts of 1", K_EQUAL, 1, MOELINK_DTYPE_BF16, 1, 0, 0, 1);
  run_case("large odd counts", K_LARGE, 4194305, MOELINK_DTYPE_BF16, 0, 1, 3, 1);
  /* 256 MiB per rank: bf16, 128 Mi elements over W.size^2 pairs. */
  const int64_t per = ((int64_t)128 << 20) / ((int64_t)W.size * W.size);
  run_case("256 MiB per rank", K_EQUAL, per, MOELINK_DTYPE_BF16, 1, 0, 0, 1);
  run_case("about 256 MiB per rank, odd", K_LARGE, per, MOELINK_DTYPE_F16, 0, 1, 0, 1);
  run_case("64 MiB per rank, f32", K_EQUAL, ((int64_t)16 << 20) / ((int64_t)W.size * W.size),
           MOELINK_DTYPE_F32, 0, 0, 0, 1);
}

static void run_errors(void) {
  /* The last rank's recv is 5 elements short, then has no room at all. */
  const int last = W.size - 1;
  run_case("recv 5 short on the last rank", K_MIXED, 300007, MOELINK_DTYPE_BF16, 0, 0,
           W.rank == last ? -5 : 0, 0);
  run_case("recv of capacity 0 on the last rank", K_LARGE, 1048577, MOELINK_DTYPE_F32, 0, 0,
           W.rank == last ? -((int64_t)1 << 40) : 0, 0);
  run_case("after the capacity errors", K_MIXED, 300007, MOELINK_DTYPE_F16, 0, 1, 0, 1);

  /* A negative count: reported by the rank that passed it, sent as 0. */
  {
    const size_t n = 1000;
    float *send = (float *)mg_dev(n * 4 * (size_t)W.size), *recv = (float *)mg_dev(n * 4 * 8);
    int64_t sc[8], *d_sc = (int64_t *)mg_dev(64), *d_rc = (int64_t *)mg_dev(64);
    for (int q = 0; q < W.size; ++q) sc[q] = (int64_t)n;
    if (W.rank == 0) sc[last] = -7;
    MG_CUDA(cudaMemcpy(d_sc, sc, sizeof sc, cudaMemcpyHostToDevice));
    MG_CUDA(cudaMemset(send, 0, n * 4 * (size_t)W.size));
    CHECK_OK(moelink_alltoallv(W.comm, send, d_sc, NULL, recv, n * 8, d_rc, NULL,
                               MOELINK_DTYPE_F32, W.stream),
             "alltoallv with a negative count: enqueued");
    moelink_status_t st = moelink_comm_check(W.comm, W.stream);
    int64_t rc[8];
    MG_CUDA(cudaMemcpy(rc, d_rc, sizeof(int64_t) * (size_t)W.size, cudaMemcpyDeviceToHost));
    if (W.rank == 0)
      CHECK(st == MOELINK_ERR_INVALID_ARGUMENT && strstr(moelink_last_error(), "send_counts"),
            "negative count: rank 0's moelink_comm_check says so (%s: %s)",
            moelink_status_string(st), moelink_last_error());
    else
      CHECK_OK(st, "negative count: the other ranks' moelink_comm_check");
    const int64_t want = W.rank == last ? 0 : (int64_t)n;
    CHECK(rc[0] == want, "negative count: rank %d got count %lld from rank 0 (want %lld)", W.rank,
          (long long)rc[0], (long long)want);
    CHECK_OK(moelink_comm_check(W.comm, W.stream), "the report was cleared");

    /* Host counts are refused before anything runs (on every rank). */
    int64_t h_rc[8];
    CHECK_STATUS(moelink_alltoallv(W.comm, send, sc, NULL, recv, n * 8, d_rc, NULL,
                                   MOELINK_DTYPE_F32, W.stream),
                 MOELINK_ERR_INVALID_ARGUMENT, "alltoallv with send_counts in host memory");
    CHECK_STATUS(moelink_alltoallv(W.comm, send, d_sc, NULL, recv, n * 8, h_rc, NULL,
                                   MOELINK_DTYPE_F32, W.stream),
                 MOELINK_ERR_INVALID_ARGUMENT, "alltoallv with recv_counts in host memory");
    cudaFree(send);
    cudaFree(recv);
    cudaFree(d_sc);
    cudaFree(d_rc);
  }
}

/* ---- 1000 back-to-back calls ------------------------------------------------ */

static void run_stress(void) {
  const int calls = 1000, n = W.size, r = W.rank;
  static const moelink_dtype_t dts[3] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16,
                                         MOELINK_DTYPE_F16};
  static const int ctas[] = {1, 3, 17, 64, 64, 128};
  const size_t arena = (size_t)1 << 22; /* elements per dtype */
  void *in[3];
  for (int d = 0; d < 3; ++d) {
    in[d] = mg_dev(arena * 4);
    MG_MUST(moelink_fill_random(W.ctx, dts[d], in[d], arena, mg_seed(r, 5000 + d), 1.0f, 0.0f,
                                W.stream),
            "fill_random");
  }
  plan *ps = (plan *)mg_host(sizeof *ps * (size_t)calls);
  int *dsel = (int *)mg_host(sizeof(int) * (size_t)calls);
  int *csel = (int *)mg_host(sizeof(int) * (size_t)calls);
  size_t *in_off = (size_t *)mg_host(sizeof(size_t) * (size_t)calls);
  size_t *out_off = (size_t *)mg_host(sizeof(size_t) * (size_t)calls);
  int64_t *h_counts = (int64_t *)mg_host(sizeof(int64_t) * 8 * 2 * (size_t)calls);
  uint64_t st = 20251130;
  size_t total = 0;
  for (int i = 0; i < calls; ++i) {
    const count_kind kind = (count_kind)(mg_next(&st) % 3 + K_TINY); /* tiny, small, mixed */
    const int64_t scale = 1 + (int64_t)(mg_next(&st) % 40000);
    dsel[i] = (int)(mg_next(&st) % 3);
    csel[i] = ctas[mg_next(&st) % 6];
    build_plan(&ps[i], 70000 + (uint64_t)i, kind, scale, dts[dsel[i]], (int)(mg_next(&st) % 2));
    const size_t need = (size_t)ps[i].send_n[r];
    in_off[i] = (size_t)(mg_next(&st) % (arena - need + 1));
    out_off[i] = total;
    total += ((size_t)ps[i].recv_n[r] * 4 + 255) / 256 * 256 + 256;
    for (int q = 0; q < n; ++q) {
      h_counts[(size_t)i * 16 + q] = ps[i].m[r][q];
      h_counts[(size_t)i * 16 + 8 + q] = ps[i].off[r][q];
    }
  }
  int64_t *d_counts = (int64_t *)mg_dev(sizeof(int64_t) * 16 * (size_t)calls);
  int64_t *d_recv_counts = (int64_t *)mg_dev(sizeof(int64_t) * 16 * (size_t)calls);
  MG_CUDA(cudaMemcpy(d_counts, h_counts, sizeof(int64_t) * 16 * (size_t)calls,
                     cudaMemcpyHostToDevice));
  MG_CUDA(cudaMemset(d_recv_counts, 0xff, sizeof(int64_t) * 16 * (size_t)calls));
  char *ours = (char *)mg_dev(total), *ref = (char *)mg_dev(total);
  MG_CUDA(cudaMemset(ours, 0xff, total));
  MG_CUDA(cudaMemset(ref, 0xff, total));
  const double t0 = mg_now();
  int enq_fail = 0;
  for (int i = 0; i < calls; ++i) {
    const size_t es = moelink_dtype_size(ps[i].dt);
    const char *src = (const char *)in[dsel[i]] + in_off[i] * es;
    MG_MUST(ml_comm_cuda_set_ctas(W.comm, csel[i]), "set ctas");
    const size_t cap = (size_t)ps[i].recv_n[r];
    moelink_status_t s = moelink_alltoallv(
        W.comm, src, d_counts + (size_t)i * 16, ps[i].packed ? NULL : d_counts + (size_t)i * 16 + 8,
        ours + out_off[i], cap, d_recv_counts + (size_t)i * 16, d_recv_counts + (size_t)i * 16 + 8,
        ps[i].dt, W.stream);
    if (s != MOELINK_SUCCESS && !enq_fail++)
      CHECK(0, "stress call %d: %s: %s", i, moelink_status_string(s), moelink_last_error());
  }
  MG_MUST(ml_comm_cuda_set_ctas(W.comm, ML_CCU_DEFAULT_CTAS), "default ctas");
  sync_stream();
  const double t_ours = mg_now() - t0;
  CHECK(enq_fail == 0, "stress: %d alltoallv calls back to back (%.3f s)", calls, t_ours);
  CHECK_OK(moelink_comm_check(W.comm, W.stream), "stress: moelink_comm_check");
  for (int i = 0; i < calls; ++i) {
    const size_t es = moelink_dtype_size(ps[i].dt);
    nccl_alltoallv(&ps[i], (const char *)in[dsel[i]] + in_off[i] * es, ref + out_off[i]);
  }
  sync_stream();
  char *h_ours = (char *)to_host(ours, total), *h_ref = (char *)to_host(ref, total);
  int64_t *h_rc = (int64_t *)to_host(d_recv_counts, sizeof(int64_t) * 16 * (size_t)calls);
  int failed = 0;
  for (int i = 0; i < calls; ++i) {
    const plan *p = &ps[i];
    const size_t es = moelink_dtype_size(p->dt);
    const size_t bytes = (size_t)p->recv_n[r] * es;
    int ok = memcmp(h_ours + out_off[i], h_ref + out_off[i], bytes) == 0;
    for (size_t b = bytes; ok && b < bytes + 256; ++b)
      ok = (unsigned char)h_ours[out_off[i] + b] == 0xff;
    int64_t at = 0;
    for (int s = 0; ok && s < n; ++s) {
      ok = h_rc[(size_t)i * 16 + s] == p->m[s][r] && h_rc[(size_t)i * 16 + 8 + s] == at;
      at += p->m[s][r];
    }
    if (!ok && failed < 5)
      CHECK(0, "stress call %d: %s, %lld elements in, %d ctas%s: differs from NCCL's (or counts)",
            i, moelink_dtype_name(p->dt), (long long)p->recv_n[r], csel[i],
            p->packed ? ", packed" : "");
    failed += !ok;
  }
  CHECK(failed == 0, "stress: %d of %d calls match NCCL bitwise, counts and offsets right",
        calls - failed, calls);
  free(h_ours);
  free(h_ref);
  free(h_rc);
  free(h_counts);
  free(ps);
  free(dsel);
  free(csel);
  free(in_off);
  free(out_off);
  cudaFree(d_counts);
  cudaFree(d_recv_counts);
  cudaFree(ours);
  cudaFree(ref);
  for (int d = 0; d < 3; ++d) cudaFree(in[d]);
}

/* ---- CUDA graph: new counts on the device between replays ------------------ */

static void run_graph(void) {
  const int r = W.rank, n = W.size;
  const size_t max_n = (size_t)1 << 21; /* elements per call and side, bf16 / f32 */
  char *s1 = (char *)mg_dev(max_n * 2), *o1 = (char *)mg_dev(max_n * 2 + 4096);
  char *s2 = (char *)mg_dev(max_n * 4), *o2 = (char *)mg_dev(max_n * 4 + 4096);
  char *r1 = (char *)mg_dev(max_n * 2), *r2 = (char *)mg_dev(max_n * 4);
  int64_t *c1 = (int64_t *)mg_dev(sizeof(int64_t) * 32);
  int64_t *c2 = (int64_t *)mg_dev(sizeof(int64_t) * 32);
  cudaGraph_t g = NULL;
  cudaGraphExec_t ge = NULL;
  MG_CUDA(cudaStreamBeginCapture(W.stream, cudaStreamCaptureModeGlobal));
  moelink_status_t a = moelink_alltoallv(W.comm, s1, c1, c1 + 8, o1, max_n, c1 + 16, c1 + 24,
                                         MOELINK_DTYPE_BF16, W.stream);
  moelink_status_t b = moelink_alltoallv(W.comm, s2, c2, NULL, o2, max_n, c2 + 16, c2 + 24,
                                         MOELINK_DTYPE_F32, W.stream);
  cudaError_t e = cudaStreamEndCapture(W.stream, &g);
  CHECK(a == MOELINK_SUCCESS && b == MOELINK_SUCCESS && e == cudaSuccess,
        "graph: two alltoallv captured (%s, %s, %s)", moelink_status_string(a),
        moelink_status_string(b), cudaGetErrorString(e));
  if (e != cudaSuccess || a || b) mg_bail("capture failed");
  MG_CUDA(cudaGraphInstantiate(&ge, g, 0));
  for (int k = 0; k < 6; ++k) {
    /* New counts each replay; every rank builds the same plans. */
    plan p1, p2;
    const int ca = g_case++, cb = g_case++;
    build_plan(&p1, 9000 + (uint64_t)k, k % 2 ? K_MIXED : K_SMALL,
               (int64_t)(max_n / (size_t)(n * n)), MOELINK_DTYPE_BF16, 0);
    build_plan(&p2, 9100 + (uint64_t)k, K_MIXED, (int64_t)(max_n / (size_t)(n * n)),
               MOELINK_DTYPE_F32, 1);
    int64_t h1[32], h2[32];
    memset(h1, 0xff, sizeof h1);
    memset(h2, 0xff, sizeof h2);
    for (int q = 0; q < n; ++q) {
      h1[q] = p1.m[r][q];
      h1[8 + q] = p1.off[r][q];
      h2[q] = p2.m[r][q];
    }
    MG_CUDA(cudaMemcpyAsync(c1, h1, sizeof h1, cudaMemcpyHostToDevice, W.stream));
    MG_CUDA(cudaMemcpyAsync(c2, h2, sizeof h2, cudaMemcpyHostToDevice, W.stream));
    if (p1.send_n[r])
      MG_MUST(moelink_fill_random(W.ctx, MOELINK_DTYPE_BF16, s1, (size_t)p1.send_n[r],
                                  mg_seed(r, ca), 1.0f, 0.0f, W.stream),
              "fill");
    if (p2.send_n[r])
      MG_MUST(moelink_fill_random(W.ctx, MOELINK_DTYPE_F32, s2, (size_t)p2.send_n[r],
                                  mg_seed(r, cb), 1.0f, 0.0f, W.stream),
              "fill");
    MG_CUDA(cudaMemsetAsync(o1, 0xff, max_n * 2 + 4096, W.stream));
    MG_CUDA(cudaMemsetAsync(o2, 0xff, max_n * 4 + 4096, W.stream));
    MG_CUDA(cudaGraphLaunch(ge, W.stream));
    nccl_alltoallv(&p1, s1, r1);
    nccl_alltoallv(&p2, s2, r2);
    CHECK_OK(moelink_comm_check(W.comm, W.stream), "graph replay: moelink_comm_check");
    char what[120];
    for (int which = 0; which < 2; ++which) {
      const plan *p = which ? &p2 : &p1;
      const size_t es = which ? 4 : 2;
      int64_t rc[8], ro[8];
      MG_CUDA(cudaMemcpy(rc, (which ? c2 : c1) + 16, sizeof(int64_t) * (size_t)n,
                         cudaMemcpyDeviceToHost));
      MG_CUDA(cudaMemcpy(ro, (which ? c2 : c1) + 24, sizeof(int64_t) * (size_t)n,
                         cudaMemcpyDeviceToHost));
      const size_t alloc_n = max_n + 4096 / es;
      void *h = to_host(which ? o2 : o1, alloc_n * es);
      snprintf(what, sizeof what, "graph replay %d: %s alltoallv of %lld elements in", k,
               which ? "f32" : "bf16", (long long)p->recv_n[r]);
      size_t bad = check_recv(what, p, h, alloc_n, max_n, rc, ro, which ? cb : ca);
      void *hr = to_host(which ? r2 : r1, (size_t)p->recv_n[r] * es);
      CHECK(bad == 0 && memcmp(h, hr, (size_t)p->recv_n[r] * es) == 0,
            "%s: bitwise the inputs and NCCL's", what);
      free(h);
      free(hr);
    }
    /* An eager call between replays continues the same epochs. */
    if (k == 2) run_case("eager call between graph replays", K_MIXED, 50001, MOELINK_DTYPE_F16,
                         0, 1, 0, 1);
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  void *bufs[] = {s1, o1, s2, o2, r1, r2, c1, c2};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) cudaFree(bufs[i]);
}

int main(void) {
  mg_init(&W);
  if (W.size > 8) mg_bail("at most 8 ranks");
  const double t0 = mg_now();
  run_sizes();
  ml_t_diag("sizes done in %.1f s", mg_now() - t0);
  run_errors();
  run_stress();
  ml_t_diag("stress done in %.1f s", mg_now() - t0);
  run_graph();
  ml_t_diag("all done in %.1f s", mg_now() - t0);
  mg_fini(&W);
  return ml_test_done();
}
