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
 * - With AVX-512, the scores of a full block of 16 positions (dim a multiple of 16) are 16 dot
 *   products reduced together (scores16); other blocks take the plain loop. The same products, summed
 *   in another order. 30 SmolLM2 layers at 32 contexts of 140 here: 36 -> 32 ms.
 * - While one block is read, the next one of the same pass is asked for (`fetch`, the whole block:
 *   12 KB for SmolLM2); during the softmax, the first block of values; during the last block of
 *   values, the next request's first block of keys. The hardware's prefetcher alone left the loads
 *   stalling: SmolLM2's 30 layers at 32 contexts of 160 took 12.4 ms with the cache in L2 and 29.5
 *   with it in memory, 8 GB/s where one core streams ~13; with these, 25.6-27.3 (AVX-512 Xeon).
 * - No threads and no allocation: the caller owns parallelism and memory.
 */
#include <math.h>
#include <stdint.h>

#include "exp_neg.h"

/* Ask for the `floats` floats from `block` (one block of keys or values) ahead of their use. */
static inline void fetch(const float *block, int64_t floats) {
    const char *at = (const char *)block;
    for (int64_t byte = 0; byte < floats * 4; byte += 64) __builtin_prefetch(at + byte, 0, 3);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane j of the result: the sum of v[j]'s 16 lanes. A transpose-and-add tree, 45 shuffles and adds
 * for the 16 sums where reducing each vector alone takes about 8 each. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: v[2i], v[2i+1], v[2i], v[2i+1] (partial sums) */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: v[4i] .. v[4i+3] (partial sums) */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes: v[8i..8i+3] twice, then v[8i+4..8i+7] twice */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* scores[0..15] = scale * q . k_p for the 16 positions of a full block, k_p = k + p * row, dim a
 * multiple of 16. */
static inline void scores16(const float *restrict q, const float *restrict k, int64_t row, int64_t dim,
                            float scale, float *restrict scores) {
    __m512 v[16];
    for (int p = 0; p < 16; p++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + p * row + d), acc);
        v[p] = acc;
    }
    _mm512_storeu_ps(scores, _mm512_mul_ps(sum16(v), _mm512_set1_ps(scale)));
}
#endif

static inline float dot(const float *restrict a, const float *restrict b, int64_t dim) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < dim; d++) s += a[d] * b[d];
    return s;
}

/* Request b: every query head against every context position, each position's row (all kv heads,
 * contiguous) read once per pass, in the order it lies in the block. `next_keys`: the next request's
 * first block of keys, or NULL. */
static inline void one_request(const float *restrict q, const float *restrict keys,
                               const float *restrict values, const int64_t *restrict table, int64_t len,
                               float *restrict out, float *restrict scores, int64_t heads,
                               int64_t kv_heads, int64_t dim, int64_t block_size, float scale,
                               const float *next_keys) {
    const int64_t group = heads / kv_heads;
    const int64_t row = kv_heads * dim; /* floats between consecutive positions of one block */
    const int64_t floats = block_size * row;
    const int64_t blocks = (len + block_size - 1) / block_size;
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t start = i * block_size;
        const int64_t n = len - start < block_size ? len - start : block_size;
        const float *k = keys + table[i] * floats;
        if (i + 1 < blocks) fetch(keys + table[i + 1] * floats, floats);
#if defined(__AVX512F__)
        if (n == 16 && dim % 16 == 0) {
            for (int64_t g = 0, h = 0; g < kv_heads; g++)
                for (int64_t j = 0; j < group; j++, h++)
                    scores16(q + h * dim, k + g * dim, row, dim, scale, scores + h * len + start);
            continue;
        }
#endif
        for (int64_t off = 0; off < n; off++, k += row) {
            for (int64_t g = 0, h = 0; g < kv_heads; g++)
                for (int64_t j = 0; j < group; j++, h++)
                    scores[h * len + start + off] = scale * dot(q + h * dim, k + g * dim, dim);
        }
    }
    fetch(values + table[0] * floats, floats);
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
        const float *v = values + table[i] * floats;
        if (i + 1 < blocks) fetch(values + table[i + 1] * floats, floats);
        else if (next_keys) fetch(next_keys, floats);
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
                out + b * heads * (DIM), scratch, heads, kv_heads, (DIM), block_size, scale, next)

void trioserve_paged_decode(const float *q, const float *keys, const float *values,
                            const int64_t *tables, const int64_t *lens, float *out, float *scratch,
                            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                            int64_t block_size, int64_t width, float scale) {
    for (int64_t b = 0; b < batch; b++) {
        /* the next request's first block of keys, asked for during this one's last block of values */
        const float *next = b + 1 < batch ? keys + tables[(b + 1) * width] * block_size * kv_heads * dim : 0;
        switch (dim) {
        case 32: REQUEST(32); break;
        case 64: REQUEST(64); break;
        case 128: REQUEST(128); break;
        default: REQUEST(dim); break;
        }
    }
}
