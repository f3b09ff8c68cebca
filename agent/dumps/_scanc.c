/* The dump scanner's block kernels: one pass over a block for every statistic the scanner
 * keeps (see scanner.py for their semantics), where numpy needs one pass per statistic.
 *
 * Plain Python C API and the buffer protocol only. Each kernel takes a block (a 1-D buffer)
 * and a per-worker state (a bytearray from state()), folds the block into the state and
 * returns True; it returns False, touching nothing, when the block is not a native-order,
 * aligned, contiguous buffer of its type, so that the caller scans that block with numpy.
 *
 * A block first takes the fast loop: float lanes for min, max, zeros and the sums of x, x*x
 * and |x| (the sign bit cleared); a NaN or Inf shows as a non-finite sum of x. Sums of
 * float32, float16 and bfloat16 values are float32 lanes folded into float64 every CHUNK
 * elements. When the block holds NaN/Inf, or a
 * float32-range block's magnitudes leave 2^-50..2^50 (float32 squares would overflow or
 * underflow), the careful loop rescans the block in float64, counting NaN and +-Inf and
 * leaving them out of the other statistics. Across chunks and blocks, sums are combined with a
 * compensated (Neumaier) float64 addition.
 *
 * Needs GNU C (gcc or clang: vector extensions); elsewhere the build skips this optional
 * module and the scanner runs on numpy. No -ffast-math: NaN semantics matter here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__GNUC__)
#error "the scan kernel needs GNU C vector extensions (gcc or clang); numpy scans instead"
#endif

#define CHUNK 1024      /* float32 lane partials are folded into float64 this often */
#define FAST_LO 0x1p-50
#define FAST_HI 0x1p50
#define F16_MAX 65504.0

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* A worker's running statistics; lives in a bytearray between calls (copied in and out). */
typedef struct {
    int64_t nan, pinf, ninf, zeros, finite, sat;
    double mn, mx;                /* min/max of finite values */
    double s, sc, q, qc, a, ac;   /* sums of x, x*x, |x|, each with its compensation term */
} state_t;

/* One block's statistics before they are folded into a state. */
typedef struct {
    int64_t nan, pinf, ninf, zeros, finite, sat;
    double mn, mx, s, sc, q, qc, a, ac;
} blk_t;

/* Neumaier summation: s + c tracks the exact sum far better than s alone. An infinite s
 * (float64 squares above ~1e154) leaves c alone: the result is s, as a float64 reference's. */
static inline void add_comp(double *s, double *c, double v) {
    double t = *s + v;
    if (isfinite(t))
        *c += fabs(*s) >= fabs(v) ? (*s - t) + v : (v - t) + *s;
    *s = t;
}

static inline double comp_value(double s, double c) { return isfinite(s) ? s + c : s; }

static void blk_init(blk_t *b) {
    memset(b, 0, sizeof *b);
    b->mn = INFINITY;
    b->mx = -INFINITY;
}

static void state_merge(state_t *st, const blk_t *b) {
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

/* -- element loaders ------------------------------------------------------------------------ */
static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float ld_f32(float v) { return v; }
static inline float ld_bf16(uint16_t w) { return f32_of_bits((uint32_t)w << 16); }

/* Exact float16 -> float32 for finite words, integer and float ops only (no float32
 * subnormals: half subnormals are their 10-bit mantissa times 2^-24). NaN/Inf words come out
 * as finite values >= 65536, which the fast loop's range check catches. */
static inline float ld_f16_fast(uint16_t w) {
    uint32_t m = w & 0x7FFFu;
    float sub = (float)(int32_t)m * 0x1p-24f;
    float nrm = f32_of_bits((m << 13) + (112u << 23));
    float v = m < 0x400u ? sub : nrm;
    return f32_of_bits(bits_of_f32(v) | ((uint32_t)(w & 0x8000u) << 16));
}

static inline double ld_f16_exact(uint16_t w) {
    uint32_t m = w & 0x7FFFu;
    if (m > 0x7C00u) return NAN;
    if (m == 0x7C00u) return (w & 0x8000u) ? -INFINITY : INFINITY;
    return ld_f16_fast(w);
}

static inline double d_f32(float v) { return v; }
static inline double d_bf16(uint16_t w) { return ld_bf16(w); }
static inline double d_f64(double v) { return v; }

/* -- careful loop: float64, NaN/Inf counted and excluded ------------------------------------ */
#define CAREFUL(NAME, T, TOD, SAT)                                                            \
    static void NAME(const T *x, Py_ssize_t n, blk_t *o) {                                    \
        blk_init(o);                                                                          \
        for (Py_ssize_t i = 0; i < n;) {                                                      \
            Py_ssize_t end = i + CHUNK < n ? i + CHUNK : n;                                   \
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

/* -- fast loop: two 64-byte vectors of lanes per step ----------------------------------------
 * GNU C vector types (gcc, clang): each target clone lowers them to its widest registers.
 * Lane min/max skip NaN (a comparison with NaN is false); pairs are reduced first, so that
 * the loop-carried chains are half as long (a NaN may then hide its pair's value: such a block
 * is rescanned anyway). No per-element NaN/Inf test: a NaN or Inf makes the block's sum NaN or
 * Inf, which the caller checks. float16 NaN/Inf words load as finite values >= 65536 instead,
 * which the caller sees in the max or min. */
#pragma GCC diagnostic ignored "-Wpsabi"  /* no function takes or returns a vector type */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef double vd __attribute__((vector_size(64)));
typedef int64_t vl __attribute__((vector_size(64)));
#define L32 16
#define L64 8
#define M32 0x7FFFFFFF            /* every bit of a float32 / float64 lane but the sign */
#define M64 0x7FFFFFFFFFFFFFFFLL

typedef struct { double s, sc, q, qc, a, ac, mn, mx; int64_t zeros; } fast_t;

/* |v| lane by lane: the sign bit cleared (M: all bits but the sign, as a lane integer) */
#define VABS(VT, IT, M, v) ((VT)((IT)(v) & (M)))

/* VLOAD2(x, v0, v1, a0, a1): the next 2*L elements into two vectors, their magnitudes into
 * two more. Lane order does not matter to the statistics: 16-bit words are read as 32-bit
 * pairs and split into the low words' vector and the high words' (one integer op each instead
 * of a widening load). float16 builds the magnitude first, so |x| costs nothing there. */
#define VL_F32(x, v0, v1, a0, a1) do { memcpy(&v0, (x), 64); memcpy(&v1, (x) + L32, 64);      \
                                       a0 = VABS(vf, vi, M32, v0); a1 = VABS(vf, vi, M32, v1); \
                                  } while (0)
#define VL_F64(x, v0, v1, a0, a1) do { memcpy(&v0, (x), 64); memcpy(&v1, (x) + L64, 64);      \
                                       a0 = VABS(vd, vl, M64, v0); a1 = VABS(vd, vl, M64, v1); \
                                  } while (0)
#define VL_BF16(x, v0, v1, a0, a1) do { vu p_; memcpy(&p_, (x), 64);                           \
                                        v0 = (vf)(p_ << 16); v1 = (vf)(p_ & 0xFFFF0000u);     \
                                        a0 = VABS(vf, vi, M32, v0); a1 = (vf)(p_ & 0x7FFF0000u); \
                                   } while (0)
#define VL_F16(x, v0, v1, a0, a1) do { vu p_; memcpy(&p_, (x), 64);                            \
                                       vu m0_ = H2F_MAG(p_ & 0x7FFFu), m1_ = H2F_MAG(p_ >> 16 & 0x7FFFu); \
                                       a0 = (vf)m0_; a1 = (vf)m1_;                            \
                                       v0 = (vf)(m0_ | ((p_ << 16) & 0x80000000u));           \
                                       v1 = (vf)(m1_ | (p_ & 0x80000000u)); } while (0)

/* ld_f16_fast's magnitude on 16 lanes, from the words without sign, as float32 bits (a
 * macro: GCC notes an ABI change on functions passing 64-byte vectors, even inlined ones) */
#define H2F_MAG(m) ({                                                                         \
    vu m_ = (m), nrm_ = (m_ << 13) + (112u << 23);                                            \
    vu sub_ = (vu)(__builtin_convertvector((vi)m_, vf) * 0x1p-24f);                           \
    vu small_ = (vu)(m_ < 0x400u);                                                            \
    (sub_ & small_) | (nrm_ & ~small_); })

/* a < b ? a : b lane by lane (C has no vector ?:); likewise for the max */
#define VMIN(VT, IT, a, b) ({ IT t_ = (a) < (b); (VT)(((IT)(a) & t_) | ((IT)(b) & ~t_)); })
#define VMAX(VT, IT, a, b) ({ IT t_ = (a) > (b); (VT)(((IT)(a) & t_) | ((IT)(b) & ~t_)); })

/* NAME(x, n, o): VT/IT vector and lane-integer types of L lanes, ET the element's float type,
 * VLOAD2 loads 2*L elements (and their magnitudes), LOAD one. */
#define FAST(NAME, T, VT, IT, ET, L, VLOAD2, LOAD)                                            \
    CLONES static void NAME(const T *x, Py_ssize_t n, fast_t *o) {                            \
        VT vmn = (VT){0} + INFINITY, vmx = (VT){0} - INFINITY;                                \
        double S = 0, Sc = 0, Q = 0, Qc = 0, A = 0, Ac = 0;                                   \
        int64_t zeros = 0;                                                                    \
        Py_ssize_t i = 0, full = n / (2 * L) * (2 * L);                                       \
        while (i < full) {                                                                    \
            Py_ssize_t end = i + CHUNK < full ? i + CHUNK : full;                             \
            VT s = {0}, q = {0}, a = {0};                                                     \
            IT z = {0};                                                                       \
            for (; i < end; i += 2 * L) {                                                     \
                VT v0, v1, a0, a1;                                                            \
                VLOAD2(x + i, v0, v1, a0, a1);                                                \
                VT lo = VMIN(VT, IT, v0, v1), hi = VMAX(VT, IT, v0, v1);                      \
                vmn = VMIN(VT, IT, lo, vmn);                                                  \
                vmx = VMAX(VT, IT, hi, vmx);                                                  \
                s += v0 + v1;                                                                 \
                q += v0 * v0 + v1 * v1;                                                       \
                a += a0 + a1;                                                                 \
                z -= (v0 == 0) + (v1 == 0);                                                   \
            }                                                                                 \
            double ds = 0, dq = 0, da = 0;                                                    \
            for (int j = 0; j < L; j++) { ds += s[j]; dq += q[j]; da += a[j]; zeros += z[j]; } \
            add_comp(&S, &Sc, ds);                                                            \
            add_comp(&Q, &Qc, dq);                                                            \
            add_comp(&A, &Ac, da);                                                            \
        }                                                                                     \
        ET mn = INFINITY, mx = -INFINITY;                                                     \
        for (int j = 0; j < L; j++) {                                                         \
            mn = vmn[j] < mn ? vmn[j] : mn;                                                   \
            mx = vmx[j] > mx ? vmx[j] : mx;                                                   \
        }                                                                                     \
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

FAST(fast_f32, float, vf, vi, float, L32, VL_F32, ld_f32)
FAST(fast_bf16, uint16_t, vf, vi, float, L32, VL_BF16, ld_bf16)
FAST(fast_f16, uint16_t, vf, vi, float, L32, VL_F16, ld_f16_fast)
FAST(fast_f64, double, vd, vl, double, L64, VL_F64, d_f64)

static void fast_to_blk(const fast_t *f, double mn, double mx, Py_ssize_t n, blk_t *o) {
    blk_init(o);
    o->finite = n; o->zeros = f->zeros;
    o->mn = mn; o->mx = mx;
    o->s = f->s; o->sc = f->sc; o->q = f->q; o->qc = f->qc; o->a = f->a; o->ac = f->ac;
}

/* -- per-type block scans (run without the GIL) --------------------------------------------- */
static inline int f32_safe(double mn, double mx) {
    double amax = -mn > mx ? -mn : mx;
    return amax == 0.0 || (amax >= FAST_LO && amax <= FAST_HI);
}

static void scan_f32(const void *p, Py_ssize_t n, blk_t *o) {
    fast_t f;
    fast_f32((const float *)p, n, &f);
    if (isfinite(f.s) && f32_safe(f.mn, f.mx)) fast_to_blk(&f, f.mn, f.mx, n, o);
    else careful_f32((const float *)p, n, o);
}

static void scan_bf16(const void *p, Py_ssize_t n, blk_t *o) {
    fast_t f;
    fast_bf16((const uint16_t *)p, n, &f);
    if (isfinite(f.s) && f32_safe(f.mn, f.mx)) fast_to_blk(&f, f.mn, f.mx, n, o);
    else careful_bf16((const uint16_t *)p, n, o);
}

static void scan_f16(const void *p, Py_ssize_t n, blk_t *o) {
    const uint16_t *w = (const uint16_t *)p;
    fast_t f;
    fast_f16(w, n, &f);
    if (f.mx > F16_MAX || f.mn < -F16_MAX) {  /* a NaN/Inf word */
        careful_f16(w, n, o);
        return;
    }
    fast_to_blk(&f, f.mn, f.mx, n, o);  /* half squares always fit float32: no range guard */
    if (f.mx == F16_MAX || f.mn == -F16_MAX)
        for (Py_ssize_t i = 0; i < n; i++) o->sat += (w[i] & 0x7FFFu) == 0x7BFFu;
}

static void scan_f64(const void *p, Py_ssize_t n, blk_t *o) {
    fast_t f;
    fast_f64((const double *)p, n, &f);
    if (isfinite(f.s)) fast_to_blk(&f, f.mn, f.mx, n, o);
    else careful_f64((const double *)p, n, o);
}

/* -- Python glue ---------------------------------------------------------------------------- */
typedef void (*scan_fn)(const void *, Py_ssize_t, blk_t *);

/* Whether ``fmt`` (a struct-module format) is one native-order item among ``codes``. */
static int format_ok(const char *fmt, const char *codes) {
    if (fmt == NULL) return 0;
    if (*fmt == '@' || *fmt == '=')
        fmt++;
#if PY_LITTLE_ENDIAN
    else if (*fmt == '<')
        fmt++;
#else
    else if (*fmt == '>')
        fmt++;
#endif
    return fmt[0] != '\0' && fmt[1] == '\0' && strchr(codes, fmt[0]) != NULL;
}

/* Whether the exported buffer is one this kernel reads directly. */
static int block_ok(const Py_buffer *b, Py_ssize_t size, const char *codes) {
    if (b->itemsize != size || b->len % size != 0 || !format_ok(b->format, codes))
        return 0;
    if ((uintptr_t)b->buf % (uintptr_t)size != 0)
        return 0;
    return PyBuffer_IsContiguous(b, 'C');
}

static PyObject *run(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t size, const char *codes,
                     scan_fn fn) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (block, state)");
        return NULL;
    }
    Py_buffer st;
    if (PyObject_GetBuffer(args[1], &st, PyBUF_WRITABLE) < 0)
        return NULL;
    if (st.len != (Py_ssize_t)sizeof(state_t)) {
        PyBuffer_Release(&st);
        PyErr_SetString(PyExc_ValueError, "state: expected a buffer from state()");
        return NULL;
    }
    Py_buffer b;
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
    state_t s;
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

static PyObject *k_f32(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 4, "f", scan_f32); }
static PyObject *k_f64(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 8, "d", scan_f64); }
static PyObject *k_f16(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 2, "eHh", scan_f16); }
static PyObject *k_bf16(PyObject *m, PyObject *const *a, Py_ssize_t n) { return run(a, n, 2, "Hh", scan_bf16); }

static void state_init(state_t *s) {
    memset(s, 0, sizeof *s);
    s->mn = INFINITY;
    s->mx = -INFINITY;
}

static PyObject *k_state(PyObject *m, PyObject *unused) {
    state_t s;
    state_init(&s);
    return PyByteArray_FromStringAndSize((const char *)&s, sizeof s);
}

static PyObject *k_take(PyObject *m, PyObject *arg) {
    Py_buffer st;
    if (PyObject_GetBuffer(arg, &st, PyBUF_WRITABLE) < 0)
        return NULL;
    if (st.len != (Py_ssize_t)sizeof(state_t)) {
        PyBuffer_Release(&st);
        PyErr_SetString(PyExc_ValueError, "state: expected a buffer from state()");
        return NULL;
    }
    state_t s, fresh;
    memcpy(&s, st.buf, sizeof s);
    state_init(&fresh);
    memcpy(st.buf, &fresh, sizeof fresh);
    PyBuffer_Release(&st);
    return Py_BuildValue("(LLLLLLddddd)", (long long)s.nan, (long long)s.pinf, (long long)s.ninf,
                         (long long)s.zeros, (long long)s.finite, (long long)s.sat, s.mn, s.mx,
                         comp_value(s.s, s.sc), comp_value(s.q, s.qc), comp_value(s.a, s.ac));
}

/* Whether the loops this CPU runs are vectorised: the AVX-512 clone is. Below it, GCC turns the
 * 512-bit lanes' comparisons into one scalar compare per lane (measured 14x slower than the
 * AVX-512 clone and slower than numpy), so kernels.py prefers numpy there unless told "c". */
static PyObject *k_fast(PyObject *self, PyObject *args) {
    (void)self; (void)args;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512f"));
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"fast", k_fast, METH_NOARGS, "fast() -> bool: the loops this CPU runs are vectorised"},
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
    PyModuleDef_HEAD_INIT, "_scanc",
    "One-pass block kernels of the dump scanner (optional; scanner.py falls back to numpy).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scanc(void) { return PyModule_Create(&module); }
