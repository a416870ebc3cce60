/* bf16 <-> fp32 for the CPU kernels (core/native/build.py puts this folder on the include path). */
#ifndef LORAPLEX_BF16_H
#define LORAPLEX_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)h << 16;
    return u.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as torch does (NaN stays a quiet NaN) */
    union { uint32_t i; float f; } u;
    u.f = f;
    if ((u.i & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u.i >> 16) | 0x40u);
    return (uint16_t)((u.i + 0x7FFFu + ((u.i >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
