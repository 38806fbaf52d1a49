/* Shared declarations of the project's C kernels (engine/native.py builds and loads them). */
#ifndef DFQ_H
#define DFQ_H
#include <stdint.h>

#define QK 32

/* a linear (n outputs, a multiple of 8; k inputs, a multiple of 32) in 4 bits (kind 4, w = d * code + m)
 * or 8 bits (kind 8, w = d * code), codes and fp16 d (and m) in int8_matmul.c's layout; bias (n) or NULL */
struct dfq_linear {
    long kind, n, k;
    const void *codes, *d, *m;
    const float *bias;
};

/* Rows of k floats as 8-bit blocks: codes q (k), scales d and sums s (k/32) per row. */
void dfq_quantize_row(const float *x, long k, int8_t *q, float *d, float *s);

/* out[r * out_stride + o] (=, or += with accumulate) row r of the quantized activations times weight row o.
 * Inside a parallel region the outputs are shared out among its threads (an orphaned omp for, with its
 * barrier); outside one, it runs on the calling thread. */
void dfq_matmul_rows(const struct dfq_linear *w, const int8_t *aq, const float *ad, const float *as, long m,
                     float *out, long out_stride, int accumulate);

/* One (token, head) of causal attention: q (hd), keys/values rows lo..lo+count-1 of (capacity, hd) head
 * buffers, out (hd). */
void dfq_attend_one(const float *q, long hd, const float *keys, const float *values, long lo, long count,
                    float scale, float *out);

#endif
