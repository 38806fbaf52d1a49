/* Llama-style decoder layers (Llama, Qwen2, Qwen3, Mistral) in fp32 with q4a8/q8a8 linears, a whole stack of
 * them in one call (a drafter's layer in one call of its own): RMSNorm, q|k|v, per-head q/k norms (Qwen3),
 * rotary embedding, K/V written to the cache, causal attention, o, residual, RMSNorm, gate|up, SiLU times up,
 * down, residual. In eager PyTorch the ~25 small ops around the
 * linears cost more than the linears themselves on a 2-core CPU (benchmarks/README.md); here they are
 * passes over a few kilobytes between the matmuls, inside one parallel region for all the layers.
 *
 * Every row is computed from its own token and the cache alone, in a fixed order, as in the parts
 * (int8_matmul.c, attention.c): a decode and a verify give bit-identical rows.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dfq.h"

struct dfq_layer {
    long hidden, heads, kv, hd, inter;
    const float *norm1, *norm2, *q_norm, *k_norm; /* q_norm/k_norm: (hd) or NULL */
    float eps1, eps2, qk_eps, scale;
    struct dfq_linear qkv, o, gate_up, down;
};

/* out = x / sqrt(mean(x^2) + eps) * w, k a multiple of 8 */
static void rms_norm(const float *x, const float *w, long k, float eps, float *out) {
    __m256 ss = _mm256_setzero_ps();
    for (long i = 0; i < k; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(dfq_sum8(ss) / (float)k + eps));
    for (long i = 0; i < k; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv), _mm256_loadu_ps(w + i)));
}

/* rms_norm of `rows` rows of k floats (k a multiple of 8), for the drafter's norms around its C layers (a torch
 * RMSNorm is ~7 ops of 10-15 us each on a few rows) */
void dfq_rms_norm_rows(const float *x, long rows, long k, const float *w, float eps, float *out) {
    for (long r = 0; r < rows; r++) rms_norm(x + r * k, w, k, eps, out + r * k);
}

/* x (hd) roped in place: x * cos + rotate_half(x) * sin, with sin's first half negated (signed), times scale */
static void rope(float *x, const float *cos, const float *signed_sin, long hd, float scale) {
    float tmp[1024];
    const long half = hd / 2;
    for (long i = 0; i < hd; i++) tmp[i] = x[i];
    for (long i = 0; i < hd; i++) {
        const float rolled = tmp[i < half ? i + half : i - half];
        x[i] = (tmp[i] * cos[i] + rolled * signed_sin[i]) * scale;
    }
}

/* out = silu(gate) * up = gate / (1 + exp(-gate)) * up, k a multiple of 8 */
static void silu_mul(const float *gate, const float *up, long k, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (long i = 0; i < k; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, dfq_exp8(_mm256_xor_ps(g, sign))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
}

/* a key or value row of hd floats into its cache row: fp32, or fp16 (rounded to nearest) where `half` */
static void cache_write(void *cache, long row, const float *x, long hd, int half) {
    if (half) {
        uint16_t *dst = (uint16_t *)cache + row * hd;
        for (long i = 0; i < hd; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    } else {
        memcpy((float *)cache + row * hd, x, sizeof(float) * (size_t)hd);
    }
}

/* Attention of n tokens (query r at q + r * q_stride, output at out + r * out_stride) over a cache of kv
 * key/value groups of `group` heads, token r seeing keys lo..lo+counts[r]-1, inside a parallel region: a
 * group's heads and a run of its tokens per task (about two tasks per thread in all), so each group's cache is
 * read once per run. */
static void attend_runs(const float *q, long q_stride, long n, long group, long kv, long hd, const void *keys,
                        const void *values, long capacity, long lo, const long *counts, float *out,
                        long out_stride, int half) {
    const long size = half ? 2 : 4;  /* bytes per cached element */
#ifdef _OPENMP
    extern int omp_get_num_threads(void);
    const long threads = omp_get_num_threads();
#else
    const long threads = 1;
#endif
    const long wanted = (2 * threads + kv - 1) / kv, runs = wanted < n ? wanted : n, per = (n + runs - 1) / runs;
#pragma omp for schedule(static)
    for (long task = 0; task < kv * runs; task++) {
        const long g = task / runs, r = task % runs * per, rows = n - r < per ? n - r : per;
        if (rows > 0)
            dfq_attend_rows(q + r * q_stride + g * group * hd, q_stride, rows, group, hd,
                            (const char *)keys + g * capacity * hd * size,
                            (const char *)values + g * capacity * hd * size,
                            lo, counts + r, 1.0f, out + r * out_stride + g * group * hd, out_stride, half);
    }
}

/* A layer call's buffers, for n rows of the widest of the layers it runs (one malloc for a whole stack). */
struct layer_scratch {
    float *xn, *qkv, *gu, *act, *ad, *as;
    int8_t *aq;
    long *counts; /* the keys each token sees: its position and before */
};

static void scratch_free(struct layer_scratch *s) {
    free(s->xn);
    free(s->qkv);
    free(s->gu);
    free(s->act);
    free(s->aq);
    free(s->ad);
    free(s->as);
    free(s->counts);
}

static int scratch_alloc(struct layer_scratch *s, const struct dfq_layer *const *layers, long count, long n,
                         const int64_t *positions) {
    long xn = 0, wide = 0, inter = 0, widest = 0;
    for (long i = 0; i < count; i++) {
        const struct dfq_layer *L = layers[i];
        const long A = L->heads * L->hd, H = L->hidden, I = L->inter, w = (L->heads + 2 * L->kv) * L->hd;
        const long x = H > A ? H : A, all = I > x ? I : x;
        xn = xn > x ? xn : x;
        wide = wide > w ? wide : w;
        inter = inter > I ? inter : I;
        widest = widest > all ? widest : all;
    }
    s->xn = malloc(sizeof(float) * (size_t)(n * xn));
    s->qkv = malloc(sizeof(float) * (size_t)(n * wide));
    s->gu = malloc(sizeof(float) * (size_t)(n * 2 * inter));
    s->act = malloc(sizeof(float) * (size_t)(n * inter));
    s->aq = malloc((size_t)(n * widest));
    s->ad = malloc(sizeof(float) * (size_t)(n * widest / QK));
    s->as = malloc(sizeof(float) * (size_t)(n * widest / QK));
    s->counts = malloc(sizeof(long) * (size_t)n);
    if (!s->xn || !s->qkv || !s->gu || !s->act || !s->aq || !s->ad || !s->as || !s->counts) {
        scratch_free(s);
        return 0;
    }
    for (long r = 0; r < n; r++) s->counts[r] = (long)positions[r] + 1;
    return 1;
}

/* One layer on h (n, hidden), in place, run by every thread of the enclosing parallel region (its loops are
 * orphaned omp fors, each ending in a barrier). */
static void layer_body(const struct dfq_layer *L, const struct layer_scratch *s, float *h, long n,
                       const int64_t *positions, const float *cos, const float *signed_sin, void *keys, void *values,
                       long capacity, float *tap, long tap_stride, int half) {
    const long H = L->hidden, heads = L->heads, kv = L->kv, hd = L->hd, I = L->inter;
    const long wide = (heads + 2 * kv) * hd, group = heads / kv, A = heads * hd;
    float *xn = s->xn, *qkv = s->qkv, *gu = s->gu, *act = s->act, *ad = s->ad, *as = s->as;
    int8_t *aq = s->aq;
    /* attention's input: norm, quantize, q|k|v */
#pragma omp for schedule(static)
    for (long r = 0; r < n; r++) {
        rms_norm(h + r * H, L->norm1, H, L->eps1, xn + r * H);
        dfq_quantize_row(xn + r * H, H, aq + r * H, ad + r * (H / QK), as + r * (H / QK));
    }
    dfq_matmul_rows(&L->qkv, aq, ad, as, n, qkv, wide, 0);
    /* per head: q/k norms, rope (q scaled), k and v into the cache */
#pragma omp for schedule(static)
    for (long task = 0; task < n * (heads + kv); task++) {
        const long r = task / (heads + kv), j = task % (heads + kv);
        float *x = qkv + r * wide + j * hd;
        const float *c = cos + r * hd, *sn = signed_sin + r * hd;
        if (j < heads) {
            if (L->q_norm) rms_norm(x, L->q_norm, hd, L->qk_eps, x);
            rope(x, c, sn, hd, L->scale);
        } else {
            const long g = j - heads;
            if (L->k_norm) rms_norm(x, L->k_norm, hd, L->qk_eps, x);
            rope(x, c, sn, hd, 1.0f);
            cache_write(keys, g * capacity + positions[r], x, hd, half);
            cache_write(values, g * capacity + positions[r], qkv + r * wide + (heads + kv + g) * hd, hd, half);
        }
    }
    /* attention into xn (n, heads * hd), then quantized for o */
    attend_runs(qkv, wide, n, group, kv, hd, keys, values, capacity, 0, s->counts, xn, A, half);
#pragma omp for schedule(static)
    for (long r = 0; r < n; r++) dfq_quantize_row(xn + r * A, A, aq + r * A, ad + r * (A / QK), as + r * (A / QK));
    dfq_matmul_rows(&L->o, aq, ad, as, n, h, H, 1);
    /* the MLP */
#pragma omp for schedule(static)
    for (long r = 0; r < n; r++) {
        rms_norm(h + r * H, L->norm2, H, L->eps2, xn + r * H);
        dfq_quantize_row(xn + r * H, H, aq + r * H, ad + r * (H / QK), as + r * (H / QK));
    }
    dfq_matmul_rows(&L->gate_up, aq, ad, as, n, gu, 2 * I, 0);
#pragma omp for schedule(static)
    for (long r = 0; r < n; r++) {
        silu_mul(gu + r * 2 * I, gu + r * 2 * I + I, I, act + r * I);
        dfq_quantize_row(act + r * I, I, aq + r * I, ad + r * (I / QK), as + r * (I / QK));
    }
    dfq_matmul_rows(&L->down, aq, ad, as, n, h, H, 1);
    if (tap) {
        const long width = 8 * DFQ_GROUPS_PER_STEP, steps = (H + width - 1) / width;
#pragma omp for schedule(static) /* a decode's down shares its columns out so too: each thread copies its own */
        for (long step = 0; step < steps; step++) {
            const long lo = step * width, hi = lo + width < H ? lo + width : H;
            for (long r = 0; r < n; r++) memcpy(tap + r * tap_stride + lo, h + r * H + lo, sizeof(float) * (size_t)(hi - lo));
        }
    }
}

/* Runs `count` layers one after the other on h (n, hidden), in place, for tokens at `positions` (n), in one
 * parallel region: one call and one set of buffers for the whole stack (per-layer calls cost a Python call, a
 * ctypes call and a fork and join each, ~6% of a decode). cos and signed_sin: (n, hd) rotary tables, the same
 * for every layer; keys[i]/values[i]: layer i's (kv, capacity, hd) cache buffers whose row r holds position r,
 * fp32, or fp16 where `half` (half the bytes for attention to read at long context); taps[i] (taps NULL, or
 * taps[i] NULL: none): layer i's output rows are also copied to taps[i] + r * tap_stride (the drafter's tapped
 * states), by the threads that wrote their columns, inside the call. Returns 0 when its buffers could not be
 * allocated (h untouched), else 1. */
int dfq_stack_forward(const struct dfq_layer *const *layers, long count, float *h, long n, const int64_t *positions,
                      const float *cos, const float *signed_sin, void *const *keys, void *const *values,
                      long capacity, float *const *taps, long tap_stride, int half) {
    struct layer_scratch s;
    if (!scratch_alloc(&s, layers, count, n, positions)) return 0;
#pragma omp parallel
    for (long i = 0; i < count; i++)
        layer_body(layers[i], &s, h, n, positions, cos, signed_sin, keys[i], values[i], capacity,
                   taps ? taps[i] : NULL, tap_stride, half);
    scratch_free(&s);
    return 1;
}

/* The target around its stack (dfq_model_forward): its input embeddings (a tied head's q8 codes, else a dense
 * fp32 table), the final norm and the LM head (n padded to 8). */
struct dfq_model {
    long hidden, vocab;
    const int8_t *embed_codes;
    const uint16_t *embed_d;
    const float *embed_dense;
    const float *norm;
    float eps;
    struct dfq_linear head;
};

/* A whole forward of the target's n tokens ids at `positions`, what engine/static_forward.py's Python around
 * dfq_stack_forward computed, the same kernels in the same order (the same bits): the embeddings' rows, the
 * stack, `last_tap` (or NULL) the final-normed rows of every token (a drafter's tap of the last layer, rows
 * tap_stride apart), then into `out` every token's (or with `last_only` the last token's) final-normed row
 * (rows, hidden), or with `logits` its logits (rows, head.n). One call instead of a dozen Python and
 * torch operations around it, which ran cold after each forward (~0.3 ms of a ~3.7 ms decode of the demo on 2
 * Zen 4 cores). Returns 1; 0 when its buffers could not be allocated; -1 for an id outside the table
 * (nothing is computed then). */
int dfq_model_forward(const struct dfq_model *M, const struct dfq_layer *const *layers, long count,
                      const int64_t *ids, long n, const int64_t *positions, const float *cos, const float *signed_sin,
                      void *const *keys, void *const *values, long capacity, float *const *taps, long tap_stride,
                      int half, float *last_tap, int last_only, int logits, float *out) {
    const long H = M->hidden;
    for (long r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= M->vocab) return -1;
    float *h = malloc(sizeof(float) * (size_t)(n * H));
    if (!h) return 0;
    for (long r = 0; r < n; r++) {
        if (M->embed_codes) {
            const long id = (long)ids[r];
            dfq_q8_rows(M->embed_codes, M->embed_d, H, M->vocab, &id, 1, h + r * H);
        } else {
            memcpy(h + r * H, M->embed_dense + ids[r] * H, sizeof(float) * (size_t)H);
        }
    }
    if (!dfq_stack_forward(layers, count, h, n, positions, cos, signed_sin, keys, values, capacity, taps, tap_stride,
                           half)) {
        free(h);
        return 0;
    }
    if (last_tap)
        for (long r = 0; r < n; r++) rms_norm(h + r * H, M->norm, H, M->eps, last_tap + r * tap_stride);
    const long first = last_only ? n - 1 : 0, rows = n - first;
    float *normed = logits ? h : out;  /* row r from row first + r: read before written, never read again */
    for (long r = 0; r < rows; r++) rms_norm(h + (first + r) * H, M->norm, H, M->eps, normed + r * H);
    if (logits) dfq_linear_forward(&M->head, normed, rows, out);
    free(h);
    return 1;
}

/* One DFlash drafter layer (full attention, bidirectional inside the block) on the block's rows h (B,
 * hidden), in place, with the new context rows ctx (P, hidden, or NULL when P = 0): the block's queries and
 * the context's and block's keys and values, written to the cache rows committed..committed+P+B-1 (row ==
 * position), every query seeing all of them, or with a context window W > 0 the last W context positions
 * and the block. cos and signed_sin: (P + B, hd) for positions committed.. */
struct dfq_draft_layer {
    long hidden, heads, kv, hd, inter;
    const float *norm1, *norm2, *q_norm, *k_norm;
    float eps1, eps2, qk_eps, scale;
    struct dfq_linear q, k, v, o, gate, up, down;
    long window;
};

void dfq_draft_layer_forward(const struct dfq_draft_layer *L, float *h, long B, const float *ctx, long P,
                             long committed, const float *cos, const float *signed_sin, float *keys,
                             float *values, long capacity) {
    const long H = L->hidden, heads = L->heads, kv = L->kv, hd = L->hd, I = L->inter, N = P + B;
    const long A = heads * hd, widest = I > H ? (I > A ? I : A) : (H > A ? H : A);
    float *xn = malloc(sizeof(float) * (size_t)(B * widest));
    float *q = malloc(sizeof(float) * (size_t)(B * A)), *k = malloc(sizeof(float) * (size_t)(N * kv * hd));
    float *v = malloc(sizeof(float) * (size_t)(N * kv * hd));
    float *g = malloc(sizeof(float) * (size_t)(B * I)), *u = malloc(sizeof(float) * (size_t)(B * I));
    int8_t *aq = malloc((size_t)(N * widest));
    float *ad = malloc(sizeof(float) * (size_t)(N * widest / QK)), *as = malloc(sizeof(float) * (size_t)(N * widest / QK));
    const long group = heads / kv, nb = H / QK, end = committed + N;
    const long lo = L->window > 0 && committed + P > L->window ? committed + P - L->window : 0;
    long *counts = malloc(sizeof(long) * (size_t)B);  /* every block row sees the same keys */
    for (long r = 0; r < B; r++) counts[r] = end - lo;
#pragma omp parallel
    {
        /* rows 0..P-1 the context (already normed by the drafter's hidden_norm), P.. the normed block */
#pragma omp for schedule(static)
        for (long r = 0; r < N; r++) {
            const float *x = r < P ? ctx + r * H : xn + (r - P) * H;
            if (r >= P) rms_norm(h + (r - P) * H, L->norm1, H, L->eps1, xn + (r - P) * H);
            dfq_quantize_row(x, H, aq + r * H, ad + r * nb, as + r * nb);
        }
        dfq_matmul_rows(&L->q, aq + P * H, ad + P * nb, as + P * nb, B, q, A, 0);
        dfq_matmul_rows(&L->k, aq, ad, as, N, k, kv * hd, 0);
        dfq_matmul_rows(&L->v, aq, ad, as, N, v, kv * hd, 0);
#pragma omp for schedule(static)
        for (long task = 0; task < B * heads + N * kv; task++) {
            if (task < B * heads) {
                const long r = task / heads, j = task % heads;
                float *x = q + r * A + j * hd;
                if (L->q_norm) rms_norm(x, L->q_norm, hd, L->qk_eps, x);
                rope(x, cos + (P + r) * hd, signed_sin + (P + r) * hd, hd, L->scale);
            } else {
                const long r = (task - B * heads) / kv, gi = (task - B * heads) % kv;
                float *x = k + (r * kv + gi) * hd;
                if (L->k_norm) rms_norm(x, L->k_norm, hd, L->qk_eps, x);
                rope(x, cos + r * hd, signed_sin + r * hd, hd, 1.0f);
                float *krow = keys + (gi * capacity + committed + r) * hd;
                float *vrow = values + (gi * capacity + committed + r) * hd;
                const float *vv = v + (r * kv + gi) * hd;
                for (long i = 0; i < hd; i++) { krow[i] = x[i]; vrow[i] = vv[i]; }
            }
        }
        attend_runs(q, A, B, group, kv, hd, keys, values, capacity, lo, counts, xn, A, 0);
#pragma omp for schedule(static)
        for (long r = 0; r < B; r++) dfq_quantize_row(xn + r * A, A, aq + r * A, ad + r * (A / QK), as + r * (A / QK));
        dfq_matmul_rows(&L->o, aq, ad, as, B, h, H, 1);
#pragma omp for schedule(static)
        for (long r = 0; r < B; r++) {
            rms_norm(h + r * H, L->norm2, H, L->eps2, xn + r * H);
            dfq_quantize_row(xn + r * H, H, aq + r * H, ad + r * nb, as + r * nb);
        }
        dfq_matmul_rows(&L->gate, aq, ad, as, B, g, I, 0);
        dfq_matmul_rows(&L->up, aq, ad, as, B, u, I, 0);
#pragma omp for schedule(static)
        for (long r = 0; r < B; r++) {
            silu_mul(g + r * I, u + r * I, I, g + r * I);
            dfq_quantize_row(g + r * I, I, aq + r * I, ad + r * (I / QK), as + r * (I / QK));
        }
        dfq_matmul_rows(&L->down, aq, ad, as, B, h, H, 1);
    }
    free(counts);
    free(xn);
    free(q);
    free(k);
    free(v);
    free(g);
    free(u);
    free(aq);
    free(ad);
    free(as);
}
