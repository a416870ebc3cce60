/* exp(x) for x <= 0 for the CPU kernels (core/native/build.py puts this folder on the include path). */
#ifndef LORAPLEX_EXP_NONPOS_H
#define LORAPLEX_EXP_NONPOS_H
#include <stdint.h>

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * e^r, |r| <= ln2 / 2, degree-7 Taylor (relative error
 * below 2e-8 before the float rounding). Plain arithmetic, so the compiler vectorizes the loops that call it. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f
              + r * (8.33333377e-3f + r * (1.38888892e-3f + r * 1.98412701e-4f))))));
    union { int32_t i; float f; } s;
    s.i = ((int32_t)n + 127) << 23;
    return p * s.f;
}

#endif
