/* A DFlash drafter's whole greedy draft in one call (engine/cpu/c_draft.py): the block's embeddings, the
 * context rows (fc over the tapped target states, then hidden_norm), the drafter's layers (layer.c), the final
 * norm of the kept slots, the head (or a shortlist head: a 4-bit copy of the 8-bit head scores every row, the
 * 8-bit codes each row's best few again, int8_matmul.c's dfq_shortlist_rows) and each row's first maximum with its softmax
 * probability (argmax.c). It calls the same kernels the drafter's Python forward calls one by one, in the same
 * order on the same rows, so its drafts, confidences and cache rows are those of that forward, bit for bit.
 *
 * Why one call: right after a verify has streamed the target's weights through the caches, each of the ~25
 * Python and torch operations between the kernels ran cold, 10-40 us apiece: about a quarter of a ~1.7 ms
 * draft on 2 Zen 4 cores (benchmarks/README.md). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dfq.h"

struct dfq_drafter {
    long hidden, layers;
    const struct dfq_draft_layer *const *layer;
    struct dfq_linear fc; /* (hidden, taps * hidden) */
    const float *hidden_norm, *norm;
    float hidden_eps, norm_eps;
    /* the anchor's embedding: a row of a tied head's q8 codes (embed_codes), else of a dense fp32 table */
    const int8_t *embed_codes;
    const uint16_t *embed_d;
    const float *embed_dense;
    long vocab;
    const float *mask_row; /* (hidden): every other slot's embedding */
    struct dfq_linear quick; /* the head (n padded to 8), or a shortlist head's 4-bit copy */
    const int8_t *exact_codes; /* a shortlist head's 8-bit codes, which score each row's best again; or NULL */
    const uint16_t *exact_d;
    const float *exact_bias;
    long head_rows, top; /* the head's real rows (quick.n pads them), the shortlist's length */
    const int64_t *vocab_ids; /* a draft vocabulary's target ids, or NULL */
};

/* Drafts keep = ids (keep) for the block [anchor, MASK x (B - 1)] at positions committed + P.., with P new
 * context rows `taps` (P, fc.k), or none (P = 0). cos/signed_sin: (P + B, hd) from position committed;
 * keys[i]/values[i]: layer i's (kv, capacity, hd) fp32 cache, rows committed.. written. `logits` (keep,
 * quick.n) gets the head's logits; `confidence` (keep) each draft's probability, or NULL. Returns 0; 1 when a
 * row of logits holds a NaN (its id is not torch's: the caller picks from `logits`); -1 for an anchor outside
 * the table or buffers that could not be allocated (nothing is drafted). */
int dfq_draft_greedy(const struct dfq_drafter *D, const float *taps, long P, long anchor, long B, long keep,
                     long committed, const float *cos, const float *signed_sin, float *const *keys,
                     float *const *values, long capacity, float *logits, int64_t *ids, float *confidence) {
    const long H = D->hidden;
    if (anchor < 0 || anchor >= D->vocab || keep < 1 || keep >= B) return -1;
    float *h = malloc(sizeof(float) * (size_t)(B * H));
    float *ctx = P ? malloc(sizeof(float) * (size_t)(2 * P * H)) : NULL;
    if (!h || (P && !ctx)) {
        free(h);
        free(ctx);
        return -1;
    }
    if (D->embed_codes)
        dfq_q8_rows(D->embed_codes, D->embed_d, H, D->vocab, &anchor, 1, h);
    else
        memcpy(h, D->embed_dense + anchor * H, sizeof(float) * (size_t)H);
    for (long r = 1; r < B; r++) memcpy(h + r * H, D->mask_row, sizeof(float) * (size_t)H);
    if (P) {
        dfq_linear_forward(&D->fc, taps, P, ctx + P * H);
        dfq_rms_norm_rows(ctx + P * H, P, H, D->hidden_norm, D->hidden_eps, ctx);
    }
    for (long i = 0; i < D->layers; i++)
        dfq_draft_layer_forward(D->layer[i], h, B, ctx, P, committed, cos, signed_sin, keys[i], values[i], capacity);
    /* slot 0 (the anchor) predicts nothing: the norm and the head take slots 1..keep */
    float *kept = h + H;
    dfq_rms_norm_rows(kept, keep, H, D->norm, D->norm_eps, kept);
    dfq_linear_forward(&D->quick, kept, keep, logits);
    if (D->exact_codes)
        dfq_shortlist_rows(kept, keep, H, D->exact_codes, D->exact_d, D->exact_bias, D->head_rows, logits, D->quick.n,
                           D->top);
    const long nans = confidence ? dfq_argmax_confidence_rows(logits, keep, D->head_rows, D->quick.n, ids, confidence)
                                 : dfq_argmax_rows(logits, keep, D->head_rows, D->quick.n, ids);
    if (confidence)
        for (long r = 0; r < keep; r++)  /* as sampling.greedy_ids_with_confidence: 0 where it cannot tell */
            confidence[r] = isfinite(confidence[r]) ? fminf(fmaxf(confidence[r], 0.0f), 1.0f) : 0.0f;
    if (D->vocab_ids && !nans)
        for (long r = 0; r < keep; r++) ids[r] = D->vocab_ids[ids[r]];
    free(h);
    free(ctx);
    return nans ? 1 : 0;
}
