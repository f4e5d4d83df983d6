/* Internal core: errors, dtype conversion, environment parameters.
 * Everything here is hidden (the library is built with -fvisibility=hidden). */
#ifndef MOELINK_CORE_H
#define MOELINK_CORE_H

#include "moelink.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Records a formatted reason as the thread's last error and returns status,
 * so a failure is reported in one line: return ml_fail(ERR, "fmt", ...). */
moelink_status_t ml_fail(moelink_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Clears the thread's last error (called at the start of each public entry). */
void ml_clear_error(void);

/* The thread's last error kept across cleanup that goes through public entry
 * points (each clears it):
 *   ml_saved_error e; ml_error_save(&e); ...cleanup...; return ml_error_restore(&e, s); */
typedef struct ml_saved_error {
  char msg[512];
} ml_saved_error;
void ml_error_save(ml_saved_error *e);
/* Puts the saved message back as the last error; returns status. */
moelink_status_t ml_error_restore(const ml_saved_error *e, moelink_status_t status);

#define ML_TRY(expr)                                                           \
  do {                                                                         \
    moelink_status_t ml_try_status_ = (expr);                                  \
    if (ml_try_status_ != MOELINK_SUCCESS) return ml_try_status_;             \
  } while (0)

/* Scalar conversions. bf16/f16 from f32 round to nearest even; NaN stays NaN,
 * overflow becomes infinity. */
float ml_bf16_to_f32(uint16_t h);
uint16_t ml_f32_to_bf16(float f);
float ml_f16_to_f32(uint16_t h);
uint16_t ml_f32_to_f16(float f);

/* Block conversions between a dtype buffer and fp32 (F32 is a copy). */
void ml_to_f32(moelink_dtype_t dtype, const void *src, float *dst, size_t n);
void ml_from_f32(moelink_dtype_t dtype, const float *src, void *dst, size_t n);

/* Environment parameters, read once and cached: MOELINK_PARAM(NAME, default)
 * defines `static int64_t ml_param_NAME(void)` reading MOELINK_<NAME>.
 * Every parameter is listed in docs/ENV.md. */
int64_t ml_env_int(const char *name, int64_t dflt);
#define MOELINK_PARAM(NAME, DEFAULT)                                           \
  static int64_t ml_param_##NAME(void) {                                       \
    static int64_t cached_;                                                    \
    static int loaded_;                                                        \
    if (!__atomic_load_n(&loaded_, __ATOMIC_ACQUIRE)) {                        \
      cached_ = ml_env_int("MOELINK_" #NAME, (DEFAULT));                       \
      __atomic_store_n(&loaded_, 1, __ATOMIC_RELEASE);                         \
    }                                                                          \
    return cached_;                                                            \
  }

#ifdef __cplusplus
}
#endif

#endif
