/* A prefill's x in tiles of PACKED_ROWS rows, for blocked_linear.c's and gated_linear.c's AVX-512
 * tiles past PACKED_FROM rows: rows p0 .. p1 - 1 of x ([m, k] row-major) copied as
 * [tile][k][PACKED_ROWS], rows past p1 zero, so a tile's step over i broadcasts from one line and the
 * tile holds 2 x PACKED_ROWS accumulators (28 of the 32 zmm registers). */
#ifndef TRIOSERVE_PACKED_ROWS_H
#define TRIOSERVE_PACKED_ROWS_H
#include <stdint.h>

#define PACKED_FROM 129 /* rows; decode steps of up to 128 requests keep the narrower tiles */
#define PACKED_ROWS 14
/* blocks per call at least: the copy is paid once for all of them (576 -> 192, 6 blocks: 4-20 %
 * slower packed) */
#define PACKED_BLOCKS 12

/* rows per panel: a multiple of PACKED_ROWS whose copy is about `bytes`, no more than m needs */
static inline int64_t packed_panel(int64_t m, int64_t k, int64_t bytes) {
    int64_t panel = bytes / (4 * k) / PACKED_ROWS * PACKED_ROWS;
    const int64_t all = (m + PACKED_ROWS - 1) / PACKED_ROWS * PACKED_ROWS;
    if (panel < PACKED_ROWS) panel = PACKED_ROWS;
    return panel < all ? panel : all;
}

static inline void pack_rows(const float *restrict x, int64_t k, int64_t p0, int64_t p1, float *restrict xp) {
    const int64_t tiles = (p1 - p0 + PACKED_ROWS - 1) / PACKED_ROWS;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t i = 0; i < k; i++)
            for (int r = 0; r < PACKED_ROWS; r++) {
                const int64_t row = p0 + t * PACKED_ROWS + r;
                xp[(t * k + i) * PACKED_ROWS + r] = row < p1 ? x[row * k + i] : 0.0f;
            }
}
#endif
