/* Environment parameters (see MOELINK_PARAM in core.h and docs/ENV.md). */
#include "core/core.h"

#include <errno.h>
#include <stdlib.h>

int64_t ml_env_int(const char *name, int64_t dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  errno = 0;
  char *end = NULL;
  long long x = strtoll(v, &end, 0);
  /* A malformed value keeps the default rather than half-parsing it. */
  if (errno || !end || *end) return dflt;
  return (int64_t)x;
}
