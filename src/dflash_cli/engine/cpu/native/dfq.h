/* Shared declarations of the project's C kernels (engine/native.py builds and loads them). */
#ifndef DFQ_H
#define DFQ_H
#include <immintrin.h>
#include <stdint.h>

#define QK 32

/* the AMX build is the AVX-512 VNNI build with tiles for calls of several rows (int8_amx.h) */
#if defined(DFQ_AMX) && !defined(DFQ_AVX512_VNNI)
#define DFQ_AVX512_VNNI
#endif

/* a linear (n outputs, a multiple of 8; k inputs, a multiple of 32) in 4 bits (kind 4, w = d * code + m)
 * or 8 bits (kind 8, w = d * code), codes and fp16 d (and m) in int8_matmul.c's layout; bias (n) or NULL */
struct dfq_linear {
    long kind, n, k;
    const void *codes, *d, *m;
    const float *bias;
};

/* how many groups of 8 output columns dfq_matmul_rows gives a thread at a time (16 columns per instruction
 * with AVX-512) */
#ifdef DFQ_AVX512_VNNI
#define DFQ_GROUPS_PER_STEP 2
#else
#define DFQ_GROUPS_PER_STEP 1
#endif

/* Rows of k floats as 8-bit blocks: codes q (k), scales d and sums s (k/32) per row. */
void dfq_quantize_row(const float *x, long k, int8_t *q, float *d, float *s);

/* out[r * out_stride + o] (=, or += with accumulate) row r of the quantized activations times weight row o.
 * Inside a parallel region the outputs are shared out among its threads (an orphaned omp for, with its
 * barrier); outside one, it runs on the calling thread. */
void dfq_matmul_rows(const struct dfq_linear *w, const int8_t *aq, const float *ad, const float *as, long m,
                     float *out, long out_stride, int accumulate);

/* Causal attention of `rows` queries of one key/value group's `heads` heads (query r at q + r * q_stride, its
 * output at out + r * out_stride) over rows lo..lo+count[r]-1 of the group's (capacity, hd) key and value
 * buffers, in fp32, or fp16 where `half` (the C layers' caches). */
void dfq_attend_rows(const float *q, long q_stride, long rows, long heads, long hd, const void *keys,
                     const void *values, long lo, const long *count, float scale, float *out, long out_stride,
                     int half);

/* Kernels one file calls from another (the C calls of a whole draft and a whole forward: draft.c, layer.c). */
void dfq_linear_forward(const struct dfq_linear *w, const float *x, long m, float *out);
long dfq_q8_rows(const int8_t *codes, const uint16_t *d, long k, long rows, const long *ids, long count,
                 float *out);
void dfq_shortlist_rows(const float *x, long rows, long k, const int8_t *codes, const uint16_t *d, const float *bias,
                        long n, float *logits, long ld, long top);
void dfq_rms_norm_rows(const float *x, long rows, long k, const float *w, float eps, float *out);
struct dfq_draft_layer;
void dfq_draft_layer_forward(const struct dfq_draft_layer *L, float *h, long B, const float *ctx, long P,
                             long committed, const float *cos, const float *signed_sin, float *keys,
                             float *values, long capacity);
long dfq_argmax_rows(const float *x, long rows, long n, long stride, int64_t *out);
long dfq_argmax_confidence_rows(const float *x, long rows, long n, long stride, int64_t *out, float *top);

/* the sum of a vector's 8 lanes, always in the same order */
static inline float dfq_sum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* exp(x) for 8 floats (Cephes' polynomial, as the common AVX "mathfun" ports: ~1 ulp over the range
 * softmax and SiLU need; below -87 it flushes to 0) */
static inline __m256 dfq_exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif
