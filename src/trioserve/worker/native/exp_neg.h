/* The native kernels' exp inside vectorised loops (inverse_cdf.c, silu_mul.c, paged_decode.c). */
#ifndef TRIOSERVE_EXP_NEG_H
#define TRIOSERVE_EXP_NEG_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0, vectorisable (no libm call): x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for exp(r) (Cephes' expf coefficients), 2^n built in the exponent bits. 0 below -87,
 * where expf itself goes subnormal. */
static inline float exp_neg(float x) {
    const float lo = -87.0f;
    const float c = x < lo ? lo : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (c * 1.44269504088896341f + shifter) - shifter;
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < lo ? 0.0f : y * scale;
}

#endif
