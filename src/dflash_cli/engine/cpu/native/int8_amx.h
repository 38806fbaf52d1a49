/* int8_matmul.c's kernels on AMX tiles (included there when built with DFQ_AMX, beside int8_avx512.h): for a
 * call of several rows (a verify, a prompt, the batched generator of `train`), one TDPBSUD (q4: signed
 * activations x unsigned codes) or TDPBSSD (q8) computes the integer sums of one block of 32 inputs for up to 16
 * rows and two groups of 8 columns at once; the float part then runs per row exactly as int8_avx512.h's pair
 * kernel runs it (the same exact block sums, the same operations in the same order per lane), so a row's bits
 * are the same whichever kernel computed it: a 1-row decode on VNNI and its 8-row verify on tiles agree.
 *
 * Tiles: 0 the sums (rows x 16 int32), 1 the activations (rows x the block's 32 bytes, read in place: a row of
 * aq is k bytes), 2 the weights (8 rows of 64 bytes: row kk holds inputs 4kk..4kk+3 of the 16 columns, the
 * layout TDPBxxD reads, unpacked from the codes per block). Linux lends tile state to a process that asks
 * (arch_prctl ARCH_REQ_XCOMP_PERM) before its first tile instruction; where it refuses, or
 * DFLASH_AMX_MIN_ROWS=0, every call keeps the VNNI kernels. */
#include <sys/syscall.h>
#include <unistd.h>

#ifdef DFQ_EMULATE
#include "amx_emulate.h"
#endif

#ifndef DFQ_AMX_MIN_ROWS
#define DFQ_AMX_MIN_ROWS 4  /* below it, the VNNI kernel's per-row work costs less than a tile round trip */
#endif
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_granted, amx_min_rows;  /* amx_min_rows 0: tiles not used */

/* calls of at least `rows` rows run on tiles (0: none), where the OS lent tile state */
void dfq_amx_set_min_rows(int rows) { amx_min_rows = amx_granted && rows > 0 ? rows : 0; }

int dfq_amx_min_rows(void) { return amx_min_rows; }

__attribute__((constructor)) static void amx_start(void) {
#ifdef DFQ_EMULATE
    amx_granted = 1;
#else
    amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
    const char *forced = getenv("DFLASH_AMX_MIN_ROWS");
    dfq_amx_set_min_rows(forced && *forced ? atoi(forced) : DFQ_AMX_MIN_ROWS);
}

/* the rows one tile call takes for a call of m rows (16 at most), 0 where tiles are not used */
static inline long amx_rows_for(long m) {
    if (!amx_min_rows || m < amx_min_rows) return 0;
    return m < 16 ? m : 16;
}

/* this thread's tile shapes for calls of `rows` rows (tile state is per thread, and other code, oneDNN's, may
 * configure it between two of ours) */
static inline void amx_configure(long rows) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = (uint8_t)rows, config.colsb[0] = 64;  /* sums: 16 int32 a row */
    config.rows[1] = (uint8_t)rows, config.colsb[1] = QK;  /* activations: one block a row */
    config.rows[2] = QK / 4, config.colsb[2] = 64;         /* weights: 4 inputs of 16 columns a row */
    _tile_loadconfig(&config);
}

/* the block's sums for `R` rows into sums (R x 16 int32): activations from aq (row stride k), weights from wbuf */
static inline void amx_block_sums(const int8_t *aq, long k, const uint8_t *wbuf, int32_t *sums, int q8) {
    _tile_zero(0);
    _tile_loadd(1, aq, k);
    _tile_loadd(2, wbuf, 64);
    if (q8)
        _tile_dpbssd(0, 1, 2);
    else
        _tile_dpbsud(0, 1, 2);
    _tile_stored(0, sums, 64);
}

static inline __attribute__((always_inline)) void amx_q4_pair(const int R, const int8_t *aq, const float *ad,
                                                              const float *as, long k, const uint8_t *codes,
                                                              const uint16_t *d, const uint16_t *m, float *out,
                                                              long ldo, const float *bias, int accumulate) {
    const long nb = k / QK;
    const wide_i low = W(_mm512_set1_epi8)(0x0f);
    uint8_t wbuf[8 * 64] __attribute__((aligned(64)));
    int32_t sums[16 * 16] __attribute__((aligned(64)));
    wide_f acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = W(_mm512_setzero_ps)();
    for (long b = 0; b < nb; b++) {
        const uint8_t *cb = codes + b * 128;
        prefetch_block(codes, 128, d, m, b);
        prefetch_block(codes + nb * 128, 128, d + nb * 8, m + nb * 8, b);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {  /* low nibbles: inputs 4t..4t+3 (row t); high: 16 + 4t.. (row 4 + t) */
            const wide_i v = load_pair(cb + 32 * t, cb + nb * 128 + 32 * t);
            W(_mm512_store_si512)((void *)(wbuf + 64 * t), W(_mm512_and_si512)(v, low));
            W(_mm512_store_si512)((void *)(wbuf + 64 * (4 + t)),
                                  W(_mm512_and_si512)(W(_mm512_srli_epi16)(v, 4), low));
        }
        amx_block_sums(aq + b * QK, k, wbuf, sums, 0);
        const wide_f dw = scales_pair(d + b * 8, d + nb * 8 + b * 8);
        const wide_f mw = scales_pair(m + b * 8, m + nb * 8 + b * 8);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const wide_f s = W(_mm512_cvtepi32_ps)(W(_mm512_load_si512)((const void *)(sums + 16 * r)));
            acc[r] = W(_mm512_fmadd_ps)(s, W(_mm512_mul_ps)(dw, W(_mm512_set1_ps)(ad[r * nb + b])), acc[r]);
            acc[r] = W(_mm512_fmadd_ps)(mw, W(_mm512_set1_ps)(as[r * nb + b]), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) store16(out + r * ldo, acc[r], bias, accumulate);
}

static inline __attribute__((always_inline)) void amx_q8_pair(const int R, const int8_t *aq, const float *ad,
                                                              long k, const int8_t *codes, const uint16_t *d,
                                                              float *out, long ldo, const float *bias,
                                                              int accumulate) {
    const long nb = k / QK;
    uint8_t wbuf[8 * 64] __attribute__((aligned(64)));
    int32_t sums[16 * 16] __attribute__((aligned(64)));
    wide_f acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = W(_mm512_setzero_ps)();
    for (long b = 0; b < nb; b++) {
        const int8_t *cb = codes + b * 256;
        prefetch_block(codes, 256, d, NULL, b);
        prefetch_block(codes + nb * 256, 256, d + nb * 8, NULL, b);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++)  /* row t: inputs 4t..4t+3 of group a's 8 columns, then group b's */
            W(_mm512_store_si512)((void *)(wbuf + 64 * t), load_pair(cb + 32 * t, cb + nb * 256 + 32 * t));
        amx_block_sums(aq + b * QK, k, wbuf, sums, 1);
        const wide_f dw = scales_pair(d + b * 8, d + nb * 8 + b * 8);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const wide_f s = W(_mm512_cvtepi32_ps)(W(_mm512_load_si512)((const void *)(sums + 16 * r)));
            acc[r] = W(_mm512_fmadd_ps)(s, W(_mm512_mul_ps)(dw, W(_mm512_set1_ps)(ad[r * nb + b])), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) store16(out + r * ldo, acc[r], bias, accumulate);
}

#define AMX_CASE(R)                                                                                  \
    case R:                                                                                          \
        if (w->kind == 4)                                                                            \
            amx_q4_pair(R, aq, ad, as, k, codes4, d, mins, out, ldo, bias, accumulate);              \
        else                                                                                         \
            amx_q8_pair(R, aq, ad, k, codes8, d, out, ldo, bias, accumulate);                        \
        break;

/* pair_rows on tiles: groups g and g + 1, `rows` rows (the configured tile rows) */
static void amx_pair_rows(const struct dfq_linear *w, long g, const int8_t *aq, const float *ad, const float *as,
                          long rows, float *out, long ldo, int accumulate) {
    const long k = w->k, nb = k / QK;
    const float *bias = w->bias ? w->bias + 8 * g : NULL;
    const uint8_t *codes4 = (const uint8_t *)w->codes + g * nb * 128;
    const int8_t *codes8 = (const int8_t *)w->codes + g * nb * 256;
    const uint16_t *d = (const uint16_t *)w->d + g * nb * 8;
    const uint16_t *mins = w->kind == 4 ? (const uint16_t *)w->m + g * nb * 8 : NULL;
    out += 8 * g;
    switch (rows) {
        AMX_CASE(1) AMX_CASE(2) AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7) AMX_CASE(8)
        AMX_CASE(9) AMX_CASE(10) AMX_CASE(11) AMX_CASE(12) AMX_CASE(13) AMX_CASE(14) AMX_CASE(15)
        default: AMX_CASE(16)
    }
}
#undef AMX_CASE
