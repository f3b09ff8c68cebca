/* AVX2 + FMA copies of the two loops of _comparec512.c, for x86-64 CPUs without AVX-512 (AMD
 * Zen 2/3, Intel before Skylake-SP, most client CPUs). The portable loops hold eight float64
 * lanes in one GNU C vector, and below AVX-512 GCC compiles every comparison of such a vector
 * to one scalar compare per lane: their AVX2 build measured 12 ns per pair in pass 1, slower
 * than numpy. Here the eight lanes of a step are two __m256d halves (lanes 0-3, 4-7), each lane
 * does the AVX-512 loops' operations in the same order, and the lanes are summed in the same
 * order: the results are those loops' bits. Masks are vectors (blends instead of masked
 * operations), counts are popcounts of movemasks.
 */
#include "_comparec.h"

#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)) \
    && !defined(PRECISION_AGENT_NO_INTRINSICS)
#include <immintrin.h>

#define T256 __attribute__((target("avx2,fma,f16c,popcnt")))
#define INL static inline __attribute__((always_inline)) T256

int c256_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt");
}

typedef struct { __m256d l, h; } D8;   /* eight float64 lanes */

#define OP2(fn, a, b) ((D8){fn((a).l, (b).l), fn((a).h, (b).h)})
#define OP3(fn, a, b, c) ((D8){fn((a).l, (b).l, (c).l), fn((a).h, (b).h, (c).h)})
#define CMP8(a, b, pred) ((D8){_mm256_cmp_pd((a).l, (b).l, pred), _mm256_cmp_pd((a).h, (b).h, pred)})

INL D8 set8(double v) { __m256d s = _mm256_set1_pd(v); return (D8){s, s}; }
INL D8 widen8(__m256 f) {
    return (D8){_mm256_cvtps_pd(_mm256_castps256_ps128(f)), _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1))};
}
INL D8 abs8(D8 a) {
    __m256d m = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    return (D8){_mm256_and_pd(a.l, m), _mm256_and_pd(a.h, m)};
}
INL D8 pick8(D8 m, D8 yes, D8 no) {   /* m ? yes : no, lane by lane */
    return (D8){_mm256_blendv_pd(no.l, yes.l, m.l), _mm256_blendv_pd(no.h, yes.h, m.h)};
}
INL int bits8(D8 m) { return _mm256_movemask_pd(m.l) | _mm256_movemask_pd(m.h) << 4; }
INL D8 lanes8(int v) {                 /* the lanes of bit mask v, as a vector mask */
    __m256i b = _mm256_set1_epi64x(v);
    __m256i lo = _mm256_setr_epi64x(1, 2, 4, 8), hi = _mm256_setr_epi64x(16, 32, 64, 128);
    return (D8){_mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(b, lo), lo)),
                _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(b, hi), hi))};
}
INL double sum8(D8 v) {
    double t[8];
    _mm256_storeu_pd(t, v.l);
    _mm256_storeu_pd(t + 4, v.h);
    return sum_lanes(t);
}
INL double max8(D8 v) {
    double t[8], m;
    _mm256_storeu_pd(t, v.l);
    _mm256_storeu_pd(t + 4, v.h);
    m = t[0];
    for (int j = 1; j < 8; j++) m = t[j] > m ? t[j] : m;
    return m;
}

/* Eight words from p + i as float32; fewer than eight (m < 0xff: the tail) go through a zeroed
 * buffer, so nothing past the end is read. */
INL __m256 load8(const void *p, Py_ssize_t i, int kind, int m) {
    size_t isz = kind == K_F32 ? 4 : 2;
    const char *src = (const char *)p + (size_t)i * isz;
    unsigned char buf[32] = {0};
    if (m != 0xff) {
        memcpy(buf, src, (size_t)__builtin_popcount((unsigned)m) * isz);
        src = (const char *)buf;
    }
    if (kind == K_F32) return _mm256_loadu_ps((const float *)src);
    __m128i h = _mm_loadu_si128((const __m128i *)src);
    if (kind == K_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INL void ahead(const void *p, Py_ssize_t i, int kind) {   /* as in _comparec512.c */
    _mm_prefetch((const char *)ahead_addr(p, i, kind), _MM_HINT_T0);
}

INL void range8(__m256 lo, __m256 hi, double *o_lo, double *o_hi) {
    float a[8], b[8];
    _mm256_storeu_ps(a, lo);
    _mm256_storeu_ps(b, hi);
    range_lanes(a, b, o_lo, o_hi);
}

/* -- pass 1 ------------------------------------------------------------------------------------ */
typedef struct {
    D8 sx, sy, sxx, syy, sxy, sdd, sad, srel, mad, mrel;
    __m256 lox, hix, loy, hiy;
    long long c1, c5, ne;
} A1;

INL void step1(A1 *a, __m256 xf, __m256 yf, int v) {
    const D8 eps = set8(EPS64);
    __m256 xr = xf, yr = yf;
    if (v != 0xff) {   /* the tail's padding must not reach the ranges */
        __m256 vm = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(__builtin_popcount((unsigned)v)),
                                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        xr = _mm256_blendv_ps(a->lox, xf, vm);
        yr = _mm256_blendv_ps(a->loy, yf, vm);
        a->hix = _mm256_max_ps(_mm256_blendv_ps(a->hix, xf, vm), a->hix);
        a->hiy = _mm256_max_ps(_mm256_blendv_ps(a->hiy, yf, vm), a->hiy);
    } else {
        a->hix = _mm256_max_ps(xf, a->hix);
        a->hiy = _mm256_max_ps(yf, a->hiy);
    }
    a->lox = _mm256_min_ps(xr, a->lox);
    a->loy = _mm256_min_ps(yr, a->loy);
    a->ne += __builtin_popcount((unsigned)(_mm256_movemask_ps(_mm256_cmp_ps(xf, yf, _CMP_NEQ_UQ)) & v));
    D8 x = widen8(xf), y = widen8(yf);
    a->sx = OP2(_mm256_add_pd, a->sx, x);
    a->sy = OP2(_mm256_add_pd, a->sy, y);
    a->sxx = OP3(_mm256_fmadd_pd, x, x, a->sxx);
    a->syy = OP3(_mm256_fmadd_pd, y, y, a->syy);
    a->sxy = OP3(_mm256_fmadd_pd, x, y, a->sxy);
    D8 d = OP2(_mm256_sub_pd, x, y);
    a->sdd = OP3(_mm256_fmadd_pd, d, d, a->sdd);
    D8 ad = abs8(d);
    a->sad = OP2(_mm256_add_pd, a->sad, ad);
    a->mad = OP2(_mm256_max_pd, ad, a->mad);
    D8 ay = abs8(y);
    D8 r = OP2(_mm256_div_pd, ad, pick8(CMP8(y, set8(0.0), _CMP_EQ_OQ), eps, ay));
    a->c1 += __builtin_popcount((unsigned)(bits8(CMP8(r, set8(R1), _CMP_LT_OQ)) & v));
    a->c5 += __builtin_popcount((unsigned)(bits8(CMP8(r, set8(R5), _CMP_LT_OQ)) & v));
    D8 big = CMP8(ay, eps, _CMP_GT_OQ);
    a->srel = pick8(big, OP2(_mm256_add_pd, a->srel, r), a->srel);
    a->mrel = pick8(big, OP2(_mm256_max_pd, r, a->mrel), a->mrel);
}

#define STEP1(i, c)                                                                            \
    do {                                                                                       \
        int m_ = (1 << (c)) - 1;                                                               \
        if ((c) == 8) { ahead(px, i, kx_); ahead(py, i, ky_); }                                \
        step1(&a, load8(px, i, kx_, m_), load8(py, i, ky_, m_), m_);                           \
    } while (0)
#define PASS1(KX, KY, A_, B_)                                                                  \
    {                                                                                          \
        const int kx_ = KX, ky_ = KY;                                                          \
        PASS1_LOOP(STEP1)                                                                      \
    }

T256 void c256_block(int kx, int ky, const void *px, const void *py, Py_ssize_t n, Sums *o) {
    A1 a;
    const D8 z = set8(0.0);
    a.sx = a.sy = a.sxx = a.syy = a.sxy = a.sdd = a.sad = a.srel = a.mad = a.mrel = z;
    a.lox = a.loy = _mm256_set1_ps(INFINITY);
    a.hix = a.hiy = _mm256_set1_ps(-INFINITY);
    a.c1 = a.c5 = a.ne = 0;
    KIND_SWITCH(PASS1, 0, 0)
    memset(o, 0, sizeof *o);
    o->sx = sum8(a.sx); o->sy = sum8(a.sy); o->sxx = sum8(a.sxx);
    o->syy = sum8(a.syy); o->sxy = sum8(a.sxy); o->sdd = sum8(a.sdd);
    o->sad = sum8(a.sad); o->srel = sum8(a.srel);
    o->mad = max8(a.mad);
    o->mrel = max8(a.mrel);
    o->c1 = a.c1; o->c5 = a.c5; o->differ = a.ne;
    range8(a.lox, a.hix, &o->lox, &o->hix);
    range8(a.loy, a.hiy, &o->loy, &o->hiy);
}

/* -- pass 2 (the formulation and the far terms: _comparec512.c) -------------------------------- */
typedef struct {
    D8 su, sv, g, tf, pf, qf;
    int far;
} A2;

typedef struct { double c, tu, tv; } P2;

INL D8 poly8(D8 w, int wide) {
    D8 c = set8(-1.0 / 20);
    if (wide) {
        c = OP3(_mm256_fmadd_pd, w, set8(-1.0 / 42), set8(1.0 / 30));
        c = OP3(_mm256_fmadd_pd, w, c, set8(-1.0 / 20));
    }
    c = OP3(_mm256_fmadd_pd, w, c, set8(1.0 / 12));
    c = OP3(_mm256_fmadd_pd, w, c, set8(-1.0 / 6));
    return OP3(_mm256_fmadd_pd, w, c, set8(0.5));
}

/* u, v, e, w of eight pairs; returns the far lanes among those of bit mask m, as a vector mask. */
INL D8 prep2(__m256 xf, __m256 yf, int m, const KldP *kp, const P2 *q2, int wide, int clamps,
             D8 *u, D8 *v, D8 *e, D8 *w) {
    *u = OP2(_mm256_sub_pd, widen8(xf), set8(kp->shx));
    *v = OP2(_mm256_sub_pd, widen8(yf), set8(kp->shy));
    *e = OP3(_mm256_fmsub_pd, set8(q2->c), *u, *v);
    *w = OP2(_mm256_div_pd, *e, *v);
    D8 f = CMP8(abs8(*w), set8(wide ? W_BF16 : W_OTHER), _CMP_GT_OQ);
    if (clamps) {
        f = OP2(_mm256_or_pd, f, CMP8(*u, set8(q2->tu), _CMP_LT_OQ));
        f = OP2(_mm256_or_pd, f, CMP8(*v, set8(q2->tv), _CMP_LT_OQ));
    }
    return m == 0xff ? f : OP2(_mm256_and_pd, f, lanes8(m));
}

INL void step2(A2 *a, __m256 xf, __m256 yf, int m, const KldP *kp, const P2 *q2, int wide, int sums,
               int clamps) {
    D8 u, v, e, w;
    D8 far = prep2(xf, yf, m, kp, q2, wide, clamps, &u, &v, &e, &w);
    D8 near = m == 0xff ? OP2(_mm256_xor_pd, far, CMP8(set8(0.0), set8(0.0), _CMP_EQ_OQ))
                        : OP2(_mm256_andnot_pd, far, lanes8(m));
    a->far |= bits8(far);
    if (sums) {
        a->su = pick8(near, OP2(_mm256_add_pd, a->su, u), a->su);
        a->sv = pick8(near, OP2(_mm256_add_pd, a->sv, v), a->sv);
    }
    a->g = pick8(near, OP3(_mm256_fmadd_pd, OP2(_mm256_mul_pd, e, w), poly8(w, wide), a->g), a->g);
}

INL v8d as_v8d(D8 a) { v8d r; memcpy(&r, &a.l, 32); memcpy((char *)&r + 32, &a.h, 32); return r; }
INL D8 as_d8(v8d a) { D8 r; memcpy(&r.l, &a, 32); memcpy(&r.h, (const char *)&a + 32, 32); return r; }

INL void far_terms(A2 *a, D8 u, D8 v, D8 f, const KldP *kp, int clamps) {
    D8 p = OP2(_mm256_mul_pd, u, set8(kp->scx));
    D8 q = OP2(_mm256_mul_pd, v, set8(kp->scy));
    if (clamps) {
        p = OP2(_mm256_max_pd, p, set8(EPS32));
        q = OP2(_mm256_max_pd, q, set8(EPS32));
    }
    p = pick8(f, p, set8(1.0));
    q = pick8(f, q, set8(1.0));
    D8 lr = as_d8(log_ratio(as_v8d(p), as_v8d(q)));
    a->tf = pick8(f, OP2(_mm256_add_pd, a->tf, OP2(_mm256_mul_pd, p, lr)), a->tf);
    a->pf = pick8(f, OP2(_mm256_add_pd, a->pf, p), a->pf);
    a->qf = pick8(f, OP2(_mm256_add_pd, a->qf, q), a->qf);
}

#define STEP2(i, c)                                                                            \
    do {                                                                                       \
        int m_ = (1 << (c)) - 1;                                                               \
        if ((c) == 8) { ahead(px, i, kx_); ahead(py, i, ky_); }                                \
        step2(&a, load8(px, i, kx_, m_), load8(py, i, ky_, m_), m_, kp, &q2, wide, sums_, cl_); \
    } while (0)
#define FAR2(i, c)                                                                             \
    do {                                                                                       \
        int m_ = (1 << (c)) - 1;                                                               \
        D8 u, v, e, w;                                                                         \
        D8 f = prep2(load8(px, i, kx_, m_), load8(py, i, ky_, m_), m_, kp, &q2, wide, cl_,     \
                     &u, &v, &e, &w);                                                          \
        if (bits8(f)) far_terms(&a, u, v, f, kp, cl_);                                         \
    } while (0)
#define PASS2(KX, KY, SUMS, CL)                                                                \
    {                                                                                          \
        const int kx_ = KX, ky_ = KY, sums_ = SUMS, cl_ = CL, wide = KX == K_BF16 || KY == K_BF16; \
        PASS2_CHUNKS(STEP2, FAR2, a.far, a.far = 0)                                            \
    }

#define KINDS2(SUMS, CL) KIND_SWITCH(PASS2, SUMS, CL)

T256 void c256_terms(int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp,
                     int sums, int clamps, Sums *o) {
    A2 a;
    a.su = a.sv = a.g = a.tf = a.pf = a.qf = set8(0.0);
    a.far = 0;
    const P2 q2 = {kp->scx / kp->scy, EPS32 / kp->scx * (1 + 0x1p-20), EPS32 / kp->scy * (1 + 0x1p-20)};
    Py_ssize_t fars[NFAR];
    int nf = 0;
    if (clamps) KINDS2(1, 1)
    else if (sums) KINDS2(1, 0)
    else KINDS2(0, 0)
    memset(o, 0, sizeof *o);
    o->sa = kp->scx * sum8(a.su);
    o->sb = kp->scy * sum8(a.sv);
    o->g = kp->scy * sum8(a.g);
    o->tf = sum8(a.tf);
    o->pf = sum8(a.pf);
    o->qf = sum8(a.qf);
}

#else
int c256_usable(void) { return 0; }
void c256_block(int kx, int ky, const void *px, const void *py, Py_ssize_t n, Sums *o) {
    (void)kx; (void)ky; (void)px; (void)py; (void)n; (void)o;
}
void c256_terms(int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp, int sums,
                int clamps, Sums *o) {
    (void)kx; (void)ky; (void)px; (void)py; (void)n; (void)kp; (void)sums; (void)clamps; (void)o;
}
#endif
