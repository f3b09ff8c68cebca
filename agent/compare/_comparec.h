/* What the parts of the compare kernel share: _comparec.c (the Python module: arguments, the
 * choice of loops, every entry point), _comparec_loops.c (the portable GNU C vector loops) and
 * _comparec512.c (AVX-512 loops for the two hot calls of the two-pass flow, picked at load time
 * where the CPU has them). */
#ifndef PRECISION_AGENT_COMPAREC_H
#define PRECISION_AGENT_COMPAREC_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define K_F32 0
#define K_F16 1
#define K_BF16 2

static const double EPS64 = 2.220446049250313e-16;     /* np.finfo(float).eps = 2^-52 */
static const double EPS32 = 1.1920928955078125e-07;    /* np.finfo(np.float32).eps = 2^-23 */
static const double R1 = 0.001, R5 = 0.005;            /* msprobe's error-ratio thresholds */
static const double LN2 = 0.6931471805599453;

/* KLD's series bound on |w| = |a − b|/b (see g_small in _comparec.c) */
#define W_BF16 0.03125
#define W_OTHER 0.0078125

/* GCC/clang vector extensions: eight float64 lanes */
typedef double v8d __attribute__((vector_size(64)));
typedef long long v8l __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) v8d splat(double v) { return (v8d){v, v, v, v, v, v, v, v}; }

/* log(p/q) for p, q >= float32 eps (both normal): q is scaled by 2^k, k the nearest integer to
 * log2(p/q) read off the bit patterns (their difference over 2^52 is log2 within 0.09), so
 * p/q' lies in [0.66, 1.51]; then log(p/q') = 2·atanh(s), s = (p − q')/(p + q') (p − q' is exact
 * there, |s| <= 0.21), by its series to s^23 (2^-53 relative). One division, no table, and for
 * p/q near 1 the result is accurate relative to its own tiny value (KLD of close tensors is a
 * sum of such terms). */
static inline __attribute__((always_inline)) v8d log_ratio(v8d p, v8d q) {
    v8l k = (((v8l)p - (v8l)q) + (1LL << 51)) >> 52;
    v8d q2 = (v8d)((v8l)q + (k << 52));
    v8d s = (p - q2) / (p + q2);
    v8d w = s * s, w2 = w * w, w4 = w2 * w2, w8 = w4 * w4;   /* Estrin: a short dependency chain */
    v8d c01 = 1.0 / 3 + w * (1.0 / 5), c23 = 1.0 / 7 + w * (1.0 / 9), c45 = 1.0 / 11 + w * (1.0 / 13);
    v8d c67 = 1.0 / 15 + w * (1.0 / 17), c89 = 1.0 / 19 + w * (1.0 / 21);
    v8d c0_3 = c01 + w2 * c23, c4_7 = c45 + w2 * c67, c8_10 = c89 + w2 * (1.0 / 23);
    v8d c = (c0_3 + w4 * c4_7) + w8 * c8_10;
    v8d at = s + s * (w * c);
    /* k to float64 without a scalar convert: |k| < 2^51 sits in the mantissa of 2^52 + 2^51 */
    v8d kd = (v8d)(k + 0x4338000000000000LL) - 6755399441055744.0;
    return kd * LN2 + 2.0 * at;
}

typedef struct { double shx, scx, shy, scy; } KldP;
enum { FCH = 512, NFAR = 32 };                  /* far-term chunks: elements, most recorded */

/* A block's partials. KLD's: sa, sb = Σa, Σb and g = Σ b·g(w) over the terms the series takes
 * ("near", |w| within its bound); tf = Σ a·log(a/b), pf = Σa, qf = Σb over the others ("far"),
 * kept apart so that the caller can form either KLD = G/Σa + log1p(e) − e (close sides: no
 * cancellation) or T/Σa + log(Σb/Σa) (far sides, where G and e grow huge and would cancel). */
typedef struct {
    double sx, sy, sxx, syy, sxy, sdd, sad, srel, mad, mrel, sa, sb, g, tf, pf, qf, lox, hix, loy, hiy;
    int64_t c1, c5, differ;
} Sums;

static inline int item_size(int kind) { return kind == K_F32 ? 4 : 2; }

/* -- the loop skeletons of the intrinsics copies (_comparec512.c, _comparec256.c) --------------
 * KIND_SWITCH runs BODY(KX, KY, A, B) for the (kx, ky) pair of word kinds, so that each pair gets
 * its own loop with the loads' kind tests resolved at compile time. PASS1_LOOP calls STEP(i, c)
 * for c = 8 pairs from i, then once for the tail (c < 8). PASS2_CHUNKS does the same by chunks of
 * FCH pairs, recording (up to NFAR, then the whole block) each chunk in which FAR_SEEN held after
 * its steps, and afterwards calls FAR(i, c) over the recorded chunks, eight pairs at a time. They
 * expect n, and PASS2_CHUNKS fars[] and nf, in scope. */
/* The reductions both copies end with, on lanes stored to memory: the sum in the portable loops'
 * order (lane 0 first, from 0.0), the range of eight float32 lanes. And the address 1 KiB ahead
 * of word i that both prefetch (an integer: never a pointer past the end). */
static inline double sum_lanes(const double t[8]) {
    double s = 0.0;
    for (int j = 0; j < 8; j++) s += t[j];
    return s;
}

static inline void range_lanes(const float lo[8], const float hi[8], double *o_lo, double *o_hi) {
    *o_lo = INFINITY;
    *o_hi = -INFINITY;
    for (int j = 0; j < 8; j++) {
        *o_lo = lo[j] < *o_lo ? lo[j] : *o_lo;
        *o_hi = hi[j] > *o_hi ? hi[j] : *o_hi;
    }
}

static inline uintptr_t ahead_addr(const void *p, Py_ssize_t i, int kind) {
    return (uintptr_t)p + (uintptr_t)i * (kind == K_F32 ? 4u : 2u) + 1024u;
}

#define KIND_SWITCH(BODY, A, B)                                                                \
    switch (kx * 3 + ky) {                                                                     \
    case 0: BODY(K_F32, K_F32, A, B) break;                                                    \
    case 1: BODY(K_F32, K_F16, A, B) break;                                                    \
    case 2: BODY(K_F32, K_BF16, A, B) break;                                                   \
    case 3: BODY(K_F16, K_F32, A, B) break;                                                    \
    case 4: BODY(K_F16, K_F16, A, B) break;                                                    \
    case 5: BODY(K_F16, K_BF16, A, B) break;                                                   \
    case 6: BODY(K_BF16, K_F32, A, B) break;                                                   \
    case 7: BODY(K_BF16, K_F16, A, B) break;                                                   \
    default: BODY(K_BF16, K_BF16, A, B) break;                                                 \
    }

#define PASS1_LOOP(STEP)                                                                       \
    {                                                                                          \
        Py_ssize_t i = 0;                                                                      \
        for (; i + 8 <= n; i += 8) STEP(i, 8);                                                 \
        if (i < n) STEP(i, n - i);                                                             \
    }

#define PASS2_NOTE(c0, FAR_SEEN, FAR_CLEAR)                                                    \
    if (FAR_SEEN) {                                                                            \
        if (nf < NFAR) fars[nf] = (c0);                                                        \
        nf += nf <= NFAR;                                                                      \
        FAR_CLEAR;                                                                             \
    }

#define PASS2_CHUNKS(STEP, FAR, FAR_SEEN, FAR_CLEAR)                                           \
    {                                                                                          \
        Py_ssize_t i = 0, full = n - n % 8;                                                    \
        while (i < full) {                                                                     \
            Py_ssize_t c0 = i, end = i + FCH < full ? i + FCH : full;                          \
            for (; i < end; i += 8) STEP(i, 8);                                                \
            PASS2_NOTE(c0, FAR_SEEN, FAR_CLEAR)                                                \
        }                                                                                      \
        if (i < n) {                                                                           \
            STEP(i, n - i);                                                                    \
            PASS2_NOTE(i, FAR_SEEN, FAR_CLEAR)                                                 \
        }                                                                                      \
        for (int k = 0; k < (nf > NFAR ? 1 : nf); k++) {                                       \
            Py_ssize_t s0 = nf > NFAR ? 0 : fars[k];                                           \
            Py_ssize_t s1 = nf > NFAR || s0 == full ? n : (s0 + FCH < full ? s0 + FCH : full); \
            for (i = s0; i < s1; i += 8) FAR(i, (s1 - i >= 8 ? 8 : s1 - i));                   \
        }                                                                                      \
    }

/* The portable loops (_comparec_loops.c): cmp_block is block() (kld 0: metrics only, 1: and
 * KLD's terms with the clamp, 2: without), cmp_terms is terms() (metrics off), cmp_range the
 * pre-pass's range, cmp_same_sums (Σx, Σx²) of a block equal on both sides (0 when not), the
 * first_* the indexes the passes only count. */
void cmp_range(const void *p, Py_ssize_t n, int kind, double *lo, double *hi);
void cmp_block(int kld, int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp,
               Sums *o);
void cmp_terms(int clamps, int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp,
               Sums *o);
int cmp_same_sums(const void *px, const void *py, Py_ssize_t n, int kind, double *s, double *q);
Py_ssize_t cmp_first_diff(const void *px, const void *py, Py_ssize_t n, int kx, int ky);
Py_ssize_t cmp_first_at(const void *px, const void *py, Py_ssize_t n, int kx, int ky, double mad);

/* The AVX-512 loops (_comparec512.c): c512_usable() says whether this CPU and build have them;
 * c512_block is the metrics-only pass (block(..., kld=None)); c512_terms is KLD's terms of a
 * block (clamps: some element may reach the clamp; sums == 0: without the near terms' Σa, Σb,
 * which the caller derives, never with clamps). */
int c512_usable(void);
int c256_usable(void);   /* _comparec256.c: the same two loops with AVX2 + FMA, the same bits */
void c256_block(int kx, int ky, const void *px, const void *py, Py_ssize_t n, Sums *o);
void c256_terms(int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp, int sums,
                int clamps, Sums *o);
void c512_block(int kx, int ky, const void *px, const void *py, Py_ssize_t n, Sums *o);
void c512_terms(int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp, int sums,
                int clamps, Sums *o);

#endif
