/* The draw of worker/sampler.py (stage 7) on the CPU: each row's token by inverting its cumulative
 * distribution with one uniform, in two reads of the row and no row-sized write
 * (worker/native_kernels.py builds and loads this file with paged_decode.c).
 *
 * Rules:
 * - logits is [rows, vocab] float32, contiguous: the warped logits (temperature, min_p, top-k, top-p
 *   applied; a cut token is -inf). u is [rows] float32 in [0, 1). out is [rows] int64.
 * - Row r's weights are w_j = e(x_j - max): e is exp to about 2 ulp (exp_neg.h), exactly 0 for
 *   x_j - max below -87 (so always for a cut token); the row's maximum has weight 1.
 * - The token is the first j whose running sum of weights exceeds u * total (total: the sum of all
 *   weights, kept below itself by one rounding step), so j is drawn with probability w_j / total and a
 *   token of weight 0 never is: the running sum does not rise there.
 * - The running sum is found by chunks: the sums of CHUNK weights each (one vectorised pass), then a
 *   scan of the one chunk the target falls in. Rounding can make that chunk's own scan end a hair
 *   short of its sum; the chunk's last token of positive weight is taken then (it exists: the chunk's
 *   sum is positive), so the second rule holds whatever the rounding.
 * - A row that is -inf everywhere (no weight at all) gets token 0. sums holds vocab / CHUNK + 1
 *   floats; it is the only memory written besides out.
 */
#include <math.h>
#include <stdint.h>

#include "exp_neg.h"

#define CHUNK 256

static int64_t draw_row(const float *restrict x, int64_t vocab, float u, float *restrict sums) {
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < vocab; j++) top = x[j] > top ? x[j] : top;
    if (top == -INFINITY) return 0;
    const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
    double total = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t end = (c + 1) * CHUNK < vocab ? (c + 1) * CHUNK : vocab;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = c * CHUNK; j < end; j++) s += exp_neg(x[j] - top);
        sums[c] = s;
        total += s;
    }
    double target = (double)u * total;
    if (target >= total) target = nextafter(total, 0.0);
    double below = 0.0; /* the weight of every chunk before c */
    int64_t c = 0;
    while (c < chunks - 1 && below + sums[c] <= target) below += sums[c++];
    const int64_t end = (c + 1) * CHUNK < vocab ? (c + 1) * CHUNK : vocab;
    int64_t last = -1;
    for (int64_t j = c * CHUNK; j < end; j++) {
        const float w = exp_neg(x[j] - top);
        if (w > 0.0f) {
            last = j;
            below += w;
            if (below > target) return j;
        }
    }
    if (last >= 0) return last;
    for (int64_t j = c * CHUNK - 1; j >= 0; j--) /* only when every chunk from c on weighs 0 */
        if (exp_neg(x[j] - top) > 0.0f) return j;
    return 0;
}

void trioserve_inverse_cdf(const float *logits, const float *u, int64_t *out, float *sums, int64_t rows,
                           int64_t vocab) {
    for (int64_t r = 0; r < rows; r++) out[r] = draw_row(logits + r * vocab, vocab, u[r], sums);
}
