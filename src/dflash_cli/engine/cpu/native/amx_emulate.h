/* The AMX tile instructions int8_amx.h uses, in portable C (tests only: DFQ_EMULATE with DFQ_AMX), so its logic
 * (tile shapes, the weight rows it lays out, the order of the float part) runs on a CPU without tiles.
 * Semantics as Intel's pseudocode (tile configuration palette 1: byte 0 the palette, bytes 16 + 2t the bytes
 * per row of tile t, byte 48 + t its rows; TDPBSSD/TDPBSUD: dst.row[m].dword[n] += the 4 products of
 * a.row[m].dword[kk] and b.row[kk].dword[n], kk < a's bytes per row / 4). A configuration or an operand
 * shape the hardware would refuse (#UD) aborts here, so a test catches it before a CPU with tiles does. */
#ifndef DFQ_AMX_EMULATE_H
#define DFQ_AMX_EMULATE_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct emulated_tiles {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
};

static __thread struct emulated_tiles emulated;

static inline void emulated_loadconfig(const void *config) {
    const uint8_t *c = config;
    if (c[0] != 1) abort();
    memset(&emulated, 0, sizeof emulated);
    for (int t = 0; t < 8; t++) {
        emulated.colsb[t] = (uint16_t)(c[16 + 2 * t] | c[17 + 2 * t] << 8);
        emulated.rows[t] = c[48 + t];
        if (emulated.rows[t] > 16 || emulated.colsb[t] > 64 || emulated.colsb[t] % 4) abort();
    }
    emulated.configured = 1;
}

static inline void emulated_check(int t) {
    if (!emulated.configured || t < 0 || t > 7 || !emulated.rows[t]) abort();
}

static inline void emulated_loadd(int t, const void *base, long stride) {
    emulated_check(t);
    memset(emulated.data[t], 0, sizeof emulated.data[t]);
    for (int r = 0; r < emulated.rows[t]; r++)
        memcpy(emulated.data[t][r], (const uint8_t *)base + r * stride, emulated.colsb[t]);
}

static inline void emulated_stored(int t, void *base, long stride) {
    emulated_check(t);
    for (int r = 0; r < emulated.rows[t]; r++) memcpy((uint8_t *)base + r * stride, emulated.data[t][r], emulated.colsb[t]);
}

static inline void emulated_zero(int t) {
    emulated_check(t);
    memset(emulated.data[t], 0, sizeof emulated.data[t]);
}

static inline void emulated_dpb(int c, int a, int b, int b_signed) {
    emulated_check(c), emulated_check(a), emulated_check(b);
    const int depth = emulated.colsb[a] / 4;
    if (emulated.rows[c] != emulated.rows[a] || emulated.rows[b] != depth || emulated.colsb[b] != emulated.colsb[c])
        abort();
    for (int m = 0; m < emulated.rows[c]; m++)
        for (int n = 0; n < emulated.colsb[c] / 4; n++) {
            int32_t sum;
            memcpy(&sum, &emulated.data[c][m][4 * n], 4);
            for (int kk = 0; kk < depth; kk++)
                for (int i = 0; i < 4; i++) {
                    const int32_t x = (int8_t)emulated.data[a][m][4 * kk + i];
                    const uint8_t raw = emulated.data[b][kk][4 * n + i];
                    sum += x * (b_signed ? (int32_t)(int8_t)raw : (int32_t)raw);
                }
            memcpy(&emulated.data[c][m][4 * n], &sum, 4);
        }
}

#define _tile_loadconfig(config) emulated_loadconfig(config)
#define _tile_loadd(t, base, stride) emulated_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emulated_stored(t, base, stride)
#define _tile_zero(t) emulated_zero(t)
#define _tile_dpbsud(c, a, b) emulated_dpb(c, a, b, 0)
#define _tile_dpbssd(c, a, b) emulated_dpb(c, a, b, 1)
#endif
