/* Threaded operations on top of one kernel table (chosen at run time); see runtime.c,
 * quant.c, dense.c, sparse.c, norm_attn.c, probe.c and decode.c. */
#ifndef SI_OPS_H
#define SI_OPS_H
#include "common.h"

const char *si_level(void);
int si_act_mode(void);                        /* ACT_INT8 (default) / ACT_PRECISE */
void si_set_act_mode(int mode);
int si_select(const char *name);              /* 0 ok, -1 unknown name, -2 not supported here */
int si_level_supported(const char *name);     /* 1 / 0 */
int si_cpu_bf16(void);                         /* 1: bfloat16 products in hardware (runtime.c) */
extern const char *const si_level_names[];    /* best first, NULL-terminated */

int si_qmat_init(qmat_t *w, int fmt, int64_t rows, int64_t cols, const void *qs, const void *d, const void *m,
                 int64_t qs_stride, int64_t d_stride);

/* v[i] = act(v[i]) in place, the best kernel level's (ACT_* code) */
void si_act(int act, float *v, int64_t n);
void si_gemv(const qmat_t *w, const float *x, float *y);
void si_matmul(const qmat_t *w, const float *X, int64_t M, float *Y);
/* the same, token t's outputs at Y + t * ldy (ldy >= w->rows) */
void si_matmul_ld(const qmat_t *w, const float *X, int64_t M, float *Y, int64_t ldy);
/* y = W (x masked to |x_j| > thr) on a column-grouped weight, reading the kept columns only;
 * returns how many inputs were kept (cols.c) */
int si_cmat_init(cmat_t *w, int64_t rows, int64_t cols, const void *qs, const void *d, const void *m);
int64_t si_gemv_cols(const cmat_t *w, const float *x, float thr, float *y);
/* y = sum_j h[j] * W[:, idx[j]] for the n inputs idx, ascending and distinct (cols.c) */
void si_gemv_cols_list(const cmat_t *w, const float *h, const int32_t *idx, int64_t n, float *y);
/* out = the row tiles of a q4 (tq4: ceil(rows/16) * nb * 320 bytes), q6 (tq6: 448 bytes per
 * tile and block) or q4k weight (tq4k: 2304 bytes per tile and super-block) (tiles.c) */
void si_tile_rows(const qmat_t *w, uint8_t *out);
/* y = W x on a tq4 weight with x in one int8 term whatever the activation mode (tiles.c: for
 * approximations, e.g. the output head's preview) */
void si_gemv_tiles_int8(const qmat_t *w, const float *x, float *y);
/* the ids i < n with p[i] >= thr or listed in extra (ids outside [0, n) ignored), ascending
 * and distinct, into out (room for n); returns how many, *n_thr how many had p[i] >= thr (sparse.c) */
int64_t si_select_ids(const float *p, int64_t n, float thr, const int64_t *extra, int64_t n_extra, int32_t *out,
                      int64_t *n_thr);
void si_gemv_rows(const qmat_t *w, const float *x, const int32_t *rows, int64_t n, float *y);
void si_axpy_rows(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n, float *y);
void si_sparse_ffn(int act, const qmat_t *gate, const qmat_t *up, const qmat_t *down_t,
                   const float *x, const int32_t *rows, int64_t n, float *y);
/* One pass over candidate neurons whose first/second/down_t rows lie in one record each (see
 * sparse.c; rec = si_record_base of the three); keeps |act(first)| > thr; returns the kept count. */
int64_t si_sparse_records(const uint8_t *rec, int act, int relu_up, const qmat_t *first, const float *fb,
                          const qmat_t *second, const float *sb, const qmat_t *down_t, const float *x,
                          const int32_t *rows, int64_t n, float thr, float *y);
/* SparseFFN's thresholded hidden rows for T > 1 (sparse.c); g is overwritten with act(g) */
void si_hidden_rows(int act, int relu_up, float *g, int64_t gs, const float *u, int64_t us, int64_t M, int64_t n,
                    float thr, const int64_t *order, float *out);
const uint8_t *si_record_base(const qmat_t *first, const qmat_t *second, const qmat_t *down_t);
void si_quantize(int layout, const float *x, int64_t K, int8_t *q, float *d, float *s);
/* GGUF Q4_K / Q6_K super-blocks -> our q4 / q6 layouts with float32 scales (repack.c) */
void si_repack_q4_k(const uint8_t *src, int64_t nsuper, uint8_t *qs, float *d, float *m);
void si_repack_q6_k(const uint8_t *src, int64_t nsuper, uint8_t *qs, float *d);
void si_dequantize_rows(const qmat_t *w, int64_t r0, int64_t r1, float *out);
/* single-token attention over a cache of type KV_* (common.h); KV heads kstride / vstride bytes apart */
void si_attend1(int type, const float *q, const void *k, const void *v, float *o, int64_t H, int64_t Hk, int64_t D,
                int64_t L, int64_t kstride, int64_t vstride, float scale);
/* write one cache row of type KV_* from D floats, the best kernel level's conversion */
void si_kv_store(int type, const float *x, void *row, int64_t D);
void si_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps);
/* grow-only per-thread buffer `slot` (0..10, see runtime.c) of at least n bytes, 64-byte aligned */
void *si_scratch(int slot, size_t n);
/* ---- decode plans: what one token's half-block step needs, packed once per layer at load.
 * sparseinfer/kernels/decode_plan.py mirrors these structs field for field (ctypes) and fills
 * them; si_check_*_plan validates a filled plan once (shapes, formats, pointers) and completes
 * its weight descriptors; the steps then run on it per token (decode.c). */

/* what the sparse FFN step did, summed over the tokens since the counters were zeroed */
typedef struct {
    int64_t tokens;
    int64_t fused_rows;        /* candidate rows through the one-pass fused kernel */
    int64_t first_rows;        /* rows of the first projection (gate, or up of a plain FFN) */
    int64_t gate_up_passes;    /* dense passes over the fused gate+up weight */
    int64_t dense_ups;         /* dense passes over up */
    int64_t up_rows;           /* rows of up on the kept neurons */
    int64_t dense_downs;       /* dense passes over the stored down */
    int64_t down_rows;         /* rows of the neuron-major down_t */
    int64_t kept;              /* neurons kept (computed) */
    int64_t predictions;       /* predictor runs */
    double predictor_seconds;
} si_ffn_stats_t;

typedef struct {
    int64_t n;                 /* model width */
    int64_t H, Hk, D, n_rot;   /* heads, KV heads, head width, rotated dims (0: no rotary) */
    int64_t kv_type;           /* the KV cache's element type, KV_* (common.h) */
    float eps, scale;          /* RMSNorm epsilon; attention scale */
    const float *norm_w;       /* (n) */
    qmat_t q, k, v, o;         /* k.fmt = v.fmt = -1: q is the fused q/k/v weight */
    const float *bq, *bk, *bv, *bo;  /* biases or NULL (bq covers all fused rows) */
} si_attn_plan_t;

enum { FFN_DENSE = 0, FFN_SPARSE = 1 };
enum { FFN_FUSED = 1, FFN_GATE_UP = 2, FFN_RECORDS = 4 };

typedef struct {
    int32_t kind;              /* FFN_DENSE or FFN_SPARSE */
    int32_t act;               /* ACT_* */
    int32_t relu_up;           /* dReLU: ReLU on up as well */
    int32_t flags;             /* FFN_FUSED | FFN_GATE_UP | FFN_RECORDS (sparse) */
    int64_t n, F;              /* width; neurons (hotness order when sparse) */
    float eps;
    float threshold;           /* keep |a| > threshold (sparse) */
    float crossover;           /* down dense above crossover * F kept */
    float up_crossover;        /* up dense above up_crossover * F kept */
    int64_t topk;              /* > 0: that many predicted rows, the highest scores */
    const float *norm_w;       /* (n), or NULL: xo = ffn(x) instead of x + ffn(rms_norm(x)) */
    qmat_t first, second;      /* gate and up; plain FFN: up and second.fmt = -1 */
    qmat_t gate_up;            /* gate rows then up rows of one weight, or fmt -1 */
    qmat_t down;               /* (n, F) as stored; sparse: may be absent (fmt -1: down never dense) */
    qmat_t down_t;             /* (F, n) neuron-major in hotness order (sparse) */
    qmat_t w1, w2t;            /* predictor (sparse), or fmt -1 */
    const float *first_bias, *second_bias, *down_bias, *b1, *cut;
    const int32_t *order;      /* order[k]: stored down column of neuron k (sparse) */
    const uint8_t *records;    /* base of the neuron records (FFN_RECORDS), set by the check */
    si_ffn_stats_t stats;
} si_ffn_plan_t;

/* 0, or a message naming what is inconsistent (static storage) */
const char *si_check_attn_plan(si_attn_plan_t *p);
const char *si_check_ffn_plan(si_ffn_plan_t *p);
/* xo = x + attention(rms_norm(x)) for one token at `pos`, appending its k/v to the caches
 * of type p->kv_type (KV head h, row pos at kc + h*kstride + pos*si_kv_row_bytes(kv_type, D),
 * strides in bytes); x and xo may alias */
void si_decode_attn(const si_attn_plan_t *p, const float *x, float *xo, const float *cos, const float *sin,
                    void *kc, void *vc, int64_t kstride, int64_t vstride, int64_t pos);
/* where one sequence's k/v go and what it attends over: KV head h's row `pos` at
 * k + h*kstride + pos*si_kv_row_bytes (strides in bytes), as si_decode_attn takes them */
typedef struct {
    void *k, *v;
    int64_t kstride, vstride, pos;
} si_kv_ref_t;
/* si_decode_attn for B tokens of B sequences at once (batched decode): row b of x / xo (n
 * floats each) is a token at kv[b].pos with its cos/sin rows at cos + b*n_rot; each product
 * reads its weight once for all the rows; every row's result equals si_decode_attn's where a
 * matmul row equals the gemv (the kernels' determinism contract) */
void si_decode_attn_rows(const si_attn_plan_t *p, int64_t B, const float *x, float *xo, const float *cos,
                         const float *sin, const si_kv_ref_t *kv);
/* si_decode_ffn (predicted or all rows) for B tokens at once: dense plans as one product per
 * weight over all the rows; sparse plans row by row */
void si_decode_ffn_rows(si_ffn_plan_t *p, int64_t B, const float *x, float *xo);
/* xo = x + ffn(rms_norm(x)) (norm_w set) or ffn(x); rows/n_rows: given candidate rows (sparse;
 * NULL: predicted, or all); x and xo may alias */
void si_decode_ffn(si_ffn_plan_t *p, const float *x, float *xo, const int32_t *rows, int64_t n_rows);
double si_read_seconds(const uint8_t *p, int64_t nbytes, int reps);
double si_read_rows_seconds(const uint8_t *p, int64_t row_bytes, const int32_t *rows, int64_t n, int reps, int prefetch);

#endif
