/* A rank that stops taking part must not hang the expert-parallel layer's
 * peers: after one good dispatch + combine, every rank but 0 leaves; rank
 * 0's next dispatch waits for rows that never come, its kernel gives up after
 * MOELINK_COMM_TIMEOUT_MS (2000 ms under ctest) and moelink_comm_check
 * reports MOELINK_ERR_TIMEOUT naming the ranks. The layer and the
 * communicator then destroy without hanging. The layer is small (max_tokens
 * 16), so with MOELINK_EP_LL on (the default) the exchanges are the
 * one-kernel ones, where every CTA waits for the peers itself.
 *
 *   MOELINK_COMM_TIMEOUT_MS=2000 moelink launch -n 2 -- mgpu_test_ep_timeout */
#include "mgpu.h"

#define ET_T 16

int main(void) {
  mg_world w;
  mg_init(&w);
  moelink_ep_config_t cfg = MOELINK_EP_CONFIG_INIT;
  cfg.moe.hidden = 256;
  cfg.moe.inter = 128;
  cfg.moe.num_experts = 4 * w.size;
  cfg.moe.top_k = 2;
  cfg.moe.max_tokens = ET_T;
  moelink_ep_t ep = NULL;
  MG_MUST(moelink_ep_create(w.comm, &cfg, &ep), "moelink_ep_create");
  const size_t row = (size_t)cfg.moe.hidden * 2;
  void *x = mg_dev(ET_T * row), *out = mg_dev(ET_T * row);
  int32_t hids[ET_T * 2];
  float hwts[ET_T * 2];
  for (int t = 0; t < ET_T; ++t) { /* two experts E / 2 apart: on two ranks */
    hids[2 * t] = t % cfg.moe.num_experts;
    hids[2 * t + 1] = (t + cfg.moe.num_experts / 2) % cfg.moe.num_experts;
    hwts[2 * t] = hwts[2 * t + 1] = 0.5f;
  }
  int32_t *ids = (int32_t *)mg_dev(sizeof hids);
  float *wts = (float *)mg_dev(sizeof hwts);
  MG_CUDA(cudaMemcpy(ids, hids, sizeof hids, cudaMemcpyHostToDevice));
  MG_CUDA(cudaMemcpy(wts, hwts, sizeof hwts, cudaMemcpyHostToDevice));
  MG_MUST(moelink_fill_random(w.ctx, MOELINK_DTYPE_BF16, x, (size_t)ET_T * cfg.moe.hidden, 1, 1.0f,
                              0.0f, w.stream),
          "fill x");

  /* one good round on every rank; the experts' outputs: zeros */
  moelink_ep_recv_t rv = MOELINK_EP_RECV_INIT;
  CHECK_OK(moelink_ep_dispatch(ep, x, ids, wts, ET_T, &rv, w.stream), "first dispatch");
  void *y = mg_dev((size_t)rv.capacity * (size_t)rv.top_k * row);
  MG_CUDA(cudaMemsetAsync(y, 0, (size_t)rv.capacity * (size_t)rv.top_k * row, w.stream));
  CHECK_OK(moelink_ep_combine(ep, y, NULL, out, w.stream), "first combine");
  CHECK_OK(moelink_comm_check(w.comm, w.stream), "check after the first round");
  /* Every rank is past the first round before the others leave. */
  MG_NCCL(w.nccl, ncclAllReduce(wts, wts, 1, ncclFloat32, ncclMax, w.nccl, w.stream));
  MG_CUDA(cudaStreamSynchronize(w.stream));

  mg_leave_unless_rank0(&w, "the second dispatch");

  const double t0 = mg_now();
  CHECK_OK(moelink_ep_dispatch(ep, x, ids, wts, ET_T, &rv, w.stream),
           "second dispatch is enqueued");
  const char *msg = mg_expect_timeout(&w, t0);
  CHECK(strstr(msg, "rank 0") && strstr(msg, "from rank"),
        "the message names the rank and the peer: %s", msg);

  const double t1 = mg_now();
  CHECK_OK(moelink_ep_destroy(ep), "ep destroy with the peers gone");
  CHECK_OK(moelink_comm_destroy(w.comm), "comm destroy with the peers gone");
  CHECK(mg_now() - t1 < 30.0, "both destroys returned in %.2f s", mg_now() - t1);
  cudaFree(x);
  cudaFree(out);
  cudaFree(y);
  cudaFree(ids);
  cudaFree(wts);
  cudaStreamDestroy(w.stream);
  CHECK_OK(moelink_context_destroy(w.ctx), "context destroy");
  return ml_test_done();
}
