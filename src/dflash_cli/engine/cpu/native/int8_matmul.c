/* 4-bit and 8-bit weights times 8-bit activations (what llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products
 * compute), built once per CPU by engine/cpu/native.py and called through ctypes.
 *
 * Activations: each row is quantized on its own in blocks of 32 (a scale d = max|x| / 127, codes
 * round(x / d), and s = d * sum(codes)). Weights: q4 blocks of 32 with w = d * code + m (codes 0..15), q8
 * blocks of 32 with w = d * code (codes -127..127), d and m fp16, laid out 8 output columns at a time
 * (below). Integer dot products per block, fp32 accumulation.
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

#include "dfq.h"

/* Which instruction sums the 8-bit products, chosen per CPU at build time (native.py's variants): AVX2's
 * maddubs (+ madd), or vpdpbusd (DFQ_AVX_VNNI: the VEX form on ymm; DFQ_AVX512_VNNI: the EVEX form, with
 * int8_avx512.h taking two groups of 8 columns per zmm), or AMX tiles for calls of several rows beside that
 * (DFQ_AMX, int8_amx.h). Integer sums are exact in every variant and the float part is the same sequence per
 * lane, so all variants give the same bits. DFQ_EMULATE (tests only) takes vpdpbusd from SIMDe's portable
 * headers and the tiles from amx_emulate.h, so a CPU without them runs the same source. */
#if defined(DFQ_EMULATE) && (defined(DFQ_AVX_VNNI) || defined(DFQ_AVX512_VNNI))
#include <simde/x86/avx512.h>
#define DFQ_VNNI 1
#define dpbusd256 simde_mm256_dpbusd_epi32
#elif defined(DFQ_AVX512_VNNI)
#define DFQ_VNNI 1
#define dpbusd256 _mm256_dpbusd_epi32
#elif defined(DFQ_AVX_VNNI)
#define DFQ_VNNI 1
#define dpbusd256 _mm256_dpbusd_avx_epi32
#endif

int dfq_abi_version(void) { return 5; }

int dfq_max_threads(void) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* One row of k floats as k/32 blocks: codes q (k), scales d and sums s (k/32). */
void dfq_quantize_row(const float *x, long k, int8_t *q, float *d, float *s) {
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
    for (long r = 0; r < rows; r++) dfq_quantize_row(x + r * k, k, q + r * k, d + r * (k / QK), s + r * (k / QK));
}

/* Weights are laid out for 8 output columns at a time (one column per lane of a vector): for each group of
 * 8 columns and each block of 32 inputs, q4 has 4 vectors of 32 bytes, byte 4c + i of vector t holding
 * column c's code of input 4t + i in its low nibble and of input 16 + 4t + i in its high nibble, then the 8
 * columns' d and m as fp16; q8 has 8 vectors, byte 4c + i of vector t column c's int8 code of input
 * 4t + i, then the 8 d as fp16. A row's 4 activation codes are broadcast to the 8 lanes, and maddubs
 * multiplies them with each column's 4 codes: no horizontal sums, one scale multiply for 8 outputs. */

/* Software prefetch of a group's codes and scales DFQ_PREFETCH_BYTES ahead of the block being read, on top of
 * the hardware's: a call of several rows computes long enough per block that the hardware prefetcher falls
 * behind and the loads stall on memory instead of overlapping it (on Zen 4, 8 rows from memory ran as long as
 * 8 rows from cache plus a 1-row call; with it, about as long as the slower of the two). Past the group's end
 * it fetches the next group's bytes, which the same thread reads next; a prefetch never faults. */
#ifndef DFQ_PREFETCH_BYTES
#define DFQ_PREFETCH_BYTES 4096
#endif
static inline __attribute__((always_inline)) void prefetch_block(const void *codes, long block_bytes,
                                                                 const uint16_t *d, const uint16_t *m, long b) {
    const long ahead = DFQ_PREFETCH_BYTES / block_bytes;
    const char *next = (const char *)codes + (b + ahead) * block_bytes;
    for (long line = 0; line < block_bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    if ((b & 3) == 0) { /* 8 fp16 scales a block: one cache line per 4 blocks */
        _mm_prefetch((const char *)(d + (b + ahead) * 8), _MM_HINT_T0);
        if (m) _mm_prefetch((const char *)(m + (b + ahead) * 8), _MM_HINT_T0);
    }
}

/* the 8 outputs of a group: + bias, then = or += */
static inline void store8(float *out, __m256 y, const float *bias, int accumulate) {
    if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias));
    if (accumulate) y = _mm256_add_ps(_mm256_loadu_ps(out), y);
    _mm256_storeu_ps(out, y);
}

static inline __m256i bcast4(const int8_t *a) {
    int32_t v;
    memcpy(&v, a, 4);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) void q4_group(const int R, const int8_t *aq, const float *ad,
                                                           const float *as, long k, const uint8_t *codes,
                                                           const uint16_t *d, const uint16_t *m, float *out,
                                                           long ldo, const float *bias, int accumulate) {
    const long nb = k / QK;
    const __m256i low = _mm256_set1_epi8(0x0f);
#ifndef DFQ_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *cb = codes + b * 128;
        prefetch_block(codes, 128, d, m, b);
        __m256i s16[4];  /* int32 sums with VNNI; without, int16 ones until the block's end */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(cb + 32 * t));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const int8_t *a = aq + r * k + b * QK;
#ifdef DFQ_VNNI
                s16[r] = dpbusd256(dpbusd256(s16[r], lo, bcast4(a + 4 * t)), hi, bcast4(a + 16 + 4 * t));
#else
                /* |sum| <= 8 * 2 * 15 * 127 = 30480: int16 holds the block's 8 maddubs terms */
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, bcast4(a + 4 * t)));
                s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, bcast4(a + 16 + 4 * t)));
#endif
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * 8)));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b * 8)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
#ifdef DFQ_VNNI
            const __m256 sums = _mm256_cvtepi32_ps(s16[r]);
#else
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));
#endif
            acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(dw, _mm256_set1_ps(ad[r * nb + b])), acc[r]);
            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(as[r * nb + b]), acc[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) store8(out + r * ldo, acc[r], bias, accumulate);
}

static inline __attribute__((always_inline)) void q8_group(const int R, const int8_t *aq, const float *ad,
                                                           const int32_t *off, long k, const int8_t *codes,
                                                           const uint16_t *d, float *out, long ldo,
                                                           const float *bias, int accumulate) {
    const long nb = k / QK;
#ifdef DFQ_VNNI
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    (void)off;
#endif
    __m256 acc[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const int8_t *cb = codes + b * 256;
        prefetch_block(codes, 256, d, NULL, b);
        __m256i s32[4];
#pragma GCC unroll 4
#ifdef DFQ_VNNI
        for (int r = 0; r < R; r++) s32[r] = _mm256_set1_epi32(off[r * nb + b]);
#else
        for (int r = 0; r < R; r++) s32[r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 1
        for (int t = 0; t < 8; t++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(cb + 32 * t));
#ifdef DFQ_VNNI
            const __m256i biased = _mm256_xor_si256(w, flip);  /* w + 128, unsigned */
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) s32[r] = dpbusd256(s32[r], biased, bcast4(aq + r * k + b * QK + 4 * t));
#else
            const __m256i wabs = _mm256_sign_epi8(w, w);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i a = _mm256_sign_epi8(bcast4(aq + r * k + b * QK + 4 * t), w);
                s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, a), ones));
            }
#endif
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * 8)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), _mm256_mul_ps(dw, _mm256_set1_ps(ad[r * nb + b])),
                                     acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) store8(out + r * ldo, acc[r], bias, accumulate);
}

/* The q8 kernels with vpdpbusd (unsigned x signed) take each weight code as w + 128 (one xor, shared by all
 * rows) and start each block's sum at -128 times the sum of its activation codes, which leaves the same exact
 * integer sum. Without it each row would flip the sign of its activations per weight vector (AVX2's sign
 * trick: one more operation per vpdpbusd). off[i] for the blocks of m rows, laid out as ad. */
#define OFFSETS_ON_STACK 2048
#ifdef DFQ_VNNI
static void q8_offsets(const int8_t *aq, long blocks, int32_t *off) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), zero = _mm256_setzero_si256();
    for (long i = 0; i < blocks; i++) {
        /* the sum of 32 codes + 128 each as 4 sums of 8 (psadbw), then less 32 * 128 */
        const __m256i sums = _mm256_sad_epu8(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(aq + i * QK)),
                                                              flip), zero);
        const __m128i two = _mm_add_epi64(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        const long total = _mm_cvtsi128_si64(_mm_add_epi64(two, _mm_unpackhi_epi64(two, two))) - QK * 128;
        off[i] = (int32_t)(-128 * total);
    }
}
#endif

static void group_rows(const struct dfq_linear *w, long g, const int8_t *aq, const float *ad, const float *as,
                       const int32_t *off, int rows, float *out, long ldo, int accumulate) {
    const long k = w->k, nb = k / QK;
    const float *bias = w->bias ? w->bias + 8 * g : NULL;
    out += 8 * g;
    if (w->kind == 4) {
        const uint8_t *codes = (const uint8_t *)w->codes + g * nb * 128;
        const uint16_t *d = (const uint16_t *)w->d + g * nb * 8, *m = (const uint16_t *)w->m + g * nb * 8;
        switch (rows) {
        case 1: q4_group(1, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 2: q4_group(2, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 3: q4_group(3, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        default: q4_group(4, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        }
    } else {
        const int8_t *codes = (const int8_t *)w->codes + g * nb * 256;
        const uint16_t *d = (const uint16_t *)w->d + g * nb * 8;
        switch (rows) {
        case 1: q8_group(1, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 2: q8_group(2, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 3: q8_group(3, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        default: q8_group(4, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        }
    }
}

#ifdef DFQ_AVX512_VNNI
#include "int8_avx512.h"
/* A pair reads two streams of codes nb * 128 (or 256) bytes apart: from memory (the LM head, every layer of a
 * target larger than the cache) that runs slower than one stream, and a call of few rows is all memory. Calls
 * of fewer than pair_min_rows rows take the groups one after the other (256-bit vpdpbusd), in tiles of 4 rows;
 * from 5 rows a pair's tile of up to 8 rows is faster (a tile of 4 and one of 1-3 unpack the codes twice);
 * DFLASH_PAIR_MIN_ROWS
 * or dfq_set_pair_min_rows changes it (benchmarks/README.md, "VNNI on Zen 4"). */
#ifndef DFQ_PAIR_MIN_ROWS
#define DFQ_PAIR_MIN_ROWS 5
#endif
static int pair_min_rows = DFQ_PAIR_MIN_ROWS;
int dfq_pair_min_rows(void) { return pair_min_rows; }
void dfq_set_pair_min_rows(int rows) { pair_min_rows = rows > 0 ? rows : 1; }
__attribute__((constructor)) static void pairs_start(void) {
    const char *forced = getenv("DFLASH_PAIR_MIN_ROWS");
    if (forced && *forced) dfq_set_pair_min_rows(atoi(forced));
}
#else
int dfq_pair_min_rows(void) { return 0; }
void dfq_set_pair_min_rows(int rows) { (void)rows; }
#endif
#ifdef DFQ_AMX
#include "int8_amx.h"
#else
int dfq_amx_min_rows(void) { return 0; }
void dfq_amx_set_min_rows(int rows) { (void)rows; }
#endif

/* One step of the columns (a group of 8, or DFQ_GROUPS_PER_STEP of them) over all m rows, in tiles of 4 (of 8
 * for pairs; of tile_rows, when not 0, for AMX): its weights are read once per tile (from L1 after the first). */
static inline void step_rows(const struct dfq_linear *w, long step, const int8_t *aq, const float *ad,
                             const float *as, const int32_t *off, long m, float *out, long ldo, int accumulate,
                             long tile_rows) {
    const long k = w->k, nb = k / QK, groups = w->n / 8, g = step * DFQ_GROUPS_PER_STEP;
    long r = 0;
#ifdef DFQ_AMX
    if (tile_rows && g + 1 < groups)
        for (; r + tile_rows <= m; r += tile_rows)
            amx_pair_rows(w, g, aq + r * k, ad + r * nb, as + r * nb, tile_rows, out + r * ldo, ldo, accumulate);
#else
    (void)tile_rows;
#endif
    while (r < m) {
        int rows = m - r < 4 ? (int)(m - r) : 4;
#ifdef DFQ_AVX512_VNNI
        if (g + 1 < groups && pair_min_rows <= m) {
            /* a pair's weights unpacked once for up to 8 rows (32 registers hold it) */
            rows = m - r < 8 ? (int)(m - r) : 8;
            pair_rows(w, g, aq + r * k, ad + r * nb, as + r * nb, off ? off + r * nb : NULL, rows, out + r * ldo,
                      ldo, accumulate);
            r += rows;
            continue;
        }
#endif
        for (long h = g; h < g + DFQ_GROUPS_PER_STEP && h < groups; h++)
            group_rows(w, h, aq + r * k, ad + r * nb, as + r * nb, off ? off + r * nb : NULL, rows, out + r * ldo,
                       ldo, accumulate);
        r += rows;
    }
}

/* Calls of at least guided_min_rows rows share out their steps guided (each thread takes a share of what is
 * left, smaller as it goes), fewer rows statically (a contiguous half each of two threads). A call of several
 * rows is compute-bound, and under a static split each one waits at its barrier for the slower thread: with a
 * core 30% taken by another process, 2 Zen 3 cores ran a verify of 3-8 rows 7-10% faster guided and a draft 11%,
 * and DFlash generation 3-6% faster in all six sets of two runs (idle: the same within noise; one core fully
 * taken and 2 threads forced: a verify of 8 in 0.58x the time). A call of few rows reads its weights from
 * memory, where one stream per thread (and the prefetch of the next group, read by the same thread) is what
 * keeps it fast: guided, a decode ran 3% slower idle and 8% under that load. AVX2 is compute-bound from 2 rows;
 * the VNNI builds take guided from 5, where the AVX-512 build's calls stop being memory-bound (pair_min_rows;
 * not measured on them). DFLASH_GUIDED_MIN_ROWS or dfq_set_guided_min_rows changes it (0: never guided). Which
 * thread computes a column changes nothing in it: every variant's bits are the same. */
#ifndef DFQ_GUIDED_MIN_ROWS
#ifdef DFQ_VNNI
#define DFQ_GUIDED_MIN_ROWS 5
#else
#define DFQ_GUIDED_MIN_ROWS 2
#endif
#endif
static int guided_min_rows = DFQ_GUIDED_MIN_ROWS;
int dfq_guided_min_rows(void) { return guided_min_rows; }
void dfq_set_guided_min_rows(int rows) { guided_min_rows = rows > 0 ? rows : 0; }
__attribute__((constructor)) static void guided_start(void) {
    const char *forced = getenv("DFLASH_GUIDED_MIN_ROWS");
    if (forced && *forced) dfq_set_guided_min_rows(atoi(forced));
}

/* Groups of 8 columns (pairs of them on AVX-512, from pair_min_rows rows) shared out among the threads, each
 * step over all rows (step_rows). */
void dfq_matmul_rows(const struct dfq_linear *w, const int8_t *aq, const float *ad, const float *as, long m,
                     float *out, long ldo, int accumulate) {
    const long nb = w->k / QK, groups = w->n / 8;
    const long steps = (groups + DFQ_GROUPS_PER_STEP - 1) / DFQ_GROUPS_PER_STEP;
    int32_t on_stack[OFFSETS_ON_STACK], *off = NULL;
#ifdef DFQ_VNNI
    if (w->kind == 8) {  /* each thread its own copy: m * k byte sums, next to m * n * k products */
        off = m * nb <= OFFSETS_ON_STACK ? on_stack : malloc(sizeof(int32_t) * (size_t)(m * nb));
        q8_offsets(aq, m * nb, off);
    }
#else
    (void)nb;
#endif
    long tile_rows = 0;
#ifdef DFQ_AMX
    tile_rows = amx_rows_for(m);  /* rows past the last whole tile take the VNNI kernel */
    if (tile_rows) amx_configure(tile_rows);  /* every thread of the team runs this, before sharing out */
#endif
    if (guided_min_rows && m >= guided_min_rows) {
#pragma omp for schedule(guided)
        for (long step = 0; step < steps; step++)
            step_rows(w, step, aq, ad, as, off, m, out, ldo, accumulate, tile_rows);
    } else {
#pragma omp for schedule(static)
        for (long step = 0; step < steps; step++)
            step_rows(w, step, aq, ad, as, off, m, out, ldo, accumulate, tile_rows);
    }
    if (off != on_stack) free(off);
}

static void matmul(const struct dfq_linear *w, const float *x, long m, float *out) {
    const long k = w->k, nb = k / QK;
    int8_t *aq = malloc((size_t)(m * k));
    float *ad = malloc(sizeof(float) * (size_t)(m * nb)), *as = malloc(sizeof(float) * (size_t)(m * nb));
    dfq_quantize_rows(x, m, k, aq, ad, as);
#pragma omp parallel if (w->n > 8 && m * w->n * k > 65536)
    dfq_matmul_rows(w, aq, ad, as, m, out, w->n, 0);
    free(aq);
    free(ad);
    free(as);
}

/* out (m, w->n) = x (m, k) times the weight w, whichever its kind (native/draft.c's linears). */
void dfq_linear_forward(const struct dfq_linear *w, const float *x, long m, float *out) { matmul(w, x, m, out); }

/* out (m, n) = x (m, k) times the q4 weight (n, k) in the layout above (n a multiple of 8). */
void dfq_q4_matmul(const float *x, long m, long k, const uint8_t *codes, const uint16_t *d, const uint16_t *mins,
                   long n, const float *bias, float *out) {
    const struct dfq_linear w = {4, n, k, codes, d, mins, bias};
    matmul(&w, x, m, out);
}

/* out (m, n) = x (m, k) times the q8 weight (n, k) in the layout above (n a multiple of 8). */
void dfq_q8_matmul(const float *x, long m, long k, const int8_t *codes, const uint16_t *d, long n,
                   const float *bias, float *out) {
    const struct dfq_linear w = {8, n, k, codes, d, NULL, bias};
    matmul(&w, x, m, out);
}

/* Rows ids[0..count) of a q8 weight of k inputs in the layout above, dequantized into out (count, k): an
   embedding lookup from a tied LM head's codes. Returns how many ids lie outside 0..rows-1 (nothing is written
   then). */
long dfq_q8_rows(const int8_t *codes, const uint16_t *d, long k, long rows, const long *ids, long count,
                 float *out) {
    long outside = 0;
    for (long r = 0; r < count; r++) outside += ids[r] < 0 || ids[r] >= rows;
    if (outside) return outside;
    const long blocks = k / 32;
    for (long r = 0; r < count; r++) {
        const long group = ids[r] / 8, column = ids[r] % 8;
        for (long b = 0; b < blocks; b++) {
            const int8_t *src = codes + (group * blocks + b) * 256 + 4 * column;
            const float scale = _cvtsh_ss(d[(group * blocks + b) * 8 + column]);
            float *dst = out + r * k + b * 32;
            for (int t = 0; t < 8; t++)
                for (int i = 0; i < 4; i++) dst[4 * t + i] = (float)src[32 * t + i] * scale;
        }
    }
    return 0;
}

/* The indices of the `top` largest of x[0..n) into best (largest first; NaNs never), top <= SHORTLIST_MAX:
 * eight at a time against the smallest kept, which most never pass. Returns how many it found (n < top). */
#define SHORTLIST_MAX 64
static long top_indices(const float *x, long n, long top, long *best) {
    float value[SHORTLIST_MAX];
    long found = 0;
    float floor = -INFINITY;  /* the smallest value kept once `top` are */
    for (long i = 0; i < n; i += 8) {
        int mask;
        if (i + 8 <= n) {
            mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(floor), _CMP_GT_OQ));
            if (found < top) mask = 0xff;
        } else {
            mask = (1 << (n - i)) - 1;
        }
        for (; mask; mask &= mask - 1) {
            const long j = i + __builtin_ctz(mask);
            const float v = x[j];
            if (v != v || (found == top && !(v > floor))) continue;
            long at = found < top ? found++ : top - 1;  /* the slot it takes, then moved up past smaller ones */
            while (at > 0 && value[at - 1] < v) {
                value[at] = value[at - 1];
                best[at] = best[at - 1];
                at--;
            }
            value[at] = v;
            best[at] = j;
            if (found == top) floor = value[top - 1];
        }
    }
    return found;
}

/* A shortlist head's second pass: for each of `rows` rows of x (k floats), its logits (row r at logits + r * ld,
 * n of them) came from a cheaper weight (a q4 copy); the `top` largest are computed again from the q8 weight
 * (int8_matmul.c's layout; bias or NULL) and written over them, each by the same operations as dfq_q8_matmul's
 * output (integer block sums, then one fused multiply-add per block in block order, then the bias): the same
 * bits. Where the q8 weight's own largest logit is among the cheap weight's `top` largest (the demo drafter's
 * draft head: 100% of 2,149 rows for the top 16 of a q4 copy, against 75% for its largest alone), the row's
 * largest is the q8 head's, at the q8 head's value. top <= 64. */
void dfq_shortlist_rows(const float *x, long rows, long k, const int8_t *codes, const uint16_t *d, const float *bias,
                        long n, float *logits, long ld, long top) {
    const long nb = k / QK;
    top = top < SHORTLIST_MAX ? top : SHORTLIST_MAX;
#pragma omp parallel for schedule(static) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        int8_t *aq = malloc((size_t)k);
        float *ad = malloc(sizeof(float) * (size_t)(2 * nb));
        long best[SHORTLIST_MAX];
        if (aq && ad) {
            dfq_quantize_row(x + r * k, k, aq, ad, ad + nb);
            float *row = logits + r * ld;
            const long found = top_indices(row, n, top, best);
            for (long c = 0; c < found; c++) {
                const long col = best[c], group = col / 8, lane = col % 8;
                float acc = 0.0f;
                for (long b = 0; b < nb; b++) {
                    const int8_t *w = codes + (group * nb + b) * 256 + 4 * lane;
                    const int8_t *a = aq + b * QK;
                    int32_t sum = 0;
                    for (int t = 0; t < 8; t++)
                        for (int i = 0; i < 4; i++) sum += (int32_t)w[32 * t + i] * (int32_t)a[4 * t + i];
                    acc = fmaf((float)sum, _cvtsh_ss(d[(group * nb + b) * 8 + lane]) * ad[b], acc);
                }
                row[col] = bias ? acc + bias[col] : acc;
            }
        }
        free(aq);
        free(ad);
    }
}

/* A 4-bit copy of `rows` rows (a multiple of 8) of a q8 weight of k inputs, both in this file's layouts: each
 * block of 32 dequantized (d * code, as the kernel multiplies them) and quantized again as
 * int8act.quantize_q4_1 does (m the block's least value in fp16, d = (greatest - m) / 15 in fp16, codes
 * round((w - m) / d) in 0..15 against the rounded values), into codes4 (rows / 8 groups of k / 32 blocks of 128
 * bytes), d4 and m4 (fp16, 8 a block): int8act.Q4A8Linear.copy_of, in one pass instead of torch's several. */
void dfq_q8_to_q4(const int8_t *codes, const uint16_t *d, long k, long rows, uint8_t *codes4, uint16_t *d4,
                  uint16_t *m4) {
    const long nb = k / QK, groups = rows / 8;
#pragma omp parallel for schedule(static)
    for (long g = 0; g < groups; g++)
        for (long b = 0; b < nb; b++) {
            const int8_t *src = codes + (g * nb + b) * 256;
            uint8_t *dst = codes4 + (g * nb + b) * 128;
            for (int c = 0; c < 8; c++) {
                const float scale = _cvtsh_ss(d[(g * nb + b) * 8 + c]);
                float w[QK], low = INFINITY, high = -INFINITY;
                for (int t = 0; t < 8; t++)
                    for (int i = 0; i < 4; i++) {
                        const float v = (float)src[32 * t + 4 * c + i] * scale;
                        w[4 * t + i] = v;
                        low = v < low ? v : low;
                        high = v > high ? v : high;
                    }
                const uint16_t mh = _cvtss_sh(low, 0);
                const float m = _cvtsh_ss(mh);
                const uint16_t dh = _cvtss_sh((high - m) / 15.0f, 0);
                const float step = _cvtsh_ss(dh), inv = step > 0.0f ? 1.0f / step : 0.0f;
                d4[(g * nb + b) * 8 + c] = dh;
                m4[(g * nb + b) * 8 + c] = mh;
                uint8_t q[QK];
                for (int i = 0; i < QK; i++) {
                    const float r = nearbyintf((w[i] - m) * inv);
                    q[i] = (uint8_t)(r < 0.0f ? 0.0f : r > 15.0f ? 15.0f : r);
                }
                for (int t = 0; t < 4; t++)  /* input 4t + i in the low nibble, 16 + 4t + i in the high one */
                    for (int i = 0; i < 4; i++)
                        dst[32 * t + 4 * c + i] = (uint8_t)(q[4 * t + i] | (q[16 + 4 * t + i] << 4));
            }
        }
}
