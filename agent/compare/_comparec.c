/* The compare kernel's Python module (see agent/compare/metrics.py for what each number means
 * and agent/compare/blocks_c.py for how blocks reach here): argument checking, the choice
 * between the portable loops (_comparec_loops.c) and the AVX-512 ones (_comparec512.c), and
 * the entry points, each of which releases the GIL around its loops.
 *
 * numpy needs one pass per operation over a block (~30 of them for a differing block); these
 * loops read each element pair once and keep every partial sum in registers. Inputs are
 * float32, float16 or bfloat16 words (kind 0, 1, 2), contiguous, native order and aligned:
 * anything else is refused with ValueError and the caller keeps numpy. A block holding
 * NaN/Inf gives None: the caller's numpy path applies the NaN/Inf policy.
 */
#include "_comparec.h"

/* -- argument checking --------------------------------------------------------------------------- */

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
        && (kind == K_F32 ? f[0] == 'f' : (kind == K_F16 ? f[0] == 'e' : (f[0] == 'H' || f[0] == 'e')));
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
    cmp_range(v.buf, n, kind, &lo, &hi);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    return Py_BuildValue("dd", lo, hi);
}

/* Which loops block() and terms() take: ISA_512 (_comparec512.c), ISA_256 (_comparec256.c,
 * the same bits) or the portable ones; the fastest the CPU has at load time, isa()/set_isa()
 * for the tests, which run every set. */
enum { ISA_PORTABLE, ISA_256, ISA_512 };
static int isa = ISA_PORTABLE;
static const char *const ISA_NAMES[] = {"portable", "avx2", "avx512"};

static int usable(int which) {
    return which == ISA_PORTABLE || (which == ISA_256 && c256_usable()) || (which == ISA_512 && c512_usable());
}

static void run_block(int kx, int ky, const void *px, const void *py, Py_ssize_t n, Sums *s) {
    if (isa == ISA_512) c512_block(kx, ky, px, py, n, s);
    else if (isa == ISA_256) c256_block(kx, ky, px, py, n, s);
    else cmp_block(0, kx, ky, px, py, n, NULL, s);
}

static void run_terms(int kx, int ky, const void *px, const void *py, Py_ssize_t n, const KldP *kp,
                      int sums, int clamps, Sums *s) {
    if (isa == ISA_512) c512_terms(kx, ky, px, py, n, kp, sums, clamps, s);
    else if (isa == ISA_256) c256_terms(kx, ky, px, py, n, kp, sums, clamps, s);
    else cmp_terms(clamps, kx, ky, px, py, n, kp, s);
}

static PyObject *py_isa(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(ISA_NAMES[isa]);
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int k = 0; k < 3; k++) {
        if (strcmp(name, ISA_NAMES[k]) == 0 && usable(k)) {
            isa = k;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "isa %R: not one of isas() on this CPU and build", PyTuple_GET_ITEM(args, 0));
    return NULL;
}

/* Whether the loops this CPU runs are vectorised: the AVX-512 and AVX2 ones are. Below that,
 * GCC turns the portable loops' comparisons of 512-bit lanes into one scalar compare per lane
 * (measured 10x slower than their AVX-512 clone, and slower than numpy), so kernels.py prefers
 * numpy there unless told "c". */
static PyObject *py_fast(PyObject *self, PyObject *args) {
    return PyBool_FromLong(c512_usable() || c256_usable());
}

static PyObject *py_isas(PyObject *self, PyObject *args) {
    PyObject *out = PyList_New(0);
    for (int k = 2; out && k >= 0; k--) {
        if (!usable(k)) continue;
        PyObject *name = PyUnicode_FromString(ISA_NAMES[k]);
        if (!name || PyList_Append(out, name) < 0) Py_CLEAR(out);
        Py_XDECREF(name);
    }
    if (!out) return NULL;
    PyObject *t = PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
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
    if (kld == 0) run_block(kx, ky, vx.buf, vy.buf, n, &s);
    else cmp_block(kld, kx, ky, vx.buf, vy.buf, n, &kp, &s);
    finite = isfinite(s.sx) && isfinite(s.sy);   /* any NaN/Inf makes a float64 sum non-finite */
    if (finite && want_first && s.differ) fd = cmp_first_diff(vx.buf, vy.buf, n, kx, ky);
    if (finite && s.mad > mad_floor) mi = cmp_first_at(vx.buf, vy.buf, n, kx, ky, s.mad);
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
    int kx, ky, clamps = 1, sums = 1;
    KldP kp;
    if (!PyArg_ParseTuple(args, "OOiiO!|p", &ox, &oy, &kx, &ky, &PyTuple_Type, &okld, &sums)) return NULL;
    if (!PyArg_ParseTuple(okld, "dddd|p", &kp.shx, &kp.scx, &kp.shy, &kp.scy, &clamps)) return NULL;
    Py_buffer vx, vy;
    Py_ssize_t n = get_pair(ox, oy, kx, ky, &vx, &vy);
    if (n < 0) return NULL;
    Sums s;
    Py_BEGIN_ALLOW_THREADS
    run_terms(kx, ky, vx.buf, vy.buf, n, &kp, sums, clamps, &s);
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
    eq = cmp_same_sums(vx.buf, vy.buf, n, kind, &s, &q);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vx);
    PyBuffer_Release(&vy);
    if (!eq) Py_RETURN_NONE;
    return Py_BuildValue("(dd)", s, q);
}

/* -- every block of a tensor in one call ---------------------------------------------------------
 * The two passes of blocks_c.two_pass over whole tensors (C-contiguous, aligned): the same
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
        if (check_same && kx == ky) eq = cmp_same_sums(bx, by, m, kx, &ss, &sq);
        if (!eq) {
            run_block(kx, ky, bx, by, m, &s);
            finite = isfinite(s.sx) && isfinite(s.sy);
            if (finite && want_first && s.differ) fd = cmp_first_diff(bx, by, m, kx, ky);
            if (finite && s.mad > mad_floor) mi = cmp_first_at(bx, by, m, kx, ky, s.mad);
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
            run_terms(kx, ky, bx, by, m, &kp, (f & 4) != 0, clamps, &s);
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
    {"range", py_range, METH_VARARGS,
     "range(words, kind) -> (min, max) of a block's float32 values, NaN/Inf counted as 0"},
    {"block", py_block, METH_VARARGS,
     "block(x, y, kx, ky, want_first, mad_floor, kld) -> every partial of a differing block, or None on NaN/Inf"},
    {"terms", py_terms, METH_VARARGS,
     "terms(x, y, kx, ky, kld, sums=True) -> KLD's near (sum a, sum b, G) and far (sum a log(a/b), sum a, sum b) of a finite block, or None"},
    {"same", py_same, METH_VARARGS,
     "same(x, y, kind) -> (sum, sum of squares) when the bytes are equal, else None"},
    {"isa", py_isa, METH_NOARGS, "isa() -> 'avx512' or 'portable': the loops block() and terms() run"},
    {"fast", py_fast, METH_NOARGS, "fast() -> bool: the loops this CPU runs are vectorised"},
    {"isas", py_isas, METH_NOARGS, "isas() -> the isa names this CPU and build can run, fastest first"},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa(name): run block() and terms() on those loops"},
    {"blocks", py_blocks, METH_VARARGS,
     "blocks(x, y, kx, ky, nb, check_same, want_first, mad_floor) -> pass 1 of every block (list)"},
    {"terms_blocks", py_terms_blocks, METH_VARARGS,
     "terms_blocks(x, y, kx, ky, nb, (shx, scx, shy, scy), flags) -> pass 2 of every block (list), or None"},
    {"log_ratio", py_log_ratio, METH_VARARGS, "log_ratio(p, q): the kernel's log(p/q) (for its accuracy test)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_comparec",
                                    "One-pass block kernels of the dump comparison.", -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__comparec(void) {
    isa = c512_usable() ? ISA_512 : c256_usable() ? ISA_256 : ISA_PORTABLE;
    return PyModule_Create(&MODULE);
}
