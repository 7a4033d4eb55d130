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
 * - Up to 8 rows, tiles of FULL_ROWS rows by the whole block; more, of ROWS rows by WIDTH columns,
 *   and where WIDTH is half a block, a panel's last rows, if FULL_ROWS or fewer, in one tile by the
 *   whole block (a tile's accumulators stay in vector registers: the counts below are per
 *   instruction set). Past 8 rows, x goes in panels of PANEL_BYTES, each against every block, so a
 *   panel is read from L2, not L3, by every block.
 * - The weights a tile reads (a block, or half of one) come from memory for its first tile and from
 *   cache for the others; the later tiles prefetch the weights read next (the next block, or the
 *   block's other half) between them (`struct ahead`), so no first tile waits on memory for all of
 *   its weights.
 * - Each step over i asks for the block's lines PREFETCH steps ahead (2 KB): without it the Xeon above
 *   read weights at 6.8-8.2 GB/s at 8 rows, 0.74-0.81x oneDNN's speed; with it 8.9-11.3 GB/s. A
 *   prefetch past the block's end reads the next block's start or nothing: it never faults.
 * - Each output is a sum over i in increasing order, one rounding per product added: within float32
 *   rounding of F.linear's, not bit-equal to it.
 * - With AVX-512, past PACKED_FROM rows (a prefill's), the full blocks take tiles of PACKED_ROWS rows
 *   whose x is first copied per panel as [tile][k][PACKED_ROWS] (packed_rows.h), so a step's
 *   broadcasts read one line and 28 accumulators hide more of the loads: 1,024-2,048 rows of SmolLM2's
 *   products 3-11 % faster on an AVX-512 Xeon (level for the 6-block k and v projections, hence
 *   PACKED_BLOCKS). The sums run in the same order as every other tile's: the bits of the 8-row tiles.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define PREFETCH 16
#define PANEL_BYTES (384 << 10) /* x rows per panel: with a block, well inside a 512 KB L2 */
#if defined(__AVX512F__)
/* 32 zmm registers: a tile of 8 rows by the whole block is 16 accumulators */
#define ROWS 8
#define WIDTH 32
#define FULL_ROWS 8
#else
/* 16 ymm registers: tiles of 3 rows by the whole block (12 accumulators) or of 6 rows by half of it
 * (12 again); 8 rows by the whole block, as above, spill (0.44-0.57x oneDNN at 32 and 1,024 rows on
 * an AMD EPYC without AVX-512; these tiles: 0.93-1.13x at 32 and 1,024, 0.99-1.37x at 1-8) */
#define ROWS 6
#define WIDTH 16
#define FULL_ROWS 3
#endif

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

/* Lines of weights a tile asks for while it runs: from `at`, one or two lines (`lines`; 0: none) of
 * each row of the packed layout, one row a step over i, or, spread, `left` rows, one every `every`
 * steps. */
struct ahead {
    const float *at;
    int64_t left;
    int64_t every, wait;
    int lines;
};

static struct ahead ahead_of(const float *at, int64_t from, int64_t count, int64_t k, int lines) {
    const int64_t every = count > 0 ? k / count : 1;
    const struct ahead a = {at ? at + from * BLOCK : 0, at ? count : 0, every, every, at ? lines : 0};
    return a;
}

/* rows (1 .. ROWS) rows of x against width (WIDTH or BLOCK) columns of one block starting at column
 * `first_col` of it: compile-time counts in each inlined copy below, so the accumulators are registers,
 * not memory. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, const int rows, const int width,
                                                       int64_t k, const float *restrict block, int first_col,
                                                       const float *restrict bias, float *restrict y, int64_t n,
                                                       int64_t cols, const int spread, struct ahead ahead) {
    float acc[ROWS > FULL_ROWS ? ROWS : FULL_ROWS][BLOCK] __attribute__((aligned(64)));
    const float *restrict w = block + first_col;
    for (int r = 0; r < rows; r++)
#pragma omp simd
        for (int j = 0; j < width; j++) acc[r][j] = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float *restrict wi = w + i * BLOCK;
        __builtin_prefetch(wi + PREFETCH * BLOCK); /* this tile's lines of the block, PREFETCH rows ahead */
        if (width > 16) __builtin_prefetch(wi + PREFETCH * BLOCK + 16);
        /* reading from cache: the next weights meanwhile (a countdown past 8 rows; up to 8, where the
         * loop waits on memory, one row of them a step: the countdown there cost 3-7 %) */
        if (spread && ahead.left > 0 && --ahead.wait == 0) {
            __builtin_prefetch(ahead.at, 0, 2);
            if (ahead.lines > 1) __builtin_prefetch(ahead.at + 16, 0, 2);
            ahead.at += BLOCK;
            ahead.left--;
            ahead.wait = ahead.every;
        } else if (!spread && ahead.lines) {
            __builtin_prefetch(ahead.at + i * BLOCK, 0, 2);
            if (ahead.lines > 1) __builtin_prefetch(ahead.at + i * BLOCK + 16, 0, 2);
        }
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * k + i];
#pragma omp simd
            for (int j = 0; j < width; j++) acc[r][j] += xi * wi[j];
        }
    }
    /* the columns of this tile that exist: all of it but in the last block */
    const int64_t out = cols - first_col < width ? cols - first_col : width;
    const float *restrict bb = bias ? bias + first_col : 0;
    for (int r = 0; r < rows; r++) {
        float *restrict yr = y + r * n + first_col;
        if (out == width && bb) {
#pragma omp simd
            for (int j = 0; j < width; j++) yr[j] = acc[r][j] + bb[j];
        } else if (out == width) {
#pragma omp simd
            for (int j = 0; j < width; j++) yr[j] = acc[r][j];
        } else {
            for (int64_t j = 0; j < out; j++) yr[j] = bb ? acc[r][j] + bb[j] : acc[r][j];
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "packed_rows.h"

/* rows (1 .. PACKED_ROWS) of a packed tile (xp: [k][PACKED_ROWS], rows past `rows` zero) against a
 * whole block; the tiles after a panel's first ask for `ahead_rows` rows of the next block from
 * `ahead`, spread over their steps (as the tiles above do). */
static inline __attribute__((always_inline)) void packed_tile(const float *restrict xp, const float *restrict w,
                                                              int64_t k, const float *restrict bias,
                                                              float *restrict y, int64_t n, int rows,
                                                              const float *ahead, int64_t ahead_rows) {
    __m512 a0[PACKED_ROWS], a1[PACKED_ROWS];
    for (int r = 0; r < PACKED_ROWS; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    const int64_t every = ahead_rows > 0 ? k / ahead_rows : k + 1;
    int64_t wait = every;
#pragma GCC unroll 2
    for (int64_t i = 0; i < k; i++) {
        const __m512 w0 = _mm512_loadu_ps(w + i * BLOCK), w1 = _mm512_loadu_ps(w + i * BLOCK + 16);
        if (--wait == 0 && ahead_rows > 0) {
            __builtin_prefetch(ahead, 0, 2);
            __builtin_prefetch(ahead + 16, 0, 2);
            ahead += BLOCK;
            ahead_rows--;
            wait = every;
        }
        const float *restrict xi = xp + i * PACKED_ROWS;
        for (int r = 0; r < PACKED_ROWS; r++) {
            const __m512 b = _mm512_set1_ps(xi[r]);
            a0[r] = _mm512_fmadd_ps(b, w0, a0[r]);
            a1[r] = _mm512_fmadd_ps(b, w1, a1[r]);
        }
    }
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(y + r * n, bias ? _mm512_add_ps(a0[r], b0) : a0[r]);
        _mm512_storeu_ps(y + r * n + 16, bias ? _mm512_add_ps(a1[r], b1) : a1[r]);
    }
}

/* Blocks first .. last - 1, all full, for every row, in packed tiles; 0 if the panel's copy could not
 * be allocated (the caller then takes the tiles above). */
static int packed_linear(const float *restrict x, int64_t m, int64_t k, const float *restrict p, int64_t n,
                         const float *restrict bias, float *restrict y, int64_t first, int64_t last) {
    const int64_t panel = packed_panel(m, k, PANEL_BYTES);
    float *xp = malloc((size_t)(panel * k) * sizeof(float));
    if (!xp) return 0;
    for (int64_t p0 = 0; p0 < m; p0 += panel) {
        const int64_t p1 = m - p0 < panel ? m : p0 + panel;
        const int64_t tiles = (p1 - p0 + PACKED_ROWS - 1) / PACKED_ROWS;
        pack_rows(x, k, p0, p1, xp);
        const int64_t share = tiles > 1 ? (k + tiles - 2) / (tiles - 1) : 0;
        for (int64_t b = first; b < last; b++) {
            const float *block = p + b * k * BLOCK;
            const float *next = b + 1 < last ? block + k * BLOCK : 0;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r0 = p0 + t * PACKED_ROWS;
                const int rows = p1 - r0 < PACKED_ROWS ? (int)(p1 - r0) : PACKED_ROWS;
                const int64_t from = t > 0 ? (t - 1) * share : k;
                const int64_t count = next && from < k ? (k - from < share ? k - from : share) : 0;
                packed_tile(xp + t * PACKED_ROWS * k, block, k, bias ? bias + b * BLOCK : 0, y + r0 * n + b * BLOCK,
                            n, rows, next ? next + from * BLOCK : 0, count);
            }
        }
    }
    free(xp);
    return 1;
}
#endif

#define TILE(rows, width) tile(xt, rows, width, k, block, c0, bb, yt, n, cols, 1, ahead)
#define TILE_UP_TO_8(rows) tile(xt, rows, BLOCK, k, block, c0, bb, yt, n, cols, 0, ahead)

void trioserve_blocked_linear(const float *restrict x, int64_t m, int64_t k, const float *restrict p,
                              int64_t n, const float *restrict bias, float *restrict y, int64_t first,
                              int64_t last) {
#if defined(__AVX512F__)
    const int64_t full = last < n / BLOCK ? last : n / BLOCK; /* the blocks with no padding */
    if (m >= PACKED_FROM && full - first >= PACKED_BLOCKS && packed_linear(x, m, k, p, n, bias, y, first, full)) first = full;
    if (first >= last) return;
#endif
    /* up to 8 rows (a decode step's), tiles of FULL_ROWS by the whole block: one stream per block;
     * more rows, tiles of ROWS by WIDTH, in panels of rows that stay in L2 across all blocks */
    const int rows = m <= 8 ? FULL_ROWS : ROWS;
    const int width = m <= 8 ? BLOCK : WIDTH;
    int64_t panel = PANEL_BYTES / (4 * k) / rows * rows;
    if (panel < rows) panel = rows;
    for (int64_t p0 = 0; p0 < m; p0 += panel) {
        const int64_t p1 = m - p0 < panel ? m : p0 + panel;
        for (int64_t b = first; b < last; b++) {
            const float *block = p + b * k * BLOCK;
            const int64_t col = b * BLOCK;
            const int64_t cols = n - col < BLOCK ? n - col : BLOCK;
            const float *bb = bias ? bias + col : 0;
            const int64_t tail = (p1 - p0) % rows;
            const int whole_tail = width < BLOCK && tail > 0 && tail <= FULL_ROWS;
            for (int c0 = 0; c0 < cols; c0 += width) {
                /* the weights read next: the block's other half, else the next block */
                const float *next = c0 + width < cols ? block + c0 + width : b + 1 < last ? block + k * BLOCK : 0;
                const int64_t tiles = (p1 - p0 + rows - 1) / rows - (whole_tail && c0 > 0);
                for (int64_t r0 = p0; r0 < p1; r0 += rows) {
                    /* Every tile after the first reads its weights from cache, so those tiles ask for
                     * the next weights between them. Up to 8 rows (whole-block tiles, one stream per
                     * block): the second tile asks for both lines of each of the next block's rows,
                     * or, with more tiles, the second and third one line each. More rows: the later
                     * tiles ask for a share of the next half block's rows each, spread over their
                     * steps, so its read from memory runs at the pace of their products instead of
                     * stalling the next first tile (at 32 rows: 68 GFLOP/s with the weights in
                     * memory, 91 with them in cache, before this). */
                    const int64_t t = (r0 - p0) / rows;
                    struct ahead ahead = ahead_of(0, 0, 0, k, 0);
                    if (m <= 8 && next && t > 0 && (tiles == 2 || t <= 2))
                        ahead = ahead_of(next + (tiles > 2 && t == 2 ? 16 : 0), 0, k, k, tiles == 2 ? 2 : 1);
                    else if (m > 8 && t > 0 && t < tiles) {
                        const int64_t share = (k + tiles - 2) / (tiles - 1);
                        const int64_t from = (t - 1) * share;
                        ahead = ahead_of(next, from, from < k ? (k - from < share ? k - from : share) : 0, k,
                                         width / 16);
                    }
                    const float *xt = x + r0 * k;
                    float *yt = y + r0 * n + col;
                    const int64_t left = p1 - r0 < rows ? p1 - r0 : rows;
                    if (m <= 8) { /* the same tiles as below with the spread prefetch compiled out */
                        switch (left) {
                        case 1: TILE_UP_TO_8(1); break;
                        case 2: TILE_UP_TO_8(2); break;
#if FULL_ROWS > 3
                        case 3: TILE_UP_TO_8(3); break;
                        case 4: TILE_UP_TO_8(4); break;
                        case 5: TILE_UP_TO_8(5); break;
                        case 6: TILE_UP_TO_8(6); break;
                        case 7: TILE_UP_TO_8(7); break;
#endif
                        default: TILE_UP_TO_8(FULL_ROWS); break;
                        }
                    } else if (width == BLOCK) {
                        switch (left) {
                        case 1: TILE(1, BLOCK); break;
                        case 2: TILE(2, BLOCK); break;
#if FULL_ROWS > 3
                        case 3: TILE(3, BLOCK); break;
                        case 4: TILE(4, BLOCK); break;
                        case 5: TILE(5, BLOCK); break;
                        case 6: TILE(6, BLOCK); break;
                        case 7: TILE(7, BLOCK); break;
#endif
                        default: TILE(FULL_ROWS, BLOCK); break;
                        }
                    } else if (left <= FULL_ROWS && left < rows) {
                        /* the panel's last rows, too few for a half-block tile to keep the FMA units
                         * busy (2 rows by 16 columns is 4 accumulators): once, by the whole block */
                        if (c0 == 0) switch (left) {
                            case 1: TILE(1, BLOCK); break;
                            case 2: TILE(2, BLOCK); break;
                            default: TILE(FULL_ROWS, BLOCK); break;
                            }
                    } else {
                        switch (left) {
                        case 1: TILE(1, WIDTH); break;
                        case 2: TILE(2, WIDTH); break;
                        case 3: TILE(3, WIDTH); break;
                        case 4: TILE(4, WIDTH); break;
                        case 5: TILE(5, WIDTH); break;
#if ROWS > 6
                        case 6: TILE(6, WIDTH); break;
                        case 7: TILE(7, WIDTH); break;
#endif
                        default: TILE(ROWS, WIDTH); break;
                        }
                    }
                }
            }
        }
    }
}
