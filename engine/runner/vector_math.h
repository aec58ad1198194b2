/* Vectorisable elementwise math shared by the engine's C kernels (included by their sources; the library
   builder hashes included headers with the source, engine.system.native_library). */

#ifndef CBSERVE_VECTOR_MATH_H
#define CBSERVE_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (a softmax's scores minus their maximum, a sigmoid's -|x|):
   2^n * 2^f, f in [-0.5, 0.5], with 2^f from its degree-7 Taylor polynomial (relative error < 2e-7).
   Inline arithmetic rather than expf, so that the loops calling it vectorise. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float t = clamped * 1.44269504088896341f;
    const float n = rintf(t);
    const float f = t - n;
    float p = 1.52527338e-5f;
    p = p * f + 1.54035304e-4f;
    p = p * f + 1.33335581e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147181e-1f;
    p = p * f + 1.0f;
    const int32_t exponent_bits = ((int32_t)n + 127) << 23;
    float power;
    memcpy(&power, &exponent_bits, sizeof power);
    return x < -87.0f ? 0.0f : p * power;
}

#endif
