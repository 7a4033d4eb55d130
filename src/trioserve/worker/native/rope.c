/* Rotary position embedding applied in place, as transformers' apply_rotary_pos_emb computes it for
 * Llama- and Qwen-style attention (worker/native_layers.py): x * cos + rotate_half(x) * sin, where
 * torch runs five passes and a concatenation per tensor (a prefill's queries: 4,096 x 9 x 64 floats).
 *
 * Rules:
 * - x is [tokens, heads, dim] float32, contiguous, dim even; cos and sin are [tokens, dim] (the
 *   model's rotary embedding for each token's position, its attention scaling included).
 * - With half = dim / 2 and i < half, per token t and head h:
 *     x[i]        <- x[i] * cos[t][i] - x[i + half] * sin[t][i]
 *     x[i + half] <- x[i + half] * cos[t][i + half] + x[i] * sin[t][i + half]
 *   both from the values before the call (rotate_half(x) is (-x[half:], x[:half])).
 * - Only x is written. Results differ from torch's by the rounding of a fused multiply-add at most.
 */
#include <stdint.h>

void trioserve_rope(float *x, int64_t tokens, int64_t heads, int64_t dim, const float *cos,
                    const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * dim;
        const float *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *restrict lo = x + (t * heads + h) * dim;
            float *restrict hi = lo + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = lo[i], b = hi[i];
                lo[i] = a * c[i] - b * s[i];
                hi[i] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
