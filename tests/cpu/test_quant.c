/* 8-bit rows on CPU (moelink_quantize / moelink_dequantize, src/cpu/quant.c)
 * against references written here, from the formats' definitions alone:
 * - e4m3: a brute-force encoder (decode all 256 codes, take the nearest
 *   finite one, ties to the even code, a zero keeps x's sign, past 448
 *   saturate, NaN stays NaN) checked against the library's conversion on
 *   every e4m3 value, every midpoint and its float neighbours, fp32
 *   subnormals, random floats of every exponent, +-0, +-inf and NaN; the
 *   same values also through moelink_quantize (MXFP8 blocks whose scale is
 *   2^0) and all 256 codes back through moelink_dequantize;
 * - FP8 and MXFP8 rows of every dtype with blocks of zeros, a NaN, only
 *   NaNs, an inf, huge, tiny and fp32-subnormal magnitudes, wide ranges
 *   inside a block and exactly representable blocks: q bytes and scales
 *   equal to a per-block reference (amax ignoring NaN, scale, element
 *   codes), dequantized values equal to e4m3 value * scale rounded to the
 *   dtype, dequantize(quantize(x)) within the format's bound and exactly x
 *   where x is representable; every e8m0 byte's scale;
 * - thread counts (1 and 4) give bitwise the same bytes, and the EP helper
 *   ml_cpu_qdq_rows is bitwise dequantize(quantize(x)), also in place;
 * - argument errors with their messages, outputs left alone. */
#include "core/fp8.h"
#include "cpu/cpu.h"
#include "harness.h"
#include "ref.h"

#include <float.h>
#include <stdint.h>

static moelink_context_t ctx1, ctx4;

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static uint32_t rng_next(void) { return ml_t_rand(&rng_state); }
static double rng_unit(void) { return ml_t_unit(&rng_state); }

static float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* ---- e4m3 from its definition -------------------------------------------- */

/* Sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent field 0 holds
 * m * 2^-9; S.1111.111 is NaN; no infinities. */
static double e4m3_decode(uint8_t b) {
  const int E = (b >> 3) & 15, m = b & 7;
  const double s = (b & 0x80) ? -1.0 : 1.0;
  if (E == 15 && m == 7) return NAN;
  if (E == 0) return s * ldexp(m, -9);
  return s * ldexp(8 + m, E - 10);
}

static int is_nan_code(uint8_t b) { return (b & 0x7f) == 0x7f; }

/* The nearest finite code by brute force. Distances are exact in double for
 * every f that can tie (|f| >= 2^-62); equal distance: the same value (the
 * two zeros) takes f's sign, different values the even code. */
static uint8_t e4m3_encode_ref(float f) {
  if (isnan(f)) return 0x7f;
  /* Past 448 (inf too): saturate; the brute force's distances would round
   * alike there. */
  if (fabsf(f) >= 448.0f) return signbit(f) ? 0xfe : 0x7e;
  int best = -1;
  double bd = 0.0;
  for (int c = 0; c < 256; ++c) {
    const double v = e4m3_decode((uint8_t)c);
    if (isnan(v)) continue;
    const double d = fabs((double)f - v);
    int take = best < 0 || d < bd;
    if (!take && d == bd) {
      const double bv = e4m3_decode((uint8_t)best);
      if (v == bv)
        take = (signbit(v) != 0) == (signbit(f) != 0);
      else
        take = (c & 1) == 0 && (best & 1) != 0;
    }
    if (take) {
      best = c;
      bd = d;
    }
  }
  return (uint8_t)best;
}

/* Every value worth checking: e4m3 values, midpoints between neighbours and
 * their float neighbours, around 448, fp32 subnormals, specials, random
 * floats of every exponent and random floats near e4m3's range. */
static size_t conversion_values(float *v, size_t cap) {
  size_t n = 0;
#define ML_PUT(x)                                                                                  \
  do {                                                                                             \
    if (n < cap) v[n++] = (x);                                                                     \
  } while (0)
  double pos[127];
  for (int c = 0; c < 127; ++c) pos[c] = e4m3_decode((uint8_t)c);
  for (int c = 0; c < 127; ++c) {
    for (int sg = 0; sg < 2; ++sg) {
      const float s = sg ? -1.0f : 1.0f;
      const float e = s * (float)pos[c];
      ML_PUT(e);
      ML_PUT(nextafterf(e, INFINITY));
      ML_PUT(nextafterf(e, -INFINITY));
      if (c < 126) {
        const float mid = s * (float)((pos[c] + pos[c + 1]) * 0.5);
        ML_PUT(mid);
        ML_PUT(nextafterf(mid, INFINITY));
        ML_PUT(nextafterf(mid, -INFINITY));
        ML_PUT(s * (float)(pos[c] + (pos[c + 1] - pos[c]) * 0.25));
        ML_PUT(s * (float)(pos[c] + (pos[c + 1] - pos[c]) * 0.75));
      }
    }
  }
  /* Past the largest finite value: 464 would be the midpoint to a next code. */
  const float big[] = {448.0f, 449.0f,     463.99997f, 464.0f, 464.00003f, 479.0f, 480.0f,
                       500.0f, 511.99997f, 512.0f,     1e4f,   65504.0f,   1e30f,  FLT_MAX};
  for (size_t i = 0; i < sizeof big / sizeof big[0]; ++i) {
    ML_PUT(big[i]);
    ML_PUT(-big[i]);
  }
  ML_PUT(0.0f);
  ML_PUT(-0.0f);
  ML_PUT(INFINITY);
  ML_PUT(-INFINITY);
  ML_PUT(NAN);
  ML_PUT(-NAN);
  ML_PUT(bits_to_float(0x7f800001u)); /* signaling */
  ML_PUT(bits_to_float(0xffbfffffu));
  /* fp32 subnormals and the smallest normals. */
  for (uint32_t u = 1; u < 64; ++u) {
    ML_PUT(bits_to_float(u));
    ML_PUT(bits_to_float(0x80000000u | u));
    ML_PUT(bits_to_float(0x00800000u + u - 1));
    ML_PUT(bits_to_float(0x007fffffu - u));
  }
  /* Random bit patterns (every exponent), then random values near e4m3's
   * range (exponents -14 .. 10, where rounding decides). */
  for (int i = 0; i < 200000; ++i) ML_PUT(bits_to_float(rng_next()));
  for (int i = 0; i < 200000; ++i) {
    const uint32_t r = rng_next();
    const uint32_t e = (uint32_t)(127 - 14 + (int)(rng_next() % 25u));
    ML_PUT(bits_to_float((r & 0x80000000u) | (e << 23) | (r & 0x7fffffu)));
  }
#undef ML_PUT
  return n;
}

static void test_conversion(void) {
  /* The decoder and the library's decoding: all 256 codes. */
  int dec_bad = -1;
  for (int c = 0; c < 256 && dec_bad < 0; ++c) {
    const double want = e4m3_decode((uint8_t)c);
    const float got = ml_e4m3_to_f32((uint8_t)c);
    if (isnan(want) ? !isnan(got) : !((double)got == want && !signbit(got) == !signbit(want)))
      dec_bad = c;
  }
  CHECK(dec_bad < 0, "ml_e4m3_to_f32 of all 256 codes is the definition's value (first bad %d)",
        dec_bad);
  int mono = 1;
  for (int c = 1; c < 127; ++c) mono &= e4m3_decode((uint8_t)c) > e4m3_decode((uint8_t)(c - 1));
  CHECK(mono && e4m3_decode(0x7e) == 448.0 && e4m3_decode(0x01) == ldexp(1, -9),
        "the reference decoder: increasing codes 0..126, largest 448, smallest 2^-9");

  const size_t cap = 500000;
  float *v = (float *)malloc(sizeof(float) * cap);
  const size_t n = conversion_values(v, cap);
  size_t bad = 0, first = 0;
  int exact_codes = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t want = e4m3_encode_ref(v[i]), got = ml_e4m3_from_f32(v[i]);
    const int ok = is_nan_code(want) ? is_nan_code(got) : got == want;
    if (!ok && bad++ == 0) first = i;
    exact_codes += !isnan(v[i]) && e4m3_decode(want) == (double)v[i];
  }
  CHECK(bad == 0,
        "ml_e4m3_from_f32 = the brute-force nearest code on %zu values (%d of them "
        "e4m3 values): %zu differ, first %a -> 0x%02x, want 0x%02x",
        n, exact_codes, bad, bad ? (double)v[first] : 0.0, bad ? ml_e4m3_from_f32(v[first]) : 0,
        bad ? e4m3_encode_ref(v[first]) : 0);

  /* The same through moelink_quantize: MXFP8 blocks of 32 whose first element
   * is 256, so amax is in [256, 512), X = 0 and q = e4m3(x) itself. */
  const int per = 31;
  size_t m = 0;
  for (size_t i = 0; i < n; ++i)
    if (!(fabsf(v[i]) >= 512.0f)) v[m++] = v[i]; /* NaN kept */
  const int rows = (int)((m + per - 1) / per);
  float *x = (float *)malloc(sizeof(float) * (size_t)rows * 32);
  uint8_t *q = (uint8_t *)malloc((size_t)rows * 32), *sc = (uint8_t *)malloc((size_t)rows);
  for (int r = 0; r < rows; ++r) {
    x[(size_t)r * 32] = 256.0f;
    for (int j = 0; j < per; ++j) {
      const size_t i = (size_t)r * per + (size_t)j;
      x[(size_t)r * 32 + 1 + j] = i < m ? v[i] : 0.0f;
    }
  }
  CHECK_OK(moelink_quantize(ctx4, MOELINK_QUANT_MXFP8, MOELINK_DTYPE_F32, x, rows, 32, q, sc, NULL),
           "quantize the conversion values (MXFP8, scale 2^0)");
  size_t qbad = 0, scbad = 0;
  for (int r = 0; r < rows; ++r) {
    scbad += sc[r] != 127;
    for (int j = 0; j < 32; ++j) {
      const uint8_t want = e4m3_encode_ref(x[(size_t)r * 32 + j]), got = q[(size_t)r * 32 + j];
      qbad += is_nan_code(want) ? !is_nan_code(got) : got != want;
    }
  }
  for (int r = 0, shown = 0; r < rows && shown < 3; ++r)
    for (int j = 0; j < 32; ++j) {
      const uint8_t want = e4m3_encode_ref(x[(size_t)r * 32 + j]), got = q[(size_t)r * 32 + j];
      if (is_nan_code(want) ? !is_nan_code(got) : got != want) {
        ml_t_diag("row %d: x[%d] = %a -> 0x%02x, want 0x%02x (scale byte %d)", r, j,
                  (double)x[(size_t)r * 32 + j], got, want, sc[r]);
        ++shown;
        break;
      }
    }
  CHECK(qbad == 0 && scbad == 0,
        "moelink_quantize: %d blocks of conversion values (%zu values below 512) encode as the "
        "reference (%zu codes, %zu scales differ)",
        rows, m, qbad, scbad);
  free(x);
  free(q);
  free(sc);
  free(v);

  /* All 256 codes back through moelink_dequantize (scale 2^0), to f32. */
  uint8_t codes[256], one[8];
  memset(one, 127, sizeof one);
  float back[256];
  for (int c = 0; c < 256; ++c) codes[c] = (uint8_t)c;
  CHECK_OK(moelink_dequantize(ctx1, MOELINK_QUANT_MXFP8, MOELINK_DTYPE_F32, codes, one, 1, 256,
                              back, NULL),
           "dequantize all 256 codes");
  int dq_bad = -1;
  for (int c = 0; c < 256 && dq_bad < 0; ++c) {
    const double want = e4m3_decode((uint8_t)c);
    if (isnan(want) ? !isnan(back[c])
                    : ((double)back[c] != want || !signbit(back[c]) != !signbit(want)))
      dq_bad = c;
  }
  CHECK(dq_bad < 0, "moelink_dequantize of all 256 codes is their value (first bad %d)", dq_bad);
}

/* ---- rows ------------------------------------------------------------------ */

typedef enum {
  BK_RANDOM, /* random values of one magnitude 2^m, m drawn per block */
  BK_ZERO,   /* zeros of both signs */
  BK_NAN,    /* random with one NaN, quiet or signaling */
  BK_ALLNAN, /* only NaNs: amax 0 */
  BK_INF,    /* random with one infinity */
  BK_HUGE,   /* near the dtype's largest finite value */
  BK_TINY,   /* near the dtype's smallest normal (f32: fp32 subnormals too) */
  BK_WIDE,   /* magnitudes spread over 2^-24 .. 1 of the block's largest */
  BK_EXACT,  /* e4m3 values times a power of two that is the block's scale */
  BK_KINDS
} block_kind;

static const char *const kind_names[] = {"random", "zeros", "a NaN",      "only NaN", "an inf",
                                         "huge",   "tiny",  "wide range", "exact"};

/* The dtype's largest finite value. */
static double dt_max(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_F16    ? 65504.0
         : dt == MOELINK_DTYPE_BF16 ? ldexp(255.0, 120)
                                    : (double)FLT_MAX;
}

/* A random magnitude exponent m such that values around 2^m are normal in dt. */
static int rand_exp(moelink_dtype_t dt) {
  return dt == MOELINK_DTYPE_F16 ? -10 + (int)(rng_next() % 24u) : -40 + (int)(rng_next() % 81u);
}

static double rand_signed(void) { return (rng_next() & 1) ? -rng_unit() : rng_unit(); }

/* A block of n values of kind, stored in x (dtype) at element base, for
 * format fmt (FP8: scale amax / 448; MXFP8: scale 2^X). */
static void make_block(moelink_dtype_t dt, moelink_quant_t fmt, block_kind kind, void *x,
                       size_t base, int n) {
  const int m = rand_exp(dt), j = -6 + (int)(rng_next() % 13u);
  const int at = (int)(rng_next() % (uint32_t)n);
  for (int i = 0; i < n; ++i) {
    double v = 0.0;
    switch (kind) {
    case BK_RANDOM:
    case BK_NAN:
    case BK_INF: v = ldexp(rand_signed(), m); break;
    case BK_ZERO: v = (rng_next() & 1) ? -0.0 : 0.0; break;
    case BK_ALLNAN: v = (rng_next() & 1) ? -NAN : NAN; break;
    case BK_HUGE: v = rand_signed() * dt_max(dt); break;
    case BK_TINY:
      if (dt == MOELINK_DTYPE_F32 && (i & 1))
        v = ldexp(rand_signed(), -130); /* fp32 subnormal */
      else
        v = ldexp(rand_signed(), dt == MOELINK_DTYPE_F16 ? -13 : -100);
      break;
    case BK_WIDE: v = ldexp(rand_signed(), m - (int)(rng_next() % 25u)); break;
    case BK_EXACT: {
      /* FP8: amax = 448 * 2^j makes the scale 2^j exactly; MXFP8: an amax
       * code in [256, 448] makes X = j. Every element is a code's value
       * times 2^j, so x / s (or x * 2^-X) is that code exactly. */
      uint8_t c = (uint8_t)(rng_next() % 0x7fu); /* 0 .. 126: finite */
      if (i == at)
        c = fmt == MOELINK_QUANT_FP8 ? 0x7e : (uint8_t)(0x78 + rng_next() % 7u);
      else if (c > 0x77)
        c = (uint8_t)(c - 0x40); /* below 256 */
      v = ldexp(e4m3_decode(c), j) * ((rng_next() & 1) ? -1.0 : 1.0);
      break;
    }
    default: break;
    }
    ref_store(dt, x, base + (size_t)i, v);
  }
  if (kind == BK_NAN) {
    /* Quiet or signaling (whose conversion to fp32 stays signaling): either
     * must leave the block's amax alone. */
    const uint32_t r = rng_next();
    if (r & 2) {
      ref_store(dt, x, base + (size_t)at, (r & 1) ? -NAN : NAN);
    } else if (dt == MOELINK_DTYPE_F32) {
      const uint32_t u = ((r & 1u) << 31) | 0x7f800001u;
      memcpy((char *)x + (base + (size_t)at) * 4, &u, 4);
    } else {
      const uint16_t h =
          (uint16_t)(((r & 1u) << 15) | (dt == MOELINK_DTYPE_BF16 ? 0x7f81u : 0x7c01u));
      memcpy((char *)x + (base + (size_t)at) * 2, &h, 2);
    }
  }
  if (kind == BK_INF) ref_store(dt, x, base + (size_t)at, (rng_next() & 1) ? INFINITY : -INFINITY);
}

/* The MX exponent of a finite amax > 0 from frexp (amax = f * 2^e, f in
 * [0.5, 1): floor(log2) = e - 1). An infinite amax counts as 2^128 (X =
 * 120), as core/fp8.h does: include/moelink.h does not say (see the report). */
static int mx_exponent(double amax) {
  if (!(amax > 0.0)) return 0;
  int e;
  if (isinf(amax))
    e = 129;
  else
    frexp(amax, &e);
  int X = e - 1 - 8;
  return X < -127 ? -127 : X > 127 ? 127 : X;
}

/* Half a unit in the last place of dt at |v| (at least its smallest step). */
static double half_ulp(moelink_dtype_t dt, double v) {
  const int p = dt == MOELINK_DTYPE_F32 ? 24 : dt == MOELINK_DTYPE_BF16 ? 8 : 11;
  const int emin = dt == MOELINK_DTYPE_F16 ? -14 : -126;
  int e;
  frexp(fabs(v), &e);
  if (e - 1 < emin) e = emin + 1;
  return ldexp(1.0, e - 1 - p);
}

typedef struct row_stats {
  size_t q_bad, s_bad, dq_bad, bound_bad, exact_bad, bound_checked, exact_checked;
  size_t first_q, first_dq, first_bound, first_exact;
  int kind_seen[BK_KINDS];
} row_stats;

/* One [rows, cols] case of format and dtype: quantize, dequantize, compare
 * every block with the reference. */
static void check_rows(moelink_quant_t fmt, moelink_dtype_t dt, int rows, int cols,
                       int first_kind) {
  const int B = fmt == MOELINK_QUANT_FP8 ? 128 : 32, nb = cols / B;
  const size_t es = moelink_dtype_size(dt), n = (size_t)rows * cols;
  const size_t sbytes = moelink_quant_scale_bytes(fmt, cols);
  unsigned char *x = (unsigned char *)malloc(n * es), *dq = (unsigned char *)malloc(n * es);
  uint8_t *q = (uint8_t *)malloc(n), *sc = (uint8_t *)malloc((size_t)rows * sbytes + 1);
  block_kind *kinds = (block_kind *)malloc(sizeof(block_kind) * (size_t)rows * nb);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < nb; ++b) {
      const size_t bi = (size_t)r * nb + b;
      /* Every kind once early (from first_kind on), then mostly random ones. */
      block_kind k = bi < BK_KINDS
                         ? (block_kind)((bi + (size_t)first_kind) % BK_KINDS)
                         : (rng_next() % 3u == 0 ? (block_kind)(rng_next() % BK_KINDS) : BK_RANDOM);
      kinds[bi] = k;
      make_block(dt, fmt, k, x, bi * B, B);
    }
  memset(q, 0xa5, n);
  memset(sc, 0xa5, (size_t)rows * sbytes + 1);
  for (size_t i = 0; i < n; ++i) ref_store(dt, dq, i, NAN);
  CHECK_OK(moelink_quantize(ctx1, fmt, dt, x, rows, cols, q, sc, NULL), "quantize");
  CHECK_OK(moelink_dequantize(ctx1, fmt, dt, q, sc, rows, cols, dq, NULL), "dequantize");

  row_stats st;
  memset(&st, 0, sizeof st);
  for (size_t bi = 0; bi < (size_t)rows * nb; ++bi) {
    const size_t base = bi * B;
    st.kind_seen[kinds[bi]] = 1;
    double amax = 0.0;
    int has_inf = 0;
    for (int i = 0; i < B; ++i) {
      const double v = ref_load(dt, x, base + i);
      if (isnan(v)) continue;
      if (fabs(v) > amax) amax = fabs(v);
      has_inf |= isinf(v);
    }
    /* The block's scale, as stored and as applied. */
    float s;
    uint8_t byte = 0;
    int X = 0;
    if (fmt == MOELINK_QUANT_FP8) {
      s = (float)amax / 448.0f;
      float got;
      memcpy(&got, sc + bi * 4, 4);
      if (memcmp(&got, &s, 4) != 0 && st.s_bad++ == 0) st.first_q = base;
    } else {
      X = mx_exponent(amax);
      byte = (uint8_t)(X + 127);
      s = (float)ldexp(1.0, X);
      if (sc[bi] != byte && st.s_bad++ == 0) st.first_q = base;
    }
    for (int i = 0; i < B; ++i) {
      const size_t at = base + i;
      const float xv = (float)ref_load(dt, x, at);
      uint8_t want;
      if (fmt == MOELINK_QUANT_FP8)
        want = amax > 0.0 ? e4m3_encode_ref(xv / s) : 0;
      else
        want = e4m3_encode_ref((float)ldexp((double)xv, -X));
      const int q_ok = is_nan_code(want) ? is_nan_code(q[at]) : q[at] == want;
      if (!q_ok && st.q_bad++ == 0) st.first_q = at;
      /* Dequantized: the code's value times the scale in fp32 (exact in
       * double, then one rounding to fp32), then to dt. */
      const float prod = (float)(e4m3_decode(want) * (double)s);
      unsigned char wbuf[4];
      ref_store(dt, wbuf, 0, (double)prod);
      const double wv = ref_load(dt, wbuf, 0), gv = ref_load(dt, dq, at);
      const int dq_ok = isnan(wv) ? isnan(gv) : memcmp(wbuf, dq + at * es, es) == 0;
      if (!dq_ok && st.dq_bad++ == 0) st.first_dq = at;
      /* The format's bound: relative 2^-4 for a normal e4m3 value, 2^-10 of
       * the scale below (e4m3 subnormals), dt's rounding on top; MXFP8
       * values past 448 * 2^X become +-448 * 2^X. Blocks with an inf, and
       * those whose scale is too small to carry x / s (fp32 subnormal
       * amax), have no bound. */
      const double ax = fabs((double)xv);
      if (!isnan(xv) && !has_inf && amax >= ldexp(1.0, -110)) {
        double allowed =
            ldexp(ax, -4) * (1 + ldexp(1, -20)) + ldexp((double)s, -10) + half_ulp(dt, ax) * 2;
        if (fmt == MOELINK_QUANT_MXFP8 && ldexp(ax, -X) > 448.0)
          allowed = ax - 448.0 * (double)s + half_ulp(dt, ax) * 2;
        ++st.bound_checked;
        if (!(fabs(gv - (double)xv) <= allowed) && st.bound_bad++ == 0) st.first_bound = at;
      }
      if (kinds[bi] == BK_EXACT || kinds[bi] == BK_ZERO) {
        ++st.exact_checked;
        if (!(gv == (double)xv) && st.exact_bad++ == 0) st.first_exact = at;
      }
    }
  }
  const char *fn = fmt == MOELINK_QUANT_FP8 ? "FP8" : "MXFP8", *dn = moelink_dtype_name(dt);
  CHECK(st.q_bad == 0 && st.s_bad == 0,
        "%s %s [%d, %d]: q bytes and scales equal the per-block reference (%zu codes, %zu "
        "scales differ; first at element %zu)",
        fn, dn, rows, cols, st.q_bad, st.s_bad, st.first_q);
  CHECK(st.dq_bad == 0,
        "%s %s [%d, %d]: dequantized = e4m3 value * scale rounded to %s (%zu differ; first at "
        "%zu: %g, want from code 0x%02x)",
        fn, dn, rows, cols, dn, st.dq_bad, st.first_dq,
        st.dq_bad ? ref_load(dt, dq, st.first_dq) : 0.0, st.dq_bad ? q[st.first_dq] : 0);
  CHECK(st.bound_bad == 0,
        "%s %s [%d, %d]: dequantize(quantize(x)) within the format's bound on %zu elements (%zu "
        "outside; first at %zu: %g for %g)",
        fn, dn, rows, cols, st.bound_checked, st.bound_bad, st.first_bound,
        ref_load(dt, dq, st.first_bound), ref_load(dt, x, st.first_bound));
  CHECK(st.exact_bad == 0 && st.exact_checked > 0,
        "%s %s [%d, %d]: representable blocks come back exactly (%zu elements, %zu differ)", fn, dn,
        rows, cols, st.exact_checked, st.exact_bad);
  if ((size_t)rows * nb >= BK_KINDS) {
    int all = 1;
    for (int k = 0; k < BK_KINDS; ++k) all &= st.kind_seen[k];
    CHECK(all, "%s %s [%d, %d]: every kind of block was there (%s .. %s)", fn, dn, rows, cols,
          kind_names[0], kind_names[BK_KINDS - 1]);
  }
  CHECK(sc[(size_t)rows * sbytes] == 0xa5, "%s %s: nothing written past the scales", fn, dn);

  /* The EP round trip: bitwise dequantize(quantize(x)), also in place. */
  unsigned char *rt = (unsigned char *)malloc(n * es);
  ml_cpu_qdq_rows(fmt, dt, x, rows, cols, rt, 3);
  int same = memcmp(rt, dq, n * es) == 0;
  memcpy(rt, x, n * es);
  ml_cpu_qdq_rows(fmt, dt, rt, rows, cols, rt, 1);
  same &= memcmp(rt, dq, n * es) == 0;
  CHECK(same, "%s %s: ml_cpu_qdq_rows is bitwise dequantize(quantize(x)), in place too", fn, dn);
  free(rt);
  free(x);
  free(dq);
  free(q);
  free(sc);
  free(kinds);
}

/* Every e8m0 byte a quantize can write (0 .. 254) as a scale: the code's
 * value times 2^(byte - 127) in fp32, to each dtype. */
static void test_e8m0_scales(void) {
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  const int cols = 64;
  uint8_t q[255 * 64], sc[255 * 2];
  for (int r = 0; r < 255; ++r) {
    sc[2 * r] = (uint8_t)r;
    sc[2 * r + 1] = (uint8_t)(254 - r);
    for (int i = 0; i < cols; ++i) q[r * cols + i] = (uint8_t)((r * 7 + i * 13) % 256);
  }
  for (int d = 0; d < 3; ++d) {
    const moelink_dtype_t dt = dts[d];
    const size_t es = moelink_dtype_size(dt);
    unsigned char *out = (unsigned char *)malloc((size_t)255 * cols * es);
    CHECK_OK(moelink_dequantize(ctx1, MOELINK_QUANT_MXFP8, dt, q, sc, 255, cols, out, NULL),
             "dequantize with every e8m0 byte");
    size_t bad = 0;
    for (int r = 0; r < 255; ++r)
      for (int i = 0; i < cols; ++i) {
        const int byte = sc[2 * r + i / 32];
        const float prod = (float)ldexp(e4m3_decode(q[r * cols + i]), byte - 127);
        unsigned char w[4];
        ref_store(dt, w, 0, (double)prod);
        const size_t at = (size_t)r * cols + i;
        if (isnan(prod) ? !isnan(ref_load(dt, out, at)) : memcmp(w, out + at * es, es) != 0) ++bad;
      }
    CHECK(bad == 0, "%s: every e8m0 byte 0..254 scales by 2^(byte - 127) (%zu differ)",
          moelink_dtype_name(dt), bad);
    free(out);
  }
}

/* 1 and 4 threads, big enough for the 4 to be used: the same bytes. */
static void test_threads(void) {
  const moelink_quant_t fmts[] = {MOELINK_QUANT_FP8, MOELINK_QUANT_MXFP8};
  const int rows = 61, cols = 1024;
  const size_t n = (size_t)rows * cols;
  uint16_t *x = (uint16_t *)malloc(n * 2), *d1 = (uint16_t *)malloc(n * 2),
           *d4 = (uint16_t *)malloc(n * 2);
  uint8_t *q1 = (uint8_t *)malloc(n), *q4 = (uint8_t *)malloc(n);
  uint8_t *s1 = (uint8_t *)malloc((size_t)rows * 32), *s4 = (uint8_t *)malloc((size_t)rows * 32);
  for (size_t i = 0; i < n; ++i)
    ref_store(MOELINK_DTYPE_BF16, x, i, ldexp(rand_signed(), (int)(i / 128 % 17) - 8));
  for (int f = 0; f < 2; ++f) {
    const size_t sb = moelink_quant_scale_bytes(fmts[f], cols) * (size_t)rows;
    CHECK_OK(moelink_quantize(ctx1, fmts[f], MOELINK_DTYPE_BF16, x, rows, cols, q1, s1, NULL),
             "quantize, 1 thread");
    CHECK_OK(moelink_quantize(ctx4, fmts[f], MOELINK_DTYPE_BF16, x, rows, cols, q4, s4, NULL),
             "quantize, 4 threads");
    CHECK_OK(moelink_dequantize(ctx1, fmts[f], MOELINK_DTYPE_BF16, q1, s1, rows, cols, d1, NULL),
             "dequantize, 1 thread");
    CHECK_OK(moelink_dequantize(ctx4, fmts[f], MOELINK_DTYPE_BF16, q1, s1, rows, cols, d4, NULL),
             "dequantize, 4 threads");
    CHECK(memcmp(q1, q4, n) == 0 && memcmp(s1, s4, sb) == 0 && memcmp(d1, d4, n * 2) == 0,
          "%s bf16 [%d, %d]: 1 and 4 threads write the same bytes", f ? "MXFP8" : "FP8", rows,
          cols);
  }
  free(x);
  free(d1);
  free(d4);
  free(q1);
  free(q4);
  free(s1);
  free(s4);
}

static void test_errors(void) {
  CHECK(moelink_quant_block(MOELINK_QUANT_FP8) == 128 &&
            moelink_quant_block(MOELINK_QUANT_MXFP8) == 32 &&
            moelink_quant_block(MOELINK_QUANT_NONE) == 0 &&
            moelink_quant_block((moelink_quant_t)9) == 0,
        "moelink_quant_block: 128, 32, 0 for NONE and an unknown format");
  CHECK(moelink_quant_scale_bytes(MOELINK_QUANT_FP8, 384) == 12 &&
            moelink_quant_scale_bytes(MOELINK_QUANT_MXFP8, 96) == 3 &&
            moelink_quant_scale_bytes(MOELINK_QUANT_NONE, 128) == 0 &&
            moelink_quant_scale_bytes((moelink_quant_t)-1, 128) == 0,
        "moelink_quant_scale_bytes: 4 per 128 (FP8), 1 per 32 (MXFP8), 0 otherwise");

  float x[256];
  uint8_t q[256], sc[64];
  for (int i = 0; i < 256; ++i) x[i] = (float)i;
  memset(q, 0x5a, sizeof q);
  memset(sc, 0x5a, sizeof sc);
  const moelink_quant_t F = MOELINK_QUANT_FP8, M = MOELINK_QUANT_MXFP8;
  const moelink_dtype_t f32 = MOELINK_DTYPE_F32;
  const moelink_status_t bad = MOELINK_ERR_INVALID_ARGUMENT;
#define ML_ERR(call, want, text, what)                                                             \
  do {                                                                                             \
    const moelink_status_t s_ = (call);                                                            \
    CHECK(s_ == (want) && strstr(moelink_last_error(), (text)), "%s -> %s (%s)", (what),           \
          moelink_status_string(s_), moelink_last_error());                                        \
  } while (0)
  ML_ERR(moelink_quantize(NULL, F, f32, x, 1, 128, q, sc, NULL), bad, "context",
         "quantize, NULL ctx");
  ML_ERR(moelink_quantize(ctx1, F, f32, NULL, 1, 128, q, sc, NULL), bad, "NULL",
         "quantize, NULL x");
  ML_ERR(moelink_quantize(ctx1, F, f32, x, 1, 128, NULL, sc, NULL), bad, "NULL",
         "quantize, NULL q");
  ML_ERR(moelink_quantize(ctx1, F, f32, x, 1, 128, q, NULL, NULL), bad, "scales",
         "quantize, NULL scales");
  ML_ERR(moelink_quantize(ctx1, F, f32, x, 1, 100, q, sc, NULL), bad, "multiple",
         "quantize FP8, cols 100");
  ML_ERR(moelink_quantize(ctx1, F, f32, x, 1, 64, q, sc, NULL), bad, "128",
         "quantize FP8, cols 64");
  ML_ERR(moelink_quantize(ctx1, M, f32, x, 2, 48, q, sc, NULL), bad, "32",
         "quantize MXFP8, cols 48");
  ML_ERR(moelink_quantize(ctx1, M, f32, x, 1, 0, q, sc, NULL), bad, "cols 0", "quantize, cols 0");
  ML_ERR(moelink_quantize(ctx1, M, f32, x, -1, 32, q, sc, NULL), bad, "rows -1",
         "quantize, rows -1");
  ML_ERR(moelink_quantize(ctx1, MOELINK_QUANT_NONE, f32, x, 1, 128, q, sc, NULL), bad, "format 0",
         "quantize, format NONE");
  ML_ERR(moelink_quantize(ctx1, (moelink_quant_t)7, f32, x, 1, 128, q, sc, NULL), bad, "format 7",
         "quantize, format 7");
  ML_ERR(moelink_quantize(ctx1, F, MOELINK_DTYPE_FP8_E4M3, x, 1, 128, q, sc, NULL),
         MOELINK_ERR_UNSUPPORTED, "fp8_e4m3", "quantize, dtype fp8_e4m3");
  ML_ERR(moelink_quantize(ctx1, F, (moelink_dtype_t)42, x, 1, 128, q, sc, NULL),
         MOELINK_ERR_UNSUPPORTED, "dtype", "quantize, dtype 42");
  ML_ERR(moelink_dequantize(NULL, M, f32, q, sc, 1, 32, x, NULL), bad, "context",
         "dequantize, NULL ctx");
  ML_ERR(moelink_dequantize(ctx1, M, f32, NULL, sc, 1, 32, x, NULL), bad, "NULL",
         "dequantize, NULL q");
  ML_ERR(moelink_dequantize(ctx1, M, f32, q, NULL, 1, 32, x, NULL), bad, "scales",
         "dequantize, NULL scales");
  ML_ERR(moelink_dequantize(ctx1, M, f32, q, sc, 1, 32, NULL, NULL), bad, "NULL",
         "dequantize, NULL x");
  ML_ERR(moelink_dequantize(ctx1, F, f32, q, sc, 1, 200, x, NULL), bad, "multiple",
         "dequantize FP8, cols 200");
  ML_ERR(moelink_dequantize(ctx1, M, f32, q, sc, 1, 33, x, NULL), bad, "multiple",
         "dequantize MXFP8, cols 33");
  ML_ERR(moelink_dequantize(ctx1, MOELINK_QUANT_NONE, f32, q, sc, 1, 128, x, NULL), bad, "format",
         "dequantize, format NONE");
  ML_ERR(moelink_dequantize(ctx1, (moelink_quant_t)3, f32, q, sc, 1, 128, x, NULL), bad, "format 3",
         "dequantize, format 3");
  ML_ERR(moelink_dequantize(ctx1, M, MOELINK_DTYPE_FP8_E4M3, q, sc, 1, 32, x, NULL),
         MOELINK_ERR_UNSUPPORTED, "fp8_e4m3", "dequantize, dtype fp8_e4m3");
#undef ML_ERR
  int untouched = 1;
  for (int i = 0; i < 256; ++i) untouched &= q[i] == 0x5a && x[i] == (float)i;
  for (int i = 0; i < 64; ++i) untouched &= sc[i] == 0x5a;
  CHECK(untouched, "refused calls write nothing");
  CHECK_OK(moelink_quantize(ctx1, F, f32, NULL, 0, 128, NULL, NULL, NULL),
           "quantize 0 rows, NULLs");
  CHECK_OK(moelink_dequantize(ctx1, M, MOELINK_DTYPE_BF16, NULL, NULL, 0, 32, NULL, NULL),
           "dequantize 0 rows, NULLs");
}

int main(void) {
  moelink_context_config_t cc = MOELINK_CONTEXT_CONFIG_INIT;
  cc.num_threads = 1;
  if (moelink_context_create(&cc, &ctx1) != MOELINK_SUCCESS) {
    printf("Bail out! context: %s\n", moelink_last_error());
    return 1;
  }
  cc.num_threads = 4;
  if (moelink_context_create(&cc, &ctx4) != MOELINK_SUCCESS) {
    printf("Bail out! context: %s\n", moelink_last_error());
    return 1;
  }
  test_errors();
  test_conversion();
  const moelink_dtype_t dts[] = {MOELINK_DTYPE_F32, MOELINK_DTYPE_BF16, MOELINK_DTYPE_F16};
  for (int d = 0; d < 3; ++d) {
    check_rows(MOELINK_QUANT_FP8, dts[d], 13, 640, 0);
    check_rows(MOELINK_QUANT_FP8, dts[d], 3, 128, BK_TINY); /* tiny, wide, exact */
    check_rows(MOELINK_QUANT_MXFP8, dts[d], 7, 352, 0);
    check_rows(MOELINK_QUANT_MXFP8, dts[d], 2, 32 * 9, 3);
  }
  test_e8m0_scales();
  test_threads();
  moelink_context_destroy(ctx1);
  moelink_context_destroy(ctx4);
  return ml_test_done();
}
