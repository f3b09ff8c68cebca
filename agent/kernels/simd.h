/* What the kernels' loops (scan.c, compare.c) share: vector types of the native width and the
 * few primitives that differ per instruction set.
 *
 * Each loop source is written once and compiled once per variant (setup.py): -DVW=64 with
 * -march=x86-64-v4 (AVX-512), -DVW=32 with -march=x86-64-v3 (AVX2), -DVW=16 for the baseline
 * (SSE2 on x86-64, NEON on aarch64). VW is the width in bytes of the GNU C vectors the loops use,
 * the vector unit's own, so that every operation, comparisons included, is one instruction.
 * Results do not depend on VW: the loops keep 64 bytes of lanes per step (a "logical vector",
 * NV native vectors), do the same operations in every lane and reduce the lanes in one fixed
 * order; -ffp-contract=off keeps the compiler from fusing multiply-adds in some variants only.
 * KERNEL_VARIANT names the variant: its entry points carry it as a suffix (KV()).
 */
#ifndef PRECISION_AGENT_SIMD_H
#define PRECISION_AGENT_SIMD_H
#ifdef KERNEL_MODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(__GNUC__)
#error "the kernels need GNU C vector extensions (gcc or clang); numpy runs instead"
#endif
#pragma GCC diagnostic ignored "-Wpsabi"   /* vectors passed between inlined helpers only */

#ifndef VW
#define VW 16
#endif
#ifndef KERNEL_VARIANT
#define KERNEL_VARIANT base
#endif
#define KV_(n, v) n##_##v
#define KV2(n, v) KV_(n, v)
#define KV(n) KV2(n, KERNEL_VARIANT)

#define NV (64 / VW)                          /* native vectors per 64-byte logical vector */
#define LF (VW / 4)                           /* float32 lanes of a native vector */
#define LD (VW / 8)                           /* float64 lanes */
#define EACH(k) _Pragma("GCC unroll 8") for (int k = 0; k < NV; k++)
#define INL static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VW)));
typedef int32_t vi __attribute__((vector_size(VW)));
typedef uint32_t vu __attribute__((vector_size(VW)));
typedef double vd __attribute__((vector_size(VW)));
typedef int64_t vl __attribute__((vector_size(VW)));
typedef float vh __attribute__((vector_size(VW / 2)));      /* the float32 values of a vd */
typedef int32_t vhi __attribute__((vector_size(VW / 2)));
typedef uint32_t vhu __attribute__((vector_size(VW / 2)));
typedef uint16_t vw __attribute__((vector_size(VW / 4)));   /* the 16-bit words of a vd */

/* m ? a : b lane by lane (C has no vector ?:), m a comparison's result */
#define SEL(m, a, b) ((__typeof__(a))(((m) & (__typeof__(m))(a)) | (~(m) & (__typeof__(m))(b))))

/* a < b ? a : b and a > b ? a : b lane by lane: a NaN in a gives b, as does a tie (0.0 against
 * -0.0 too). x86's min/max instructions are exactly that; elsewhere a compare and a select
 * (aarch64's fmin/fmax would order -0.0 below 0.0 and propagate NaN: not the same bits). */
#if defined(__x86_64__)
#include <immintrin.h>
#if VW == 64 && defined(__AVX512F__)
#define MM_F(op) _mm512_##op##_ps
#define MM_D(op) _mm512_##op##_pd
#define MM_H(op) _mm256_##op##_ps
#define MM_TF __m512
#define MM_TD __m512d
#define MM_TH __m256
#elif VW == 32 && defined(__AVX2__)
#define MM_F(op) _mm256_##op##_ps
#define MM_D(op) _mm256_##op##_pd
#define MM_H(op) _mm_##op##_ps
#define MM_TF __m256
#define MM_TD __m256d
#define MM_TH __m128
#endif
#endif
#ifdef MM_F
#define PRIM(name, T, MT, MM, op) INL T name(T a, T b) { return (T)MM(op)((MT)a, (MT)b); }
PRIM(vmin_f, vf, MM_TF, MM_F, min) PRIM(vmax_f, vf, MM_TF, MM_F, max)
PRIM(vmin_d, vd, MM_TD, MM_D, min) PRIM(vmax_d, vd, MM_TD, MM_D, max)
PRIM(vmin_h, vh, MM_TH, MM_H, min) PRIM(vmax_h, vh, MM_TH, MM_H, max)
#else
#define PRIM(name, T, OP) INL T name(T a, T b) { return SEL(a OP b, a, b); }
PRIM(vmin_f, vf, <) PRIM(vmax_f, vf, >) PRIM(vmin_d, vd, <) PRIM(vmax_d, vd, >)
PRIM(vmin_h, vh, <) PRIM(vmax_h, vh, >)
#endif

/* -- words to values (scalar) ---------------------------------------------------------------- */
INL float f_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
INL uint32_t u_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INL float bf16_value(uint16_t w) { return f_bits((uint32_t)w << 16); }

/* IEEE half to float: the exponent/mantissa bits moved into a float's field and rebiased by a
 * multiply with 2^112 (exact, and right for subnormals too); Inf/NaN words map to Inf/NaN. */
INL float half_value(uint16_t h) {
    uint32_t em = h & 0x7fffu, sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t bits = em >= 0x7c00u ? (0x7f800000u | (em << 13)) : u_bits(f_bits(em << 13) * 0x1p112f);
    return f_bits(bits | sign);
}

#ifdef KERNEL_MODULE
/* -- the module's choice of variant (made at import; tests may force another) ---------------------
 * setup.py defines KERNEL_X86_VARIANTS where it also built the x86-64-v4 and -v3 loops. */
#if defined(KERNEL_X86_VARIANTS)
static const char *const VARIANT_NAMES[] = {"avx512", "avx2", "baseline"};
#define N_VARIANTS 3
#define VARIANT_TABLE(T, NAME) extern const T NAME##_v4, NAME##_v3; \
    static const T *const OPS[] = {&NAME##_v4, &NAME##_v3, &NAME##_base};
static int usable(int v) {   /* the CPU (and OS) run variant v: x86-64-v4, -v3, baseline */
    __builtin_cpu_init();
    int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")
          && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("movbe");
    int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
          && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    return v == 2 || (v == 1 && v3) || (v == 0 && v4);
}
#else
#if defined(__aarch64__)
static const char *const VARIANT_NAMES[] = {"neon"};
#else
static const char *const VARIANT_NAMES[] = {"baseline"};
#endif
#define N_VARIANTS 1
#define VARIANT_TABLE(T, NAME) static const T *const OPS[] = {&NAME##_base};
static int usable(int v) { return v == 0; }
#endif

static int cur;   /* index of the variant that runs */

static int best_variant(void) {
    int v = 0;
    while (!usable(v)) v++;
    return v;
}

static PyObject *py_variants(PyObject *self, PyObject *args) {
    PyObject *out = PyTuple_New(0);
    for (int v = 0; out && v < N_VARIANTS; v++) {
        if (!usable(v)) continue;
        PyObject *name = PyUnicode_FromString(VARIANT_NAMES[v]);
        Py_ssize_t k = PyTuple_GET_SIZE(out);
        if (!name || _PyTuple_Resize(&out, k + 1) < 0) { Py_XDECREF(name); Py_CLEAR(out); break; }
        PyTuple_SET_ITEM(out, k, name);
    }
    return out;
}

static PyObject *py_variant(PyObject *self, PyObject *args) { return PyUnicode_FromString(VARIANT_NAMES[cur]); }

static PyObject *py_set_variant(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    for (int v = 0; v < N_VARIANTS; v++)
        if (strcmp(name, VARIANT_NAMES[v]) == 0 && usable(v)) {
            cur = v;
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_ValueError, "variant %R: not one of variants() on this CPU and build", arg);
    return NULL;
}

#define VARIANT_METHODS                                                                        \
    {"variants", py_variants, METH_NOARGS, "variants() -> the loop variants this CPU runs, best first"}, \
    {"variant", py_variant, METH_NOARGS, "variant() -> the variant in use"},                   \
    {"set_variant", py_set_variant, METH_O, "set_variant(name): use that variant (tests, bench)"},

/* Whether ``fmt`` (a struct-module format) is one native-order item among ``codes``. */
static int format_ok(const char *fmt, const char *codes) {
    if (fmt == NULL) return 0;
#if PY_LITTLE_ENDIAN
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
#else
    if (*fmt == '@' || *fmt == '=' || *fmt == '>' || *fmt == '!') fmt++;
#endif
    return fmt[0] != '\0' && fmt[1] == '\0' && strchr(codes, fmt[0]) != NULL;
}
#endif
#endif
