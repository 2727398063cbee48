/* Threaded operations on top of one kernel table (chosen at run time); see ops.c. */
#ifndef SI_OPS_H
#define SI_OPS_H
#include "common.h"

const char *si_level(void);
int si_act_mode(void);                        /* ACT_INT8 (default) / ACT_PRECISE */
void si_set_act_mode(int mode);
int si_select(const char *name);              /* 0 ok, -1 unknown name, -2 not supported here */
int si_level_supported(const char *name);     /* 1 / 0 */
extern const char *const si_level_names[];    /* best first, NULL-terminated */

int si_qmat_init(qmat_t *w, int fmt, int64_t rows, int64_t cols, const void *qs, const void *d, const void *m,
                 int64_t qs_stride, int64_t d_stride);

/* v[i] = act(v[i]) in place, the best kernel level's (ACT_* code) */
void si_act(int act, float *v, int64_t n);
void si_gemv(const qmat_t *w, const float *x, float *y);
void si_matmul(const qmat_t *w, const float *X, int64_t M, float *Y);
void si_gemv_rows(const qmat_t *w, const float *x, const int32_t *rows, int64_t n, float *y);
void si_axpy_rows(const qmat_t *wt, const float *h, const int32_t *rows, int64_t n, float *y);
void si_sparse_ffn(int act, const qmat_t *gate, const qmat_t *up, const qmat_t *down_t,
                   const float *x, const int32_t *rows, int64_t n, float *y);
/* One pass over candidate neurons whose first/second/down_t rows lie in one record each (see
 * ops.c; rec = si_record_base of the three); keeps |act(first)| > thr; returns the kept count. */
int64_t si_sparse_records(const uint8_t *rec, int act, int relu_up, const qmat_t *first, const float *fb,
                          const qmat_t *second, const float *sb, const qmat_t *down_t, const float *x,
                          const int32_t *rows, int64_t n, float thr, float *y);
/* SparseFFN's thresholded hidden rows for T > 1 (ops.c); g is overwritten with act(g) */
void si_hidden_rows(int act, int relu_up, float *g, int64_t gs, const float *u, int64_t us, int64_t M, int64_t n,
                    float thr, const int64_t *order, float *out);
const uint8_t *si_record_base(const qmat_t *first, const qmat_t *second, const qmat_t *down_t);
void si_quantize(int layout, const float *x, int64_t K, int8_t *q, float *d, float *s);
/* GGUF Q4_K / Q6_K super-blocks -> our q4 / q6 layouts with float32 scales (repack.c) */
void si_repack_q4_k(const uint8_t *src, int64_t nsuper, uint8_t *qs, float *d, float *m);
void si_repack_q6_k(const uint8_t *src, int64_t nsuper, uint8_t *qs, float *d);
void si_dequantize_rows(const qmat_t *w, int64_t r0, int64_t r1, float *out);
void si_attend1(const float *q, const float *k, const float *v, float *o, int64_t H, int64_t Hk, int64_t D,
                int64_t L, int64_t kstride, int64_t vstride, float scale);
void si_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps);
/* grow-only per-thread buffer `slot` (0..6, see ops.c) of at least n bytes, 64-byte aligned */
void *si_scratch(int slot, size_t n);
/* fused single-token decode steps of a pre-norm transformer block (decode.c) */
void si_decode_attn(const float *x, float *xo, int64_t n, const float *norm_w, float eps, const qmat_t *q,
                    const qmat_t *k, const qmat_t *v, const float *bq, const float *bk, const float *bv, int64_t H,
                    int64_t Hk, int64_t D, int64_t n_rot, const float *cos, const float *sin, float *kc, float *vc,
                    int64_t kstride, int64_t vstride, int64_t pos, const qmat_t *o, const float *o_bias,
                    float scale);
void si_decode_mlp(const float *x, float *xo, int64_t n, const float *norm_w, float eps, int act, int relu_up,
                   const qmat_t *gate, const qmat_t *upm, int64_t F, const qmat_t *down);
/* one token through an activation-sparse FFN (decode.c; SparseFFN in sparseinfer/sparse/ffn.py) */
typedef struct {
    int act, relu_up, fused;          /* fused: the one-pass kernel over the candidate rows */
    const uint8_t *records;           /* base of first/second/down_t's neuron records (si_record_base), or NULL */
    int64_t F;                        /* neurons, in hotness order */
    const qmat_t *first, *second;     /* gate and up, or (plain FFN) up and NULL */
    const qmat_t *first_up;           /* gate rows then up rows of one buffer (dense gate+up), or NULL */
    const float *first_bias, *second_bias;
    const qmat_t *down_t, *down;      /* (F, n) neuron-major in hotness order; (n, F) as stored */
    const int32_t *order;             /* order[k]: stored column of neuron k */
    const float *down_bias;
    const qmat_t *w1, *w2t;           /* the predictor, or NULL */
    const float *b1, *cut;
    int64_t topk;                     /* > 0: that many rows, the highest scores (forced density) */
    float threshold;                  /* keep |a| > threshold */
    float crossover, up_crossover;    /* down / up dense above that many kept (x F), else on the kept rows */
    int64_t *counters;                /* tokens, fused-kernel rows, first-projection rows, gate+up passes,
                                         dense ups, up rows, dense downs, down_t rows, kept, predictions */
    double *pred_seconds;
} sparse_mlp_t;
void si_decode_sparse_mlp(const float *x, float *xo, int64_t n, const float *norm_w, float eps,
                          const sparse_mlp_t *s, const int32_t *given, int64_t n_given);
double si_read_seconds(const uint8_t *p, int64_t nbytes, int reps);
double si_read_rows_seconds(const uint8_t *p, int64_t row_bytes, const int32_t *rows, int64_t n, int reps, int prefetch);

#endif
