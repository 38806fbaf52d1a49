/* The index of each row's first maximum, torch.argmax's choice: the greedy token of a row of logits. torch's
 * CPU argmax reads about one float per nanosecond (80 us for one row of a 49k vocabulary, 150 us for a
 * draft's 7 rows of 22k); this reads 8 at a time. A row holding a NaN (torch's argmax takes the NaN) is
 * counted and left to the caller. */
#include <immintrin.h>
#include <stdint.h>

#include <math.h>

#include "dfq.h"

static int64_t argmax_row(const float *x, long n, int *nan) {
    long at = 0, i = 8;
    float best = x[0];
    if (n >= 8) {
        __m256 top = _mm256_loadu_ps(x), unordered = _mm256_cmp_ps(top, top, _CMP_UNORD_Q);
        __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), index = where;
        const __m256i step = _mm256_set1_epi32(8);
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            index = _mm256_add_epi32(index, step);
            const __m256 above = _mm256_cmp_ps(v, top, _CMP_GT_OQ);  /* strictly: each lane keeps its first */
            top = _mm256_blendv_ps(top, v, above);
            where = _mm256_blendv_epi8(where, index, _mm256_castps_si256(above));
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        int32_t places[8];
        _mm256_storeu_ps(lanes, top);
        _mm256_storeu_si256((__m256i *)places, where);
        best = lanes[0];
        at = places[0];
        for (int j = 1; j < 8; j++)  /* the largest value, and of equal ones the first place */
            if (lanes[j] > best || (lanes[j] == best && places[j] < at)) best = lanes[j], at = places[j];
        *nan |= _mm256_movemask_ps(unordered) != 0;
    } else {
        i = 1;
        *nan |= x[0] != x[0];
    }
    for (; i < n; i++) {  /* the tail, past every vector lane's places */
        *nan |= x[i] != x[i];
        if (x[i] > best) best = x[i], at = i;
    }
    return at;
}

/* out[r] = the first maximum's index in row r (n floats at x + r * stride); returns how many rows held a NaN
 * (their out is not torch's) */
long dfq_argmax_rows(const float *x, long rows, long n, long stride, int64_t *out) {
    long nans = 0;
    for (long r = 0; r < rows; r++) {
        int nan = 0;
        out[r] = argmax_row(x + r * stride, n, &nan);
        nans += nan;
    }
    return nans;
}

/* exp(x) for x <= 0 within 0.6% (2^(x log2 e) as a power of two times the fraction's cubic Taylor polynomial;
 * below -87, about 2^-126), half the operations of dfq_exp8: a confidence needs no more */
static inline __m256 exp_coarse8(__m256 x) {
    const __m256 y = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _mm256_set1_ps(-126.0f));
    const __m256 whole = _mm256_floor_ps(y), f = _mm256_sub_ps(y, whole);
    __m256 p = _mm256_fmadd_ps(f, _mm256_set1_ps(0.0555041f), _mm256_set1_ps(0.2402265f));
    p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(0.6931472f));
    p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* dfq_argmax_rows, and top[r] = the softmax probability of row r's maximum, 1 / sum_i exp(x_i - max): how sure
 * a drafter is of its greedy draft (engine/adaptive.py's drafts_worth_verifying), from a second pass over the row. */
long dfq_argmax_confidence_rows(const float *x, long rows, long n, long stride, int64_t *out, float *top) {
    long nans = 0;
    for (long r = 0; r < rows; r++) {
        int nan = 0;
        const float *row = x + r * stride;
        out[r] = argmax_row(row, n, &nan);
        nans += nan;
        const __m256 max = _mm256_set1_ps(row[out[r]]);
        __m256 sum = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= n; i += 8) sum = _mm256_add_ps(sum, exp_coarse8(_mm256_sub_ps(_mm256_loadu_ps(row + i), max)));
        float total = dfq_sum8(sum);
        for (; i < n; i++) total += expf(row[i] - row[out[r]]);
        top[r] = 1.0f / total;
    }
    return nans;
}
