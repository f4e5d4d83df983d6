/* Status names and the thread-local last-error message. */
#include "core/core.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char ml_last_error_buf[512];

moelink_status_t ml_fail(moelink_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ml_last_error_buf, sizeof ml_last_error_buf, fmt, ap);
  va_end(ap);
  return status;
}

void ml_clear_error(void) { ml_last_error_buf[0] = 0; }

const char *moelink_last_error(void) { return ml_last_error_buf; }

void ml_error_save(ml_saved_error *e) {
  snprintf(e->msg, sizeof e->msg, "%s", ml_last_error_buf);
}

moelink_status_t ml_error_restore(const ml_saved_error *e, moelink_status_t status) {
  snprintf(ml_last_error_buf, sizeof ml_last_error_buf, "%s", e->msg);
  return status;
}

const char *moelink_status_string(moelink_status_t status) {
  switch (status) {
  case MOELINK_SUCCESS: return "MOELINK_SUCCESS";
  case MOELINK_ERR_INVALID_ARGUMENT: return "MOELINK_ERR_INVALID_ARGUMENT";
  case MOELINK_ERR_DTYPE_MISMATCH: return "MOELINK_ERR_DTYPE_MISMATCH";
  case MOELINK_ERR_NOT_FOUND: return "MOELINK_ERR_NOT_FOUND";
  case MOELINK_ERR_INVALID_STATE: return "MOELINK_ERR_INVALID_STATE";
  case MOELINK_ERR_UNSUPPORTED: return "MOELINK_ERR_UNSUPPORTED";
  case MOELINK_ERR_OUT_OF_MEMORY: return "MOELINK_ERR_OUT_OF_MEMORY";
  case MOELINK_ERR_CUDA: return "MOELINK_ERR_CUDA";
  case MOELINK_ERR_NCCL: return "MOELINK_ERR_NCCL";
  case MOELINK_ERR_TIMEOUT: return "MOELINK_ERR_TIMEOUT";
  case MOELINK_ERR_INTERNAL: return "MOELINK_ERR_INTERNAL";
  }
  return "MOELINK_ERR_UNKNOWN_STATUS";
}
