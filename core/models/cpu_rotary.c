/* Rotary embedding (HF's rotate_half form) on the CPU in one pass over q and k (issue 38): out = x * cos +
 * rotate_half(x) * sin, where rotate_half(x) = [-x[half:], x[:half]], for each token's query and key heads.
 *
 * Bit-identical to the torch path of core/models/fused_ops.py (`q * cos + _rotate_half(q) * sin`): built with
 * -ffp-contract=off, so each product and the sum round as torch's separate ops round them (no FMA); in bf16 each
 * of the three results is rounded to bf16, as torch's bf16 ops do (a product of two bf16 values is exact in fp32,
 * so widening, multiplying and rounding once equals torch's bf16 multiply). The caller passes cos/sin already
 * gathered by position and cast to q's dtype ([T, D], contiguous), and contiguous outputs [T, H, D], [T, Hkv, D].
 * Built by core/native/build.py; called by core/models/cpu_rotary.py.
 */
#include <stdint.h>
#include "bf16.h"

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define ROUND_F32(x) (x)
#define ROUND_BF16(x) round_bf16(x)

/* One tensor's heads of one token: x [heads, D] (row stride `head_stride`), c/s [D], out [heads, D] contiguous. */
#define DEFINE_ROTATE(NAME, T, LOAD, STORE, ROUND)                                                            \
static inline void NAME(const T *x, int64_t head_stride, int num_heads, const T *c, const T *s, T *out,      \
                        int head_dim) {                                                                      \
    const int half = head_dim / 2;                                                                           \
    for (int h = 0; h < num_heads; h++) {                                                                    \
        const T *xh = x + h * head_stride;                                                                   \
        T *oh = out + (int64_t)h * head_dim;                                                                 \
        for (int d = 0; d < half; d++) {                                                                     \
            float a = ROUND(LOAD(xh[d]) * LOAD(c[d]));                                                       \
            float b = ROUND(-LOAD(xh[d + half]) * LOAD(s[d]));                                               \
            oh[d] = STORE(a + b);                                                                            \
        }                                                                                                    \
        for (int d = half; d < head_dim; d++) {                                                              \
            float a = ROUND(LOAD(xh[d]) * LOAD(c[d]));                                                       \
            float b = ROUND(LOAD(xh[d - half]) * LOAD(s[d]));                                                \
            oh[d] = STORE(a + b);                                                                            \
        }                                                                                                    \
    }                                                                                                        \
}

#define DEFINE_ENTRY(NAME, ROTATE, T)                                                                        \
void NAME(const T *q, int64_t q_row_stride, int64_t q_head_stride, int num_heads,                            \
          const T *k, int64_t k_row_stride, int64_t k_head_stride, int num_kv_heads,                         \
          const T *cos, const T *sin, T *q_out, T *k_out, int num_tokens, int head_dim, int num_threads) {   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(num_tokens >= 16)")              \
    for (int t = 0; t < num_tokens; t++) {                                                                   \
        const T *c = cos + (int64_t)t * head_dim, *s = sin + (int64_t)t * head_dim;                          \
        ROTATE(q + t * q_row_stride, q_head_stride, num_heads, c, s,                                         \
               q_out + (int64_t)t * num_heads * head_dim, head_dim);                                         \
        ROTATE(k + t * k_row_stride, k_head_stride, num_kv_heads, c, s,                                      \
               k_out + (int64_t)t * num_kv_heads * head_dim, head_dim);                                      \
    }                                                                                                        \
}

DEFINE_ROTATE(rotate_f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_ROTATE(rotate_bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
DEFINE_ENTRY(rotary_f32, rotate_f32, float)
DEFINE_ENTRY(rotary_bf16, rotate_bf16, uint16_t)
