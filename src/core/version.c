#include "core/core.h"

#define ML_STR2(x) #x
#define ML_STR(x) ML_STR2(x)

const char *moelink_version(void) {
  return ML_STR(MOELINK_VERSION_MAJOR) "." ML_STR(MOELINK_VERSION_MINOR) "." ML_STR(
      MOELINK_VERSION_PATCH);
}

int moelink_version_code(void) { return MOELINK_VERSION_CODE; }
