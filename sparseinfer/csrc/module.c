/* sparseinfer._cpu: thin CPython binding (METH_FASTCALL, data pointers passed as ints).
 *
 * The Python wrapper (sparseinfer/kernels/cpu.py) owns dtype/shape/contiguity checks; this
 * layer checks what it can see (formats, sizes, null pointers, row ids in range) and raises
 * ValueError rather than crashing.  A weight is passed as 8 ints: fmt, rows, cols, qs, d, m
 * (d/m = 0 for None), qs row stride in bytes, d/m row stride in elements (0 = natural).  The GIL is released while kernels run. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ops.h"
#include "pool.h"

static int get_i64(PyObject *o, int64_t *v) {
    long long x = PyLong_AsLongLong(o);
    if (x == -1 && PyErr_Occurred()) return -1;
    *v = (int64_t)x;
    return 0;
}

static int get_ptr(PyObject *o, void **p) {
    void *x = PyLong_AsVoidPtr(o);
    if (!x && PyErr_Occurred()) return -1;
    *p = x;
    return 0;
}

static int nargs_ok(Py_ssize_t n, Py_ssize_t want, const char *fn) {
    if (n != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, n);
        return 0;
    }
    return 1;
}

/* args[0..7] = (fmt, rows, cols, qs, d, m, qs_stride, d_stride, qs row stride in bytes, d/m row stride in
 * elements; strides 0 = natural) -> qmat; accepts fmt == -1 as "no weight" when allow_none */
static int get_qmat(PyObject *const *a, qmat_t *w, int allow_none, int *is_none) {
    int64_t fmt, rows, cols, qst, dst;
    void *qs, *d, *m;
    if (get_i64(a[0], &fmt) || get_i64(a[1], &rows) || get_i64(a[2], &cols) || get_ptr(a[3], &qs) ||
        get_ptr(a[4], &d) || get_ptr(a[5], &m) || get_i64(a[6], &qst) || get_i64(a[7], &dst))
        return -1;
    if (is_none) *is_none = 0;
    if (allow_none && fmt == -1) {
        *is_none = 1;
        return 0;
    }
    if (si_qmat_init(w, (int)fmt, rows, cols, qs, d, m, qst, dst) != 0) {
        PyErr_Format(PyExc_ValueError, "invalid weight descriptor (fmt=%lld rows=%lld cols=%lld strides %lld/%lld, "
                     "missing scales or strides below the row width?)", (long long)fmt, (long long)rows,
                     (long long)cols, (long long)qst, (long long)dst);
        return -1;
    }
    return 0;
}

/* the column-sparse kernels (axpy over neuron-major rows) take f32/f16/bf16/q8/q4 */
static int axpy_fmt_ok(const qmat_t *w, const char *what) {
    if (w->fmt != FMT_Q6) return 1;
    PyErr_Format(PyExc_ValueError, "%s: q6 weights have no column-sparse (axpy) kernel; store the neuron-major "
                 "matrix as q8 (from_float(w.dequantize(), \"q8\"))", what);
    return 0;
}

static int check_rows(const int32_t *rows, int64_t n, int64_t limit) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "row id %d at position %lld is out of range [0, %lld)", rows[i],
                         (long long)i, (long long)limit);
            return -1;
        }
    return 0;
}

/* gemv(w[8], x, y); w[8] = the weight descriptor of get_qmat */
static PyObject *py_gemv(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    qmat_t w;
    void *x, *y;
    if (!nargs_ok(n, 10, "gemv") || get_qmat(a, &w, 0, NULL) || get_ptr(a[8], &x) || get_ptr(a[9], &y)) return NULL;
    if (w.rows == 0) Py_RETURN_NONE;
    if (!x || !y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_gemv(&w, x, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* matmul(w[8], X, M, Y) */
static PyObject *py_matmul(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    qmat_t w;
    void *x, *y;
    int64_t M;
    if (!nargs_ok(n, 11, "matmul") || get_qmat(a, &w, 0, NULL) || get_ptr(a[8], &x) || get_i64(a[9], &M) ||
        get_ptr(a[10], &y))
        return NULL;
    if (M < 0) return PyErr_Format(PyExc_ValueError, "M must be >= 0");
    if (M == 0 || w.rows == 0) Py_RETURN_NONE;
    if (!x || !y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    if (M == 1) si_gemv(&w, x, y);
    else si_matmul(&w, x, M, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gemv_rows(w[8], x, idx, n, y) */
static PyObject *py_gemv_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t w;
    void *x, *idx, *y;
    int64_t n;
    if (!nargs_ok(na, 12, "gemv_rows") || get_qmat(a, &w, 0, NULL) || get_ptr(a[8], &x) || get_ptr(a[9], &idx) ||
        get_i64(a[10], &n) || get_ptr(a[11], &y))
        return NULL;
    if (n <= 0) Py_RETURN_NONE;
    if (!x || !idx || !y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (check_rows(idx, n, w.rows)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    si_gemv_rows(&w, x, idx, n, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* axpy_rows(w[8], h, idx, n, y) */
static PyObject *py_axpy_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t w;
    void *h, *idx, *y;
    int64_t n;
    if (!nargs_ok(na, 12, "axpy_rows") || get_qmat(a, &w, 0, NULL) || get_ptr(a[8], &h) || get_ptr(a[9], &idx) ||
        get_i64(a[10], &n) || get_ptr(a[11], &y))
        return NULL;
    if (!y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (!axpy_fmt_ok(&w, "axpy_rows")) return NULL;
    if (n > 0 && (!h || !idx)) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (n > 0 && check_rows(idx, n, w.rows)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    si_axpy_rows(&w, h, idx, n < 0 ? 0 : n, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* sparse_ffn(act, gate[8] (fmt -1 = none), up[8], down_t[8], x, idx, n, y) */
static PyObject *py_sparse_ffn(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t g, u, dn;
    int64_t act, n;
    int gnone;
    void *x, *idx, *y;
    if (!nargs_ok(na, 29, "sparse_ffn") || get_i64(a[0], &act) || get_qmat(a + 1, &g, 1, &gnone) ||
        get_qmat(a + 9, &u, 0, NULL) || get_qmat(a + 17, &dn, 0, NULL) || get_ptr(a[25], &x) ||
        get_ptr(a[26], &idx) || get_i64(a[27], &n) || get_ptr(a[28], &y))
        return NULL;
    if (act < 0 || act >= ACT_COUNT) return PyErr_Format(PyExc_ValueError, "unknown activation code %lld", (long long)act);
    if (!gnone && (g.rows != u.rows || g.cols != u.cols))
        return PyErr_Format(PyExc_ValueError, "gate and up shapes differ");
    if (!axpy_fmt_ok(&dn, "sparse_ffn down_t")) return NULL;
    if (dn.rows != u.rows) return PyErr_Format(PyExc_ValueError, "down_t must have one row per neuron (%lld), has %lld",
                                               (long long)u.rows, (long long)dn.rows);
    if (!x || !y || (n > 0 && !idx)) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (n > 0 && check_rows(idx, n, u.rows)) return NULL;
    if (n <= 0) {
        memset(y, 0, (size_t)dn.cols * sizeof(float));
        Py_RETURN_NONE;
    }
    Py_BEGIN_ALLOW_THREADS
    si_sparse_ffn((int)act, gnone ? NULL : &g, &u, &dn, x, idx, n, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* quantize(layout, x, K, q, d, s): test helper, the activation quantizer of the current level */
static PyObject *py_quantize(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    int64_t layout, K;
    void *x, *q, *d, *s;
    if (!nargs_ok(na, 6, "quantize") || get_i64(a[0], &layout) || get_ptr(a[1], &x) || get_i64(a[2], &K) ||
        get_ptr(a[3], &q) || get_ptr(a[4], &d) || get_ptr(a[5], &s))
        return NULL;
    if (K <= 0 || !x || !q || !d || !s || (layout != XL_NATURAL && layout != XL_Q4))
        return PyErr_Format(PyExc_ValueError, "bad quantize arguments");
    si_quantize((int)layout, x, K, q, d, s);
    Py_RETURN_NONE;
}

/* read_seconds(ptr, nbytes, reps) -> seconds for `reps` full parallel passes */
static PyObject *py_read_seconds(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p;
    int64_t nbytes, reps;
    double sec;
    if (!nargs_ok(na, 3, "read_seconds") || get_ptr(a[0], &p) || get_i64(a[1], &nbytes) || get_i64(a[2], &reps))
        return NULL;
    if (!p || nbytes <= 0 || reps <= 0) return PyErr_Format(PyExc_ValueError, "bad read_seconds arguments");
    Py_BEGIN_ALLOW_THREADS
    sec = si_read_seconds(p, nbytes, (int)reps);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(sec);
}

/* read_rows_seconds(ptr, row_bytes, idx, n, reps, prefetch) -> seconds (rows must be in range;
 * prefetch: 1 = whole rows 8 ahead in software, 0 = none, the hardware prefetchers only,
 * 2 = eight rows at a time, line by line across them) */
static PyObject *py_read_rows_seconds(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p, *idx;
    int64_t row_bytes, n, reps, pf;
    double sec;
    if (!nargs_ok(na, 6, "read_rows_seconds") || get_ptr(a[0], &p) || get_i64(a[1], &row_bytes) ||
        get_ptr(a[2], &idx) || get_i64(a[3], &n) || get_i64(a[4], &reps) || get_i64(a[5], &pf))
        return NULL;
    if (!p || !idx || row_bytes <= 0 || n <= 0 || reps <= 0) return PyErr_Format(PyExc_ValueError, "bad read_rows_seconds arguments");
    Py_BEGIN_ALLOW_THREADS
    sec = si_read_rows_seconds(p, row_bytes, idx, n, (int)reps, pf == 2 ? 2 : pf != 0);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(sec);
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v < 1) return PyErr_Format(PyExc_ValueError, "number of threads must be >= 1, got %ld", v);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = si_pool_set_threads((int)v);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_Format(PyExc_RuntimeError, "could not start %ld threads", v);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) { return PyLong_FromLong(si_pool_get_threads()); }

static PyObject *py_set_spin_us(PyObject *self, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    si_pool_set_spin_us((int)v);
    Py_RETURN_NONE;
}

static PyObject *py_simd_level(PyObject *self, PyObject *unused) { return PyUnicode_FromString(si_level()); }

static PyObject *py_set_simd_level(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    int rc = si_select(name);
    if (rc == -1) return PyErr_Format(PyExc_ValueError, "unknown SIMD level %R", arg);
    if (rc == -2) return PyErr_Format(PyExc_ValueError, "SIMD level %R is not supported by this CPU", arg);
    Py_RETURN_NONE;
}

static PyObject *py_act_mode(PyObject *self, PyObject *unused) { return PyLong_FromLong(si_act_mode()); }

static PyObject *py_set_act_mode(PyObject *self, PyObject *arg) {
    long mode = PyLong_AsLong(arg);
    if (mode == -1 && PyErr_Occurred()) return NULL;
    if (mode < ACT_INT8 || mode > ACT_PRECISE) return PyErr_Format(PyExc_ValueError, "activation mode must be 0 or 1 (got %ld)", mode);
    si_set_act_mode((int)mode);
    Py_RETURN_NONE;
}

static PyObject *py_supported_levels(PyObject *self, PyObject *unused) {
    PyObject *l = PyList_New(0);
    if (!l) return NULL;
    for (int i = 0; si_level_names[i]; i++)
        if (si_level_supported(si_level_names[i])) {
            PyObject *s = PyUnicode_FromString(si_level_names[i]);
            if (!s || PyList_Append(l, s)) {
                Py_XDECREF(s);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(s);
        }
    return l;
}

/* advise_hugepages(ptr, nbytes) -> bytes advised: ask for transparent huge pages on the
 * 2 MB-aligned interior of a buffer (before it is first written, so faults map 2 MB pages).
 * Random-row sparse reads otherwise pay a TLB miss per row and scale array. */
static PyObject *py_advise_hugepages(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p;
    int64_t nbytes;
    if (!nargs_ok(na, 2, "advise_hugepages") || get_ptr(a[0], &p) || get_i64(a[1], &nbytes)) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = 2u << 20;
    uintptr_t b = ((uintptr_t)p + huge - 1) & ~(huge - 1), e = ((uintptr_t)p + (uintptr_t)nbytes) & ~(huge - 1);
    if (p && nbytes > 0 && e > b && madvise((void *)b, e - b, MADV_HUGEPAGE) == 0) return PyLong_FromLongLong((long long)(e - b));
#endif
    return PyLong_FromLong(0);
}

/* dequantize_rows(w[8], r0, r1, out): out = W[r0:r1] as float32 */
static PyObject *py_dequantize_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t w;
    int64_t r0, r1;
    void *out;
    if (!nargs_ok(na, 11, "dequantize_rows") || get_qmat(a, &w, 0, NULL) || get_i64(a[8], &r0) ||
        get_i64(a[9], &r1) || get_ptr(a[10], &out))
        return NULL;
    if (r0 < 0 || r1 > w.rows || r0 > r1)
        return PyErr_Format(PyExc_ValueError, "row range [%lld, %lld) is outside [0, %lld)", (long long)r0,
                            (long long)r1, (long long)w.rows);
    if (r0 == r1 || w.cols == 0) Py_RETURN_NONE;
    if (!out) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_dequantize_rows(&w, r0, r1, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* act(code, v, n): v[i] = act(v[i]) in place (float32) */
static PyObject *py_act(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *v;
    int64_t code, n;
    if (!nargs_ok(na, 3, "act") || get_i64(a[0], &code) || get_ptr(a[1], &v) || get_i64(a[2], &n)) return NULL;
    if (code < 0 || code >= ACT_COUNT) return PyErr_Format(PyExc_ValueError, "unknown activation code %lld", (long long)code);
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0");
    if (n == 0) Py_RETURN_NONE;
    if (!v) return PyErr_Format(PyExc_ValueError, "null data pointer");
    si_act((int)code, v, n);
    Py_RETURN_NONE;
}

static int get_f32(PyObject *o, float *v);

/* hidden_rows(act, relu_up, g, g_stride, u, u_stride, M, n, thr, order, out): see ops.c
 * (u 0: plain FFN; order 0: no permutation); g is overwritten */
static PyObject *py_hidden_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *g, *u, *order, *out;
    int64_t act, relu_up, gs, us, M, n;
    float thr;
    if (!nargs_ok(na, 11, "hidden_rows") || get_i64(a[0], &act) || get_i64(a[1], &relu_up) || get_ptr(a[2], &g) ||
        get_i64(a[3], &gs) || get_ptr(a[4], &u) || get_i64(a[5], &us) || get_i64(a[6], &M) || get_i64(a[7], &n) ||
        get_f32(a[8], &thr) || get_ptr(a[9], &order) || get_ptr(a[10], &out))
        return NULL;
    if (act < 0 || act >= ACT_COUNT) return PyErr_Format(PyExc_ValueError, "unknown activation code %lld", (long long)act);
    if (M < 0 || n < 0 || gs < n || (u && us < n)) return PyErr_Format(PyExc_ValueError, "bad shapes or strides");
    if (M == 0 || n == 0) Py_RETURN_NONE;
    if (!g || !out) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_hidden_rows((int)act, relu_up != 0, g, gs, u, us, M, n, thr, order, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm(x, w, y, rows, n, eps): y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, float32 */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *x, *w, *y;
    int64_t rows, n;
    if (!nargs_ok(na, 6, "rms_norm") || get_ptr(a[0], &x) || get_ptr(a[1], &w) || get_ptr(a[2], &y) ||
        get_i64(a[3], &rows) || get_i64(a[4], &n))
        return NULL;
    double eps = PyFloat_AsDouble(a[5]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    if (rows < 0 || n < 0) return PyErr_Format(PyExc_ValueError, "rows and n must be >= 0");
    if (rows == 0 || n == 0) Py_RETURN_NONE;
    if (!x || !w || !y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    si_rms_norm(x, w, y, rows, n, (float)eps);  /* microseconds: keeping the GIL is cheaper than releasing it */
    Py_RETURN_NONE;
}

/* attend1(q, k, v, o, H, Hk, D, L, kstride, vstride, scale): single-token attention, see ops.c */
static PyObject *py_attend1(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *q, *k, *v, *o;
    int64_t H, Hk, D, L, ks, vs;
    if (!nargs_ok(na, 11, "attend1") || get_ptr(a[0], &q) || get_ptr(a[1], &k) || get_ptr(a[2], &v) ||
        get_ptr(a[3], &o) || get_i64(a[4], &H) || get_i64(a[5], &Hk) || get_i64(a[6], &D) || get_i64(a[7], &L) ||
        get_i64(a[8], &ks) || get_i64(a[9], &vs))
        return NULL;
    double scale = PyFloat_AsDouble(a[10]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    if (H < 1 || Hk < 1 || H % Hk || D < 1 || L < 1 || (Hk > 1 && (ks < L * D || vs < L * D)))
        return PyErr_Format(PyExc_ValueError, "attend1: bad shape");
    if (!q || !k || !v || !o) return PyErr_Format(PyExc_ValueError, "null data pointer");
    si_attend1(q, k, v, o, H, Hk, D, L, ks, vs, (float)scale);  /* tens of microseconds: keep the GIL */
    Py_RETURN_NONE;
}

static int get_f32(PyObject *o, float *v) {
    double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    *v = (float)d;
    return 0;
}

/* decode_attn(x, xo, n, norm_w, eps, q[8], k[8], v[8], bq, bk, bv, H, Hk, D, n_rot, cos, sin, kc, vc,
 *             kstride, vstride, pos, o[8], o_bias, scale): one token through a pre-norm
 * attention half-block, see decode.c.  k and v fmt -1: q is the fused q/k/v weight (bq its
 * bias); bias pointers may be 0; n_rot 0 = no rotary. */
static PyObject *py_decode_attn(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t q, k, v, o;
    int knone, vnone;
    void *x, *xo, *nw, *bq, *bk, *bv, *cs, *sn, *kc, *vc, *ob;
    int64_t n, H, Hk, D, nrot, ks, vs, pos;
    float eps, scale;
    if (!nargs_ok(na, 53, "decode_attn") || get_ptr(a[0], &x) || get_ptr(a[1], &xo) || get_i64(a[2], &n) ||
        get_ptr(a[3], &nw) || get_f32(a[4], &eps) || get_qmat(a + 5, &q, 0, NULL) || get_qmat(a + 13, &k, 1, &knone) ||
        get_qmat(a + 21, &v, 1, &vnone) || get_ptr(a[29], &bq) || get_ptr(a[30], &bk) || get_ptr(a[31], &bv) ||
        get_i64(a[32], &H) || get_i64(a[33], &Hk) || get_i64(a[34], &D) || get_i64(a[35], &nrot) ||
        get_ptr(a[36], &cs) || get_ptr(a[37], &sn) || get_ptr(a[38], &kc) || get_ptr(a[39], &vc) ||
        get_i64(a[40], &ks) || get_i64(a[41], &vs) || get_i64(a[42], &pos) || get_qmat(a + 43, &o, 0, NULL) ||
        get_ptr(a[51], &ob) || get_f32(a[52], &scale))
        return NULL;
    int bad = n < 1 || H < 1 || Hk < 1 || H % Hk || D < 1 || pos < 0 || nrot < 0 || nrot > D || nrot % 2 ||
              knone != vnone || q.cols != n || o.cols != H * D || o.rows != n ||
              (Hk > 1 && (ks < (pos + 1) * D || vs < (pos + 1) * D));
    if (knone) bad |= q.rows != (H + 2 * Hk) * D || bk || bv;
    else bad |= q.rows != H * D || k.rows != Hk * D || v.rows != Hk * D || k.cols != n || v.cols != n;
    if (bad) return PyErr_Format(PyExc_ValueError, "decode_attn: inconsistent shapes");
    if (!x || !xo || !nw || !kc || !vc || (nrot && (!cs || !sn))) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_decode_attn(x, xo, n, nw, eps, &q, knone ? NULL : &k, vnone ? NULL : &v, bq, bk, bv, H, Hk, D, nrot, cs, sn, kc,
                   vc, ks, vs, pos, &o, ob, scale);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* decode_mlp(x, xo, n, norm_w, eps, act, relu_up, gate[8], up[8], F, down[8]): one token through
 * a pre-norm gated MLP half-block, see decode.c; up fmt -1: gate is the fused gate/up weight */
static PyObject *py_decode_mlp(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t g, u, dn;
    int unone;
    void *x, *xo, *nw;
    int64_t n, act, relu_up, F;
    float eps;
    if (!nargs_ok(na, 32, "decode_mlp") || get_ptr(a[0], &x) || get_ptr(a[1], &xo) || get_i64(a[2], &n) ||
        get_ptr(a[3], &nw) || get_f32(a[4], &eps) || get_i64(a[5], &act) || get_i64(a[6], &relu_up) ||
        get_qmat(a + 7, &g, 0, NULL) || get_qmat(a + 15, &u, 1, &unone) || get_i64(a[23], &F) ||
        get_qmat(a + 24, &dn, 0, NULL))
        return NULL;
    if (act < 0 || act >= ACT_COUNT) return PyErr_Format(PyExc_ValueError, "unknown activation code %lld", (long long)act);
    int bad = n < 1 || F < 1 || g.cols != n || dn.cols != F || dn.rows != n;
    bad |= unone ? g.rows != 2 * F : (g.rows != F || u.rows != F || u.cols != n);
    if (bad) return PyErr_Format(PyExc_ValueError, "decode_mlp: inconsistent shapes");
    if (!x || !xo || !nw) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_decode_mlp(x, xo, n, nw, eps, (int)act, relu_up != 0, &g, unone ? NULL : &u, F, &dn);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* decode_sparse_mlp(x, xo, norm_w, eps, rows, n_rows, n, act, relu_up, fused, F, first[8],
 *                   first_bias, second[8], second_bias, down_t[8], down[8], order, down_bias,
 *                   w1[8], b1, w2t[8], cut, topk, threshold, crossover, up_crossover, counters):
 * one token through an activation-sparse FFN, see decode.c.  norm_w 0: xo = ffn(x), else
 * xo = x + ffn(rms_norm(x)); rows 0 with n_rows -1: predicted (w1 given) or all rows;
 * second fmt -1: plain FFN; w1 fmt -1: no predictor; fused: 1 the one-pass kernel on
 * candidate rows, | 2 gate and up are one weight's adjacent rows (dense gate+up in one pass),
 * | 4 first/second/down_t are neuron records (one pass over whole records, see ops.c);
 * counters: int64[11], the last slot the predictor's seconds as a float64. */
static PyObject *py_decode_sparse_mlp(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t first, second, down_t, down, w1, w2t;
    int snone, pnone, pnone2;
    void *x, *xo, *nw, *rows, *fb, *sb, *order, *db, *b1, *cut, *cnt, *ps;
    int64_t nrows, n, act, relu_up, fused, F, topk;
    float eps, thr, cross, upcross;
    if (!nargs_ok(na, 70, "decode_sparse_mlp") || get_ptr(a[0], &x) || get_ptr(a[1], &xo) || get_ptr(a[2], &nw) ||
        get_f32(a[3], &eps) || get_ptr(a[4], &rows) || get_i64(a[5], &nrows) || get_i64(a[6], &n) ||
        get_i64(a[7], &act) || get_i64(a[8], &relu_up) || get_i64(a[9], &fused) || get_i64(a[10], &F) ||
        get_qmat(a + 11, &first, 0, NULL) || get_ptr(a[19], &fb) || get_qmat(a + 20, &second, 1, &snone) ||
        get_ptr(a[28], &sb) || get_qmat(a + 29, &down_t, 0, NULL) || get_qmat(a + 37, &down, 0, NULL) ||
        get_ptr(a[45], &order) || get_ptr(a[46], &db) || get_qmat(a + 47, &w1, 1, &pnone) || get_ptr(a[55], &b1) ||
        get_qmat(a + 56, &w2t, 1, &pnone2) || get_ptr(a[64], &cut) || get_i64(a[65], &topk) ||
        get_f32(a[66], &thr) || get_f32(a[67], &cross) || get_f32(a[68], &upcross) || get_ptr(a[69], &cnt))
        return NULL;
    if (act < 0 || act >= ACT_COUNT) return PyErr_Format(PyExc_ValueError, "unknown activation code %lld", (long long)act);
    int bad = n < 1 || F < 1 || first.rows != F || first.cols != n || down_t.rows != F || down_t.cols != n ||
              down.rows != n || down.cols != F || pnone != pnone2 || nrows < -1 || (nrows > 0 && !rows);
    if (!snone) bad |= second.rows != F || second.cols != n;
    if (!pnone) bad |= w1.cols != n || w2t.rows != w1.rows || w2t.cols != F || !b1 || !cut;
    if (bad) return PyErr_Format(PyExc_ValueError, "decode_sparse_mlp: inconsistent shapes");
    if (!axpy_fmt_ok(&down_t, "decode_sparse_mlp down_t") || (!pnone && !axpy_fmt_ok(&w2t, "decode_sparse_mlp predictor w2t")))
        return NULL;
    if (!x || !xo || !order || !cnt) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (nrows > 0 && check_rows(rows, nrows, F)) return NULL;
    /* fused bit 1: gate and up are adjacent row blocks of one weight (SparseFFN's views of its
     * fused gate+up), so the dense first projection covers both in one pass */
    qmat_t both;
    if (fused & 2) {
        const int64_t ds = first.ds;
        if (snone || second.fmt != first.fmt || second.row_bytes != first.row_bytes || second.ds != ds ||
            second.qs != first.qs + F * first.row_bytes ||
            (first.d && second.d != first.d + F * ds) || (first.m && second.m != first.m + F * ds) ||
            (!first.d) != (!second.d) || (!first.m) != (!second.m) ||
            si_qmat_init(&both, first.fmt, 2 * F, n, first.qs, first.d, first.m, first.row_bytes, ds) != 0)
            return PyErr_Format(PyExc_ValueError, "decode_sparse_mlp: gate and up are not one fused weight");
    }
    /* fused bit 2: first, second and down_t are row views into one record per neuron */
    const uint8_t *rec = (fused & 4) ? si_record_base(&first, snone ? NULL : &second, &down_t) : NULL;
    if ((fused & 4) && !rec)
        return PyErr_Format(PyExc_ValueError, "decode_sparse_mlp: first, second and down_t are not neuron records "
                            "(one common row stride holding all three rows and their scales)");
    ps = (double *)cnt + 10; /* counters: 10 int64, then the predictor's seconds as a float64 */
    sparse_mlp_t s = {(int)act, relu_up != 0, (fused & 1) != 0, rec, F, &first, snone ? NULL : &second,
                      (fused & 2) ? &both : NULL, fb, sb, &down_t, &down,
                      order, db, pnone ? NULL : &w1, pnone ? NULL : &w2t, b1, cut, topk, thr, cross, upcross, cnt, ps};
    Py_BEGIN_ALLOW_THREADS
    si_decode_sparse_mlp(x, xo, n, nw, eps, &s, nrows >= 0 ? rows : NULL, nrows);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* repack_q4_k(src, nsuper, qs, d, m) / repack_q6_k(src, nsuper, qs, d): see repack.c */
static PyObject *py_repack_q4_k(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *src, *qs, *d, *m;
    int64_t ns;
    if (!nargs_ok(na, 5, "repack_q4_k") || get_ptr(a[0], &src) || get_i64(a[1], &ns) || get_ptr(a[2], &qs) ||
        get_ptr(a[3], &d) || get_ptr(a[4], &m))
        return NULL;
    if (ns < 0 || (ns > 0 && (!src || !qs || !d || !m))) return PyErr_Format(PyExc_ValueError, "repack_q4_k: bad arguments");
    Py_BEGIN_ALLOW_THREADS
    si_repack_q4_k(src, ns, qs, d, m);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_repack_q6_k(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *src, *qs, *d;
    int64_t ns;
    if (!nargs_ok(na, 4, "repack_q6_k") || get_ptr(a[0], &src) || get_i64(a[1], &ns) || get_ptr(a[2], &qs) ||
        get_ptr(a[3], &d))
        return NULL;
    if (ns < 0 || (ns > 0 && (!src || !qs || !d))) return PyErr_Format(PyExc_ValueError, "repack_q6_k: bad arguments");
    Py_BEGIN_ALLOW_THREADS
    si_repack_q6_k(src, ns, qs, d);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_noop(PyObject *self, PyObject *const *a, Py_ssize_t na) { Py_RETURN_NONE; }

static PyMethodDef methods[] = {
    {"gemv", (PyCFunction)(void (*)(void))py_gemv, METH_FASTCALL, "gemv(fmt, rows, cols, qs, d, m, qs_stride, d_stride, x, y)"},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "matmul(fmt, rows, cols, qs, d, m, qs_stride, d_stride, X, M, Y)"},
    {"gemv_rows", (PyCFunction)(void (*)(void))py_gemv_rows, METH_FASTCALL, "gemv_rows(fmt, rows, cols, qs, d, m, qs_stride, d_stride, x, idx, n, y)"},
    {"axpy_rows", (PyCFunction)(void (*)(void))py_axpy_rows, METH_FASTCALL, "axpy_rows(fmt, rows, cols, qs, d, m, qs_stride, d_stride, h, idx, n, y)"},
    {"sparse_ffn", (PyCFunction)(void (*)(void))py_sparse_ffn, METH_FASTCALL, "sparse_ffn(act, gate*8, up*8, down_t*8, x, idx, n, y)"},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL, "quantize(layout, x, K, q, d, s)"},
    {"read_seconds", (PyCFunction)(void (*)(void))py_read_seconds, METH_FASTCALL, "read_seconds(ptr, nbytes, reps)"},
    {"read_rows_seconds", (PyCFunction)(void (*)(void))py_read_rows_seconds, METH_FASTCALL, "read_rows_seconds(ptr, row_bytes, idx, n, reps, prefetch)"},
    {"advise_hugepages", (PyCFunction)(void (*)(void))py_advise_hugepages, METH_FASTCALL, "advise_hugepages(ptr, nbytes) -> bytes advised"},
    {"dequantize_rows", (PyCFunction)(void (*)(void))py_dequantize_rows, METH_FASTCALL, "dequantize_rows(fmt, rows, cols, qs, d, m, qs_stride, d_stride, r0, r1, out)"},
    {"act", (PyCFunction)(void (*)(void))py_act, METH_FASTCALL, "act(code, v, n): v = act(v) in place"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, "rms_norm(x, w, y, rows, n, eps)"},
    {"hidden_rows", (PyCFunction)(void (*)(void))py_hidden_rows, METH_FASTCALL, "hidden_rows(act, relu_up, g, g_stride, u, u_stride, M, n, thr, order, out)"},
    {"attend1", (PyCFunction)(void (*)(void))py_attend1, METH_FASTCALL, "attend1(q, k, v, o, H, Hk, D, L, kstride, vstride, scale)"},
    {"decode_attn", (PyCFunction)(void (*)(void))py_decode_attn, METH_FASTCALL, "decode_attn(x, xo, n, norm_w, eps, q*8, k*8, v*8, bq, bk, bv, H, Hk, D, n_rot, cos, sin, kc, vc, kstride, vstride, pos, o*8, o_bias, scale)"},
    {"decode_mlp", (PyCFunction)(void (*)(void))py_decode_mlp, METH_FASTCALL, "decode_mlp(x, xo, n, norm_w, eps, act, relu_up, gate*8, up*8, F, down*8)"},
    {"decode_sparse_mlp", (PyCFunction)(void (*)(void))py_decode_sparse_mlp, METH_FASTCALL, "decode_sparse_mlp(x, xo, norm_w, eps, rows, n_rows, n, act, relu_up, fused, F, first*8, first_bias, second*8, second_bias, down_t*8, down*8, order, down_bias, w1*8, b1, w2t*8, cut, topk, threshold, crossover, up_crossover, counters)"},
    {"repack_q4_k", (PyCFunction)(void (*)(void))py_repack_q4_k, METH_FASTCALL, "repack_q4_k(src, nsuper, qs, d, m)"},
    {"repack_q6_k", (PyCFunction)(void (*)(void))py_repack_q6_k, METH_FASTCALL, "repack_q6_k(src, nsuper, qs, d)"},
    {"noop", (PyCFunction)(void (*)(void))py_noop, METH_FASTCALL, "call-overhead baseline"},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n)"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "get_num_threads()"},
    {"set_spin_us", py_set_spin_us, METH_O, "set_spin_us(us): how long idle workers spin before sleeping"},
    {"simd_level", py_simd_level, METH_NOARGS, "simd_level()"},
    {"set_simd_level", py_set_simd_level, METH_O, "set_simd_level(name): testing; one of supported_levels()"},
    {"act_mode", py_act_mode, METH_NOARGS, "act_mode(): 0 one int8 term per block of 32 (default), 1 two terms"},
    {"set_act_mode", py_set_act_mode, METH_O, "set_act_mode(mode): see act_mode"},
    {"supported_levels", py_supported_levels, METH_NOARGS, "supported_levels()"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_cpu", "sparseinfer CPU kernels (C, SIMD)", -1, methods};

PyMODINIT_FUNC PyInit__cpu(void) {
    PyObject *mod = PyModule_Create(&moddef);
    if (!mod) return NULL;
    PyModule_AddIntConstant(mod, "FMT_F32", FMT_F32);
    PyModule_AddIntConstant(mod, "FMT_F16", FMT_F16);
    PyModule_AddIntConstant(mod, "FMT_BF16", FMT_BF16);
    PyModule_AddIntConstant(mod, "FMT_Q8", FMT_Q8);
    PyModule_AddIntConstant(mod, "FMT_Q4", FMT_Q4);
    PyModule_AddIntConstant(mod, "FMT_Q6", FMT_Q6);
    PyModule_AddIntConstant(mod, "XL_NATURAL", XL_NATURAL);
    PyModule_AddIntConstant(mod, "XL_Q4", XL_Q4);
    PyModule_AddIntConstant(mod, "ACT_INT8", ACT_INT8);
    PyModule_AddIntConstant(mod, "ACT_PRECISE", ACT_PRECISE);
    PyModule_AddIntConstant(mod, "ACT_SILU", ACT_SILU);
    PyModule_AddIntConstant(mod, "ACT_RELU", ACT_RELU);
    PyModule_AddIntConstant(mod, "ACT_GELU", ACT_GELU);
    PyModule_AddIntConstant(mod, "ACT_GELU_TANH", ACT_GELU_TANH);
    return mod;
}
