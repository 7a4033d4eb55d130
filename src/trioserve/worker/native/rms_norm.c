/* RMSNorm as Llama- and Qwen-style models compute it (worker/native_layers.py sets it as their norms'
 * forward): torch runs it as six passes over the rows (pow, mean, add, rsqrt, two multiplies), a
 * prefill's 4,096 x 576 rows leaving the caches between them; here it is two reads and one write.
 *
 * Rules:
 * - x and out are [rows, n] float32 row-major, w is [n]; out may be x (each row is read whole
 *   before any of it is written), nothing else is written.
 * - out[r][j] = w[j] * (x[r][j] * (1 / sqrt(mean_j(x[r][j]^2) + eps))): transformers' order of the two
 *   multiplies; the mean is summed in another order than torch's, so results differ from it by
 *   float32 rounding, not more.
 */
#include <math.h>
#include <stdint.h>

void trioserve_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n,
                        float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n; j++) total += xr[j] * xr[j];
        const float scale = 1.0f / sqrtf(total / (float)n + eps);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) o[j] = w[j] * (xr[j] * scale);
    }
}
