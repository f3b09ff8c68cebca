/* The dump comparison's block kernels (see compare/metrics.py for what each number means and
 * kernels/compare_c.py for how blocks reach here). numpy needs one pass per operation over a
 * block (~30 of them for a differing block); these loops read each element pair once and keep
 * every partial sum in registers. Inputs are float32, float16 or bfloat16 words (kind 0, 1, 2),
 * contiguous, native order and aligned: anything else is refused with ValueError and the caller
 * keeps numpy. A block holding NaN/Inf gives None: the caller's numpy path applies the NaN/Inf
 * policy.
 *
 * Built like scan.c: the loops once per variant (simd.h), the module (-DKERNEL_MODULE) with the
 * baseline loops and the choice of variant at import. Sums run in float64 over eight lanes (one
 * 64-byte logical vector, NV native ones) reduced in one fixed order, so that every variant gives
 * the same bits; they are returned per block and folded by the caller with math.fsum. No
 * -ffast-math: the NaN tests and the ratio thresholds depend on IEEE comparisons.
 */
#include "simd.h"

#define K_F32 0
#define K_F16 1
#define K_BF16 2

static const double EPS64 = 2.220446049250313e-16;     /* np.finfo(float).eps = 2^-52 */
static const double EPS32 = 1.1920928955078125e-07;    /* np.finfo(np.float32).eps = 2^-23 */
static const double R1 = 0.001, R5 = 0.005;            /* msprobe's error-ratio thresholds */
static const double LN2 = 0.6931471805599453;
#define W_BF16 0.03125                                 /* KLD's series bound on |w| (g_small) */
#define W_OTHER 0.0078125

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

/* The loops of one variant. block: every metric of a differing block (kld 0), and KLD's terms
 * with the clamp at float32 eps (kld 1) or without (2); terms: KLD's terms alone (pass 2);
 * range: (min, max) of a block's values, NaN/Inf as 0; same: (Σx, Σx²) of a block equal on both
 * sides (0 when not); first_at: the first index at distance mad. */
typedef struct {
    void (*range)(const void *, ptrdiff_t, int, double *, double *);
    void (*block)(int, int, int, const void *, const void *, ptrdiff_t, const KldP *, Sums *);
    void (*terms)(int, int, int, const void *, const void *, ptrdiff_t, const KldP *, Sums *);
    int (*same)(const void *, const void *, ptrdiff_t, int, double *, double *);
    ptrdiff_t (*first_at)(const void *, const void *, ptrdiff_t, int, int, double);
} cmp_ops;

static inline int item_size(int kind) { return kind == K_F32 ? 4 : 2; }

static inline double load(const void *p, ptrdiff_t i, int kind) {
    if (kind == K_F32) return (double)((const float *)p)[i];
    uint16_t w = ((const uint16_t *)p)[i];
    return kind == K_F16 ? (double)half_value(w) : (double)bf16_value(w);
}

INL vd splat(double v) { return (vd){0} + v; }
INL vd vabs(vd v) { return (vd)((vl)v & 0x7fffffffffffffffLL); }

/* log(p/q) for p, q >= float32 eps (both normal): q is scaled by 2^k, k the nearest integer to
 * log2(p/q) read off the bit patterns (their difference over 2^52 is log2 within 0.09), so
 * p/q' lies in [0.66, 1.51]; then log(p/q') = 2·atanh(s), s = (p − q')/(p + q') (p − q' is exact
 * there, |s| <= 0.21), by its series to s^23 (2^-53 relative). One division, no table, and for
 * p/q near 1 the result is accurate relative to its own tiny value (KLD of close tensors is a
 * sum of such terms). */
INL vd log_ratio(vd p, vd q) {
    vl k = (((vl)p - (vl)q) + (1LL << 51)) >> 52;
    vd q2 = (vd)((vl)q + (k << 52));
    vd s = (p - q2) / (p + q2);
    vd w = s * s, w2 = w * w, w4 = w2 * w2, w8 = w4 * w4;   /* Estrin: a short dependency chain */
    vd c01 = 1.0 / 3 + w * (1.0 / 5), c23 = 1.0 / 7 + w * (1.0 / 9), c45 = 1.0 / 11 + w * (1.0 / 13);
    vd c67 = 1.0 / 15 + w * (1.0 / 17), c89 = 1.0 / 19 + w * (1.0 / 21);
    vd c0_3 = c01 + w2 * c23, c4_7 = c45 + w2 * c67, c8_10 = c89 + w2 * (1.0 / 23);
    vd c = (c0_3 + w4 * c4_7) + w8 * c8_10;
    vd at = s + s * (w * c);
    /* k to float64 without a scalar convert: |k| < 2^51 sits in the mantissa of 2^52 + 2^51 */
    vd kd = (vd)(k + 0x4338000000000000LL) - 6755399441055744.0;
    return kd * LN2 + 2.0 * at;
}

/* -- the range pre-pass ----------------------------------------------------------------------------
 * Min and max of the float32 values through order-preserving integer keys of the words (flip the
 * magnitude bits of negatives); a key beyond ±Inf's means NaN/Inf in the block, which then gets
 * an exact second loop: extremes of the finite values and 0 (the main pass zeroes NaN/Inf). */
static inline int32_t key32(uint32_t w) { int32_t s = (int32_t)w; return s ^ ((s >> 31) & 0x7fffffff); }
static inline int32_t key16(uint16_t w) { int32_t s = (int16_t)w; return s ^ ((s >> 15) & 0x7fff); }

typedef int16_t vs __attribute__((vector_size(VW)));

/* Lane-wise min/max of the keys of n words of type T in native vectors VT; KEY1: one word */
#define RANGE_LOOP(T, VT, SHIFT, MASK, KEY1)                                                  \
    {                                                                                         \
        const T *w = p;                                                                       \
        enum { NL = sizeof(VT) / sizeof(T) };                                                 \
        VT lo = (VT){0} + (T)~(-(1LL << (SHIFT))), hi = ~lo;                                  \
        for (; i + NL <= n; i += NL) {                                                        \
            VT k;                                                                             \
            memcpy(&k, w + i, sizeof k);                                                      \
            k ^= (k >> (SHIFT)) & (T)(MASK);                                                  \
            lo = SEL(k < lo, k, lo);                                                          \
            hi = SEL(k > hi, k, hi);                                                          \
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

static void range_keys(const void *p, ptrdiff_t n, int kind, int32_t *lo_k, int32_t *hi_k) {
    ptrdiff_t i = 0;
    *lo_k = INT32_MAX;
    *hi_k = INT32_MIN;
    if (kind == K_F32) RANGE_LOOP(int32_t, vi, 31, 0x7fffffff, key32)
    else RANGE_LOOP(int16_t, vs, 15, 0x7fff, key16)
}

static double key_value(int32_t k, int kind) {
    if (kind == K_F32) return (double)f_bits((uint32_t)(k ^ ((k >> 31) & 0x7fffffff)));
    uint16_t w = (uint16_t)(k ^ ((k >> 15) & 0x7fff));
    return load(&w, 0, kind);
}

static void cmp_range(const void *p, ptrdiff_t n, int kind, double *lo, double *hi) {
    int32_t lo_k, hi_k;
    range_keys(p, n, kind, &lo_k, &hi_k);
    int32_t top = kind == K_F32 ? key32(0x7f7fffffu) : key16(kind == K_F16 ? 0x7bffu : 0x7f7fu);
    if (lo_k >= -top - 1 && hi_k <= top) {   /* key(-max) == -top - 1 */
        *lo = key_value(lo_k, kind);
        *hi = key_value(hi_k, kind);
    } else {                                  /* NaN/Inf somewhere: they count as 0 */
        *lo = 0.0;
        *hi = 0.0;
        for (ptrdiff_t i = 0; i < n; i++) {
            double x = load(p, i, kind);
            if (isfinite(x)) { *lo = x < *lo ? x : *lo; *hi = x > *hi ? x : *hi; }
        }
    }
}

/* -- the main pass ------------------------------------------------------------------------------ */
/* The LD words at p + i as float32 values. */
INL vh vloadh(const void *p, ptrdiff_t i, int kind) {
    if (kind == K_F32) {
        vh f;
        memcpy(&f, (const float *)p + i, sizeof f);
        return f;
    }
    vw h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    vhu u = __builtin_convertvector(h, vhu);
    if (kind == K_BF16) return (vh)(u << 16);
    vhu em = u & 0x7fffu, sign = (u & 0x8000u) << 16;     /* half_value, lane by lane */
    vh v = (vh)(em << 13) * 0x1p112f;
    vhi special = (vhi)(em >= 0x7c00u);
    vhi bits = (special & (vhi)(0x7f800000u | (em << 13))) | (~special & (vhi)v);
    return (vh)((vhu)bits | sign);
}

INL vd widen(vh f) { return __builtin_convertvector(f, vd); }

/* The lanes of one logical vector: [k] is native vector k (logical lanes k·LD ...). */
typedef struct {
    vd sx[NV], sy[NV], sxx[NV], syy[NV], sxy[NV], sdd[NV], sad[NV], srel[NV], mad[NV], mrel[NV];
    vd sa[NV], sb[NV], g[NV], tf[NV], pf[NV], qf[NV];
    vh lox[NV], hix[NV], loy[NV], hiy[NV];        /* ranges: exact in float32, half the width */
    vl c1[NV], c5[NV], ne[NV], far[NV];
} Lanes;

/* KLD's terms, as G = Σ b·g(w) with w = (a − b)/b and g(w) = (1 + w)·log(1 + w) − w >= 0, so
 * that Σ a·log(a/b) = G + Σa − Σb. Each term is second order in the difference and none cancel,
 * so a short series serves where |w| is small: to w⁵ for |w| <= 1/128 (2.5e-10 relative), to
 * w⁷ for |w| <= 1/32 (3e-11) where a side is bfloat16, whose rounding alone reaches 1/128. A
 * block with a larger |w| somewhere gets a second loop for those terms, a·log(a/b) − (a − b)
 * with the full log (cancellation costs at most a factor 64 of 2^-53). */
INL vd g_small(vd w, int wide) {
    if (!wide) return (w * w) * (0.5 + w * (-1.0 / 6 + w * (1.0 / 12 + w * (-1.0 / 20))));
    vd c = 1.0 / 12 + w * (-1.0 / 20 + w * (1.0 / 30 + w * (-1.0 / 42)));
    return (w * w) * (0.5 + w * (-1.0 / 6 + w * c));
}

/* Native vector k of a step (lanes where `valid` is set: the tail) into the lanes; comparisons
 * give -1 per true lane, so counts subtract them. `metrics` == 0: KLD's terms only (pass 2). */
INL void step(Lanes *a, int k, vh xf, vh yf, vl valid, int metrics, int kld, int wide, const KldP *kp) {
    vd x = widen(xf), y = widen(yf);
    if (metrics) {
        vhi v32 = __builtin_convertvector(valid, vhi);
        a->lox[k] = vmin_h(SEL(v32, xf, a->lox[k]), a->lox[k]);
        a->hix[k] = vmax_h(SEL(v32, xf, a->hix[k]), a->hix[k]);
        a->loy[k] = vmin_h(SEL(v32, yf, a->loy[k]), a->loy[k]);
        a->hiy[k] = vmax_h(SEL(v32, yf, a->hiy[k]), a->hiy[k]);
        a->sx[k] += x; a->sy[k] += y;
        a->sxx[k] += x * x; a->syy[k] += y * y; a->sxy[k] += x * y;
        a->ne[k] -= (x != y) & valid;
        vd d = x - y;                               /* exact: two float32 values */
        a->sdd[k] += d * d;
        vd ad = vabs(d);
        a->sad[k] += ad;
        a->mad[k] = vmax_d(ad, a->mad[k]);          /* its first index: found after the loop */
        vd ay = vabs(y);
        /* y == 0: msprobe adds eps to both sides, so the error is |x|/eps (exact: eps = 2^-52) */
        vd r = ad / SEL(y == 0.0, splat(EPS64), ay);
        a->c1[k] -= (r < R1) & valid;
        a->c5[k] -= (r < R5) & valid;
        vd rb = (vd)((ay > EPS64) & (vl)r);         /* msaccucmp: |y| <= eps contributes 0 */
        a->srel[k] += rb;
        a->mrel[k] = vmax_d(rb, a->mrel[k]);
    }
    if (kld) {                                  /* kld == 2: no element of the block is clamped */
        vd p = (x - kp->shx) * kp->scx, q = (y - kp->shy) * kp->scy;
        if (kld == 1) {                         /* the clamp at float32 eps */
            p = SEL(p < EPS32, splat(EPS32), p);
            q = SEL(q < EPS32, splat(EPS32), q);
        }
        q = SEL(valid, q, splat(1.0));          /* the padding's terms: 0 */
        p = SEL(valid, p, splat(1.0));
        vd w = (p - q) / q;                     /* p − q exact where |w| <= 1/32 (Sterbenz) */
        vl far = vabs(w) > (wide ? W_BF16 : W_OTHER);   /* their terms: far_terms' loop */
        a->far[k] |= far;
        a->sa[k] += (vd)((vl)p & valid & ~far);
        a->sb[k] += (vd)((vl)q & valid & ~far);
        a->g[k] += (vd)((vl)(q * g_small(w, wide)) & valid & ~far);
    }
}

INL void far_terms(Lanes *a, int k, vd x, vd y, vl valid, int wide, const KldP *kp) {
    vd p = (x - kp->shx) * kp->scx, q = (y - kp->shy) * kp->scy;
    p = SEL(valid, SEL(p < EPS32, splat(EPS32), p), splat(1.0));
    q = SEL(valid, SEL(q < EPS32, splat(EPS32), q), splat(1.0));
    vl far = (vabs((p - q) / q) > (wide ? W_BF16 : W_OTHER)) & valid;
    a->tf[k] += (vd)((vl)(p * log_ratio(p, q)) & far);
    a->pf[k] += (vd)((vl)p & far);
    a->qf[k] += (vd)((vl)q & far);
}

/* Record chunk c0 if a lane met a far term in it (more than NFAR: nf > NFAR, the whole block). */
INL void note_far(Lanes *a, ptrdiff_t c0, ptrdiff_t *fars, int *nf) {
    int64_t f = 0;
    for (int k = 0; k < NV; k++)
        for (int j = 0; j < LD; j++) f |= a->far[k][j];
    if (!f) return;
    if (*nf < NFAR) fars[*nf] = c0;
    *nf += *nf <= NFAR;
    EACH(k) a->far[k] = (vl){0};
}

INL vl lanes_below(int k, ptrdiff_t m) {   /* the lanes of native vector k among the first m */
    vl io;
    for (int j = 0; j < LD; j++) io[j] = k * LD + j;
    return io < m;
}

/* Eight pairs from i (m of them valid: the tail's are zero-padded copies). */
#define EIGHT(BODY)                                                                            \
    do {                                                                                       \
        unsigned char bx_[32] = {0}, by_[32] = {0};                                            \
        const void *qx_ = px, *qy_ = py;                                                       \
        ptrdiff_t o_ = i;                                                                      \
        if (m < 8) {                                                                           \
            memcpy(bx_, (const char *)px + i * item_size(kx), (size_t)m * item_size(kx));      \
            memcpy(by_, (const char *)py + i * item_size(ky), (size_t)m * item_size(ky));      \
            qx_ = bx_; qy_ = by_; o_ = 0;                                                      \
        }                                                                                      \
        EACH(k) { vh xf = vloadh(qx_, o_ + k * LD, kx), yf = vloadh(qy_, o_ + k * LD, ky);     \
                  vl valid = m < 8 ? lanes_below(k, m) : (vl){0} - 1; BODY; }                  \
    } while (0)

INL void block_body(const void *px, const void *py, ptrdiff_t n, int kx, int ky, int metrics, int kld,
                    const KldP *kp, Sums *o) {
    Lanes a;
    memset(&a, 0, sizeof a);
    EACH(k) {
        a.lox[k] = a.loy[k] = (vh){0} + INFINITY;
        a.hix[k] = a.hiy[k] = (vh){0} - INFINITY;
    }
    const int wide = kx == K_BF16 || ky == K_BF16;
    /* chunks holding a far KLD term (|w| above the series' bound), for the second loop: a
     * handful per block at most on realistic data (only values next to a side's minimum get
     * there), so that loop reads those chunks and not the whole block */
    ptrdiff_t fars[NFAR], i = 0, full = n - n % 8, m = 8;
    int nf = 0;
    while (i < full) {
        ptrdiff_t c0 = i, e = i + FCH < full ? i + FCH : full;
        for (; i < e; i += 8) EIGHT(step(&a, k, xf, yf, valid, metrics, kld, wide, kp));
        if (kld) note_far(&a, c0, fars, &nf);
    }
    if (i < n) {                                /* the tail, zero-padded to eight */
        m = n - i;
        EIGHT(step(&a, k, xf, yf, valid, metrics, kld, wide, kp));
        if (kld) note_far(&a, i, fars, &nf);
    }
    for (int c = 0; kld && c < (nf > NFAR ? 1 : nf); c++) {   /* |w| beyond the series, same lanes */
        ptrdiff_t c0 = nf > NFAR ? 0 : fars[c];
        ptrdiff_t e = nf > NFAR || c0 == full ? n : (c0 + FCH < full ? c0 + FCH : full);
        for (i = c0; i < e; i += 8) {
            m = e - i < 8 ? e - i : 8;
            EIGHT(far_terms(&a, k, widen(xf), widen(yf), valid, wide, kp));
        }
    }
    memset(o, 0, sizeof *o);
    o->lox = o->loy = INFINITY;
    o->hix = o->hiy = -INFINITY;
    for (int k = 0; k < NV; k++)                /* a fixed order: the same result on every CPU */
        for (int j = 0; j < LD; j++) {
            o->sx += a.sx[k][j]; o->sy += a.sy[k][j]; o->sxx += a.sxx[k][j]; o->syy += a.syy[k][j];
            o->sxy += a.sxy[k][j]; o->sdd += a.sdd[k][j]; o->sad += a.sad[k][j]; o->srel += a.srel[k][j];
            o->sa += a.sa[k][j]; o->sb += a.sb[k][j]; o->g += a.g[k][j];
            o->tf += a.tf[k][j]; o->pf += a.pf[k][j]; o->qf += a.qf[k][j];
            o->c1 += a.c1[k][j]; o->c5 += a.c5[k][j]; o->differ += a.ne[k][j];
            o->mrel = a.mrel[k][j] > o->mrel ? a.mrel[k][j] : o->mrel;
            o->mad = a.mad[k][j] > o->mad ? a.mad[k][j] : o->mad;
            o->lox = a.lox[k][j] < o->lox ? a.lox[k][j] : o->lox; o->hix = a.hix[k][j] > o->hix ? a.hix[k][j] : o->hix;
            o->loy = a.loy[k][j] < o->loy ? a.loy[k][j] : o->loy; o->hiy = a.hiy[k][j] > o->hiy ? a.hiy[k][j] : o->hiy;
        }
}

typedef void (*block_fn)(const void *, const void *, ptrdiff_t, const KldP *, Sums *);
/* block_M_KX_KY_KLD: M = 1 every metric (and KLD's terms where KLD > 0), M = 0 KLD's only; each
 * combination its own loop, the loads' kind tests resolved at compile time */
#define DEF_BLOCK(M, KX, KY, KLD) \
    static void block_##M##_##KX##_##KY##_##KLD(const void *px, const void *py, ptrdiff_t n, \
                                                const KldP *kp, Sums *o) { \
        block_body(px, py, n, KX, KY, M, KLD, kp, o); }
#define DEF_ROW(M, KX, KLD) DEF_BLOCK(M, KX, 0, KLD) DEF_BLOCK(M, KX, 1, KLD) DEF_BLOCK(M, KX, 2, KLD)
#define DEF_KLD(M, KLD) DEF_ROW(M, 0, KLD) DEF_ROW(M, 1, KLD) DEF_ROW(M, 2, KLD)
DEF_KLD(1, 0) DEF_KLD(1, 1) DEF_KLD(1, 2) DEF_KLD(0, 1) DEF_KLD(0, 2)
#define FN_ROW(M, KX, KLD) {block_##M##_##KX##_0_##KLD, block_##M##_##KX##_1_##KLD, block_##M##_##KX##_2_##KLD}
#define FN_KLD(M, KLD) {FN_ROW(M, 0, KLD), FN_ROW(M, 1, KLD), FN_ROW(M, 2, KLD)}
static const block_fn BLOCKS[3][3][3] = {FN_KLD(1, 0), FN_KLD(1, 1), FN_KLD(1, 2)};
static const block_fn TERMS[2][3][3] = {FN_KLD(0, 1), FN_KLD(0, 2)};

static void cmp_block(int kld, int kx, int ky, const void *px, const void *py, ptrdiff_t n,
                      const KldP *kp, Sums *o) {
    BLOCKS[kld][kx][ky](px, py, n, kp, o);
}

static void cmp_terms(int clamps, int kx, int ky, const void *px, const void *py, ptrdiff_t n,
                      const KldP *kp, Sums *o) {
    TERMS[clamps ? 0 : 1][kx][ky](px, py, n, kp, o);
}

/* Index of the first pair at distance `mad` (run only when the block holds a new maximum: for
 * data whose errors grow along the tensor, every block; the block is still in cache, and a
 * vector of pairs a step keeps this rescan a fraction of the main pass). */
#define FIRST_AT(KX, KY)                                                                      \
    for (; i + LD <= n; i += LD) {                                                            \
        vl hit = vabs(widen(vloadh(px, i, KX)) - widen(vloadh(py, i, KY))) == m;              \
        int64_t any = 0;                                                                      \
        for (int j = 0; j < LD; j++) any |= hit[j];                                           \
        if (any) break;                                                                       \
    }
static ptrdiff_t cmp_first_at(const void *px, const void *py, ptrdiff_t n, int kx, int ky, double mad) {
    ptrdiff_t i = 0;
    const vd m = splat(mad);
    if (kx == K_F32 && ky == K_F32) { FIRST_AT(K_F32, K_F32) }
    else if (kx == K_F16 && ky == K_F16) { FIRST_AT(K_F16, K_F16) }
    else if (kx == K_BF16 && ky == K_BF16) { FIRST_AT(K_BF16, K_BF16) }
    else { FIRST_AT(kx, ky) }
    for (; i < n; i++)                          /* the step that hit, or the tail */
        if (fabs(load(px, i, kx) - load(py, i, ky)) == mad) return i;
    return -1;
}

/* -- identical blocks ------------------------------------------------------------------------------
 * Bytes equal on both sides: only Σx and Σx² are needed. Compares the words and sums in one
 * pass; gives 0 as soon as a chunk differs (the caller then runs the full pass). */
static int cmp_same_sums(const void *px, const void *py, ptrdiff_t n, int kind, double *s, double *q) {
    vd sl[NV], ql[NV];
    EACH(k) sl[k] = ql[k] = (vd){0};
    const ptrdiff_t CH = 4096;                  /* a multiple of 8: only the last chunk has a tail */
    size_t isz = (size_t)item_size(kind);
    for (ptrdiff_t c = 0; c < n; c += CH) {
        ptrdiff_t e = c + CH < n ? c + CH : n, i = c;
        if (memcmp((const char *)px + c * isz, (const char *)py + c * isz, (size_t)(e - c) * isz)) return 0;
        for (; i + 8 <= e; i += 8)
            EACH(k) { vd x = widen(vloadh(px, i + k * LD, kind)); sl[k] += x; ql[k] += x * x; }
        if (i < e) {                            /* zero padding adds nothing to either sum */
            unsigned char buf[32] = {0};
            memcpy(buf, (const char *)px + i * isz, (size_t)(e - i) * isz);
            EACH(k) { vd x = widen(vloadh(buf, k * LD, kind)); sl[k] += x; ql[k] += x * x; }
        }
    }
    *s = *q = 0.0;
    for (int k = 0; k < NV; k++)
        for (int j = 0; j < LD; j++) { *s += sl[k][j]; *q += ql[k][j]; }
    return 1;
}

const cmp_ops KV(CMP_OPS) = {cmp_range, cmp_block, cmp_terms, cmp_same_sums, cmp_first_at};

#ifdef KERNEL_MODULE
/* -- Python glue: argument checking, the entry points (each releases the GIL around its loops) -- */
VARIANT_TABLE(cmp_ops, CMP_OPS)

/* Index of the first pair whose values differ (the main pass only counts them). */
static ptrdiff_t cmp_first_diff(const void *px, const void *py, ptrdiff_t n, int kx, int ky) {
    for (ptrdiff_t i = 0; i < n; i++)
        if (load(px, i, kx) != load(py, i, ky)) return i;
    return -1;
}

/* A contiguous, aligned, native-order buffer of `kind` words; returns the element count or -1
 * (ValueError set, buffer released). */
static Py_ssize_t get_words(PyObject *obj, int kind, Py_buffer *view) {
    if (kind < K_F32 || kind > K_BF16) {
        PyErr_SetString(PyExc_ValueError, "unknown kind");
        return -1;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    int sz = item_size(kind);
#if PY_BIG_ENDIAN
    if (*f == '@' || *f == '=' || *f == '>' || *f == '!') f++;
#else
    if (*f == '@' || *f == '=' || *f == '<') f++;
#endif
    int code_ok = f[0] && !f[1]
        && (kind == K_F32 ? f[0] == 'f' : (f[0] == 'H' || f[0] == 'e'));   /* 16-bit words: 'H' from a memoryview */
    if (!code_ok || view->itemsize != sz || view->len % sz || ((uintptr_t)view->buf) % (uintptr_t)sz) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "not a contiguous aligned native buffer of that kind");
        return -1;
    }
    return view->len / sz;
}

/* Two blocks of the same non-zero length; returns it, or -1 (ValueError set, nothing held). */
static Py_ssize_t get_pair(PyObject *ox, PyObject *oy, int kx, int ky, Py_buffer *vx, Py_buffer *vy) {
    Py_ssize_t n = get_words(ox, kx, vx);
    if (n < 0) return -1;
    Py_ssize_t ny = get_words(oy, ky, vy);
    if (ny < 0) { PyBuffer_Release(vx); return -1; }
    if (n != ny || n == 0) {
        PyBuffer_Release(vx);
        PyBuffer_Release(vy);
        PyErr_SetString(PyExc_ValueError, "blocks of different or zero length");
        return -1;
    }
    return n;
}

static PyObject *py_range(PyObject *self, PyObject *args) {
    PyObject *obj;
    int kind;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &kind)) return NULL;
    Py_buffer v;
    Py_ssize_t n = get_words(obj, kind, &v);
    if (n < 0) return NULL;
    if (n == 0) { PyBuffer_Release(&v); PyErr_SetString(PyExc_ValueError, "empty block"); return NULL; }
    double lo, hi;
    Py_BEGIN_ALLOW_THREADS
    OPS[cur]->range(v.buf, n, kind, &lo, &hi);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return Py_BuildValue("dd", lo, hi);
}

static PyObject *py_block(PyObject *self, PyObject *args) {
    PyObject *ox, *oy, *okld;
    int kx, ky, want_first;
    double mad_floor;
    if (!PyArg_ParseTuple(args, "OOiipdO", &ox, &oy, &kx, &ky, &want_first, &mad_floor, &okld)) return NULL;
    KldP kp = {0.0, 1.0, 0.0, 1.0};
    int kld = 0, clamps = 1;                     /* kld: (shift, scale) of each side, clamps */
    if (okld != Py_None) {
        if (!PyArg_ParseTuple(okld, "dddd|p", &kp.shx, &kp.scx, &kp.shy, &kp.scy, &clamps)) return NULL;
        kld = clamps ? 1 : 2;
    }
    Py_buffer vx, vy;
    Py_ssize_t n = get_pair(ox, oy, kx, ky, &vx, &vy);
    if (n < 0) return NULL;
    Sums s;
    Py_ssize_t fd = -1, mi = -1;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    OPS[cur]->block(kld, kx, ky, vx.buf, vy.buf, n, &kp, &s);
    finite = isfinite(s.sx) && isfinite(s.sy);   /* any NaN/Inf makes a float64 sum non-finite */
    if (finite && want_first && s.differ) fd = cmp_first_diff(vx.buf, vy.buf, n, kx, ky);
    if (finite && s.mad > mad_floor) mi = OPS[cur]->first_at(vx.buf, vy.buf, n, kx, ky, s.mad);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vy);
    if (!finite) Py_RETURN_NONE;                 /* NaN/Inf: numpy's policy path */
    return Py_BuildValue("(dddddddddndnnnndddddddddd)", s.sx, s.sy, s.sxx, s.syy, s.sxy, s.sdd, s.sad,
                         s.srel, s.mad, mi, s.mrel, (Py_ssize_t)s.c1, (Py_ssize_t)s.c5,
                         (Py_ssize_t)s.differ, fd, s.sa, s.sb, s.g, s.tf, s.pf, s.qf,
                         s.lox, s.hix, s.loy, s.hiy);
}

/* KLD's terms of a block whose metrics pass 1 took (and found finite): (Σa, Σb, G) of the near
 * terms and (Σ a·log(a/b), Σa, Σb) of the far ones (Sums). sums=False: the caller needs no
 * near Σa, Σb (it derives them), and the loops may leave them 0. */
static PyObject *py_terms(PyObject *self, PyObject *args) {
    PyObject *ox, *oy, *okld;
    int kx, ky, clamps = 1, sums = 1;   /* accepted, unused: the loops always sum */
    KldP kp;
    if (!PyArg_ParseTuple(args, "OOiiO!|p", &ox, &oy, &kx, &ky, &PyTuple_Type, &okld, &sums)) return NULL;
    if (!PyArg_ParseTuple(okld, "dddd|p", &kp.shx, &kp.scx, &kp.shy, &kp.scy, &clamps)) return NULL;
    Py_buffer vx, vy;
    Py_ssize_t n = get_pair(ox, oy, kx, ky, &vx, &vy);
    if (n < 0) return NULL;
    Sums s;
    Py_BEGIN_ALLOW_THREADS
    OPS[cur]->terms(clamps, kx, ky, vx.buf, vy.buf, n, &kp, &s);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vy);
    if (!(isfinite(s.sa) && isfinite(s.sb) && isfinite(s.g) && isfinite(s.tf) && isfinite(s.pf)
          && isfinite(s.qf))) Py_RETURN_NONE;
    return Py_BuildValue("(dddddd)", s.sa, s.sb, s.g, s.tf, s.pf, s.qf);
}

static PyObject *py_same(PyObject *self, PyObject *args) {
    PyObject *ox, *oy;
    int kind;
    if (!PyArg_ParseTuple(args, "OOi", &ox, &oy, &kind)) return NULL;
    Py_buffer vx, vy;
    Py_ssize_t n = get_pair(ox, oy, kind, kind, &vx, &vy);
    if (n < 0) return NULL;
    double s = 0.0, q = 0.0;
    int eq;
    Py_BEGIN_ALLOW_THREADS
    eq = OPS[cur]->same(vx.buf, vy.buf, n, kind, &s, &q);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vy);
    if (!eq) Py_RETURN_NONE;
    return Py_BuildValue("(dd)", s, q);
}

/* -- every block of a tensor in one call ---------------------------------------------------------
 * The two passes of compare_c.two_pass over whole tensors (C-contiguous, aligned): the same
 * kernels as block(), same() and terms(), block after block, the GIL released for each, with
 * the per-block bookkeeping in C rather than ~10 µs of Python per block. */
static PyObject *block_tuple(const Sums *s, Py_ssize_t mi, Py_ssize_t fd) {
    return Py_BuildValue("(dddddddddndnnnndddddddddd)", s->sx, s->sy, s->sxx, s->syy, s->sxy, s->sdd,
                         s->sad, s->srel, s->mad, mi, s->mrel, (Py_ssize_t)s->c1, (Py_ssize_t)s->c5,
                         (Py_ssize_t)s->differ, fd, s->sa, s->sb, s->g, s->tf, s->pf, s->qf,
                         s->lox, s->hix, s->loy, s->hiy);
}

/* blocks(x, y, kx, ky, nb, check_same, want_first, mad_floor): per block of nb elements,
 * (Σx, Σx²) where check_same and its bytes are equal on both sides, else block()'s tuple for
 * kld=None (want_first until a block gives a first difference; the index of the largest |x − y|
 * where it exceeds mad_floor and every earlier block's); None for a block holding NaN/Inf (the
 * caller's numpy path takes it). */
static PyObject *py_blocks(PyObject *self, PyObject *args) {
    PyObject *ox, *oy;
    int kx, ky, check_same, want_first;
    Py_ssize_t nb;
    double mad_floor;
    if (!PyArg_ParseTuple(args, "OOiinppd", &ox, &oy, &kx, &ky, &nb, &check_same, &want_first, &mad_floor))
        return NULL;
    if (nb <= 0) { PyErr_SetString(PyExc_ValueError, "block size must be positive"); return NULL; }
    Py_buffer vx, vy;
    Py_ssize_t n = get_pair(ox, oy, kx, ky, &vx, &vy);
    if (n < 0) return NULL;
    PyObject *out = PyList_New(0);
    size_t isx = (size_t)item_size(kx), isy = (size_t)item_size(ky);
    for (Py_ssize_t off = 0; out && off < n; off += nb) {
        Py_ssize_t m = n - off < nb ? n - off : nb;
        const char *bx = (const char *)vx.buf + off * isx, *by = (const char *)vy.buf + off * isy;
        PyObject *item;
        int eq = 0, finite = 1;
        double ss = 0.0, sq = 0.0;
        Sums s;
        Py_ssize_t fd = -1, mi = -1;
        Py_BEGIN_ALLOW_THREADS
        if (check_same && kx == ky) eq = OPS[cur]->same(bx, by, m, kx, &ss, &sq);
        if (!eq) {
            OPS[cur]->block(0, kx, ky, bx, by, m, NULL, &s);
            finite = isfinite(s.sx) && isfinite(s.sy);
            if (finite && want_first && s.differ) fd = cmp_first_diff(bx, by, m, kx, ky);
            if (finite && s.mad > mad_floor) mi = OPS[cur]->first_at(bx, by, m, kx, ky, s.mad);
        }
        Py_END_ALLOW_THREADS
        if (eq) item = Py_BuildValue("(dd)", ss, sq);
        else if (!finite) item = Py_NewRef(Py_None);
        else {
            item = block_tuple(&s, mi, fd);
            want_first = want_first && fd < 0;
            mad_floor = s.mad > mad_floor ? s.mad : mad_floor;
        }
        if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vy);
    return out;
}

/* terms_blocks(x, y, kx, ky, nb, (shx, scx, shy, scy), flags): terms() of every block whose flag
 * byte (one per block) has bit 0 clear, with bit 1 "reaches the clamp" and bit 2 "sums" (else
 * None in its place); None instead of the list if a block's terms are not finite. */
static PyObject *py_terms_blocks(PyObject *self, PyObject *args) {
    PyObject *ox, *oy;
    int kx, ky;
    Py_ssize_t nb;
    KldP kp;
    Py_buffer fl;
    if (!PyArg_ParseTuple(args, "OOiin(dddd)y*", &ox, &oy, &kx, &ky, &nb, &kp.shx, &kp.scx, &kp.shy,
                          &kp.scy, &fl))
        return NULL;
    Py_buffer vx, vy;
    Py_ssize_t n = nb > 0 ? get_pair(ox, oy, kx, ky, &vx, &vy) : -1;
    if (n < 0 || fl.len != n / nb + (n % nb != 0)) {
        if (n >= 0) { PyBuffer_Release(&vx); PyBuffer_Release(&vy); }
        PyBuffer_Release(&fl);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "one flag byte per block, blocks of a positive size");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    size_t isx = (size_t)item_size(kx), isy = (size_t)item_size(ky);
    for (Py_ssize_t off = 0, k = 0; out && off < n; off += nb, k++) {
        unsigned char f = ((const unsigned char *)fl.buf)[k];
        PyObject *item;
        if (f & 1) {
            item = Py_NewRef(Py_None);
        } else {
            Py_ssize_t m = n - off < nb ? n - off : nb;
            const char *bx = (const char *)vx.buf + off * isx, *by = (const char *)vy.buf + off * isy;
            int clamps = (f & 2) != 0;
            Sums s;
            Py_BEGIN_ALLOW_THREADS
            OPS[cur]->terms(clamps, kx, ky, bx, by, m, &kp, &s);
            Py_END_ALLOW_THREADS
            if (!(isfinite(s.sa) && isfinite(s.sb) && isfinite(s.g) && isfinite(s.tf) && isfinite(s.pf)
                  && isfinite(s.qf))) {
                Py_CLEAR(out);
                out = Py_NewRef(Py_None);
                break;
            }
            item = Py_BuildValue("(dddddd)", s.sa, s.sb, s.g, s.tf, s.pf, s.qf);
        }
        if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vy);
    PyBuffer_Release(&fl);
    return out;
}

static PyObject *py_log_ratio(PyObject *self, PyObject *args) {
    double p, q;
    if (!PyArg_ParseTuple(args, "dd", &p, &q)) return NULL;
    if (!(p >= EPS32 && q >= EPS32 && p <= 1e300 && q <= 1e300)) {
        PyErr_SetString(PyExc_ValueError, "log_ratio takes p, q in [float32 eps, 1e300]");
        return NULL;
    }
    return PyFloat_FromDouble(log_ratio(splat(p), splat(q))[0]);
}

static PyMethodDef METHODS[] = {
    VARIANT_METHODS
    {"range", py_range, METH_VARARGS,
     "range(words, kind) -> (min, max) of a block's float32 values, NaN/Inf counted as 0"},
    {"block", py_block, METH_VARARGS,
     "block(x, y, kx, ky, want_first, mad_floor, kld) -> every partial of a differing block, or None on NaN/Inf"},
    {"terms", py_terms, METH_VARARGS,
     "terms(x, y, kx, ky, kld, sums=True) -> KLD's near (sum a, sum b, G) and far (sum a log(a/b), sum a, sum b) of a finite block, or None"},
    {"same", py_same, METH_VARARGS,
     "same(x, y, kind) -> (sum, sum of squares) when the bytes are equal, else None"},
    {"blocks", py_blocks, METH_VARARGS,
     "blocks(x, y, kx, ky, nb, check_same, want_first, mad_floor) -> pass 1 of every block (list)"},
    {"terms_blocks", py_terms_blocks, METH_VARARGS,
     "terms_blocks(x, y, kx, ky, nb, (shx, scx, shy, scy), flags) -> pass 2 of every block (list), or None"},
    {"log_ratio", py_log_ratio, METH_VARARGS, "log_ratio(p, q): the kernel's log(p/q) (for its accuracy test)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_compare",
                                    "One-pass block kernels of the dump comparison.", -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__compare(void) {
    cur = best_variant();
    return PyModule_Create(&MODULE);
}
#endif
