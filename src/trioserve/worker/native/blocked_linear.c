/* y = x W^T + b for the CPU worker's linear layers, over a weight repacked once at load into blocks
 * of BLOCK output columns (worker/native_kernels.py builds and loads this file; worker/packed_linear.py
 * uses it). Why: a decode step multiplies a few rows by every weight, so its time is the weight's read
 * from memory; one contiguous stream per block, each value used by every row of the batch while it is
 * in a register, reads it near the core's bandwidth (bench/linear_products.py: 1.4-2.1x oneDNN's
 * speed at 1-8 rows, within 3 % of it at a thousand, on an AMD EPYC; on a Xeon whose one core reads
 * ~13 GB/s, 1.1-1.5x at 8 rows and 0.89-1.01x at a thousand, with the prefetch below).
 *
 * Rules:
 * - w is [n, k] float32 row-major (nn.Linear's weight). The packed copy p is [blocks][k][BLOCK] with
 *   blocks = ceil(n / BLOCK): p[b][i][j] = w[b * BLOCK + j][i], 0 past column n (the last block's
 *   padding, never written out).
 * - x is [m, k] and y is [m, n], float32 row-major; bias is [n] or NULL.
 * - One call writes the columns of blocks first .. last - 1 for every row, nothing else, so calls on
 *   disjoint block ranges may run at once (one per thread) on the same x and y.
 * - Rows go in tiles of up to ROWS (the tile's accumulators stay in vector registers: ROWS x BLOCK
 *   floats); a block is read from memory for its first tile and from cache for the others.
 * - Each step over i asks for the block's lines PREFETCH steps ahead (2 KB): without it the Xeon above
 *   read weights at 6.8-8.2 GB/s at 8 rows, 0.74-0.81x oneDNN's speed; with it 8.9-11.3 GB/s. A
 *   prefetch past the block's end reads the next block's start or nothing: it never faults.
 * - Each output is a sum over i in increasing order, one rounding per product added: within float32
 *   rounding of F.linear's, not bit-equal to it.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define ROWS 8
#define PREFETCH 16

void trioserve_pack_linear(const float *restrict w, int64_t n, int64_t k, float *restrict p) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < BLOCK; j++) {
                const int64_t col = b * BLOCK + j;
                p[(b * k + i) * BLOCK + j] = col < n ? w[col * k + i] : 0.0f;
            }
}

/* The same layout over w itself, for n a multiple of BLOCK: rows b * BLOCK .. b * BLOCK + BLOCK - 1
 * of w are exactly the floats of packed block b, so each block is copied to tmp (BLOCK * k floats)
 * and written back transposed. No second copy of the weight is kept. (Where the weight is a private
 * mapping of its checkpoint, as transformers maps a float32 one, each page written still takes a
 * copy-on-write fault: worker/packed_store.py keeps the packed copies for the next start.) */
void trioserve_pack_linear_in_place(float *restrict w, int64_t n, int64_t k, float *restrict tmp) {
    for (int64_t b = 0; b < n / BLOCK; b++) {
        float *restrict block = w + b * BLOCK * k;
        memcpy(tmp, block, (size_t)(BLOCK * k) * sizeof(float));
        /* in tiles of 16 inputs, whose reads (a line of each of the block's rows) and writes (16
         * packed rows) stay in L1: the plain double loop ran at ~1 GB/s */
        for (int64_t i0 = 0; i0 < k; i0 += 16) {
            const int64_t i1 = k - i0 < 16 ? k : i0 + 16;
            for (int64_t j = 0; j < BLOCK; j++)
                for (int64_t i = i0; i < i1; i++) block[i * BLOCK + j] = tmp[j * k + i];
        }
    }
}

/* rows (1 .. ROWS) rows of x against one block: a compile-time count in each inlined copy below, so
 * the accumulators are registers, not memory. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, const int rows, int64_t k,
                                                       const float *restrict block, const float *restrict bias,
                                                       float *restrict y, int64_t n, int64_t cols) {
    float acc[ROWS][BLOCK] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++)
#pragma omp simd
        for (int j = 0; j < BLOCK; j++) acc[r][j] = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float *restrict wi = block + i * BLOCK;
        __builtin_prefetch(wi + PREFETCH * BLOCK); /* the block's next two lines, PREFETCH rows ahead */
        __builtin_prefetch(wi + PREFETCH * BLOCK + 16);
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * k + i];
#pragma omp simd
            for (int j = 0; j < BLOCK; j++) acc[r][j] += xi * wi[j];
        }
    }
    for (int r = 0; r < rows; r++) {
        float *restrict yr = y + r * n;
        if (cols == BLOCK && bias) {
#pragma omp simd
            for (int j = 0; j < BLOCK; j++) yr[j] = acc[r][j] + bias[j];
        } else if (cols == BLOCK) {
#pragma omp simd
            for (int j = 0; j < BLOCK; j++) yr[j] = acc[r][j];
        } else {
            for (int64_t j = 0; j < cols; j++) yr[j] = bias ? acc[r][j] + bias[j] : acc[r][j];
        }
    }
}

void trioserve_blocked_linear(const float *restrict x, int64_t m, int64_t k, const float *restrict p,
                              int64_t n, const float *restrict bias, float *restrict y, int64_t first,
                              int64_t last) {
    for (int64_t b = first; b < last; b++) {
        const float *block = p + b * k * BLOCK;
        const int64_t col = b * BLOCK;
        const int64_t cols = n - col < BLOCK ? n - col : BLOCK;
        const float *bb = bias ? bias + col : 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            const float *xt = x + r0 * k;
            float *yt = y + r0 * n + col;
            switch (m - r0 < ROWS ? m - r0 : ROWS) {
            case 1: tile(xt, 1, k, block, bb, yt, n, cols); break;
            case 2: tile(xt, 2, k, block, bb, yt, n, cols); break;
            case 3: tile(xt, 3, k, block, bb, yt, n, cols); break;
            case 4: tile(xt, 4, k, block, bb, yt, n, cols); break;
            case 5: tile(xt, 5, k, block, bb, yt, n, cols); break;
            case 6: tile(xt, 6, k, block, bb, yt, n, cols); break;
            case 7: tile(xt, 7, k, block, bb, yt, n, cols); break;
            default: tile(xt, ROWS, k, block, bb, yt, n, cols); break;
            }
        }
    }
}
