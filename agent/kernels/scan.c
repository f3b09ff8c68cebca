/* The dump scanner's block kernels: one pass over a block for every statistic the scanner
 * keeps (see dumps/scanner.py for their semantics), where numpy needs one pass per statistic.
 *
 * Built twice over (setup.py): the loops once per variant (simd.h: vector width VW, entry points
 * suffixed by KERNEL_VARIANT), and with -DKERNEL_MODULE the Python module, which holds the
 * baseline loops too and picks the best variant the CPU runs at import. Plain Python C API and
 * the buffer protocol. Each kernel takes a block (a 1-D buffer) and a per-worker state (a
 * bytearray from state()), folds the block into the state and returns True; it returns False,
 * touching nothing, when the block is not a native-order, aligned, contiguous buffer of its
 * type, so that the caller scans that block with numpy.
 *
 * A block first takes the fast loop: float lanes for min, max, zeros and the sums of x, x*x
 * and |x| (the sign bit cleared); a NaN or Inf shows as a non-finite sum of x. Sums of
 * float32, float16 and bfloat16 values are float32 lanes folded into float64 every CHUNK
 * elements. When the block holds NaN/Inf, or a float32-range block's magnitudes leave
 * 2^-50..2^50 (float32 squares would overflow or underflow), the careful loop rescans the block
 * in float64, counting NaN and +-Inf and leaving them out of the other statistics. Across chunks
 * and blocks, sums are combined with a compensated (Neumaier) float64 addition. No -ffast-math:
 * NaN semantics matter here.
 */
#include "simd.h"

#define CHUNK 1024      /* float32 lane partials are folded into float64 this often */
#define FAST_LO 0x1p-50
#define FAST_HI 0x1p50
#define F16_MAX 65504.0

/* One block's statistics (and, in the module, a worker's running ones: the same fields). */
typedef struct {
    int64_t nan, pinf, ninf, zeros, finite, sat;
    double mn, mx;                /* min/max of finite values */
    double s, sc, q, qc, a, ac;   /* sums of x, x*x, |x|, each with its compensation term */
} blk_t;

/* The loops of one variant: fold n elements at p into a fresh blk_t. */
typedef struct {
    void (*f32)(const void *, ptrdiff_t, blk_t *);
    void (*f64)(const void *, ptrdiff_t, blk_t *);
    void (*f16)(const void *, ptrdiff_t, blk_t *);
    void (*bf16)(const void *, ptrdiff_t, blk_t *);
} scan_ops;

/* Neumaier summation: s + c tracks the exact sum far better than s alone. An infinite s
 * (float64 squares above ~1e154) leaves c alone: the result is s, as a float64 reference's. */
static inline void add_comp(double *s, double *c, double v) {
    double t = *s + v;
    if (isfinite(t))
        *c += fabs(*s) >= fabs(v) ? (*s - t) + v : (v - t) + *s;
    *s = t;
}

static void blk_init(blk_t *b) {
    memset(b, 0, sizeof *b);
    b->mn = INFINITY;
    b->mx = -INFINITY;
}

/* Exact float16 -> float32 for finite words, integer and float ops only (no float32
 * subnormals: half subnormals are their 10-bit mantissa times 2^-24). NaN/Inf words come out
 * as finite values >= 65536, which the fast loop's range check catches. */
static inline float ld_f16_fast(uint16_t w) {
    uint32_t m = w & 0x7FFFu;
    float sub = (float)(int32_t)m * 0x1p-24f;
    float nrm = f_bits((m << 13) + (112u << 23));
    float v = m < 0x400u ? sub : nrm;
    return f_bits(u_bits(v) | ((uint32_t)(w & 0x8000u) << 16));
}

static inline double ld_f16_exact(uint16_t w) { return half_value(w); }
static inline float ld_f32(float v) { return v; }
static inline double d_f32(float v) { return v; }
static inline double d_bf16(uint16_t w) { return bf16_value(w); }
static inline double d_f64(double v) { return v; }

/* -- careful loop: float64, NaN/Inf counted and excluded ------------------------------------ */
#define CAREFUL(NAME, T, TOD, SAT)                                                            \
    static void NAME(const T *x, ptrdiff_t n, blk_t *o) {                                     \
        blk_init(o);                                                                          \
        for (ptrdiff_t i = 0; i < n;) {                                                       \
            ptrdiff_t end = i + CHUNK < n ? i + CHUNK : n;                                    \
            double s = 0, q = 0, a = 0;                                                       \
            for (; i < end; i++) {                                                            \
                double v = TOD(x[i]);                                                         \
                if (v != v) { o->nan++; continue; }                                           \
                if (v == INFINITY) { o->pinf++; continue; }                                   \
                if (v == -INFINITY) { o->ninf++; continue; }                                  \
                o->finite++;                                                                  \
                if (v < o->mn) o->mn = v;                                                     \
                if (v > o->mx) o->mx = v;                                                     \
                o->zeros += v == 0.0;                                                         \
                if (SAT) o->sat += fabs(v) >= F16_MAX;                                        \
                s += v;                                                                       \
                q += v * v;                                                                   \
                a += fabs(v);                                                                 \
            }                                                                                 \
            add_comp(&o->s, &o->sc, s);                                                       \
            add_comp(&o->q, &o->qc, q);                                                       \
            add_comp(&o->a, &o->ac, a);                                                       \
        }                                                                                     \
    }

CAREFUL(careful_f32, float, d_f32, 0)
CAREFUL(careful_f64, double, d_f64, 0)
CAREFUL(careful_bf16, uint16_t, d_bf16, 0)
CAREFUL(careful_f16, uint16_t, ld_f16_exact, 1)

/* -- fast loop: two 64-byte logical vectors per step -----------------------------------------
 * Logical lane j of the step's first vector is element i + j, of its second i + STEP + j; lane
 * j sits in native vector j / L at position j % L. Lane min/max skip NaN (a comparison with NaN
 * is false); pairs are reduced first, so that the loop-carried chains are half as long (a NaN
 * may then hide its pair's value: such a block is rescanned anyway). No per-element NaN/Inf
 * test: a NaN or Inf makes the block's sum NaN or Inf, which the caller checks. float16 NaN/Inf
 * words load as finite values >= 65536 instead, which the caller sees in the max or min. */
#define M32 0x7FFFFFFF            /* every bit of a float32 / float64 lane but the sign */
#define M64 0x7FFFFFFFFFFFFFFFLL

typedef struct { double s, sc, q, qc, a, ac, mn, mx; int64_t zeros; } fast_t;

#define VABS(VT, IT, M, v) ((VT)((IT)(v) & (M)))

/* VLOAD2(x, k, v0, v1, a0, a1): native vector k of the step's two logical vectors, and their
 * magnitudes. 16-bit words are read as 32-bit pairs (64 bytes of words: one logical vector)
 * and split into the low words' vector and the high words'. */
#define VL_F32(x, k, v0, v1, a0, a1) do { memcpy(&v0, (x) + (k) * LF, VW); memcpy(&v1, (x) + 16 + (k) * LF, VW); \
                                          a0 = VABS(vf, vi, M32, v0); a1 = VABS(vf, vi, M32, v1); } while (0)
#define VL_F64(x, k, v0, v1, a0, a1) do { memcpy(&v0, (x) + (k) * LD, VW); memcpy(&v1, (x) + 8 + (k) * LD, VW); \
                                          a0 = VABS(vd, vl, M64, v0); a1 = VABS(vd, vl, M64, v1); } while (0)
#define VL_BF16(x, k, v0, v1, a0, a1) do { vu p_; memcpy(&p_, (x) + (k) * 2 * LF, VW);                  \
                                           v0 = (vf)(p_ << 16); v1 = (vf)(p_ & 0xFFFF0000u);             \
                                           a0 = VABS(vf, vi, M32, v0); a1 = (vf)(p_ & 0x7FFF0000u); } while (0)
#define VL_F16(x, k, v0, v1, a0, a1) do { vu p_; memcpy(&p_, (x) + (k) * 2 * LF, VW);                   \
                                          vu m0_ = h2f_mag(p_ & 0x7FFFu), m1_ = h2f_mag(p_ >> 16 & 0x7FFFu); \
                                          a0 = (vf)m0_; a1 = (vf)m1_;                                    \
                                          v0 = (vf)(m0_ | ((p_ << 16) & 0x80000000u));                   \
                                          v1 = (vf)(m1_ | (p_ & 0x80000000u)); } while (0)

/* ld_f16_fast's magnitude lane by lane, from the words without sign, as float32 bits */
INL vu h2f_mag(vu m) {
    vu nrm = (m << 13) + (112u << 23);
    vu sub = (vu)(__builtin_convertvector((vi)m, vf) * 0x1p-24f);
    vu small = (vu)(m < 0x400u);
    return (sub & small) | (nrm & ~small);
}

/* NAME(x, n, o): VT/IT native vector and lane-integer types, ET the element's float type, STEP
 * the lanes of a logical vector, VLOAD2 loads a native vector of the step's two, LOAD one. */
#define FAST(NAME, T, VT, IT, ET, STEP, VMIN, VMAX, VLOAD2, LOAD)                             \
    static void NAME(const T *x, ptrdiff_t n, fast_t *o) {                                    \
        enum { L = STEP / NV };                                                               \
        VT vmn[NV], vmx[NV];                                                                  \
        EACH(k) { vmn[k] = (VT){0} + INFINITY; vmx[k] = (VT){0} - INFINITY; }                 \
        double S = 0, Sc = 0, Q = 0, Qc = 0, A = 0, Ac = 0;                                   \
        int64_t zeros = 0;                                                                    \
        ptrdiff_t i = 0, full = n / (2 * STEP) * (2 * STEP);                                  \
        while (i < full) {                                                                    \
            ptrdiff_t end = i + CHUNK < full ? i + CHUNK : full;                              \
            VT s[NV], q[NV], a[NV];                                                           \
            IT z[NV];                                                                         \
            EACH(k) { s[k] = q[k] = a[k] = (VT){0}; z[k] = (IT){0}; }                         \
            for (; i < end; i += 2 * STEP) {                                                  \
                EACH(k) {                                                                     \
                    VT v0, v1, a0, a1;                                                        \
                    VLOAD2(x + i, k, v0, v1, a0, a1);                                         \
                    vmn[k] = VMIN(VMIN(v0, v1), vmn[k]);                                      \
                    vmx[k] = VMAX(VMAX(v0, v1), vmx[k]);                                      \
                    s[k] += v0 + v1;                                                          \
                    q[k] += v0 * v0 + v1 * v1;                                                \
                    a[k] += a0 + a1;                                                          \
                    z[k] -= (v0 == 0) + (v1 == 0);                                            \
                }                                                                             \
            }                                                                                 \
            double ds = 0, dq = 0, da = 0;                                                    \
            for (int k = 0; k < NV; k++)                                                      \
                for (int j = 0; j < L; j++) { ds += s[k][j]; dq += q[k][j]; da += a[k][j]; zeros += z[k][j]; } \
            add_comp(&S, &Sc, ds);                                                            \
            add_comp(&Q, &Qc, dq);                                                            \
            add_comp(&A, &Ac, da);                                                            \
        }                                                                                     \
        ET mn = INFINITY, mx = -INFINITY;                                                     \
        for (int k = 0; k < NV; k++)                                                          \
            for (int j = 0; j < L; j++) {                                                     \
                mn = vmn[k][j] < mn ? vmn[k][j] : mn;                                         \
                mx = vmx[k][j] > mx ? vmx[k][j] : mx;                                         \
            }                                                                                 \
        double ts = 0, tq = 0, ta = 0;                                                        \
        for (; i < n; i++) {                                                                  \
            ET v = LOAD(x[i]);                                                                \
            mn = v < mn ? v : mn;                                                             \
            mx = v > mx ? v : mx;                                                             \
            ts += v;                                                                          \
            tq += (double)v * v;                                                              \
            ta += fabs((double)v);                                                            \
            zeros += v == 0;                                                                  \
        }                                                                                     \
        add_comp(&S, &Sc, ts);                                                                \
        add_comp(&Q, &Qc, tq);                                                                \
        add_comp(&A, &Ac, ta);                                                                \
        o->s = S; o->sc = Sc; o->q = Q; o->qc = Qc; o->a = A; o->ac = Ac;                     \
        o->mn = mn; o->mx = mx; o->zeros = zeros;                                             \
    }

FAST(fast_f32, float, vf, vi, float, 16, vmin_f, vmax_f, VL_F32, ld_f32)
FAST(fast_bf16, uint16_t, vf, vi, float, 16, vmin_f, vmax_f, VL_BF16, bf16_value)
FAST(fast_f16, uint16_t, vf, vi, float, 16, vmin_f, vmax_f, VL_F16, ld_f16_fast)
FAST(fast_f64, double, vd, vl, double, 8, vmin_d, vmax_d, VL_F64, d_f64)

static void fast_to_blk(const fast_t *f, ptrdiff_t n, blk_t *o) {
    blk_init(o);
    o->finite = n; o->zeros = f->zeros;
    o->mn = f->mn; o->mx = f->mx;
    o->s = f->s; o->sc = f->sc; o->q = f->q; o->qc = f->qc; o->a = f->a; o->ac = f->ac;
}

/* -- per-type block scans (the module runs them without the GIL) ----------------------------- */
static inline int f32_safe(double mn, double mx) {
    double amax = -mn > mx ? -mn : mx;
    return amax == 0.0 || (amax >= FAST_LO && amax <= FAST_HI);
}

static void scan_f32(const void *p, ptrdiff_t n, blk_t *o) {
    fast_t f;
    fast_f32((const float *)p, n, &f);
    if (isfinite(f.s) && f32_safe(f.mn, f.mx)) fast_to_blk(&f, n, o);
    else careful_f32((const float *)p, n, o);
}

static void scan_bf16(const void *p, ptrdiff_t n, blk_t *o) {
    fast_t f;
    fast_bf16((const uint16_t *)p, n, &f);
    if (isfinite(f.s) && f32_safe(f.mn, f.mx)) fast_to_blk(&f, n, o);
    else careful_bf16((const uint16_t *)p, n, o);
}

static void scan_f16(const void *p, ptrdiff_t n, blk_t *o) {
    const uint16_t *w = (const uint16_t *)p;
    fast_t f;
    fast_f16(w, n, &f);
    if (f.mx > F16_MAX || f.mn < -F16_MAX) {  /* a NaN/Inf word */
        careful_f16(w, n, o);
        return;
    }
    fast_to_blk(&f, n, o);  /* half squares always fit float32: no range guard */
    if (f.mx == F16_MAX || f.mn == -F16_MAX)
        for (ptrdiff_t i = 0; i < n; i++) o->sat += (w[i] & 0x7FFFu) == 0x7BFFu;
}

static void scan_f64(const void *p, ptrdiff_t n, blk_t *o) {
    fast_t f;
    fast_f64((const double *)p, n, &f);
    if (isfinite(f.s)) fast_to_blk(&f, n, o);
    else careful_f64((const double *)p, n, o);
}

const scan_ops KV(SCAN_OPS) = {scan_f32, scan_f64, scan_f16, scan_bf16};

#ifdef KERNEL_MODULE
/* -- Python glue ---------------------------------------------------------------------------- */
VARIANT_TABLE(scan_ops, SCAN_OPS)

static inline double comp_value(double s, double c) { return isfinite(s) ? s + c : s; }

static void state_merge(blk_t *st, const blk_t *b) {
    st->nan += b->nan; st->pinf += b->pinf; st->ninf += b->ninf;
    st->zeros += b->zeros; st->finite += b->finite; st->sat += b->sat;
    if (b->finite) {
        if (b->mn < st->mn) st->mn = b->mn;
        if (b->mx > st->mx) st->mx = b->mx;
    }
    add_comp(&st->s, &st->sc, b->s);
    st->sc += b->sc;
    add_comp(&st->q, &st->qc, b->q);
    st->qc += b->qc;
    add_comp(&st->a, &st->ac, b->a);
    st->ac += b->ac;
}

/* Whether the exported buffer is one this kernel reads directly. */
static int block_ok(const Py_buffer *b, Py_ssize_t size, const char *codes) {
    if (b->itemsize != size || b->len % size != 0 || !format_ok(b->format, codes))
        return 0;
    if ((uintptr_t)b->buf % (uintptr_t)size != 0)
        return 0;
    return PyBuffer_IsContiguous(b, 'C');
}

static int get_state(PyObject *obj, Py_buffer *st) {
    if (PyObject_GetBuffer(obj, st, PyBUF_WRITABLE) < 0)
        return -1;
    if (st->len != (Py_ssize_t)sizeof(blk_t)) {
        PyBuffer_Release(st);
        PyErr_SetString(PyExc_ValueError, "state: expected a buffer from state()");
        return -1;
    }
    return 0;
}

typedef void (*scan_fn)(const void *, ptrdiff_t, blk_t *);

static PyObject *run(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t size, const char *codes, int which) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (block, state)");
        return NULL;
    }
    Py_buffer st, b;
    if (get_state(args[1], &st) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyErr_Clear();  /* not a buffer we can read: the caller's numpy path takes it */
        PyBuffer_Release(&st);
        Py_RETURN_FALSE;
    }
    if (!block_ok(&b, size, codes)) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&st);
        Py_RETURN_FALSE;
    }
    const scan_ops *ops = OPS[cur];
    scan_fn fn = which == 0 ? ops->f32 : which == 1 ? ops->f64 : which == 2 ? ops->f16 : ops->bf16;
    blk_t s;
    memcpy(&s, st.buf, sizeof s);
    Py_ssize_t n = b.len / size;
    if (n > 0) {
        blk_t o;
        Py_BEGIN_ALLOW_THREADS
        fn(b.buf, n, &o);
        state_merge(&s, &o);
        Py_END_ALLOW_THREADS
    }
    memcpy(st.buf, &s, sizeof s);
    PyBuffer_Release(&b);
    PyBuffer_Release(&st);
    Py_RETURN_TRUE;
}

static PyObject *k_f32(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 4, "f", 0); }
static PyObject *k_f64(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 8, "d", 1); }
static PyObject *k_f16(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 2, "eHh", 2); }
static PyObject *k_bf16(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 2, "Hh", 3); }

static PyObject *k_state(PyObject *m, PyObject *unused) {
    blk_t s;
    blk_init(&s);
    return PyByteArray_FromStringAndSize((const char *)&s, sizeof s);
}

static PyObject *k_take(PyObject *m, PyObject *arg) {
    Py_buffer st;
    if (get_state(arg, &st) < 0)
        return NULL;
    blk_t s, fresh;
    memcpy(&s, st.buf, sizeof s);
    blk_init(&fresh);
    memcpy(st.buf, &fresh, sizeof fresh);
    PyBuffer_Release(&st);
    return Py_BuildValue("(LLLLLLddddd)", (long long)s.nan, (long long)s.pinf, (long long)s.ninf,
                         (long long)s.zeros, (long long)s.finite, (long long)s.sat, s.mn, s.mx,
                         comp_value(s.s, s.sc), comp_value(s.q, s.qc), comp_value(s.a, s.ac));
}

static PyMethodDef methods[] = {
    VARIANT_METHODS
    {"f32", (PyCFunction)(void (*)(void))k_f32, METH_FASTCALL,
     "f32(block, state) -> bool: fold a float32 block into state; False: not readable here"},
    {"f64", (PyCFunction)(void (*)(void))k_f64, METH_FASTCALL, "f64(block, state) -> bool: float64"},
    {"f16", (PyCFunction)(void (*)(void))k_f16, METH_FASTCALL,
     "f16(block, state) -> bool: float16 (or its raw 16-bit words)"},
    {"bf16", (PyCFunction)(void (*)(void))k_bf16, METH_FASTCALL,
     "bf16(block, state) -> bool: raw bfloat16 words (uint16/int16)"},
    {"state", k_state, METH_NOARGS, "state() -> bytearray: a fresh per-worker state"},
    {"take", k_take, METH_O,
     "take(state) -> (nan, pinf, ninf, zeros, finite, sat, min, max, sum, sumsq, sumabs); resets state"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_scan",
    "One-pass block kernels of the dump scanner (optional; the scanner falls back to numpy).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) {
    cur = best_variant();
    return PyModule_Create(&module);
}
#endif
