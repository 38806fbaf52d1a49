/* Causal attention for one sequence in fp32 whose every output row depends only on its own query, its
 * position and the cache: each (token, head) is computed on its own by one thread, with its keys read in
 * order, so a 1-token decode and a block verify give bit-identical rows (torch's fp32 matmuls round a row
 * differently by the number of rows in the call). It also reads q in the projection's layout and writes the
 * output in the o projection's, so no permutes are needed around it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "dfq.h"

/* 8 elements from i of a cache row (fp32, or fp16 where `half`: the fused layers' caches) as floats */
static inline __attribute__((always_inline)) __m256 load8(const void *row, long i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)))
                : _mm256_loadu_ps((const float *)row + i);
}

/* cache row i of a buffer of hd-wide rows */
static inline __attribute__((always_inline)) const void *cache_row(const void *base, long i, long hd,
                                                                   const int half) {
    return (const char *)base + i * hd * (half ? 2 : 4);
}

/* a . b's 8 lane sums (b a cache row), to be summed as dfq_sum8 does */
static inline __attribute__((always_inline)) __m256 dot_lanes(const float *a, const void *b, long hd,
                                                              const int half) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long d = 0;
    for (; d + 16 <= hd; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b, d, half), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8(b, d + 8, half), s1);
    }
    for (; d < hd; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b, d, half), s0);
    return _mm256_add_ps(s0, s1);
}

/* dfq_sum8 of four vectors at once, (sum a, sum b, sum c, sum d): the same additions in the same grouping
 * (lanes i and i + 4, then those sums' 0 + 2 and 1 + 3, then the two), so the same bits, in 13 operations
 * where four dfq_sum8 take 28. */
static inline __m128 sum8_four(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 g = _mm256_add_ps(_mm256_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1));  /* g: a c a c | b d b d */
}

/* p[0..count) = exp(p - max), the padded tail lanes left out of the sum; returns 1 / the sum */
static float softmax_weights(float *p, long count, float max) {
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 vsum = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= count; j += 8) {
        __m256 e = dfq_exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), vmax));
        _mm256_storeu_ps(p + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (j < count) { /* the tail through the same vector exp, padded lanes left out of the sum */
        float tail[8] = {0};
        for (long i = j; i < count; i++) tail[i - j] = p[i] - max;
        __m256 e = dfq_exp8(_mm256_loadu_ps(tail));
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(count - j)), lane);
        e = _mm256_and_ps(e, _mm256_castsi256_ps(live));
        _mm256_storeu_ps(tail, e);
        for (long i = j; i < count; i++) p[i] = tail[i - j];
        vsum = _mm256_add_ps(vsum, e);
    }
    return 1.0f / dfq_sum8(vsum);
}


#define MAX_ROWS 16   /* queries per pass (their maxima and accumulators live on the stack) */
#define KEY_CHUNK 64  /* values read once per chunk for every query: the chunk stays in L1 between them */
#define D_CHUNK 128   /* head dimensions summed per pass over the values */

/* prefetches cache rows lo..end-1 (nothing where half < 0) */
static inline __attribute__((always_inline)) void prefetch_rows(const void *base, long hd, long lo, long end,
                                                                const int half) {
    for (long i = lo; half >= 0 && i < end; i++)
        for (long line = 0; line < hd * (half ? 2 : 4); line += 64)
            _mm_prefetch((const char *)cache_row(base, i, hd, half) + line, _MM_HINT_T0);
}

/* floats 8 * vecs from column d of fp16 cache rows lo..end-1 into out (rows of 8 * vecs): a chunk that several
 * queries and heads read, converted once (cvtph per load and per reader made a verify slower than fp32) */
static void widen_rows(const void *base, long hd, long d, long lo, long end, long vecs, float *out) {
    for (long i = lo; i < end; i++)
        for (long c = 0; c < vecs; c++)
            _mm256_storeu_ps(out + (i - lo) * 8 * vecs + 8 * c, load8(cache_row(base, i, hd, 1), d + 8 * c, 1));
}

/* sums (vecs vectors of 8) += w[i] * value row i over keys i0..end-1 (row i at v + i * hd): each lane one
 * multiply-add chain in key order, eight vectors at a time in registers. With `ahead`, the rows that many
 * keys on are prefetched, up to row most - 1 (the next chunk: re-reading a chunk per head breaks the hardware
 * prefetcher's stream). */
static inline __attribute__((always_inline)) void weighted_values(const float *w, const void *v, long hd, long i0,
                                                                  long end, long most, long vecs, float *sums,
                                                                  long ahead, const int half) {
    prefetch_rows(v, hd, i0 + ahead, (end < most - ahead ? end : most - ahead) + ahead, ahead ? half : -1);
    long c = 0;
    for (; c + 8 <= vecs; c += 8) {
        __m256 acc[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) acc[j] = _mm256_loadu_ps(sums + 8 * (c + j));
        for (long i = i0; i < end; i++) {
            const __m256 weight = _mm256_set1_ps(w[i]);
            const void *row = cache_row(v, i, hd, half);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(weight, load8(row, 8 * (c + j), half), acc[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(sums + 8 * (c + j), acc[j]);
    }
    for (; c < vecs; c++) {
        __m256 acc = _mm256_loadu_ps(sums + 8 * c);
        for (long i = i0; i < end; i++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), load8(cache_row(v, i, hd, half), 8 * c, half), acc);
        _mm256_storeu_ps(sums + 8 * c, acc);
    }
}

/* The `heads` query heads of one key/value group for `rows` queries at once (query r at q + r * q_stride,
 * its output at out + r * out_stride, seeing keys lo..lo+count[r]-1): each key and value row is read once for
 * all of them (a verify's 8 queries used to read the whole cache 8 times). Each query's scores, maximum,
 * weights and sums are the same operations in the same order as alone. */
static inline __attribute__((always_inline)) void attend_rows(const float *q, long q_stride, long rows, long heads,
                                                              long hd, const void *keys, const void *values,
                                                              long lo, const long *count, float scale, float *out,
                                                              long out_stride, const int half) {
    long most = 0;
    for (long r = 0; r < rows; r++) most = count[r] > most ? count[r] : most;
    const long stride = most + 8;
    const size_t need = (size_t)(rows * heads * stride);
    float stack[8 * 512], *p = need <= 8 * 512 ? stack : malloc(sizeof(float) * need);
    const void *kb = cache_row(keys, lo, hd, half), *vb = cache_row(values, lo, hd, half);
    float max[MAX_ROWS][8], inv[MAX_ROWS][8];
    __m128 vmax[MAX_ROWS][8];
    const __m128 vscale = _mm_set1_ps(scale);
    for (long r = 0; r < rows; r++)
        for (long h = 0; h < heads; h++) vmax[r][h] = _mm_set1_ps(-INFINITY);
    /* several queries: four keys' scores per query and head at a time (the four keys stay in L1 for all of
     * them); one query (a decode) takes its keys one by one, which measured faster for it on Zen 4 at long
     * context. The sums are the same either way. */
    const long blocked = rows > 1 ? 4 : 0;
    float keys4[half ? 4 * 1024 : 1];  /* (hd <= 1024: engine/cpu/c_layers.py) */
    for (long j = 0; blocked && j + 4 <= most; j += 4) {
        const void *k0 = cache_row(kb, j, hd, half), *k1 = cache_row(kb, j + 1, hd, half);
        const void *k2 = cache_row(kb, j + 2, hd, half), *k3 = cache_row(kb, j + 3, hd, half);
        if (half) {  /* the four keys in fp32 once, for every query and head */
            widen_rows(kb, hd, 0, j, j + 4, hd / 8, keys4);
            k0 = keys4, k1 = keys4 + hd, k2 = keys4 + 2 * hd, k3 = keys4 + 3 * hd;
        }
        for (long r = 0; r < rows; r++) {
            if (j + 4 > count[r]) continue;
            for (long h = 0; h < heads; h++) {
                const float *qh = q + r * q_stride + h * hd;
                const __m128 scores = _mm_mul_ps(sum8_four(dot_lanes(qh, k0, hd, 0), dot_lanes(qh, k1, hd, 0),
                                                           dot_lanes(qh, k2, hd, 0), dot_lanes(qh, k3, hd, 0)),
                                                 vscale);
                _mm_storeu_ps(p + (r * heads + h) * stride + j, scores);
                vmax[r][h] = _mm_max_ps(scores, vmax[r][h]);  /* a NaN score leaves the max as it was, as below */
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        for (long h = 0; h < heads; h++) {
            float lanes[4];
            _mm_storeu_ps(lanes, vmax[r][h]);
            max[r][h] = lanes[0];
            for (int i = 1; i < 4; i++) max[r][h] = lanes[i] > max[r][h] ? lanes[i] : max[r][h];
        }
        for (long j = blocked ? count[r] & ~3L : 0; j < count[r]; j++) { /* the last keys one at a time */
            const void *k = cache_row(kb, j, hd, half);
            for (long h = 0; h < heads; h++) {
                const float score = dfq_sum8(dot_lanes(q + r * q_stride + h * hd, k, hd, half)) * scale;
                p[(r * heads + h) * stride + j] = score;
                max[r][h] = score > max[r][h] ? score : max[r][h];
            }
        }
        for (long h = 0; h < heads; h++) inv[r][h] = softmax_weights(p + (r * heads + h) * stride, count[r], max[r][h]);
    }
    /* the weighted values: each (query, head)'s sums over D_CHUNK dimensions at a time (all of them for a head
     * dimension up to 128), kept in `sums` between chunks of KEY_CHUNK keys; a chunk of values stays in L1
     * for every query and head, so each value row is streamed from memory once */
    float one[8 * D_CHUNK], *sums = rows > 1 ? malloc(sizeof(float) * (size_t)(rows * heads * D_CHUNK)) : one;
    float chunk[half ? KEY_CHUNK * D_CHUNK : 1];  /* a chunk of fp16 values in fp32 (widened below) */
    for (long d = 0; d < hd; d += D_CHUNK) {
        const long vecs = (hd - d < D_CHUNK ? hd - d : D_CHUNK) / 8;
        for (long s = 0; s < rows * heads * D_CHUNK; s++) sums[s] = 0.0f;
        for (long i0 = 0; i0 < most; i0 += KEY_CHUNK) {
            const long ahead = d == 0 && i0 + KEY_CHUNK < most ? KEY_CHUNK : 0;
            const int widened = half && rows > 1;  /* several queries read the chunk: in fp32 once */
            if (widened) {
                const long last = i0 + KEY_CHUNK < most ? i0 + KEY_CHUNK : most;
                prefetch_rows(vb, hd, last, last + ahead < most ? last + ahead : most, ahead ? 1 : -1);
                widen_rows(vb, hd, d, i0, last, vecs, chunk);
            }
            for (long r = 0; r < rows; r++) {
                const long end = i0 + KEY_CHUNK < count[r] ? i0 + KEY_CHUNK : count[r];
                for (long h = 0; end > i0 && h < heads; h++) {
                    const float *w = p + (r * heads + h) * stride;
                    if (widened)  /* the chunk's row i at chunk + (i - i0) * 8 * vecs */
                        weighted_values(w + i0, chunk, 8 * vecs, 0, end - i0, end - i0, vecs,
                                        sums + (r * heads + h) * D_CHUNK, 0, 0);
                    else
                        weighted_values(w, half ? (const void *)((const uint16_t *)vb + d)
                                                : (const void *)((const float *)vb + d),
                                        hd, i0, end, most, vecs, sums + (r * heads + h) * D_CHUNK,
                                        r + h == 0 ? ahead : 0, half);
                }
            }
        }
        for (long r = 0; r < rows; r++)
            for (long h = 0; h < heads; h++) {
                const __m256 vinv = _mm256_set1_ps(inv[r][h]);
                const float *sh = sums + (r * heads + h) * D_CHUNK;
                for (long c = 0; c < vecs; c++)
                    _mm256_storeu_ps(out + r * out_stride + h * hd + d + 8 * c,
                                     _mm256_mul_ps(_mm256_loadu_ps(sh + 8 * c), vinv));
            }
    }
    if (sums != one) free(sums);
    if (p != stack) free(p);
}

/* attend_rows for fp32 or fp16 caches, and instances for the common head dimensions (64: SmolLM2; 128: Llama,
 * Qwen3, Mistral), where hd is a constant: the compiler unrolls the dot products and loads each query vector
 * once for four keys (the demo's verify of 8 rows 1.3% faster at 200 positions, 2.6% at 2,000, on Zen 4). Every
 * instance runs the same operations in the same order: the same bits. */
#define ATTEND_ROWS(name, half, HD)                                                                              \
    static void name(const float *q, long q_stride, long rows, long heads, long hd, const void *keys,            \
                     const void *values, long lo, const long *count, float scale, float *out, long out_stride) { \
        attend_rows(q, q_stride, rows, heads, HD ? HD : hd, keys, values, lo, count, scale, out, out_stride, half); \
    }
ATTEND_ROWS(attend_rows_f32, 0, 0)
ATTEND_ROWS(attend_rows_f16, 1, 0)
ATTEND_ROWS(attend_rows_f32_hd64, 0, 64)
ATTEND_ROWS(attend_rows_f16_hd64, 1, 64)
ATTEND_ROWS(attend_rows_f32_hd128, 0, 128)
ATTEND_ROWS(attend_rows_f16_hd128, 1, 128)

typedef void (*attend_rows_fn)(const float *, long, long, long, long, const void *, const void *, long, const long *,
                               float, float *, long);

/* attend_rows over a cache of fp32 rows, or of fp16 rows where `half` (dfq.h); in parts of at most 8 heads
 * and MAX_ROWS queries (the accumulators that registers and the stack hold) */
void dfq_attend_rows(const float *q, long q_stride, long rows, long heads, long hd, const void *keys,
                     const void *values, long lo, const long *count, float scale, float *out, long out_stride,
                     int half) {
    const attend_rows_fn attend = hd == 64    ? (half ? attend_rows_f16_hd64 : attend_rows_f32_hd64)
                                  : hd == 128 ? (half ? attend_rows_f16_hd128 : attend_rows_f32_hd128)
                                              : (half ? attend_rows_f16 : attend_rows_f32);
    for (long h = 0; h < heads; h += 8)
        for (long r = 0; r < rows; r += MAX_ROWS)
            attend(q + r * q_stride + h * hd, q_stride, rows - r < MAX_ROWS ? rows - r : MAX_ROWS,
                   heads - h < 8 ? heads - h : 8, hd, keys, values, lo, count + r, scale, out + r * out_stride + h * hd,
                   out_stride);
}

/* q: (n, heads, hd) with row stride q_stride (floats between tokens); keys/values: (kv, capacity, hd), buffer
 * row == position, fp32, or fp16 where `half`; positions (n,); a query at position p sees keys lo..p, lo =
 * p - window + 1 with a window, else 0; scale multiplies the scores; out: (n, heads * hd). hd is a multiple
 * of 8. */
void dfq_attention(const float *q, long q_stride, long n, long heads, long kv, long hd, const void *keys,
                   const void *values, long capacity, const int64_t *positions, long window, float scale,
                   float *out, int half) {
    const long group = heads / kv, tasks = n * kv, size = half ? 2 : 4;
#pragma omp parallel for schedule(static) if (tasks > 1 && positions[n - 1] * tasks * group > 2048)
    for (long task = 0; task < tasks; task++) {
        const long t = task / kv, g = task % kv, pos = positions[t];
        const long lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0, count = pos - lo + 1;
        dfq_attend_rows(q + t * q_stride + g * group * hd, 0, 1, group, hd,
                        (const char *)keys + g * capacity * hd * size, (const char *)values + g * capacity * hd * size,
                        lo, &count, scale, out + t * heads * hd + g * group * hd, 0, half);
    }
}
