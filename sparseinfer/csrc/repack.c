/* GGUF K-quant super-blocks -> our q4 / q6 layouts, at load time.
 *
 * Why by hand: the gguf package only dequantizes to float, and our numpy converters
 * (sparseinfer/io/gguf.py: _q4_k, _q6_k + quant.pack_q6, kept as the reference the tests
 * compare against) make many passes over temporaries, which dominated the load time of
 * K-quant GGUF files.  These loops do the same bit shuffles in one pass per super-block.
 *
 * Scales come out as float32 products exactly as numpy computes them (f16 -> f32, times the
 * integer sub-scale in f32); the caller rounds them to f16 (round to nearest even, as numpy's
 * astype does), so the results are bit-identical to the reference converters. */
#include <stdint.h>
#include <string.h>

#include "common.h"

/* Q4_K super-block (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit sub-scales and mins,
 * 128 bytes of nibbles (chunk c of 64 values: byte 32c + l holds value 64c + l in its low
 * nibble and value 64c + 32 + l in its high one).  Out, per 32-value block b: 16 bytes in our
 * q4 order (byte l = value l | value l + 16 << 4), d[b] = d * sc_b, m[b] = -(dmin * mn_b). */
void si_repack_q4_k(const uint8_t *src, int64_t nsuper, uint8_t *qs, float *d, float *m) {
    for (int64_t s = 0; s < nsuper; s++) {
        const uint8_t *x = src + 144 * s;
        uint16_t hd, hm;
        memcpy(&hd, x, 2);
        memcpy(&hm, x + 2, 2);
        const float dd = si_h2f(hd), dmin = si_h2f(hm);
        const uint8_t *sc = x + 4, *q = x + 16;
        for (int j = 0; j < 8; j++) {
            int a, b;
            if (j < 4) {
                a = sc[j] & 63;
                b = sc[j + 4] & 63;
            } else {
                a = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
                b = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
            }
            d[8 * s + j] = dd * (float)a;
            m[8 * s + j] = -(dmin * (float)b);
            /* block j: chunk j / 2, nibble j % 2 */
            const uint8_t *src_b = q + 32 * (j >> 1);
            const int sh = 4 * (j & 1);
            uint8_t *o = qs + 128 * s + 16 * j;
            for (int l = 0; l < 16; l++)
                o[l] = (uint8_t)(((src_b[l] >> sh) & 0x0F) | (((src_b[l + 16] >> sh) & 0x0F) << 4));
        }
    }
}

/* Q6_K super-block (210 bytes): ql[128], qh[64], int8 scales[16], f16 d.  In half h of 128
 * values, value 32 i + l (i < 4, l < 32) takes nibble i / 2 of ql[64 h + 32 (i % 2) + l] and
 * bits 2i..2i+1 of qh[32 h + l].  Out: our q6 layout (quant.py), a group of 4 blocks of 32 per
 * 128 values = 96 bytes: byte 16 i + l = low nibbles of values 32 i + l and 32 i + 16 + l;
 * byte 64 + 16 k + l = 2-bit high parts of values (block k, l), (block k + 2, l),
 * (block k, 16 + l), (block k + 2, 16 + l) at shifts 0, 2, 4, 6; d[16 per super-block] =
 * d * scale. */
void si_repack_q6_k(const uint8_t *src, int64_t nsuper, uint8_t *qs, float *d) {
    for (int64_t s = 0; s < nsuper; s++) {
        const uint8_t *x = src + 210 * s;
        uint16_t hd;
        memcpy(&hd, x + 208, 2);
        const float dd = si_h2f(hd);
        for (int j = 0; j < 16; j++) d[16 * s + j] = dd * (float)(int8_t)x[192 + j];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = x + 64 * h, *qh = x + 128 + 32 * h;
            uint8_t v[128]; /* codes 0..63 of this half, in value order */
            for (int i = 0; i < 4; i++)
                for (int l = 0; l < 32; l++)
                    v[32 * i + l] = (uint8_t)(((ql[32 * (i & 1) + l] >> (4 * (i >> 1))) & 0x0F) |
                                              (((qh[l] >> (2 * i)) & 3) << 4));
            uint8_t *o = qs + 192 * s + 96 * h;
            for (int i = 0; i < 4; i++)
                for (int l = 0; l < 16; l++)
                    o[16 * i + l] = (uint8_t)((v[32 * i + l] & 0x0F) | ((v[32 * i + 16 + l] & 0x0F) << 4));
            for (int k = 0; k < 2; k++)
                for (int l = 0; l < 16; l++)
                    o[64 + 16 * k + l] = (uint8_t)((v[32 * k + l] >> 4) | ((v[32 * (k + 2) + l] >> 4) << 2) |
                                                   ((v[32 * k + 16 + l] >> 4) << 4) |
                                                   ((v[32 * (k + 2) + 16 + l] >> 4) << 6));
        }
    }
}
