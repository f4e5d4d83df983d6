/* A rank that stops taking part must not hang the others: after one good
 * all-reduce, rank 1 leaves without the second one; rank 0's kernel gives up
 * after MOELINK_COMM_TIMEOUT_MS (2000 ms under ctest) and moelink_comm_check
 * reports MOELINK_ERR_TIMEOUT naming the rank, the collective and the value
 * awaited. The communicator then refuses work and destroys without hanging.
 *
 *   MOELINK_COMM_TIMEOUT_MS=2000 moelink launch -n 2 -- mgpu_test_timeout */
#include "mgpu.h"

int main(void) {
  mg_world w;
  mg_init(&w);
  const size_t count = 4099;
  float *send = (float *)mg_dev(count * 4), *recv = (float *)mg_dev(count * 4);
  MG_MUST(moelink_fill_random(w.ctx, MOELINK_DTYPE_F32, send, count, 1, 1.0f, 0.0f, w.stream),
          "fill");
  CHECK_OK(moelink_allreduce(w.comm, send, recv, count, MOELINK_DTYPE_F32, w.stream),
           "first allreduce (every rank)");
  CHECK_OK(moelink_comm_check(w.comm, w.stream), "check after the first allreduce");
  /* Both ranks are past the first collective before rank 1 leaves. */
  MG_NCCL(w.nccl, ncclAllReduce(send, recv, 1, ncclFloat32, ncclSum, w.nccl, w.stream));
  MG_CUDA(cudaStreamSynchronize(w.stream));

  mg_leave_unless_rank0(&w, "the second allreduce");

  const double t0 = mg_now();
  CHECK_OK(moelink_allreduce(w.comm, send, recv, count, MOELINK_DTYPE_F32, w.stream),
           "second allreduce is enqueued");
  const char *msg = mg_expect_timeout(&w, t0);
  CHECK(strstr(msg, "rank 0") && strstr(msg, "from rank 1") && strstr(msg, "all-reduce") &&
            strstr(msg, "value"),
        "the message names the rank, the peer, the collective and the value: %s", msg);

  moelink_status_t s = moelink_comm_check(w.comm, w.stream);
  CHECK(s == MOELINK_ERR_TIMEOUT, "the failure stays reported (%s)", moelink_status_string(s));
  s = moelink_allreduce(w.comm, send, recv, count, MOELINK_DTYPE_F32, w.stream);
  CHECK(s == MOELINK_ERR_INVALID_STATE, "a broken communicator refuses work (%s: %s)",
        moelink_status_string(s), moelink_last_error());

  const double t1 = mg_now();
  CHECK_OK(moelink_comm_destroy(w.comm), "destroy with the peer gone");
  CHECK(mg_now() - t1 < 30.0, "destroy returned in %.2f s", mg_now() - t1);
  cudaFree(send);
  cudaFree(recv);
  cudaStreamDestroy(w.stream);
  CHECK_OK(moelink_context_destroy(w.ctx), "context destroy");
  return ml_test_done();
}
