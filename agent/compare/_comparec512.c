/* AVX-512 loops for the two calls that a float32/float16/bfloat16 compare spends its time in
 * (blocks_c.two_pass): pass 1, every metric and both ranges of a differing block, and pass 2,
 * KLD's terms of a block no element of which reaches the clamp. _comparec.c dispatches here when
 * c512_usable() (CPU and OS have AVX-512 F/DQ/VL/BW, the build has the intrinsics) and the
 * module's isa is "avx512"; everything else stays on its portable loops.
 *
 * Why a second copy of two loops: written with GNU C vector extensions, GCC emits a compare, a
 * mask-to-vector move and an integer subtract for each of the three counts, and a compare and
 * a blend for each minimum and maximum; 512-bit float64 operations run at half rate on some
 * CPUs (AMD Zen 4), so pass 1 cost ~44 vector instructions per 8 pairs. Here the counts are
 * popcounts of compare masks (scalar, off the vector pipes), the extremes vmin/vmax, the masked
 * sums one masked add, and the four sums of products fused multiply-adds (x², y² and x·y of
 * float32 values are exact in float64, so only Σ(x − y)² can round differently: one rounding
 * less than the portable loop's). Pass 2 uses a shorter formulation of the same terms (below),
 * with its own rounding. So the results agree with the portable loops' within ~1e-15 relative
 * per term, not bit for bit; every other partial of pass 1 is the portable loop's, bit for bit.
 */
#include "_comparec.h"

/* -DPRECISION_AGENT_NO_INTRINSICS builds the stub below on any host (tests/test_kernels.py). */
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)) \
    && !defined(PRECISION_AGENT_NO_INTRINSICS)
#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw,fma,f16c,popcnt")))
#define INL static inline __attribute__((always_inline)) T512

int c512_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")
        && __builtin_cpu_supports("popcnt");
}

/* Eight words from p + i as float32 (lanes outside mask m read nothing and are 0). */
INL __m256 load8(const void *p, Py_ssize_t i, int kind, __mmask8 m) {
    if (kind == K_F32) return _mm256_maskz_loadu_ps(m, (const float *)p + i);
    __m128i h = _mm_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (kind == K_F16) return _mm256_cvtph_ps(h);    /* exact, subnormals and Inf/NaN included */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* A prefetch 1 KiB ahead of the words at p + i: both loops are bound by arithmetic, and the
 * hardware prefetcher alone left ~12% of pass 2's time waiting on memory for tensors larger than
 * the caches (measured on two 256 MiB sides; no cost in cache). Past the end it is a no-op. */
INL void ahead(const void *p, Py_ssize_t i, int kind) {
    _mm_prefetch((const char *)ahead_addr(p, i, kind), _MM_HINT_T0);
}

INL double lanes_sum(__m512d v) {
    double t[8];
    _mm512_storeu_pd(t, v);
    return sum_lanes(t);
}

INL void lanes_range(__m256 lo, __m256 hi, double *o_lo, double *o_hi) {
    float a[8], b[8];
    _mm256_storeu_ps(a, lo);
    _mm256_storeu_ps(b, hi);
    range_lanes(a, b, o_lo, o_hi);
}

/* -- pass 1 ------------------------------------------------------------------------------------ */
typedef struct {
    __m512d sx, sy, sxx, syy, sxy, sdd, sad, srel, mad, mrel;
    __m256 lox, hix, loy, hiy;
    long long c1, c5, ne;
} A1;

/* Eight pairs (the lanes of v: all but in the tail) into the partials; the same definitions and
 * operations as step() in _comparec.c with metrics on and KLD off. */
INL void step1(A1 *a, __m256 xf, __m256 yf, __mmask8 v) {
    const __m512d eps = _mm512_set1_pd(EPS64);
    /* min(new, kept) gives kept on a tie (0.0 against -0.0 too), as the portable loop's
     * new < kept ? new : kept does */
    a->lox = _mm256_mask_min_ps(a->lox, v, xf, a->lox);
    a->hix = _mm256_mask_max_ps(a->hix, v, xf, a->hix);
    a->loy = _mm256_mask_min_ps(a->loy, v, yf, a->loy);
    a->hiy = _mm256_mask_max_ps(a->hiy, v, yf, a->hiy);
    a->ne += __builtin_popcount(_mm256_mask_cmp_ps_mask(v, xf, yf, _CMP_NEQ_UQ));
    __m512d x = _mm512_cvtps_pd(xf), y = _mm512_cvtps_pd(yf);
    a->sx = _mm512_add_pd(a->sx, x);
    a->sy = _mm512_add_pd(a->sy, y);
    a->sxx = _mm512_fmadd_pd(x, x, a->sxx);         /* exact products: the same as mul, add */
    a->syy = _mm512_fmadd_pd(y, y, a->syy);
    a->sxy = _mm512_fmadd_pd(x, y, a->sxy);
    __m512d d = _mm512_sub_pd(x, y);
    a->sdd = _mm512_fmadd_pd(d, d, a->sdd);         /* d·d may round: fused, one rounding */
    __m512d ad = _mm512_abs_pd(d);
    a->sad = _mm512_add_pd(a->sad, ad);
    a->mad = _mm512_max_pd(ad, a->mad);
    __m512d ay = _mm512_abs_pd(y);
    __mmask8 yz = _mm256_cmp_ps_mask(yf, _mm256_setzero_ps(), _CMP_EQ_OQ);
    __m512d r = _mm512_div_pd(ad, _mm512_mask_blend_pd(yz, ay, eps));   /* y == 0: |x|/eps */
    a->c1 += __builtin_popcount(_mm512_mask_cmp_pd_mask(v, r, _mm512_set1_pd(R1), _CMP_LT_OQ));
    a->c5 += __builtin_popcount(_mm512_mask_cmp_pd_mask(v, r, _mm512_set1_pd(R5), _CMP_LT_OQ));
    __mmask8 big = _mm512_cmp_pd_mask(ay, eps, _CMP_GT_OQ);   /* msaccucmp: |y| <= eps adds 0 */
    a->srel = _mm512_mask_add_pd(a->srel, big, a->srel, r);
    a->mrel = _mm512_mask_max_pd(a->mrel, big, r, a->mrel);
}

#define STEP1(i, c)                                                                            \
    do {                                                                                       \
        __mmask8 m_ = (__mmask8)((1u << (c)) - 1);                                             \
        if ((c) == 8) { ahead(px, i, kx_); ahead(py, i, ky_); }                                \
        step1(&a, load8(px, i, kx_, m_), load8(py, i, ky_, m_), m_);                           \
    } while (0)
#define PASS1(KX, KY, A_, B_)                                                                  \
    {                                                                                          \
        const int kx_ = KX, ky_ = KY;                                                          \
        PASS1_LOOP(STEP1)                                                                      \
    }

T512 void c512_block(int kx, int ky, const void *px, const void *py, Py_ssize_t n, Sums *o) {
    A1 a;
    const __m512d z = _mm512_setzero_pd();
    a.sx = a.sy = a.sxx = a.syy = a.sxy = a.sdd = a.sad = a.srel = a.mad = a.mrel = z;
    a.lox = a.loy = _mm256_set1_ps(INFINITY);
    a.hix = a.hiy = _mm256_set1_ps(-INFINITY);
    a.c1 = a.c5 = a.ne = 0;
    /* each pair of kinds its own loop: the loads' kind tests are resolved at compile time */
    KIND_SWITCH(PASS1, 0, 0)
    memset(o, 0, sizeof *o);
    o->sx = lanes_sum(a.sx); o->sy = lanes_sum(a.sy); o->sxx = lanes_sum(a.sxx);
    o->syy = lanes_sum(a.syy); o->sxy = lanes_sum(a.sxy); o->sdd = lanes_sum(a.sdd);
    o->sad = lanes_sum(a.sad); o->srel = lanes_sum(a.srel);
    o->mad = _mm512_reduce_max_pd(a.mad);
    o->mrel = _mm512_reduce_max_pd(a.mrel);
    o->c1 = a.c1; o->c5 = a.c5; o->differ = a.ne;
    lanes_range(a.lox, a.hix, &o->lox, &o->hix);
    lanes_range(a.loy, a.hiy, &o->loy, &o->hiy);
}

/* -- pass 2 ------------------------------------------------------------------------------------
 * With u = x − min_x, v = y − min_y (both exact), a = s_x·u and b = s_y·v (s: 1/range), the
 * portable loop's w = (a − b)/b is (c·u − v)/v with c = s_x/s_y, and its term b·g(w) =
 * b·w²·P(w) is s_y·e·w·P(w) with e = c·u − v (one fused rounding): no per-element scaling,
 * Σa = s_x·Σu, Σb = s_y·Σv. Terms with |w| beyond the series' bound are left out of that sum and
 * recorded by chunk; a second loop takes them with the full log, deciding "beyond" with the very
 * same operations, so each term is counted once. In a block that may reach the clamp at float32
 * eps (it holds a side's minimum, or it is the whole of a small tensor), the elements under the
 * clamp (u below eps/s_x, a hair more to be safe, or v likewise: a handful next to each minimum)
 * count as far too, and the far loop clamps them: the block keeps this loop. */
typedef struct {
    __m512d su, sv, g, tf, pf, qf;
    __mmask8 far;
} A2;

typedef struct { double c, tu, tv; } P2;   /* c = s_x/s_y; the clamp's bounds on u and v */

INL __m512d poly(__m512d w, int wide) {   /* P(w) = g(w)/w², to w³ (w⁵ where a side is bf16) */
    __m512d c = _mm512_set1_pd(-1.0 / 20);
    if (wide) {
        c = _mm512_fmadd_pd(w, _mm512_set1_pd(-1.0 / 42), _mm512_set1_pd(1.0 / 30));
        c = _mm512_fmadd_pd(w, c, _mm512_set1_pd(-1.0 / 20));
    }
    c = _mm512_fmadd_pd(w, c, _mm512_set1_pd(1.0 / 12));
    c = _mm512_fmadd_pd(w, c, _mm512_set1_pd(-1.0 / 6));
    return _mm512_fmadd_pd(w, c, _mm512_set1_pd(0.5));
}

/* u, v, e and w of eight pairs; returns the lanes of m that are far: |w| beyond the series, or
 * (clamps) under the clamp. */
INL __mmask8 prep2(__m256 xf, __m256 yf, __mmask8 m, const KldP *kp, const P2 *q2, int wide,
                   int clamps, __m512d *u, __m512d *v, __m512d *e, __m512d *w) {
    *u = _mm512_sub_pd(_mm512_cvtps_pd(xf), _mm512_set1_pd(kp->shx));
    *v = _mm512_sub_pd(_mm512_cvtps_pd(yf), _mm512_set1_pd(kp->shy));
    *e = _mm512_fmsub_pd(_mm512_set1_pd(q2->c), *u, *v);
    *w = _mm512_div_pd(*e, *v);
    __mmask8 f = _mm512_mask_cmp_pd_mask(m, _mm512_abs_pd(*w), _mm512_set1_pd(wide ? W_BF16 : W_OTHER),
                                         _CMP_GT_OQ);
    if (clamps)   /* NaN w (u = v = 0) fails the test above: these catch it */
        f |= _mm512_mask_cmp_pd_mask(m, *u, _mm512_set1_pd(q2->tu), _CMP_LT_OQ)
           | _mm512_mask_cmp_pd_mask(m, *v, _mm512_set1_pd(q2->tv), _CMP_LT_OQ);
    return f;
}

INL void step2(A2 *a, __m256 xf, __m256 yf, __mmask8 m, const KldP *kp, const P2 *q2, int wide,
               int sums, int clamps) {
    __m512d u, v, e, w;
    __mmask8 far = prep2(xf, yf, m, kp, q2, wide, clamps, &u, &v, &e, &w);
    __mmask8 near = m & (__mmask8)~far;
    a->far |= far;
    if (sums) {   /* else the caller has them: Σu from pass 1's Σx, less the far terms' Σa */
        a->su = _mm512_mask_add_pd(a->su, near, a->su, u);
        a->sv = _mm512_mask_add_pd(a->sv, near, a->sv, v);
    }
    a->g = _mm512_mask3_fmadd_pd(_mm512_mul_pd(e, w), poly(w, wide), a->g, near);   /* += e·w·P */
}

#define STEP2(i, c)                                                                            \
    do {                                                                                       \
        __mmask8 m_ = (__mmask8)((1u << (c)) - 1);                                             \
        if ((c) == 8) { ahead(px, i, kx_); ahead(py, i, ky_); }                                \
        step2(&a, load8(px, i, kx_, m_), load8(py, i, ky_, m_), m_, kp, &q2, wide, sums_, cl_); \
    } while (0)
#define FAR2(i, c)                                                                             \
    do {                                                                                       \
        __mmask8 m_ = (__mmask8)((1u << (c)) - 1);                                             \
        __m512d u, v, e, w;                                                                    \
        __mmask8 f = prep2(load8(px, i, kx_, m_), load8(py, i, ky_, m_), m_, kp, &q2, wide, cl_, \
                           &u, &v, &e, &w);                                                    \
        if (f) far_terms(&a, u, v, f, kp, cl_);                                                \
    } while (0)
#define PASS2(KX, KY, SUMS, CL)                                                                \
    {                                                                                          \
        const int kx_ = KX, ky_ = KY, sums_ = SUMS, cl_ = CL, wide = KX == K_BF16 || KY == K_BF16; \
        PASS2_CHUNKS(STEP2, FAR2, a.far, a.far = 0)                                            \
    }

/* a·log(a/b), a and b of the lanes f (a = s_x·u, b = s_y·v, clamped at float32 eps if CL). */
INL void far_terms(A2 *a, __m512d u, __m512d v, __mmask8 f, const KldP *kp, int clamps) {
    __m512d p = _mm512_mul_pd(u, _mm512_set1_pd(kp->scx));
    __m512d q = _mm512_mul_pd(v, _mm512_set1_pd(kp->scy));
    if (clamps) {
        p = _mm512_max_pd(p, _mm512_set1_pd(EPS32));
        q = _mm512_max_pd(q, _mm512_set1_pd(EPS32));
    }
    p = _mm512_mask_blend_pd(f, _mm512_set1_pd(1.0), p);   /* the other lanes: log(1) */
    q = _mm512_mask_blend_pd(f, _mm512_set1_pd(1.0), q);
    v8d lr = log_ratio((v8d)p, (v8d)q);
    a->tf = _mm512_mask_add_pd(a->tf, f, a->tf, _mm512_mul_pd(p, (__m512d)lr));
    a->pf = _mm512_mask_add_pd(a->pf, f, a->pf, p);
    a->qf = _mm512_mask_add_pd(a->qf, f, a->qf, q);
}

#define KINDS2(SUMS, CL) KIND_SWITCH(PASS2, SUMS, CL)

T512 void c512_terms(int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp,
                     int sums, int clamps, Sums *o) {
    A2 a;
    a.su = a.sv = a.g = a.tf = a.pf = a.qf = _mm512_setzero_pd();
    a.far = 0;
    /* the bounds: every u with fl(s_x·u) < eps is below tu (2^-20 of margin for two roundings) */
    const P2 q2 = {kp->scx / kp->scy, EPS32 / kp->scx * (1 + 0x1p-20), EPS32 / kp->scy * (1 + 0x1p-20)};
    Py_ssize_t fars[NFAR];
    int nf = 0;
    if (clamps) KINDS2(1, 1)          /* near Σa, Σb always: the caller cannot derive them here */
    else if (sums) KINDS2(1, 0)
    else KINDS2(0, 0)
    memset(o, 0, sizeof *o);
    o->sa = kp->scx * lanes_sum(a.su);
    o->sb = kp->scy * lanes_sum(a.sv);
    o->g = kp->scy * lanes_sum(a.g);
    o->tf = lanes_sum(a.tf);
    o->pf = lanes_sum(a.pf);
    o->qf = lanes_sum(a.qf);
}

#else   /* no AVX-512 intrinsics in this build: the portable loops serve every CPU */
int c512_usable(void) { return 0; }
void c512_block(int kx, int ky, const void *px, const void *py, Py_ssize_t n, Sums *o) {
    (void)kx; (void)ky; (void)px; (void)py; (void)n; (void)o;
}
void c512_terms(int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp, int sums,
                int clamps, Sums *o) {
    (void)kx; (void)ky; (void)px; (void)py; (void)n; (void)kp; (void)sums; (void)clamps; (void)o;
}
#endif
