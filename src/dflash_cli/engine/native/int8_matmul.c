/* 4-bit and 8-bit weights times 8-bit activations on AVX2 (what llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0
 * dot products compute), built once per CPU by engine/native.py and called through ctypes.
 *
 * Activations: each row is quantized on its own in blocks of 32 (a scale d = max|x| / 127, codes
 * round(x / d), and s = d * sum(codes)). Weights: q4 blocks of 32 with w = d * code + m, codes 0..15 in 16
 * bytes (byte j: code j in the low nibble, code j + 16 in the high one); q8 rows of int8 codes with one scale
 * per block of 32. Integer dot products per block (maddubs), fp32 accumulation.
 *
 * Row-exact: output (r, o) is computed from activation row r and weight row o alone, by the same sequence
 * of operations whatever the number of rows or threads (threads split the outputs, never a sum), so a
 * 1-token decode and a block verify give bit-identical rows. Build with -ffp-contract=off: a contracted
 * multiply-add in one tile shape and not another would break that.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32

int dfq_abi_version(void) { return 1; }

int dfq_max_threads(void) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* One row of k floats as k/32 blocks: codes q (k), scales d and sums s (k/32). */
static void quantize_row(const float *x, long k, int8_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float max = _mm_cvtss_f32(m);
        const float scale = max / 127.0f;
        const float inv = max != 0.0f ? 127.0f / max : 0.0f;
        const __m256 mul = _mm256_set1_ps(inv);
        __m256i i32[4];
        for (int j = 0; j < 4; j++)
            i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], mul),
                                                        _MM_ROUND_NEAREST | _MM_FROUND_NO_EXC));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* pack 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes; the permute undoes it) */
        __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
        __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), p8);
        d[b] = scale;
        s[b] = scale * (float)_mm_cvtsi128_si32(s4);
    }
}

void dfq_quantize_rows(const float *x, long rows, long k, int8_t *q, float *d, float *s) {
    for (long r = 0; r < rows; r++) quantize_row(x + r * k, k, q + r * k, d + r * (k / QK), s + r * (k / QK));
}

static inline __m256i unpack_q4(const uint8_t *qs) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(t, mask), hi = _mm_and_si128(_mm_srli_epi16(t, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

/* Up to R activation rows times C weight rows of q4. acc[r][c] runs the same operations for every (r, c),
 * whatever R and C are. */
#define Q4_TILE(R, C)                                                                                      \
    static inline void q4_tile_##R##_##C(const int8_t *aq, const float *ad, const float *as, long k,        \
                                         const void *wqv, const float *wd, const float *wm, long o,           \
                                         long n, float *out, const float *bias) {                            \
        const long nb = k / QK;                                                                             \
        const uint8_t *wq = wqv;                                                                            \
        const __m256i ones = _mm256_set1_epi16(1);                                                          \
        __m256 acc[R][C];                                                                                   \
        float summ[R][C];                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) { acc[r][c] = _mm256_setzero_ps(); summ[r][c] = 0.0f; }              \
        for (long b = 0; b < nb; b++) {                                                                     \
            __m256i w[C];                                                                                   \
            float dw[C], mw[C];                                                                             \
            for (int c = 0; c < C; c++) {                                                                   \
                w[c] = unpack_q4(wq + (o + c) * (k / 2) + b * 16);                                          \
                dw[c] = wd[(o + c) * nb + b];                                                               \
                mw[c] = wm[(o + c) * nb + b];                                                               \
            }                                                                                               \
            for (int r = 0; r < R; r++) {                                                                   \
                __m256i a = _mm256_loadu_si256((const __m256i *)(aq + r * k + b * QK));                     \
                float da = ad[r * nb + b], sa = as[r * nb + b];                                             \
                for (int c = 0; c < C; c++) {                                                               \
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w[c], a), ones);                     \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[c] * da), acc[r][c]); \
                    summ[r][c] += mw[c] * sa;                                                               \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) {                                                                   \
                float y = hsum(acc[r][c]) + summ[r][c];                                                     \
                out[r * n + o + c] = bias ? y + bias[o + c] : y;                                            \
            }                                                                                               \
    }

/* the same for q8 weights (one scale per block): |w| times a with w's sign, as maddubs needs */
#define Q8_TILE(R, C)                                                                                      \
    static inline void q8_tile_##R##_##C(const int8_t *aq, const float *ad, const float *as, long k,        \
                                         const void *wqv, const float *wd, const float *unused, long o,       \
                                         long n, float *out, const float *bias) {                            \
        (void)as; (void)unused;                                                                             \
        const int8_t *wq = wqv;                                                                             \
        const long nb = k / QK;                                                                             \
        const __m256i ones = _mm256_set1_epi16(1);                                                          \
        __m256 acc[R][C];                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                                     \
        for (long b = 0; b < nb; b++) {                                                                     \
            __m256i w[C], wabs[C];                                                                          \
            float dw[C];                                                                                    \
            for (int c = 0; c < C; c++) {                                                                   \
                w[c] = _mm256_loadu_si256((const __m256i *)(wq + (o + c) * k + b * QK));                    \
                wabs[c] = _mm256_sign_epi8(w[c], w[c]);                                                     \
                dw[c] = wd[(o + c) * nb + b];                                                               \
            }                                                                                               \
            for (int r = 0; r < R; r++) {                                                                   \
                __m256i a = _mm256_loadu_si256((const __m256i *)(aq + r * k + b * QK));                     \
                float da = ad[r * nb + b];                                                                  \
                for (int c = 0; c < C; c++) {                                                               \
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[c], _mm256_sign_epi8(a, w[c])), ones); \
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw[c] * da), acc[r][c]); \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) {                                                                   \
                float y = hsum(acc[r][c]);                                                                  \
                out[r * n + o + c] = bias ? y + bias[o + c] : y;                                            \
            }                                                                                               \
    }

Q4_TILE(1, 1) Q4_TILE(2, 1) Q4_TILE(3, 1) Q4_TILE(4, 1)
Q4_TILE(1, 2) Q4_TILE(2, 2) Q4_TILE(3, 2) Q4_TILE(4, 2)
Q8_TILE(1, 1) Q8_TILE(2, 1) Q8_TILE(3, 1) Q8_TILE(4, 1)
Q8_TILE(1, 2) Q8_TILE(2, 2) Q8_TILE(3, 2) Q8_TILE(4, 2)

typedef void (*tile_fn)(const int8_t *, const float *, const float *, long, const void *, const float *,
                        const float *, long, long, float *, const float *);

static const tile_fn Q4_TILES[2][4] = {
    {q4_tile_1_1, q4_tile_2_1, q4_tile_3_1, q4_tile_4_1},
    {q4_tile_1_2, q4_tile_2_2, q4_tile_3_2, q4_tile_4_2}};
static const tile_fn Q8_TILES[2][4] = {
    {q8_tile_1_1, q8_tile_2_1, q8_tile_3_1, q8_tile_4_1},
    {q8_tile_1_2, q8_tile_2_2, q8_tile_3_2, q8_tile_4_2}};

/* Columns in chunks of 16 (pairs inside), each chunk over all rows in tiles of 4: a thread reads its
 * weight rows once per 4 activation rows. */
#define CHUNK 16

static void matmul(const tile_fn tiles[2][4], const float *x, long m, long k, const void *wq, const float *wd,
                   const float *wm, long n, const float *bias, float *out) {
    const long nb = k / QK;
    int8_t *aq = malloc((size_t)(m * k));
    float *ad = malloc(sizeof(float) * (size_t)(m * nb)), *as = malloc(sizeof(float) * (size_t)(m * nb));
    dfq_quantize_rows(x, m, k, aq, ad, as);
    const long chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (chunks > 1 && m * n * k > 65536)
    for (long ch = 0; ch < chunks; ch++) {
        const long o0 = ch * CHUNK, o1 = o0 + CHUNK < n ? o0 + CHUNK : n;
        for (long r = 0; r < m; r += 4) {
            const int rows = m - r < 4 ? (int)(m - r) : 4;
            for (long o = o0; o < o1;) {
                const int cols = o1 - o >= 2 ? 2 : 1;
                tiles[cols - 1][rows - 1](aq + r * k, ad + r * nb, as + r * nb, k, wq, wd, wm, o, n,
                                          out + r * n, bias);
                o += cols;
            }
        }
    }
    free(aq);
    free(ad);
    free(as);
}

/* out (m, n) = x (m, k) times the q4 weight (n, k): codes (n, k/2), d and m (n, k/32). */
void dfq_q4_matmul(const float *x, long m, long k, const uint8_t *codes, const float *d, const float *mins,
                   long n, const float *bias, float *out) {
    matmul(Q4_TILES, x, m, k, codes, d, mins, n, bias, out);
}

/* out (m, n) = x (m, k) times the q8 weight (n, k): codes (n, k), d (n, k/32). */
void dfq_q8_matmul(const float *x, long m, long k, const int8_t *codes, const float *d, long n,
                   const float *bias, float *out) {
    matmul(Q8_TILES, x, m, k, codes, d, NULL, n, bias, out);
}
