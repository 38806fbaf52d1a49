/* The index of each row's first maximum, torch.argmax's choice: the greedy token of a row of logits. torch's
 * CPU argmax reads about one float per nanosecond (80 us for one row of a 49k vocabulary, 150 us for a
 * draft's 7 rows of 22k); this reads 8 at a time. A row holding a NaN (torch's argmax takes the NaN) is
 * counted and left to the caller. */
#include <immintrin.h>
#include <stdint.h>

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
