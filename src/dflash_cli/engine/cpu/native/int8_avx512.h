/* int8_matmul.c's kernels on AVX-512 VNNI (included there when built with DFQ_AVX512_VNNI): two groups of 8
 * output columns side by side in one 512-bit vector (the weight layout is unchanged: the two groups' bytes
 * are loaded from their own places), their 8-bit products summed by vpdpbusd, 4 activation bytes broadcast
 * to all 16 lanes. Per lane it computes what the AVX2 kernel computes: the same exact integer sum of a
 * block, then the same float operations in the same order, so every output is bit-identical to it.
 *
 * With DFQ_EMULATE (tests only) the 512-bit operations come from SIMDe, so the source runs on an AVX2 CPU. */
#ifdef DFQ_EMULATE
#define W(name) simde##name
typedef simde__m512i wide_i;
typedef simde__m512 wide_f;
/* SIMDe 0.7 has no _mm512_cvtepi32_ps: the two halves through AVX's conversion (exact either way) */
static inline wide_f simde_mm512_cvtepi32_ps(wide_i v) {
    const __m256 lo = _mm256_cvtepi32_ps(simde_mm512_castsi512_si256(v));
    const __m256 hi = _mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(v, 1));
    return simde_mm512_castpd_ps(simde_mm512_insertf64x4(simde_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                                         _mm256_castps_pd(hi), 1));
}
#else
#define W(name) name
typedef __m512i wide_i;
typedef __m512 wide_f;
#endif

/* 32 bytes of each group, group a's in lanes 0-7 and group b's in lanes 8-15 */
static inline wide_i load_pair(const void *a, const void *b) {
    return W(_mm512_inserti64x4)(W(_mm512_castsi256_si512)(_mm256_loadu_si256((const __m256i *)a)),
                                 _mm256_loadu_si256((const __m256i *)b), 1);
}

/* 8 fp16 scales of each group as 16 floats */
static inline wide_f scales_pair(const uint16_t *a, const uint16_t *b) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)a));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
    return W(_mm512_castpd_ps)(W(_mm512_insertf64x4)(W(_mm512_castpd256_pd512)(_mm256_castps_pd(lo)),
                                                     _mm256_castps_pd(hi), 1));
}

static inline wide_i bcast4_wide(const int8_t *a) {
    int32_t v;
    memcpy(&v, a, 4);
    return W(_mm512_set1_epi32)(v);
}

/* acc + vpdpbusd(u, the 4 bytes at a broadcast): gcc 12 does not fold the broadcast into the instruction's
 * memory operand ({1to16}), which saves a separate load-and-broadcast per product */
static inline __attribute__((always_inline)) wide_i dpbusd_bcast_wide(wide_i acc, wide_i u, const int8_t *a) {
#ifdef DFQ_EMULATE
    return W(_mm512_dpbusd_epi32)(acc, u, bcast4_wide(a));
#else
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)a));
    return acc;
#endif
}

/* prefetch_block for a pair: its two groups' streams (codes a, and b = a + nb blocks), read side by side, and
 * where that runs past their end, the next pair's two (the same thread's next step). prefetch_block on each
 * stream would fetch group b's bytes from group a's (read already) and leave the next pair's first group to
 * the hardware: with k = 576 (18 blocks a group) most of the distance ran past the end. */
static inline __attribute__((always_inline)) void prefetch_pair(const void *codes, long block_bytes, long nb,
                                                                const uint16_t *d, const uint16_t *m, long b) {
    long at = b + DFQ_PREFETCH_BYTES / block_bytes;
    const long pairs_on = at / nb;
    at -= pairs_on * nb;
    const char *a = (const char *)codes + (2 * pairs_on * nb + at) * block_bytes;
    for (long line = 0; line < block_bytes; line += 64) {
        _mm_prefetch(a + line, _MM_HINT_T0);
        _mm_prefetch(a + nb * block_bytes + line, _MM_HINT_T0);
    }
    if ((at & 3) == 0) { /* 8 fp16 scales a block: one cache line per 4 blocks */
        const long s = (2 * pairs_on * nb + at) * 8;
        _mm_prefetch((const char *)(d + s), _MM_HINT_T0);
        _mm_prefetch((const char *)(d + s + nb * 8), _MM_HINT_T0);
        if (m) {
            _mm_prefetch((const char *)(m + s), _MM_HINT_T0);
            _mm_prefetch((const char *)(m + s + nb * 8), _MM_HINT_T0);
        }
    }
}

/* the 16 outputs of a pair: + bias, then = or += (as store8, per lane) */
static inline void store16(float *out, wide_f y, const float *bias, int accumulate) {
    if (bias) y = W(_mm512_add_ps)(y, W(_mm512_loadu_ps)(bias));
    if (accumulate) y = W(_mm512_add_ps)(W(_mm512_loadu_ps)(out), y);
    W(_mm512_storeu_ps)(out, y);
}

static inline __attribute__((always_inline)) void q4_pair(const int R, const int8_t *aq, const float *ad,
                                                          const float *as, long k, const uint8_t *codes,
                                                          const uint16_t *d, const uint16_t *m, float *out,
                                                          long ldo, const float *bias, int accumulate) {
    const long nb = k / QK;  /* group b's codes and scales follow group a's whole rows of blocks */
    const wide_i low = W(_mm512_set1_epi8)(0x0f);
    wide_f acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = W(_mm512_setzero_ps)();
    for (long b = 0; b < nb; b++) {
        const uint8_t *cb = codes + b * 128;
        prefetch_pair(codes, 128, nb, d, m, b);
        wide_i s32[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) s32[r] = W(_mm512_setzero_si512)();
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const wide_i v = load_pair(cb + 32 * t, cb + nb * 128 + 32 * t);
            const wide_i lo = W(_mm512_and_si512)(v, low);
            const wide_i hi = W(_mm512_and_si512)(W(_mm512_srli_epi16)(v, 4), low);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *a = aq + r * k + b * QK;
                s32[r] = dpbusd_bcast_wide(s32[r], lo, a + 4 * t);
                s32[r] = dpbusd_bcast_wide(s32[r], hi, a + 16 + 4 * t);
            }
        }
        const wide_f dw = scales_pair(d + b * 8, d + nb * 8 + b * 8);
        const wide_f mw = scales_pair(m + b * 8, m + nb * 8 + b * 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const wide_f sums = W(_mm512_cvtepi32_ps)(s32[r]);
            acc[r] = W(_mm512_fmadd_ps)(sums, W(_mm512_mul_ps)(dw, W(_mm512_set1_ps)(ad[r * nb + b])), acc[r]);
            acc[r] = W(_mm512_fmadd_ps)(mw, W(_mm512_set1_ps)(as[r * nb + b]), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) store16(out + r * ldo, acc[r], bias, accumulate);
}

static inline __attribute__((always_inline)) void q8_pair(const int R, const int8_t *aq, const float *ad,
                                                          const int32_t *off, long k, const int8_t *codes,
                                                          const uint16_t *d, float *out, long ldo,
                                                          const float *bias, int accumulate) {
    const long nb = k / QK;
    const wide_i flip = W(_mm512_set1_epi8)((char)0x80);
    wide_f acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = W(_mm512_setzero_ps)();
    for (long b = 0; b < nb; b++) {
        const int8_t *cb = codes + b * 256;
        prefetch_pair(codes, 256, nb, d, NULL, b);
        wide_i s32[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) s32[r] = W(_mm512_set1_epi32)(off[r * nb + b]);
#pragma GCC unroll 1
        for (int t = 0; t < 8; t++) {
            /* vpdpbusd takes unsigned x signed: w + 128 (the sum starts at -128 times the activations' sum) */
            const wide_i biased = W(_mm512_xor_si512)(load_pair(cb + 32 * t, cb + nb * 256 + 32 * t), flip);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                s32[r] = dpbusd_bcast_wide(s32[r], biased, aq + r * k + b * QK + 4 * t);
        }
        const wide_f dw = scales_pair(d + b * 8, d + nb * 8 + b * 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            acc[r] = W(_mm512_fmadd_ps)(W(_mm512_cvtepi32_ps)(s32[r]),
                                        W(_mm512_mul_ps)(dw, W(_mm512_set1_ps)(ad[r * nb + b])), acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) store16(out + r * ldo, acc[r], bias, accumulate);
}

/* group_rows for groups g and g + 1 together */
static void pair_rows(const struct dfq_linear *w, long g, const int8_t *aq, const float *ad, const float *as,
                      const int32_t *off, int rows, float *out, long ldo, int accumulate) {
    const long k = w->k, nb = k / QK;
    const float *bias = w->bias ? w->bias + 8 * g : NULL;
    out += 8 * g;
    if (w->kind == 4) {
        const uint8_t *codes = (const uint8_t *)w->codes + g * nb * 128;
        const uint16_t *d = (const uint16_t *)w->d + g * nb * 8, *m = (const uint16_t *)w->m + g * nb * 8;
        switch (rows) {
        case 1: q4_pair(1, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 2: q4_pair(2, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 3: q4_pair(3, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 4: q4_pair(4, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 5: q4_pair(5, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 6: q4_pair(6, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        case 7: q4_pair(7, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        default: q4_pair(8, aq, ad, as, k, codes, d, m, out, ldo, bias, accumulate); break;
        }
    } else {
        const int8_t *codes = (const int8_t *)w->codes + g * nb * 256;
        const uint16_t *d = (const uint16_t *)w->d + g * nb * 8;
        switch (rows) {
        case 1: q8_pair(1, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 2: q8_pair(2, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 3: q8_pair(3, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 4: q8_pair(4, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 5: q8_pair(5, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 6: q8_pair(6, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        case 7: q8_pair(7, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        default: q8_pair(8, aq, ad, off, k, codes, d, out, ldo, bias, accumulate); break;
        }
    }
}
