/* The README's C code works: every ```c block is compiled against include/
 * and the built shared library; blocks with a main() are linked and run and
 * must exit 0. A missing README or one without a C program fails. */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef ML_SOURCE_DIR
#error "ML_SOURCE_DIR must be defined by the build"
#endif
#ifndef ML_BINARY_DIR
#error "ML_BINARY_DIR must be defined by the build"
#endif
#ifndef ML_C_COMPILER
#define ML_C_COMPILER "cc"
#endif

/* A sanitized library needs its runtime first in the program: build the
 * README program the way this test was built. */
#if defined(__SANITIZE_ADDRESS__)
#define ML_SAN_FLAGS "-fsanitize=address,undefined"
#else
#define ML_SAN_FLAGS ""
#endif

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap + 1);
  size_t got;
  while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
    n += got;
    if (n == cap) {
      cap *= 2;
      char *nb = realloc(buf, cap + 1);
      if (!nb) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = nb;
    }
  }
  fclose(f);
  if (buf) buf[n] = 0;
  if (len) *len = n;
  return buf;
}

/* Prints a file's lines as TAP diagnostics (at most max_lines). */
static void diag_file(const char *path, int max_lines) {
  FILE *f = fopen(path, "r");
  if (!f) return;
  char line[1024];
  int n = 0;
  while (fgets(line, sizeof line, f) && n < max_lines) {
    line[strcspn(line, "\n")] = 0;
    ml_t_diag("  %s", line);
    ++n;
  }
  fclose(f);
}

/* Exit status of a shell command (-1 when it did not exit normally). */
static int run(const char *cmd) {
  int rc = system(cmd);
  if (rc == -1 || !WIFEXITED(rc)) return -1;
  return WEXITSTATUS(rc);
}

/* Is this line a fence opening a C block ("```c", optionally indented or
 * with trailing spaces)? */
static int opens_c_block(const char *line, size_t len) {
  size_t i = 0;
  while (i < len && (line[i] == ' ' || line[i] == '\t')) ++i;
  if (len - i < 4 || strncmp(line + i, "```", 3) != 0) return 0;
  i += 3;
  if (line[i] != 'c' && line[i] != 'C') return 0;
  ++i;
  while (i < len && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
  return i == len;
}

static int is_fence(const char *line, size_t len) {
  size_t i = 0;
  while (i < len && (line[i] == ' ' || line[i] == '\t')) ++i;
  return len - i >= 3 && strncmp(line + i, "```", 3) == 0;
}

int main(void) {
  const char *readme = ML_SOURCE_DIR "/README.md";
  size_t len = 0;
  char *text = read_file(readme, &len);
  CHECK(text != NULL, "README.md exists at %s", readme);
  if (!text) return ml_test_done();

  char dir[] = "/tmp/moelink-readme-XXXXXX";
  if (!mkdtemp(dir)) {
    CHECK(0, "temporary directory");
    free(text);
    return ml_test_done();
  }

  int blocks = 0, programs = 0;
  const char *p = text, *end = text + len;
  while (p < end) {
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    if (!eol) eol = end;
    if (!opens_c_block(p, (size_t)(eol - p))) {
      p = eol + 1;
      continue;
    }
    /* Collect the block up to the closing fence. */
    const char *body = eol < end ? eol + 1 : end, *q = body, *body_end = NULL;
    while (q < end) {
      const char *qe = memchr(q, '\n', (size_t)(end - q));
      if (!qe) qe = end;
      if (is_fence(q, (size_t)(qe - q))) {
        body_end = q;
        p = qe + 1;
        break;
      }
      q = qe + 1;
    }
    ++blocks;
    if (!body_end) {
      CHECK(0, "C block %d is closed by a fence", blocks);
      break;
    }
    char src[256], exe[256], log[256], cmd[2048];
    snprintf(src, sizeof src, "%s/block%d.c", dir, blocks);
    snprintf(exe, sizeof exe, "%s/block%d", dir, blocks);
    snprintf(log, sizeof log, "%s/block%d.log", dir, blocks);
    FILE *f = fopen(src, "w");
    if (!f) {
      CHECK(0, "write %s", src);
      continue;
    }
    fwrite(body, 1, (size_t)(body_end - body), f);
    fclose(f);
    size_t blen = (size_t)(body_end - body);
    char *copy = malloc(blen + 1);
    memcpy(copy, body, blen);
    copy[blen] = 0;
    const int has_main = strstr(copy, "main(") != NULL || strstr(copy, "main (") != NULL;
    free(copy);

    if (has_main) {
      ++programs;
      snprintf(cmd, sizeof cmd,
               "'%s' -std=c11 -Wall -Wextra %s -I'%s/include' '%s' -o '%s' "
               "'%s/libmoelink.so' -Wl,-rpath,'%s' -lm > '%s' 2>&1",
               ML_C_COMPILER, ML_SAN_FLAGS, ML_SOURCE_DIR, src, exe, ML_BINARY_DIR,
               ML_BINARY_DIR, log);
    } else {
      snprintf(cmd, sizeof cmd,
               "'%s' -std=c11 -Wall -Wextra -I'%s/include' -c '%s' -o '%s.o' > '%s' 2>&1",
               ML_C_COMPILER, ML_SOURCE_DIR, src, exe, log);
    }
    int rc = run(cmd);
    CHECK(rc == 0, "C block %d (%s) compiles%s", blocks, has_main ? "program" : "fragment",
          has_main ? " and links against libmoelink.so" : "");
    if (rc != 0) {
      diag_file(log, 40);
      continue;
    }
    size_t loglen = 0;
    char *warn = read_file(log, &loglen);
    if (warn && loglen > 0) {
      ml_t_diag("compiler output for block %d:", blocks);
      diag_file(log, 20);
    }
    free(warn);
    if (!has_main) continue;
    snprintf(cmd, sizeof cmd, "cd '%s' && timeout 300 '%s' > '%s' 2>&1", dir, exe, log);
    rc = run(cmd);
    CHECK(rc == 0, "README program (block %d) runs and exits 0 (status %d)", blocks, rc);
    ml_t_diag("output of block %d:", blocks);
    diag_file(log, rc == 0 ? 15 : 60);
  }
  CHECK(blocks > 0, "README.md has at least one ```c block (%d)", blocks);
  CHECK(programs > 0, "README.md has a complete C program (a block with main) (%d)", programs);

  char cmd[512];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (run(cmd) != 0) ml_t_diag("could not remove %s", dir);
  free(text);
  return ml_test_done();
}
