/* sparseinfer._cpu: thin CPython binding (METH_FASTCALL, data pointers passed as ints).
 *
 * The Python wrapper (sparseinfer/kernels/cpu.py) owns dtype/shape/contiguity checks; this
 * layer checks what it can see (formats, sizes, null pointers, row ids in range) and raises
 * ValueError rather than crashing.  A weight is passed as the address of a qmat_t (ops.h /
 * common.h) that sparseinfer/kernels/cpu.py fills field by field (fmt, rows, cols, qs, d, m,
 * qs row stride in bytes and d/m row stride in elements, 0 = natural); every call copies it
 * and completes the copy through si_qmat_init, which checks it.  A decode plan is passed as
 * the address of its struct, checked once by check_attn_plan / check_ffn_plan.  The GIL is
 * released while kernels run. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <stddef.h>

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

/* a weight: the address of a qmat_t (0 = none, accepted when allow_none), copied to *w and
 * completed by si_qmat_init (derived sizes recomputed, strides checked against the row width) */
static int get_qmat(PyObject *o, qmat_t *w, int allow_none, int *is_none) {
    void *p;
    if (get_ptr(o, &p)) return -1;
    if (is_none) *is_none = 0;
    if (!p) {
        if (allow_none) {
            *is_none = 1;
            return 0;
        }
        PyErr_SetString(PyExc_ValueError, "null weight descriptor");
        return -1;
    }
    const qmat_t *src = p;
    if (si_qmat_init(w, src->fmt, src->rows, src->cols, src->qs, src->d, src->m, src->row_bytes, src->ds) != 0) {
        PyErr_Format(PyExc_ValueError, "invalid weight descriptor (fmt=%d rows=%lld cols=%lld strides %lld/%lld, "
                     "missing scales or strides below the row width?)", src->fmt, (long long)src->rows,
                     (long long)src->cols, (long long)src->row_bytes, (long long)src->ds);
        return -1;
    }
    return 0;
}

/* row-tiled (tq4, tq6, tq4k) weights are read only whole (gemv, matmul): row lists need row-major rows */
static int rows_fmt_ok(const qmat_t *w, const char *what) {
    if (!si_fmt_tiled(w->fmt)) return 1;
    PyErr_Format(PyExc_ValueError, "%s: row-tiled (tq4, tq6, tq4k) weights have no row-sparse kernels; use the row-major "
                 "weight (quant.from_tiles(w))", what);
    return 0;
}

/* the column-sparse kernels (axpy over neuron-major rows) take f32/f16/bf16/q8/q4 */
static int axpy_fmt_ok(const qmat_t *w, const char *what) {
    if (!rows_fmt_ok(w, what)) return 0;
    if (w->fmt != FMT_Q6 && w->fmt != FMT_Q4K) return 1;
    PyErr_Format(PyExc_ValueError, "%s: %s weights have no column-sparse (axpy) kernel; store the neuron-major "
                 "matrix as q8 (from_float(w.dequantize(), \"q8\"))", what, w->fmt == FMT_Q6 ? "q6" : "q4k");
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

/* gemv(w, x, y); w: a weight descriptor address (get_qmat) */
static PyObject *py_gemv(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    qmat_t w;
    void *x, *y;
    if (!nargs_ok(n, 3, "gemv") || get_qmat(a[0], &w, 0, NULL) || get_ptr(a[1], &x) || get_ptr(a[2], &y)) return NULL;
    if (w.rows == 0) Py_RETURN_NONE;
    if (!x || !y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_gemv(&w, x, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* matmul(w, X, M, Y) */
static PyObject *py_matmul(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    qmat_t w;
    void *x, *y;
    int64_t M;
    if (!nargs_ok(n, 4, "matmul") || get_qmat(a[0], &w, 0, NULL) || get_ptr(a[1], &x) || get_i64(a[2], &M) ||
        get_ptr(a[3], &y))
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

/* gemv_rows(w, x, idx, n, y) */
static PyObject *py_gemv_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t w;
    void *x, *idx, *y;
    int64_t n;
    if (!nargs_ok(na, 5, "gemv_rows") || get_qmat(a[0], &w, 0, NULL) || get_ptr(a[1], &x) || get_ptr(a[2], &idx) ||
        get_i64(a[3], &n) || get_ptr(a[4], &y))
        return NULL;
    if (!rows_fmt_ok(&w, "gemv_rows")) return NULL;
    if (n <= 0) Py_RETURN_NONE;
    if (!x || !idx || !y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (check_rows(idx, n, w.rows)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    si_gemv_rows(&w, x, idx, n, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* axpy_rows(w, h, idx, n, y) */
static PyObject *py_axpy_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t w;
    void *h, *idx, *y;
    int64_t n;
    if (!nargs_ok(na, 5, "axpy_rows") || get_qmat(a[0], &w, 0, NULL) || get_ptr(a[1], &h) || get_ptr(a[2], &idx) ||
        get_i64(a[3], &n) || get_ptr(a[4], &y))
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

/* gemv_int8(w, x, y): a tq4 weight, x in one int8 term whatever the activation mode */
static PyObject *py_gemv_int8(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    qmat_t w;
    void *x, *y;
    if (!nargs_ok(n, 3, "gemv_int8") || get_qmat(a[0], &w, 0, NULL) || get_ptr(a[1], &x) || get_ptr(a[2], &y)) return NULL;
    if (w.fmt != FMT_TQ4) return PyErr_Format(PyExc_ValueError, "gemv_int8 takes row-tiled (tq4) weights");
    if (w.rows == 0) Py_RETURN_NONE;
    if (!x || !y) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_gemv_tiles_int8(&w, x, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* tile_rows(w, out): out the row tiles of the q4, q6 or q4k weight w; the caller (kernels/cpu.py `tile`)
 * sized out (quant.tiles_shape) */
static PyObject *py_tile_rows(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    qmat_t w;
    void *out;
    if (!nargs_ok(n, 2, "tile_rows") || get_qmat(a[0], &w, 0, NULL) || get_ptr(a[1], &out)) return NULL;
    if (w.fmt != FMT_Q4 && w.fmt != FMT_Q6 && w.fmt != FMT_Q4K)
        return PyErr_Format(PyExc_ValueError, "tile takes q4, q6 or q4k weights");
    if (w.rows == 0) Py_RETURN_NONE;
    if (!out) return PyErr_Format(PyExc_ValueError, "null data pointer");
    Py_BEGIN_ALLOW_THREADS
    si_tile_rows(&w, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* select_ids(p, n, thr, extra, out) -> (ids written, of them at or above thr): extra a list of ints (ids outside [0, n) are
 * ignored) or None; out has room for n int32 (checked by the caller) */
static PyObject *py_select_ids(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p, *out;
    int64_t n;
    if (!nargs_ok(na, 5, "select_ids") || get_ptr(a[0], &p) || get_i64(a[1], &n) || get_ptr(a[4], &out)) return NULL;
    const double thr = PyFloat_AsDouble(a[2]);
    if (thr == -1.0 && PyErr_Occurred()) return NULL;
    if (!p || !out || n < 0) return PyErr_Format(PyExc_ValueError, "select_ids: null buffer or negative length");
    int64_t ne = 0, *extra = NULL;
    if (a[3] != Py_None) {
        if (!PyList_Check(a[3])) return PyErr_Format(PyExc_TypeError, "select_ids: extra ids must be a list of ints");
        ne = PyList_GET_SIZE(a[3]);
        extra = malloc((size_t)(ne ? ne : 1) * sizeof(int64_t));
        if (!extra) return PyErr_NoMemory();
        for (int64_t i = 0; i < ne; i++) {
            const long long v = PyLong_AsLongLong(PyList_GET_ITEM(a[3], i));
            if (v == -1 && PyErr_Occurred()) {
                free(extra);
                return NULL;
            }
            extra[i] = (int64_t)v;
        }
    }
    int64_t k, above;
    Py_BEGIN_ALLOW_THREADS
    k = si_select_ids(p, n, (float)thr, extra, ne, out, &above);
    Py_END_ALLOW_THREADS
    free(extra);
    return Py_BuildValue("LL", (long long)k, (long long)above);
}

/* gemv_cols(rows, cols, qs, d, m, x, thr, y) -> inputs kept: a column-grouped q4 weight (cols.c);
 * the caller (sparseinfer/kernels/cpu.py) has checked the buffers' sizes */
static PyObject *py_gemv_cols(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    cmat_t w;
    int64_t rows, cols;
    void *qs, *d, *m, *x, *y;
    double thr;
    if (!nargs_ok(na, 8, "gemv_cols") || get_i64(a[0], &rows) || get_i64(a[1], &cols) || get_ptr(a[2], &qs) ||
        get_ptr(a[3], &d) || get_ptr(a[4], &m) || get_ptr(a[5], &x) || get_ptr(a[7], &y))
        return NULL;
    thr = PyFloat_AsDouble(a[6]);
    if (thr == -1.0 && PyErr_Occurred()) return NULL;
    if (si_cmat_init(&w, rows, cols, qs, d, m) != 0 || !x || !y)
        return PyErr_Format(PyExc_ValueError, "invalid column-grouped weight or null pointer");
    int64_t kept;
    Py_BEGIN_ALLOW_THREADS
    kept = si_gemv_cols(&w, x, (float)thr, y);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)kept);
}

/* gemv_cols_list(rows, cols, qs, d, m, h, idx, n, y): idx checked ascending, distinct, in range */
static PyObject *py_gemv_cols_list(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    cmat_t w;
    int64_t rows, cols, n;
    void *qs, *d, *m, *h, *idx, *y;
    if (!nargs_ok(na, 9, "gemv_cols_list") || get_i64(a[0], &rows) || get_i64(a[1], &cols) || get_ptr(a[2], &qs) ||
        get_ptr(a[3], &d) || get_ptr(a[4], &m) || get_ptr(a[5], &h) || get_ptr(a[6], &idx) || get_i64(a[7], &n) ||
        get_ptr(a[8], &y))
        return NULL;
    if (si_cmat_init(&w, rows, cols, qs, d, m) != 0 || !y || (n > 0 && (!h || !idx)))
        return PyErr_Format(PyExc_ValueError, "invalid column-grouped weight or null pointer");
    if (n > 0 && check_rows(idx, n, cols)) return NULL;
    for (int64_t i = 1; i < n; i++)
        if (((const int32_t *)idx)[i] <= ((const int32_t *)idx)[i - 1])
            return PyErr_Format(PyExc_ValueError, "input ids must be ascending and distinct (position %lld)", (long long)i);
    Py_BEGIN_ALLOW_THREADS
    si_gemv_cols_list(&w, h, idx, n < 0 ? 0 : n, y);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* sparse_ffn(act, gate (0 = none), up, down_t, x, idx, n, y) */
static PyObject *py_sparse_ffn(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t g, u, dn;
    int64_t act, n;
    int gnone;
    void *x, *idx, *y;
    if (!nargs_ok(na, 8, "sparse_ffn") || get_i64(a[0], &act) || get_qmat(a[1], &g, 1, &gnone) ||
        get_qmat(a[2], &u, 0, NULL) || get_qmat(a[3], &dn, 0, NULL) || get_ptr(a[4], &x) ||
        get_ptr(a[5], &idx) || get_i64(a[6], &n) || get_ptr(a[7], &y))
        return NULL;
    if (act < 0 || act >= ACT_COUNT) return PyErr_Format(PyExc_ValueError, "unknown activation code %lld", (long long)act);
    if (!gnone && (g.rows != u.rows || g.cols != u.cols))
        return PyErr_Format(PyExc_ValueError, "gate and up shapes differ");
    if (!axpy_fmt_ok(&dn, "sparse_ffn down_t") || !rows_fmt_ok(&u, "sparse_ffn") || (!gnone && !rows_fmt_ok(&g, "sparse_ffn")))
        return NULL;
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
    if (K <= 0 || !x || !q || !d || !s || (layout != XL_NATURAL && layout != XL_Q4 && layout != XL_Q8K))
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

static PyObject *py_cpu_bf16(PyObject *self, PyObject *unused) { return PyBool_FromLong(si_cpu_bf16()); }

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

/* dequantize_rows(w, r0, r1, out): out = W[r0:r1] as float32 */
static PyObject *py_dequantize_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    qmat_t w;
    int64_t r0, r1;
    void *out;
    if (!nargs_ok(na, 4, "dequantize_rows") || get_qmat(a[0], &w, 0, NULL) || get_i64(a[1], &r0) ||
        get_i64(a[2], &r1) || get_ptr(a[3], &out))
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

/* hidden_rows(act, relu_up, g, g_stride, u, u_stride, M, n, thr, order, out): see sparse.c
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

/* attend1(q, k, v, o, H, Hk, D, L, kstride, vstride, scale, type): single-token attention over
 * K/V rows of cache type `type` (KV_*), KV heads kstride / vstride bytes apart; see norm_attn.c */
static PyObject *py_attend1(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *q, *k, *v, *o;
    int64_t H, Hk, D, L, ks, vs, type;
    if (!nargs_ok(na, 12, "attend1") || get_ptr(a[0], &q) || get_ptr(a[1], &k) || get_ptr(a[2], &v) ||
        get_ptr(a[3], &o) || get_i64(a[4], &H) || get_i64(a[5], &Hk) || get_i64(a[6], &D) || get_i64(a[7], &L) ||
        get_i64(a[8], &ks) || get_i64(a[9], &vs) || get_i64(a[11], &type))
        return NULL;
    double scale = PyFloat_AsDouble(a[10]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    if (type < 0 || type >= KV_COUNT) return PyErr_Format(PyExc_ValueError, "attend1: unknown KV cache type %lld", (long long)type);
    const int64_t rb = H < 1 || D < 1 ? 0 : si_kv_row_bytes((int)type, D);
    if (H < 1 || Hk < 1 || H % Hk || D < 1 || L < 1 || (Hk > 1 && (ks < L * rb || vs < L * rb)))
        return PyErr_Format(PyExc_ValueError, "attend1: bad shape");
    if (!q || !k || !v || !o) return PyErr_Format(PyExc_ValueError, "null data pointer");
    si_attend1((int)type, q, k, v, o, H, Hk, D, L, ks, vs, (float)scale);  /* tens of microseconds: keep the GIL */
    Py_RETURN_NONE;
}

/* kv_store(type, x, row, D): one KV cache row of type `type` (KV_*) from D floats, with the
 * selected kernel level's conversion (what the decode step writes) */
static PyObject *py_kv_store(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *x, *row;
    int64_t type, D;
    if (!nargs_ok(na, 4, "kv_store") || get_i64(a[0], &type) || get_ptr(a[1], &x) || get_ptr(a[2], &row) ||
        get_i64(a[3], &D))
        return NULL;
    if (type < 0 || type >= KV_COUNT) return PyErr_Format(PyExc_ValueError, "kv_store: unknown KV cache type %lld", (long long)type);
    if (D < 1) return PyErr_Format(PyExc_ValueError, "kv_store: D must be >= 1");
    if (!x || !row) return PyErr_Format(PyExc_ValueError, "null data pointer");
    si_kv_store((int)type, x, row, D);
    Py_RETURN_NONE;
}

static int get_f32(PyObject *o, float *v) {
    double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    *v = (float)d;
    return 0;
}

/* check_attn_plan(plan) / check_ffn_plan(plan): validate a filled decode plan once (shapes,
 * formats, pointers; see ops.h) and complete its weight descriptors; ValueError naming what
 * is wrong otherwise */
static PyObject *py_check_attn_plan(PyObject *self, PyObject *arg) {
    void *p;
    if (get_ptr(arg, &p)) return NULL;
    if (!p) return PyErr_Format(PyExc_ValueError, "null plan");
    const char *err = si_check_attn_plan(p);
    if (err) return PyErr_Format(PyExc_ValueError, "attention decode plan: %s", err);
    Py_RETURN_NONE;
}

static PyObject *py_check_ffn_plan(PyObject *self, PyObject *arg) {
    void *p;
    if (get_ptr(arg, &p)) return NULL;
    if (!p) return PyErr_Format(PyExc_ValueError, "null plan");
    const char *err = si_check_ffn_plan(p);
    if (err) return PyErr_Format(PyExc_ValueError, "FFN decode plan: %s", err);
    Py_RETURN_NONE;
}

/* decode_attn(plan, x, xo, cos, sin, kc, vc, kcap, vcap, pos): one token through an
 * attention half-block on its checked plan (cos/sin 0 without rotary); kc, vc: caches of the
 * plan's type with kcap / vcap rows per KV head */
static PyObject *py_decode_attn(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p, *x, *xo, *cs, *sn, *kc, *vc;
    int64_t ks, vs, pos;
    if (!nargs_ok(na, 10, "decode_attn") || get_ptr(a[0], &p) || get_ptr(a[1], &x) || get_ptr(a[2], &xo) ||
        get_ptr(a[3], &cs) || get_ptr(a[4], &sn) || get_ptr(a[5], &kc) || get_ptr(a[6], &vc) || get_i64(a[7], &ks) ||
        get_i64(a[8], &vs) || get_i64(a[9], &pos))
        return NULL;
    const si_attn_plan_t *plan = p;
    if (!p || !x || !xo || !kc || !vc || (plan->n_rot && (!cs || !sn)))
        return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (pos < 0 || ks < pos + 1 || vs < pos + 1)
        return PyErr_Format(PyExc_ValueError, "decode_attn: position %lld outside the cache", (long long)pos);
    const int64_t rb = si_kv_row_bytes((int)plan->kv_type, plan->D);
    Py_BEGIN_ALLOW_THREADS
    si_decode_attn(plan, x, xo, cs, sn, kc, vc, ks * rb, vs * rb, pos);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* decode_ffn(plan, x, xo, rows, n_rows): one token through an FFN (half-block when the plan has
 * a norm) on its checked plan; rows 0 with n_rows -1: predicted or all rows */
static PyObject *py_decode_ffn(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p, *x, *xo, *rows;
    int64_t nrows;
    if (!nargs_ok(na, 5, "decode_ffn") || get_ptr(a[0], &p) || get_ptr(a[1], &x) || get_ptr(a[2], &xo) ||
        get_ptr(a[3], &rows) || get_i64(a[4], &nrows))
        return NULL;
    si_ffn_plan_t *plan = p;
    if (!p || !x || !xo || nrows < -1 || (nrows > 0 && !rows)) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (nrows >= 0 && plan->kind != FFN_SPARSE) return PyErr_Format(PyExc_ValueError, "decode_ffn: rows given to a dense FFN");
    if (nrows > 0 && check_rows(rows, nrows, plan->F)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    si_decode_ffn(plan, x, xo, nrows >= 0 ? rows : NULL, nrows);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* decode_attn_rows(plan, B, x, xo, cos, sin, refs): B tokens of B sequences through an
 * attention half-block (cos/sin: B rows of n_rot, 0 without rotary); refs: B rows of five
 * int64 {k cache, v cache, kcap, vcap, pos}, as decode_attn takes them one by one */
static PyObject *py_decode_attn_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p, *x, *xo, *cs, *sn, *refs;
    int64_t B;
    if (!nargs_ok(na, 7, "decode_attn_rows") || get_ptr(a[0], &p) || get_i64(a[1], &B) || get_ptr(a[2], &x) ||
        get_ptr(a[3], &xo) || get_ptr(a[4], &cs) || get_ptr(a[5], &sn) || get_ptr(a[6], &refs))
        return NULL;
    const si_attn_plan_t *plan = p;
    if (!p || !x || !xo || !refs || (plan->n_rot && (!cs || !sn)))
        return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (B < 1 || B > 4096) return PyErr_Format(PyExc_ValueError, "decode_attn_rows: %lld rows", (long long)B);
    si_kv_ref_t *kv = malloc((size_t)B * sizeof(si_kv_ref_t));
    if (!kv) return PyErr_NoMemory();
    const int64_t rb = si_kv_row_bytes((int)plan->kv_type, plan->D), *r = refs;
    for (int64_t b = 0; b < B; b++, r += 5) {
        const int64_t pos = r[4];
        if (!r[0] || !r[1] || pos < 0 || r[2] < pos + 1 || r[3] < pos + 1) {
            free(kv);
            return PyErr_Format(PyExc_ValueError, "decode_attn_rows: row %lld: position %lld outside its cache",
                                (long long)b, (long long)pos);
        }
        kv[b] = (si_kv_ref_t){(void *)(intptr_t)r[0], (void *)(intptr_t)r[1], r[2] * rb, r[3] * rb, pos};
    }
    Py_BEGIN_ALLOW_THREADS
    si_decode_attn_rows(plan, B, x, xo, cs, sn, kv);
    Py_END_ALLOW_THREADS
    free(kv);
    Py_RETURN_NONE;
}

/* decode_ffn_rows(plan, B, x, xo): B tokens through an FFN on its checked plan (predicted or
 * all rows) */
static PyObject *py_decode_ffn_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    void *p, *x, *xo;
    int64_t B;
    if (!nargs_ok(na, 4, "decode_ffn_rows") || get_ptr(a[0], &p) || get_i64(a[1], &B) || get_ptr(a[2], &x) ||
        get_ptr(a[3], &xo))
        return NULL;
    if (!p || !x || !xo) return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (B < 1 || B > 4096) return PyErr_Format(PyExc_ValueError, "decode_ffn_rows: %lld rows", (long long)B);
    Py_BEGIN_ALLOW_THREADS
    si_decode_ffn_rows(p, B, x, xo);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* plan_layout() -> {struct: (size, {field: offset})}: what decode_plan.py checks its ctypes
 * mirrors against at import */
#define FIELD(T, f) if (add_field(d, #f, offsetof(T, f))) goto fail;
static int add_field(PyObject *d, const char *name, size_t off) {
    PyObject *v = PyLong_FromSize_t(off);
    int rc = v ? PyDict_SetItemString(d, name, v) : -1;
    Py_XDECREF(v);
    return rc;
}

static PyObject *layout_entry(size_t size, PyObject *d) {
    if (!d) return NULL;
    PyObject *t = Py_BuildValue("(nO)", (Py_ssize_t)size, d);
    Py_DECREF(d);
    return t;
}

static PyObject *py_plan_layout(PyObject *self, PyObject *unused) {
    PyObject *out = PyDict_New(), *d = NULL, *t;
    if (!out) return NULL;
    d = PyDict_New();
    if (!d) goto fail;
    FIELD(qmat_t, fmt) FIELD(qmat_t, rows) FIELD(qmat_t, cols) FIELD(qmat_t, row_bytes) FIELD(qmat_t, ds)
    FIELD(qmat_t, qs) FIELD(qmat_t, d) FIELD(qmat_t, m)
    t = layout_entry(sizeof(qmat_t), d), d = NULL;
    if (!t || PyDict_SetItemString(out, "qmat", t)) { Py_XDECREF(t); goto fail; }
    Py_DECREF(t);
    d = PyDict_New();
    if (!d) goto fail;
    FIELD(si_attn_plan_t, n) FIELD(si_attn_plan_t, n_rot) FIELD(si_attn_plan_t, kv_type) FIELD(si_attn_plan_t, eps) FIELD(si_attn_plan_t, scale)
    FIELD(si_attn_plan_t, norm_w) FIELD(si_attn_plan_t, q) FIELD(si_attn_plan_t, o) FIELD(si_attn_plan_t, bo)
    t = layout_entry(sizeof(si_attn_plan_t), d), d = NULL;
    if (!t || PyDict_SetItemString(out, "attn", t)) { Py_XDECREF(t); goto fail; }
    Py_DECREF(t);
    d = PyDict_New();
    if (!d) goto fail;
    FIELD(si_ffn_plan_t, kind) FIELD(si_ffn_plan_t, flags) FIELD(si_ffn_plan_t, n) FIELD(si_ffn_plan_t, eps)
    FIELD(si_ffn_plan_t, up_crossover) FIELD(si_ffn_plan_t, topk) FIELD(si_ffn_plan_t, norm_w)
    FIELD(si_ffn_plan_t, first) FIELD(si_ffn_plan_t, w2t) FIELD(si_ffn_plan_t, first_bias) FIELD(si_ffn_plan_t, order)
    FIELD(si_ffn_plan_t, records) FIELD(si_ffn_plan_t, stats)
    t = layout_entry(sizeof(si_ffn_plan_t), d), d = NULL;
    if (!t || PyDict_SetItemString(out, "ffn", t)) { Py_XDECREF(t); goto fail; }
    Py_DECREF(t);
    d = PyDict_New();
    if (!d) goto fail;
    FIELD(si_ffn_stats_t, tokens) FIELD(si_ffn_stats_t, predictions) FIELD(si_ffn_stats_t, predictor_seconds)
    t = layout_entry(sizeof(si_ffn_stats_t), d), d = NULL;
    if (!t || PyDict_SetItemString(out, "stats", t)) { Py_XDECREF(t); goto fail; }
    Py_DECREF(t);
    return out;
fail:
    Py_XDECREF(d);
    Py_DECREF(out);
    return NULL;
}
#undef FIELD

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
    {"gemv", (PyCFunction)(void (*)(void))py_gemv, METH_FASTCALL, "gemv(w, x, y)"},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "matmul(w, X, M, Y)"},
    {"gemv_rows", (PyCFunction)(void (*)(void))py_gemv_rows, METH_FASTCALL, "gemv_rows(w, x, idx, n, y)"},
    {"gemv_int8", (PyCFunction)(void (*)(void))py_gemv_int8, METH_FASTCALL, "gemv_int8(w, x, y): tq4, one int8 term"},
    {"tile_rows", (PyCFunction)(void (*)(void))py_tile_rows, METH_FASTCALL, "tile_rows(w, out): q4 / q6 / q4k -> row tiles"},
    {"select_ids", (PyCFunction)(void (*)(void))py_select_ids, METH_FASTCALL, "ids at or above a threshold, or listed"},
    {"gemv_cols", (PyCFunction)(void (*)(void))py_gemv_cols, METH_FASTCALL, "column-grouped q4 product over kept inputs"},
    {"gemv_cols_list", (PyCFunction)(void (*)(void))py_gemv_cols_list, METH_FASTCALL, "column-grouped q4 product over listed inputs"},
    {"axpy_rows", (PyCFunction)(void (*)(void))py_axpy_rows, METH_FASTCALL, "axpy_rows(w, h, idx, n, y)"},
    {"sparse_ffn", (PyCFunction)(void (*)(void))py_sparse_ffn, METH_FASTCALL, "sparse_ffn(act, gate, up, down_t, x, idx, n, y)"},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL, "quantize(layout, x, K, q, d, s)"},
    {"read_seconds", (PyCFunction)(void (*)(void))py_read_seconds, METH_FASTCALL, "read_seconds(ptr, nbytes, reps)"},
    {"read_rows_seconds", (PyCFunction)(void (*)(void))py_read_rows_seconds, METH_FASTCALL, "read_rows_seconds(ptr, row_bytes, idx, n, reps, prefetch)"},
    {"advise_hugepages", (PyCFunction)(void (*)(void))py_advise_hugepages, METH_FASTCALL, "advise_hugepages(ptr, nbytes) -> bytes advised"},
    {"dequantize_rows", (PyCFunction)(void (*)(void))py_dequantize_rows, METH_FASTCALL, "dequantize_rows(w, r0, r1, out)"},
    {"act", (PyCFunction)(void (*)(void))py_act, METH_FASTCALL, "act(code, v, n): v = act(v) in place"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, "rms_norm(x, w, y, rows, n, eps)"},
    {"hidden_rows", (PyCFunction)(void (*)(void))py_hidden_rows, METH_FASTCALL, "hidden_rows(act, relu_up, g, g_stride, u, u_stride, M, n, thr, order, out)"},
    {"attend1", (PyCFunction)(void (*)(void))py_attend1, METH_FASTCALL, "attend1(q, k, v, o, H, Hk, D, L, kstride, vstride, scale, type)"},
    {"kv_store", (PyCFunction)(void (*)(void))py_kv_store, METH_FASTCALL, "kv_store(type, x, row, D): one KV cache row"},
    {"check_attn_plan", py_check_attn_plan, METH_O, "check_attn_plan(plan): validate and complete an attention decode plan"},
    {"check_ffn_plan", py_check_ffn_plan, METH_O, "check_ffn_plan(plan): validate and complete an FFN decode plan"},
    {"decode_attn", (PyCFunction)(void (*)(void))py_decode_attn, METH_FASTCALL, "decode_attn(plan, x, xo, cos, sin, kc, vc, kcap, vcap, pos)"},
    {"decode_ffn", (PyCFunction)(void (*)(void))py_decode_ffn, METH_FASTCALL, "decode_ffn(plan, x, xo, rows, n_rows)"},
    {"decode_attn_rows", (PyCFunction)(void (*)(void))py_decode_attn_rows, METH_FASTCALL,
     "decode_attn_rows(plan, B, x, xo, cos, sin, refs)"},
    {"decode_ffn_rows", (PyCFunction)(void (*)(void))py_decode_ffn_rows, METH_FASTCALL, "decode_ffn_rows(plan, B, x, xo)"},
    {"plan_layout", py_plan_layout, METH_NOARGS, "plan_layout(): sizes and field offsets of the plan structs"},
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
    {"cpu_bf16", py_cpu_bf16, METH_NOARGS, "cpu_bf16(): the CPU multiplies bfloat16 in hardware"},
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
    PyModule_AddIntConstant(mod, "FMT_Q4K", FMT_Q4K);
    PyModule_AddIntConstant(mod, "FMT_TQ4", FMT_TQ4);
    PyModule_AddIntConstant(mod, "FMT_TQ6", FMT_TQ6);
    PyModule_AddIntConstant(mod, "FMT_TQ4K", FMT_TQ4K);
    PyModule_AddIntConstant(mod, "XL_NATURAL", XL_NATURAL);
    PyModule_AddIntConstant(mod, "XL_Q4", XL_Q4);
    PyModule_AddIntConstant(mod, "XL_Q8K", XL_Q8K);
    PyModule_AddIntConstant(mod, "ACT_INT8", ACT_INT8);
    PyModule_AddIntConstant(mod, "ACT_PRECISE", ACT_PRECISE);
    PyModule_AddIntConstant(mod, "ACT_SILU", ACT_SILU);
    PyModule_AddIntConstant(mod, "ACT_RELU", ACT_RELU);
    PyModule_AddIntConstant(mod, "ACT_GELU", ACT_GELU);
    PyModule_AddIntConstant(mod, "ACT_GELU_TANH", ACT_GELU_TANH);
    return mod;
}
