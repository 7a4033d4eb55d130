/* Decode attention read in place from trioserve's paged KV cache (worker/native_kernels.py builds
 * and loads this file; worker/paged_attention.py calls it).
 *
 * Rules:
 * - The cache of one layer is [num_blocks, block_size, kv_heads, dim] float32, contiguous, keys and
 *   values alike (worker/paged_attention.py's PagedKVCache). Nothing is copied out of it: each
 *   position's key and value rows are read where they lie, through the request's block table.
 * - One query token per request: q and out are [batch, heads, dim] float32, contiguous. Query head h
 *   reads kv head h / group (transformers' repeat_kv order), group = heads / kv_heads.
 * - Request b attends to its positions 0 .. lens[b] - 1, position p in block tables[b][p / block_size]
 *   at offset p % block_size; lens[b] >= 1 and every block id is below num_blocks (the caller's
 *   layout guarantees both; nothing here checks them).
 * - out = softmax(scale * q . k) . v per head, in float32, with the maximum subtracted before the exp
 *   (exp_neg.h's, vectorised: libm's expf took 12 % of the kernel here).
 * - scratch holds at least heads * max(lens) floats; it is the only memory written besides out.
 * - Each position's row (all kv heads, contiguous) is read once per pass, in block order, not head by
 *   head in strided passes (three over each block for SmolLM2's 3 kv heads). With the exp above:
 *   SmolLM2's 30 layers at 32 contexts of 140, the cache out of the CPU's caches, 47 -> 40 ms here.
 * - No threads and no allocation: the caller owns parallelism and memory.
 */
#include <math.h>
#include <stdint.h>

#include "exp_neg.h"

static inline float dot(const float *restrict a, const float *restrict b, int64_t dim) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < dim; d++) s += a[d] * b[d];
    return s;
}

/* Request b: every query head against every context position, each position's row (all kv heads,
 * contiguous) read once per pass, in the order it lies in the block. */
static inline void one_request(const float *restrict q, const float *restrict keys,
                               const float *restrict values, const int64_t *restrict table, int64_t len,
                               float *restrict out, float *restrict scores, int64_t heads,
                               int64_t kv_heads, int64_t dim, int64_t block_size, float scale) {
    const int64_t group = heads / kv_heads;
    const int64_t row = kv_heads * dim; /* floats between consecutive positions of one block */
    const int64_t blocks = (len + block_size - 1) / block_size;
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t start = i * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *k = keys + table[i] * block_size * row;
        for (int64_t off = 0; off < n; off++, k += row) {
            for (int64_t g = 0, h = 0; g < kv_heads; g++)
                for (int64_t j = 0; j < group; j++, h++)
                    scores[h * len + start + off] = scale * dot(q + h * dim, k + g * dim, dim);
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * len;
        float top = -INFINITY;
        for (int64_t p = 0; p < len; p++) top = s[p] > top ? s[p] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t p = 0; p < len; p++) {
            s[p] = exp_neg(s[p] - top);
            total += s[p];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t p = 0; p < len; p++) s[p] *= inv;
        float *o = out + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
    }
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t start = i * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *v = values + table[i] * block_size * row;
        /* Head by head over the block, which is in L1 after the first head's pass. */
        for (int64_t g = 0, h = 0; g < kv_heads; g++)
            for (int64_t j = 0; j < group; j++, h++) {
                const float *restrict w = scores + h * len + start;
                const float *restrict vg = v + g * dim;
                float *restrict o = out + h * dim;
                for (int64_t off = 0; off < n; off++) {
#pragma omp simd
                    for (int64_t d = 0; d < dim; d++) o[d] += w[off] * vg[off * row + d];
                }
            }
    }
}

/* The head sizes of the models served today get their own copy with dim a constant, so that the
 * compiler unrolls the dot products and the accumulation fully; any other dim takes the generic one. */
#define REQUEST(DIM)                                                                               \
    one_request(q + b * heads * (DIM), keys, values, tables + b * width, lens[b],                  \
                out + b * heads * (DIM), scratch, heads, kv_heads, (DIM), block_size, scale)

void trioserve_paged_decode(const float *q, const float *keys, const float *values,
                            const int64_t *tables, const int64_t *lens, float *out, float *scratch,
                            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t block_size, int64_t width, float scale) {
    for (int64_t b = 0; b < batch; b++) {
        switch (dim) {
        case 32: REQUEST(32); break;
        case 64: REQUEST(64); break;
        case 128: REQUEST(128); break;
        default: REQUEST(dim); break;
        }
    }
}
