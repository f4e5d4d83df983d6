/* moelink_device.cuh's host functions in a library built without the CUDA
 * communicator (no CUDA, or no NCCL >= 2.28): they exist, and say why they
 * cannot work. */
#include "core/core.h"
#include "moelink_device.cuh"

moelink_status_t moelink_comm_device(moelink_comm_t comm, moelink_device_comm_t *out) {
  ml_clear_error();
  (void)comm;
  (void)out;
  return ml_fail(MOELINK_ERR_UNSUPPORTED,
                 "comm_device: this library was built without the cuda communicator (NCCL)");
}

moelink_status_t moelink_symm_view(moelink_comm_t comm, const void *ptr,
                                   moelink_symm_view_t *out) {
  ml_clear_error();
  (void)comm;
  (void)ptr;
  (void)out;
  return ml_fail(MOELINK_ERR_UNSUPPORTED,
                 "symm_view: this library was built without the cuda communicator (NCCL)");
}
