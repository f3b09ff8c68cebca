/* The portable loops of the compare kernel: GNU C vector extensions, cloned per x86-64 level
 * where GCC can (AVX-512, AVX2, baseline), compiled once for the baseline elsewhere (SSE2, NEON).
 * _comparec.c is the Python module that calls them; _comparec512.c holds AVX-512 intrinsics
 * copies of the two hottest loops. Sums run in float64 over eight independent accumulators (a
 * fixed order, so a result does not depend on the CPU or on which clone runs), returned per
 * block and folded by the caller with math.fsum. No -ffast-math: the NaN tests and the ratio
 * thresholds depend on IEEE comparisons.
 */
#if !defined(__GNUC__)
#error "_comparec needs GCC or clang vector extensions (the build is optional: numpy runs instead)"
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
/* x86-64-v3 (AVX2, FMA, BMI) and v4 (AVX-512 F/BW/DQ/VL: BW gives 16-bit lanes, DQ 64-bit
 * integer converts), picked at load time. ISO C (-std=c11) leaves fp-contract off, so no clone
 * fuses a multiply-add the others round twice: every clone gives the same bits. */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif


#include "_comparec.h"

/* -- words to float32 values ------------------------------------------------------------------ */
static inline float f_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t u_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE half to float: the exponent/mantissa bits moved into a float's field and rebiased by a
 * multiply with 2^112 (exact, and right for subnormals too); Inf/NaN words map to Inf/NaN. */
static inline float half_to_float(uint16_t h) {
    uint32_t em = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
    float v = f_bits(em << 13) * 0x1p112f;
    uint32_t bits = em >= 0x7c00u ? (0x7f800000u | (em << 13)) : u_bits(v);
    return f_bits(bits | sign);
}

static inline double load(const void *p, Py_ssize_t i, int kind) {
    if (kind == K_F32) return (double)((const float *)p)[i];
    uint16_t w = ((const uint16_t *)p)[i];
    if (kind == K_F16) return (double)half_to_float(w);
    return (double)f_bits((uint32_t)w << 16);
}


/* -- the range pre-pass ----------------------------------------------------------------------------
 * Min and max of the float32 values through order-preserving integer keys of the words (flip the
 * magnitude bits of negatives); a key beyond ±Inf's means NaN/Inf in the block, which then gets
 * an exact second loop: extremes of the finite values and 0 (the main pass zeroes NaN/Inf). */
static inline int32_t key32(uint32_t w) { int32_t s = (int32_t)w; return s ^ ((s >> 31) & 0x7fffffff); }
static inline int32_t key16(uint16_t w) { int32_t s = (int16_t)w; return s ^ ((s >> 15) & 0x7fff); }

typedef int v16i __attribute__((vector_size(64)));
typedef short v16s __attribute__((vector_size(32)));

/* Lane-wise min/max of the keys of n words of type T, VT holding sizeof(VT)/sizeof(T) of them;
 * the keys flip the magnitude bits of negative words (arithmetic shifts spread the sign); KEY1
 * does one word of the tail. */
#define RANGE_LOOP(T, VT, SHIFT, MASK, KEY1)                                                  \
    {                                                                                         \
        const T *w = p;                                                                       \
        enum { NL = sizeof(VT) / sizeof(T) };                                                 \
        VT lo, hi;                                                                            \
        for (int j = 0; j < NL; j++) { lo[j] = (T)(-(1LL << (SHIFT)) ); hi[j] = lo[j]; }     \
        lo = ~lo; /* the largest key: 0111…1 */                                              \
        for (; i + NL <= n; i += NL) {                                                        \
            VT k;                                                                             \
            memcpy(&k, w + i, sizeof k);                                                      \
            k ^= (k >> (SHIFT)) & (T)(MASK);                                                  \
            lo = (VT)((k < lo) & k) | (VT)(~(k < lo) & lo);                                   \
            hi = (VT)((k > hi) & k) | (VT)(~(k > hi) & hi);                                   \
        }                                                                                     \
        for (int j = 0; j < NL; j++) {                                                        \
            *lo_k = lo[j] < *lo_k ? lo[j] : *lo_k;                                            \
            *hi_k = hi[j] > *hi_k ? hi[j] : *hi_k;                                            \
        }                                                                                     \
        for (; i < n; i++) {                                                                  \
            int32_t k = KEY1(w[i]);                                                           \
            *lo_k = k < *lo_k ? k : *lo_k;                                                    \
            *hi_k = k > *hi_k ? k : *hi_k;                                                    \
        }                                                                                     \
    }

CLONES static void range_keys(const void *p, Py_ssize_t n, int kind, int32_t *lo_k, int32_t *hi_k) {
    Py_ssize_t i = 0;
    *lo_k = INT32_MAX;
    *hi_k = INT32_MIN;
    if (kind == K_F32) RANGE_LOOP(int32_t, v16i, 31, 0x7fffffff, key32)
    else RANGE_LOOP(int16_t, v16s, 15, 0x7fff, key16)
}

static double key_value(int32_t k, int kind) {
    if (kind == K_F32) return (double)f_bits((uint32_t)(k ^ ((k >> 31) & 0x7fffffff)));
    uint16_t w = (uint16_t)(k ^ ((k >> 15) & 0x7fff));
    return load(&w, 0, kind);
}

/* (min, max) of a block's float32 values, NaN/Inf counted as 0 (the main pass zeroes them). */
void cmp_range(const void *p, Py_ssize_t n, int kind, double *lo, double *hi) {
    int32_t lo_k, hi_k;
    range_keys(p, n, kind, &lo_k, &hi_k);
    int32_t top = kind == K_F32 ? key32(0x7f7fffffu) : key16(kind == K_F16 ? 0x7bffu : 0x7f7fu);
    if (lo_k >= -top - 1 && hi_k <= top) {   /* key(-max) == -top - 1 */
        *lo = key_value(lo_k, kind);
        *hi = key_value(hi_k, kind);
    } else {                                  /* NaN/Inf somewhere: they count as 0 */
        *lo = 0.0;
        *hi = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) {
            double x = load(p, i, kind);
            if (isfinite(x)) { *lo = x < *lo ? x : *lo; *hi = x > *hi ? x : *hi; }
        }
    }
}

/* -- the main pass ------------------------------------------------------------------------------
 * GCC/clang vector extensions, eight float64 lanes (zmm with AVX-512, two ymm with AVX2, four
 * xmm otherwise: the same lanes and order, so the same sums, on every CPU). */
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));
typedef unsigned int v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8d sel(v8l m, v8d a, v8d b) { return (v8d)((m & (v8l)a) | (~m & (v8l)b)); }
static inline __attribute__((always_inline)) v8f self(v8i m, v8f a, v8f b) { return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }
static inline __attribute__((always_inline)) v8d vabs(v8d v) { return (v8d)((v8l)v & 0x7fffffffffffffffLL); }

/* Eight words as float32 values. */
static inline __attribute__((always_inline)) v8f vloadf(const void *p, Py_ssize_t i, int kind) {
    if (kind == K_F32) {
        v8f f;
        memcpy(&f, (const float *)p + i, sizeof f);
        return f;
    }
    const uint16_t *h = (const uint16_t *)p + i;
    v8u u = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]};
    if (kind == K_BF16) return (v8f)(u << 16);
    v8u em = u & 0x7fffu, sign = (u & 0x8000u) << 16;     /* half_to_float, eight at a time */
    v8f v = (v8f)(em << 13) * 0x1p112f;
    v8i special = (v8i)(em >= 0x7c00u);
    v8i bits = (special & (v8i)(0x7f800000u | (em << 13))) | (~special & (v8i)v);
    return (v8f)((v8u)bits | sign);
}

/* element-wise initialisers: GCC makes one vcvtps2pd (zmm) of them, where a converted vector
 * load came out as four instructions */
static inline __attribute__((always_inline)) v8d widen(v8f f) {
    return (v8d){f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]};
}

static inline __attribute__((always_inline)) v8d vload(const void *p, Py_ssize_t i, int kind) {
    return widen(vloadf(p, i, kind));
}



typedef struct {
    v8d sx, sy, sxx, syy, sxy, sdd, sad, srel, mad, mrel, sa, sb, g, tf, pf, qf;
    v8f lox, hix, loy, hiy;                     /* ranges: exact in float32, half the width */
    v8l c1, c5, ne, far;
} Lanes;


/* KLD's terms, as G = Σ b·g(w) with w = (a − b)/b and g(w) = (1 + w)·log(1 + w) − w >= 0, so
 * that Σ a·log(a/b) = G + Σa − Σb. Each term is second order in the difference and none cancel,
 * so a short series serves where |w| is small: to w⁵ for |w| <= 1/128 (2.5e-10 relative), to
 * w⁷ for |w| <= 1/32 (3e-11) where a side is bfloat16, whose rounding alone reaches 1/128. A
 * block with a larger |w| somewhere gets a second loop for those terms, a·log(a/b) − (a − b)
 * with the full log (cancellation costs at most a factor 64 of 2^-53). */
static inline __attribute__((always_inline)) v8d g_small(v8d w, int wide) {
    if (!wide) return (w * w) * (0.5 + w * (-1.0 / 6 + w * (1.0 / 12 + w * (-1.0 / 20))));
    v8d c = 1.0 / 12 + w * (-1.0 / 20 + w * (1.0 / 30 + w * (-1.0 / 42)));
    return (w * w) * (0.5 + w * (-1.0 / 6 + w * c));
}

/* Eight element pairs (lanes where `valid` is set: the tail) into the lanes (metrics.py has the
 * definitions); comparisons give -1 per true lane, so counts subtract them. `metrics` == 0:
 * KLD's terms only (the second pass of blocks_c.two_pass, once pass 1 found the ranges). */
static inline __attribute__((always_inline)) void
step(Lanes *a, v8f xf, v8f yf, v8l valid, int metrics, int kld, int wide, const KldP *kp) {
    v8d x = widen(xf), y = widen(yf);
    if (metrics) {
        v8i v32 = __builtin_convertvector(valid, v8i);
        a->lox = self(v32 & (xf < a->lox), xf, a->lox); a->hix = self(v32 & (xf > a->hix), xf, a->hix);
        a->loy = self(v32 & (yf < a->loy), yf, a->loy); a->hiy = self(v32 & (yf > a->hiy), yf, a->hiy);
        a->sx += x; a->sy += y;
        a->sxx += x * x; a->syy += y * y; a->sxy += x * y;
        a->ne -= (x != y) & valid;
        v8d d = x - y;                              /* exact: two float32 values */
        a->sdd += d * d;
        v8d ad = vabs(d);
        a->sad += ad;
        a->mad = sel(ad > a->mad, ad, a->mad);      /* its first index: found after the loop */
        v8d ay = vabs(y);
        /* y == 0: msprobe adds eps to both sides, so the error is |x|/eps (exact: eps = 2^-52) */
        v8d r = ad / sel(y == 0.0, splat(EPS64), ay);
        a->c1 -= (r < R1) & valid;
        a->c5 -= (r < R5) & valid;
        v8d rb = (v8d)((ay > EPS64) & (v8l)r);      /* msaccucmp: |y| <= eps contributes 0 */
        a->srel += rb;
        a->mrel = sel(rb > a->mrel, rb, a->mrel);
    }
    if (kld) {                                  /* kld == 2: no element of the block is clamped */
        v8d p = (x - kp->shx) * kp->scx, q = (y - kp->shy) * kp->scy;
        if (kld == 1) {                         /* the clamp at float32 eps */
            p = sel(p < EPS32, splat(EPS32), p);
            q = sel(q < EPS32, splat(EPS32), q);
        }
        q = sel(valid, q, splat(1.0));          /* the padding's terms: 0 */
        p = sel(valid, p, splat(1.0));
        v8d w = (p - q) / q;                    /* p − q exact where |w| <= 1/32 (Sterbenz) */
        v8l far = vabs(w) > (wide ? W_BF16 : W_OTHER);   /* their terms: far_terms' loop */
        a->far |= far;
        a->sa += (v8d)((v8l)p & valid & ~far);
        a->sb += (v8d)((v8l)q & valid & ~far);
        a->g += (v8d)((v8l)(q * g_small(w, wide)) & valid & ~far);
    }
}

/* Record chunk c0 if a lane met a far term in it (more than NFAR: nf > NFAR, the whole block). */
static inline __attribute__((always_inline)) void note_far(Lanes *a, Py_ssize_t c0, Py_ssize_t *fars, int *nf) {
    long long f = 0;
    for (int j = 0; j < 8; j++) f |= a->far[j];
    if (!f) return;
    if (*nf < NFAR) fars[*nf] = c0;
    *nf += *nf <= NFAR;
    a->far = (v8l){0};
}

static inline __attribute__((always_inline)) void
far_terms(Lanes *a, v8d x, v8d y, v8l valid, int wide, const KldP *kp) {
    v8d p = (x - kp->shx) * kp->scx, q = (y - kp->shy) * kp->scy;
    p = sel(valid, sel(p < EPS32, splat(EPS32), p), splat(1.0));
    q = sel(valid, sel(q < EPS32, splat(EPS32), q), splat(1.0));
    v8l far = (vabs((p - q) / q) > (wide ? W_BF16 : W_OTHER)) & valid;
    a->tf += (v8d)((v8l)(p * log_ratio(p, q)) & far);
    a->pf += (v8d)((v8l)p & far);
    a->qf += (v8d)((v8l)q & far);
}

static inline __attribute__((always_inline)) void
block_body(const void *px, const void *py, Py_ssize_t n, int kx, int ky, int metrics, int kld,
           const KldP *kp, Sums *o) {
    Lanes a;
    memset(&a, 0, sizeof a);
    a.lox = a.loy = (v8f){0} + INFINITY;
    a.hix = a.hiy = (v8f){0} - INFINITY;
    const v8l iota = {0, 1, 2, 3, 4, 5, 6, 7}, all = iota >= 0;
    const int wide = kx == K_BF16 || ky == K_BF16;
    /* chunks holding a far KLD term (|w| above the series' bound), for the second loop: a
     * handful per block at most on realistic data (only values next to a side's minimum get
     * there), so that loop reads those chunks and not the whole block */
    Py_ssize_t fars[NFAR], i = 0, full = n - n % 8;
    int nf = 0;
    while (i < full) {
        Py_ssize_t c0 = i, e = i + FCH < full ? i + FCH : full;
        for (; i < e; i += 8)
            step(&a, vloadf(px, i, kx), vloadf(py, i, ky), all, metrics, kld, wide, kp);
        if (kld) note_far(&a, c0, fars, &nf);
    }
    if (i < n) {                                /* the tail, zero-padded to eight */
        unsigned char bx[32] = {0}, by[32] = {0};
        size_t isx = (size_t)item_size(kx), isy = (size_t)item_size(ky);
        memcpy(bx, (const char *)px + i * isx, (size_t)(n - i) * isx);
        memcpy(by, (const char *)py + i * isy, (size_t)(n - i) * isy);
        step(&a, vloadf(bx, 0, kx), vloadf(by, 0, ky), iota < (n - i), metrics, kld, wide, kp);
        if (kld) note_far(&a, i, fars, &nf);
    }
    memset(o, 0, sizeof *o);
    o->lox = o->loy = INFINITY;
    o->hix = o->hiy = -INFINITY;
    for (int c = 0; kld && c < (nf > NFAR ? 1 : nf); c++) {   /* |w| beyond the series, same lanes */
        Py_ssize_t c0 = nf > NFAR ? 0 : fars[c];
        Py_ssize_t e = nf > NFAR || c0 == full ? n : (c0 + FCH < full ? c0 + FCH : full);
        for (i = c0; i < e; i += 8) {
            unsigned char bx[32] = {0}, by[32] = {0};
            Py_ssize_t m = e - i < 8 ? e - i : 8;
            memcpy(bx, (const char *)px + i * item_size(kx), (size_t)m * item_size(kx));
            memcpy(by, (const char *)py + i * item_size(ky), (size_t)m * item_size(ky));
            far_terms(&a, vload(bx, 0, kx), vload(by, 0, ky), iota < m, wide, kp);
        }
    }
    for (int j = 0; j < 8; j++) {               /* a fixed order: the same result on every CPU */
        o->sx += a.sx[j]; o->sy += a.sy[j]; o->sxx += a.sxx[j]; o->syy += a.syy[j];
        o->sxy += a.sxy[j]; o->sdd += a.sdd[j]; o->sad += a.sad[j]; o->srel += a.srel[j];
        o->sa += a.sa[j]; o->sb += a.sb[j]; o->g += a.g[j];
        o->tf += a.tf[j]; o->pf += a.pf[j]; o->qf += a.qf[j];
        o->c1 += a.c1[j]; o->c5 += a.c5[j]; o->differ += a.ne[j];
        o->mrel = a.mrel[j] > o->mrel ? a.mrel[j] : o->mrel;
        o->mad = a.mad[j] > o->mad ? a.mad[j] : o->mad;
        o->lox = a.lox[j] < o->lox ? a.lox[j] : o->lox; o->hix = a.hix[j] > o->hix ? a.hix[j] : o->hix;
        o->loy = a.loy[j] < o->loy ? a.loy[j] : o->loy; o->hiy = a.hiy[j] > o->hiy ? a.hiy[j] : o->hiy;
    }
}

typedef void (*block_fn)(const void *, const void *, Py_ssize_t, const KldP *, Sums *);
/* block_M_KX_KY_KLD: M = 1 every metric (and KLD's terms where KLD > 0), M = 0 KLD's only */
#define DEF_BLOCK(M, KX, KY, KLD) \
    CLONES static void block_##M##_##KX##_##KY##_##KLD(const void *px, const void *py, Py_ssize_t n, \
                                                       const KldP *kp, Sums *o) { \
        block_body(px, py, n, KX, KY, M, KLD, kp, o); }
#define DEF_ROW(M, KX, KLD) DEF_BLOCK(M, KX, 0, KLD) DEF_BLOCK(M, KX, 1, KLD) DEF_BLOCK(M, KX, 2, KLD)
#define DEF_KLD(M, KLD) DEF_ROW(M, 0, KLD) DEF_ROW(M, 1, KLD) DEF_ROW(M, 2, KLD)
DEF_KLD(1, 0) DEF_KLD(1, 1) DEF_KLD(1, 2) DEF_KLD(0, 1) DEF_KLD(0, 2)
#define FN_ROW(M, KX, KLD) {block_##M##_##KX##_0_##KLD, block_##M##_##KX##_1_##KLD, block_##M##_##KX##_2_##KLD}
#define FN_KLD(M, KLD) {FN_ROW(M, 0, KLD), FN_ROW(M, 1, KLD), FN_ROW(M, 2, KLD)}
static const block_fn BLOCKS[3][3][3] = {FN_KLD(1, 0), FN_KLD(1, 1), FN_KLD(1, 2)};
static const block_fn TERMS[2][3][3] = {FN_KLD(0, 1), FN_KLD(0, 2)};

/* Index of the first pair whose values differ (the main pass only counts them). */
Py_ssize_t cmp_first_diff(const void *px, const void *py, Py_ssize_t n, int kx, int ky) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (load(px, i, kx) != load(py, i, ky)) return i;
    return -1;
}

/* Index of the first pair at distance `mad` (run only when the block holds a new maximum: for
 * data whose errors grow along the tensor, every block; the block is still in cache, and eight
 * pairs a step keep this rescan a fraction of the main pass). */
#define FIRST_AT(KX, KY)                                                                      \
    for (; i + 8 <= n; i += 8) {                                                              \
        v8l hit = vabs(vload(px, i, KX) - vload(py, i, KY)) == m;                             \
        long long any = 0;                                                                    \
        for (int j = 0; j < 8; j++) any |= hit[j];                                            \
        if (any) break;                                                                       \
    }
CLONES Py_ssize_t cmp_first_at(const void *px, const void *py, Py_ssize_t n, int kx, int ky, double mad) {
    Py_ssize_t i = 0;
    const v8d m = splat(mad);
    if (kx == K_F32 && ky == K_F32) { FIRST_AT(K_F32, K_F32) }
    else if (kx == K_F16 && ky == K_F16) { FIRST_AT(K_F16, K_F16) }
    else if (kx == K_BF16 && ky == K_BF16) { FIRST_AT(K_BF16, K_BF16) }
    else { FIRST_AT(kx, ky) }
    for (; i < n; i++)                          /* the step that hit, or the tail */
        if (fabs(load(px, i, kx) - load(py, i, ky)) == mad) return i;
    return -1;
}

void cmp_block(int kld, int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp,
               Sums *o) {
    BLOCKS[kld][kx][ky](px, py, n, kp, o);
}

void cmp_terms(int clamps, int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp,
               Sums *o) {
    TERMS[clamps ? 0 : 1][kx][ky](px, py, n, kp, o);
}

/* -- identical blocks ------------------------------------------------------------------------------
 * Bytes equal on both sides: only Σx and Σx² are needed. Compares the words and sums in one
 * pass; returns None as soon as a chunk differs (the caller then runs the full pass). */
CLONES int cmp_same_sums(const void *px, const void *py, Py_ssize_t n, int kind, double *s, double *q) {
    v8d sl = {0}, ql = {0};
    const Py_ssize_t CH = 4096;                 /* a multiple of 8: only the last chunk has a tail */
    size_t isz = (size_t)item_size(kind);
    for (Py_ssize_t c = 0; c < n; c += CH) {
        Py_ssize_t e = c + CH < n ? c + CH : n, i = c;
        if (memcmp((const char *)px + c * isz, (const char *)py + c * isz, (size_t)(e - c) * isz)) return 0;
        for (; i + 8 <= e; i += 8) {
            v8d x = vload(px, i, kind);
            sl += x;
            ql += x * x;
        }
        if (i < e) {                            /* zero padding adds nothing to either sum */
            unsigned char buf[32] = {0};
            memcpy(buf, (const char *)px + i * isz, (size_t)(e - i) * isz);
            v8d x = vload(buf, 0, kind);
            sl += x;
            ql += x * x;
        }
    }
    *s = *q = 0.0;
    for (int j = 0; j < 8; j++) { *s += sl[j]; *q += ql[j]; }
    return 1;
}

