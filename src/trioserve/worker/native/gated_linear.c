/* The gated MLP's first half in one pass for a prefill's rows: out = SiLU(x Wg^T) * (x Wu^T), over the
 * gate and up weights in blocked_linear.c's packed layout (worker/native_mlp.py calls it; decode steps,
 * a few rows, keep the two products and silu_mul.c). Why: at a prefill's thousands of rows the two
 * products each wrote an [m, n] float32 output and silu_mul.c read both back and wrote a third (five
 * trips of m x n floats through memory); here each tile keeps its gate and up sums in registers and
 * writes the one result.
 *
 * Rules:
 * - pg and pu are [blocks][k][BLOCK] as blocked_linear.c packs an [n, k] weight (0 past column n);
 *   x is [m, k] and out is [m, n], float32 row-major.
 * - One call writes out's columns of blocks first .. last - 1 for every row, nothing else, so calls on
 *   disjoint block ranges may run at once on the same x and out.
 * - Tiles of ROWS rows by half a block of gate columns and the same half of up columns (16 + 16
 *   accumulator vectors with AVX-512, 6 + 6 with AVX2), x in panels of PANEL_BYTES that stay in L2
 *   across every block, as in blocked_linear.c.
 * - Each gate and up value is a sum over i in increasing order from 0, as blocked_linear.c sums
 *   without a bias, and the SiLU is silu_mul.c's formula: the result is bit-equal to the two
 *   products followed by silu_mul.c.
 * - With AVX-512, past PACKED_FROM rows, blocked_linear.c's packed tiles of x (packed_rows.h): 14 rows
 *   by a half block of gate and of up columns, the same sums in the same order, so the same bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "exp_neg.h"

#define BLOCK 32 /* blocked_linear.c's */
#define HALF 16
#define PREFETCH 16
#define PANEL_BYTES (384 << 10)
#if defined(__AVX512F__)
#define ROWS 8
#else
#define ROWS 3
#endif

/* silu_mul.c's formula, so the results are its bits */
static inline float silu_times(const float g, const float u) {
    const float e = exp_neg(-fabsf(g));
    const float s = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
    return g * s * u;
}

static inline __attribute__((always_inline)) void gated_tile(const float *restrict x, const int rows, int64_t k,
                                                             const float *restrict g, const float *restrict u,
                                                             float *restrict out, int64_t n, int64_t cols) {
    float ga[ROWS][HALF] __attribute__((aligned(64)));
    float ua[ROWS][HALF] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++)
#pragma omp simd
        for (int j = 0; j < HALF; j++) ga[r][j] = ua[r][j] = 0.0f;
    for (int64_t i = 0; i < k; i++) {
        const float *restrict gi = g + i * BLOCK;
        const float *restrict ui = u + i * BLOCK;
        __builtin_prefetch(gi + PREFETCH * BLOCK);
        __builtin_prefetch(ui + PREFETCH * BLOCK);
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * k + i];
#pragma omp simd
            for (int j = 0; j < HALF; j++) {
                ga[r][j] += xi * gi[j];
                ua[r][j] += xi * ui[j];
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float *restrict o = out + r * n;
        if (cols == HALF) {
#pragma omp simd
            for (int j = 0; j < HALF; j++) o[j] = silu_times(ga[r][j], ua[r][j]);
        } else {
            for (int64_t j = 0; j < cols; j++) o[j] = silu_times(ga[r][j], ua[r][j]);
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

#include "packed_rows.h"

/* rows (1 .. PACKED_ROWS) of a packed tile (xp: [k][PACKED_ROWS]) against a half block of gate (g)
 * and of up (u) columns, all HALF of them there */
static inline __attribute__((always_inline)) void packed_gated_tile(const float *restrict xp, int64_t k,
                                                                    const float *restrict g,
                                                                    const float *restrict u,
                                                                    float *restrict out, int64_t n, int rows) {
    __m512 ga[PACKED_ROWS], ua[PACKED_ROWS];
    for (int r = 0; r < PACKED_ROWS; r++) ga[r] = ua[r] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t i = 0; i < k; i++) {
        const __m512 gi = _mm512_loadu_ps(g + i * BLOCK), ui = _mm512_loadu_ps(u + i * BLOCK);
        __builtin_prefetch(g + (i + PREFETCH) * BLOCK);
        __builtin_prefetch(u + (i + PREFETCH) * BLOCK);
        const float *restrict xi = xp + i * PACKED_ROWS;
        for (int r = 0; r < PACKED_ROWS; r++) {
            const __m512 b = _mm512_set1_ps(xi[r]);
            ga[r] = _mm512_fmadd_ps(b, gi, ga[r]);
            ua[r] = _mm512_fmadd_ps(b, ui, ua[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float gs[HALF] __attribute__((aligned(64))), us[HALF] __attribute__((aligned(64)));
        _mm512_store_ps(gs, ga[r]);
        _mm512_store_ps(us, ua[r]);
        float *restrict o = out + r * n;
#pragma omp simd
        for (int j = 0; j < HALF; j++) o[j] = silu_times(gs[j], us[j]);
    }
}

/* Blocks first .. last - 1, all full, in packed tiles; 0 if the copy of x could not be allocated. */
static int packed_gated(const float *restrict x, int64_t m, int64_t k, const float *restrict pg,
                        const float *restrict pu, int64_t n, float *restrict out, int64_t first, int64_t last) {
    const int64_t panel = packed_panel(m, k, PANEL_BYTES);
    float *xp = malloc((size_t)(panel * k) * sizeof(float));
    if (!xp) return 0;
    for (int64_t p0 = 0; p0 < m; p0 += panel) {
        const int64_t p1 = m - p0 < panel ? m : p0 + panel;
        pack_rows(x, k, p0, p1, xp);
        for (int64_t b = first; b < last; b++)
            for (int64_t c0 = 0; c0 < BLOCK; c0 += HALF)
                for (int64_t r0 = p0; r0 < p1; r0 += PACKED_ROWS)
                    packed_gated_tile(xp + (r0 - p0) * k, k, pg + b * k * BLOCK + c0, pu + b * k * BLOCK + c0,
                                      out + r0 * n + b * BLOCK + c0, n,
                                      p1 - r0 < PACKED_ROWS ? (int)(p1 - r0) : PACKED_ROWS);
    }
    free(xp);
    return 1;
}
#endif

#define GATED(rows) gated_tile(x + r0 * k, rows, k, g, u, out + r0 * n + col, n, cols)

void trioserve_gated_linear(const float *restrict x, int64_t m, int64_t k, const float *restrict pg,
                            const float *restrict pu, int64_t n, float *restrict out, int64_t first,
                            int64_t last) {
#if defined(__AVX512F__)
    const int64_t full = last < n / BLOCK ? last : n / BLOCK; /* the blocks with no padding */
    if (m >= PACKED_FROM && full - first >= PACKED_BLOCKS && packed_gated(x, m, k, pg, pu, n, out, first, full))
        first = full;
    if (first >= last) return;
#endif
    int64_t panel = PANEL_BYTES / (4 * k) / ROWS * ROWS;
    if (panel < ROWS) panel = ROWS;
    for (int64_t p0 = 0; p0 < m; p0 += panel) {
        const int64_t p1 = m - p0 < panel ? m : p0 + panel;
        for (int64_t b = first; b < last; b++)
            for (int64_t c0 = 0; c0 < BLOCK && b * BLOCK + c0 < n; c0 += HALF) {
                const float *g = pg + b * k * BLOCK + c0;
                const float *u = pu + b * k * BLOCK + c0;
                const int64_t col = b * BLOCK + c0;
                const int64_t cols = n - col < HALF ? n - col : HALF;
                for (int64_t r0 = p0; r0 < p1; r0 += ROWS) {
                    switch (p1 - r0 < ROWS ? p1 - r0 : ROWS) {
                    case 1: GATED(1); break;
                    case 2: GATED(2); break;
#if ROWS > 3
                    case 3: GATED(3); break;
                    case 4: GATED(4); break;
                    case 5: GATED(5); break;
                    case 6: GATED(6); break;
                    case 7: GATED(7); break;
#endif
                    default: GATED(ROWS); break;
                    }
                }
            }
    }
}
