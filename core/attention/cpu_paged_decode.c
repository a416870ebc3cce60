/* Paged decode attention on the CPU, reading K and V in place through the block tables (issue 38).
 *
 * One query per sequence and head; K/V caches [num_blocks, block_size, Hkv, D] (the last dimension contiguous),
 * the block table of a sequence [max_blocks] int64, its context length (keys, the new one included).
 * Work item: one sequence and all its heads (a slice of its KV heads when there are too few sequences to keep
 * every thread busy): a token's heads are adjacent in the cache, so K and V stream block by block, and each K and
 * V row is read from memory once for all the query heads it serves. Three passes over the sequence's keys: scores
 * (K read once), an exact softmax (max, exp, sum: the same order as torch's), then P V (V read once). Scores live
 * in a per-thread scratch of H x L floats.
 * OpenMP spreads the items over the threads of the process's OpenMP runtime (torch's own, loaded before this
 * library). Built by core/native/build.py with the system C compiler; core/attention/cpu_paged_decode.py calls it.
 *
 * bf16: loads widen to fp32 (q . k through AVX512-BF16 where the CPU has it: the same exact products); the
 * scores are rounded to bf16 before the scale and the probabilities to bf16 before P V, as HF eager does with bf16
 * matmuls (its reference order), and the output is rounded to bf16.
 */
#include <stdint.h>
#include "bf16.h"
#include "exp_nonpos.h"
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

/* q . k over one head: fp32, and bf16 (q also given widened); with AVX512-BF16 (-march=native on a CPU that
 * has it), 32 bf16 pairs per VDPBF16PS: exact products, fp32 sums, as the widened loop computes them. */
static inline __attribute__((always_inline)) float dot_f32(const float *q, const float *k, const int n) {
    float s = 0.0f;
    _Pragma("omp simd reduction(+:s)")
    for (int d = 0; d < n; d++) s += q[d] * k[d];
    return s;
}

static inline __attribute__((always_inline)) float dot_bf16(const uint16_t *q, const float *qf, const uint16_t *k,
                                                            const int n) {
#ifdef __AVX512BF16__
    if ((n & 31) == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < n; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
        return _mm512_reduce_add_ps(acc);
    }
#endif
    (void)q;
    float s = 0.0f;
    _Pragma("omp simd reduction(+:s)")
    for (int d = 0; d < n; d++) s += qf[d] * bf16_to_f32(k[d]);
    return s;
}

#define DOT_F32(qraw, qf, k, n) ((void)(qraw), dot_f32(qf, k, n))
#define DOT_BF16(qraw, qf, k, n) dot_bf16(qraw, qf, k, n)

#define MAX_HEAD_DIM 8192   /* H x D of one sequence: the queries and the accumulator live on the stack */

/* Everything one work item needs: a (sequence, slice of KV heads) pair's inputs. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *tables, *context_lens;
    int64_t q_row_stride, q_head_stride, block_stride, token_stride, head_stride, table_stride;
    int64_t out_row_stride, out_head_stride;
    int num_heads, num_kv_heads, head_dim, block_size, window, max_context;
    float scale, softcap;
} Args;

/* One item's three passes, for one element type (T, LOAD widens to fp32, STORE narrows). `head_dim` is a
 * constant where the dispatcher below knows it (64, 128), so the dot products unroll into whole vectors. */
#define DEFINE_ITEM(NAME, T, LOAD, STORE, DOT, IS_BF16)                                                           \
static inline __attribute__((always_inline)) void NAME(const Args *a, int seq, int kv0, int kv1,             \
                                                       float *scores, const int head_dim) {                  \
    const int group = a->num_heads / a->num_kv_heads;                                                        \
    const int h0 = kv0 * group, nh = (kv1 - kv0) * group;   /* this item's query heads */                    \
    const T *q = (const T *)a->q, *k_cache = (const T *)a->k_cache, *v_cache = (const T *)a->v_cache;        \
    T *out = (T *)a->out;                                                                                    \
    const int64_t context = a->context_lens[seq];                                                            \
    const int64_t first = (a->window > 0 && context > a->window) ? context - a->window : 0;                  \
    const int64_t num_keys = context - first;                                                                \
    const int64_t *table = a->tables + (int64_t)seq * a->table_stride;                                       \
    const int block_size = a->block_size;                                                                    \
    float qf[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];                                                               \
    if (num_keys <= 0 || num_keys > a->max_context) {                                                        \
        for (int h = 0; h < nh; h++)                                                                         \
            memset(out + seq * a->out_row_stride + (int64_t)(h0 + h) * a->out_head_stride, 0,                \
                   sizeof(T) * head_dim);                                                                    \
        return;                                                                                              \
    }                                                                                                        \
    for (int h = 0; h < nh; h++) {                                                                           \
        const T *qrow = q + seq * a->q_row_stride + (int64_t)(h0 + h) * a->q_head_stride;                    \
        for (int d = 0; d < head_dim; d++) qf[h * head_dim + d] = LOAD(qrow[d]);                             \
    }                                                                                                        \
    /* pass 1: scores [nh, L]; a token's heads are adjacent in the cache, so K streams block by block */     \
    for (int64_t t = 0; t < num_keys; t++) {                                                                 \
        const int64_t pos = first + t;                                                                       \
        const T *krow = k_cache + table[pos / block_size] * a->block_stride + (pos % block_size) * a->token_stride; \
        for (int h = 0; h < nh; h++) {                                                                       \
            const T *qraw = q + seq * a->q_row_stride + (int64_t)(h0 + h) * a->q_head_stride;                \
            const T *kh = krow + (int64_t)(kv0 + h / group) * a->head_stride;                                \
            float s = DOT(qraw, qf + h * head_dim, kh, head_dim);                                            \
            if (IS_BF16) s = round_bf16(s);                                                                  \
            s *= a->scale;                                                                                   \
            if (a->softcap > 0.0f) s = a->softcap * tanhf(s / a->softcap);                                   \
            scores[h * num_keys + t] = s;                                                                    \
        }                                                                                                    \
    }                                                                                                        \
    /* pass 2: an exact softmax over each head's row (max, exp, sum, scale: torch's order) */                \
    for (int h = 0; h < nh; h++) {                                                                           \
        float *row = scores + h * num_keys;                                                                  \
        float m = row[0];                                                                                    \
        for (int64_t t = 1; t < num_keys; t++) m = row[t] > m ? row[t] : m;                                  \
        float sum = 0.0f;                                                                                    \
        _Pragma("omp simd reduction(+:sum)")                                                                 \
        for (int64_t t = 0; t < num_keys; t++) { float e = exp_nonpos(row[t] - m); row[t] = e; sum += e; }   \
        const float inv = 1.0f / sum;                                                                        \
        _Pragma("omp simd")                                                                                  \
        for (int64_t t = 0; t < num_keys; t++) row[t] = IS_BF16 ? round_bf16(row[t] * inv) : row[t] * inv;  \
    }                                                                                                        \
    /* pass 3: out = P V, V streamed like K */                                                               \
    for (int i = 0; i < nh * head_dim; i++) acc[i] = 0.0f;                                                   \
    for (int64_t t = 0; t < num_keys; t++) {                                                                 \
        const int64_t pos = first + t;                                                                       \
        const T *vrow = v_cache + table[pos / block_size] * a->block_stride + (pos % block_size) * a->token_stride; \
        for (int h = 0; h < nh; h++) {                                                                       \
            const float p = scores[h * num_keys + t];                                                        \
            const T *vh = vrow + (int64_t)(kv0 + h / group) * a->head_stride;                                \
            float *ah = acc + h * head_dim;                                                                  \
            _Pragma("omp simd")                                                                              \
            for (int d = 0; d < head_dim; d++) ah[d] += p * LOAD(vh[d]);                                     \
        }                                                                                                    \
    }                                                                                                        \
    for (int h = 0; h < nh; h++) {                                                                           \
        T *orow = out + seq * a->out_row_stride + (int64_t)(h0 + h) * a->out_head_stride;                    \
        const float *ah = acc + h * head_dim;                                                                \
        for (int d = 0; d < head_dim; d++) orow[d] = STORE(ah[d]);                                           \
    }                                                                                                        \
}

/* The entry point of one element type: items (sequence, slice of KV heads) spread over the OpenMP threads; a
 * sequence is cut into slices only when there are too few sequences to keep every thread busy. Returns 0, 1 for
 * shapes it does not take (the caller checks them first) or 2 when a thread's score scratch was not allocated. */
#define DEFINE_ENTRY(NAME, ITEM, T)                                                                          \
int NAME(const T *q, int64_t q_row_stride, int64_t q_head_stride,                                            \
         const T *k_cache, const T *v_cache, int64_t block_stride, int64_t token_stride,                     \
         int64_t head_stride, const int64_t *tables, int64_t table_stride, const int64_t *context_lens,      \
         T *out, int64_t out_row_stride, int64_t out_head_stride, int num_seqs, int num_heads,               \
         int num_kv_heads, int head_dim, int block_size, float scale, int window, float softcap,             \
         int num_threads, int max_context) {                                                                 \
    if (num_heads * head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads || max_context < 1) return 1;        \
    const Args a = {q, k_cache, v_cache, out, tables, context_lens, q_row_stride, q_head_stride,             \
                    block_stride, token_stride, head_stride, table_stride, out_row_stride, out_head_stride,  \
                    num_heads, num_kv_heads, head_dim, block_size, window, max_context, scale, softcap};     \
    int num_slices = (2 * num_threads + num_seqs - 1) / num_seqs;                                            \
    if (num_slices > num_kv_heads) num_slices = num_kv_heads;                                                \
    const int heads_per_slice = (num_kv_heads + num_slices - 1) / num_slices;                                \
    const int num_items = num_seqs * num_slices;                                                             \
    int failed = 0;                                                                                          \
    _Pragma("omp parallel num_threads(num_threads)")                                                         \
    {                                                                                                        \
        float *scores = (float *)malloc(sizeof(float) * (size_t)num_heads * (size_t)max_context);            \
        if (!scores) {                                                                                       \
            _Pragma("omp atomic write") failed = 2;                                                          \
        }                                                                                                    \
        _Pragma("omp for schedule(dynamic, 1)")                                                              \
        for (int item = 0; item < num_items; item++) {                                                       \
            const int seq = item / num_slices, kv0 = (item % num_slices) * heads_per_slice;                  \
            const int kv1 = kv0 + heads_per_slice < num_kv_heads ? kv0 + heads_per_slice : num_kv_heads;     \
            if (!scores || kv0 >= kv1) continue;                                                             \
            switch (head_dim) {                                                                              \
                case 64: ITEM(&a, seq, kv0, kv1, scores, 64); break;                                         \
                case 128: ITEM(&a, seq, kv0, kv1, scores, 128); break;                                       \
                default: ITEM(&a, seq, kv0, kv1, scores, head_dim);                                          \
            }                                                                                                \
        }                                                                                                    \
        free(scores);                                                                                        \
    }                                                                                                        \
    return failed;                                                                                           \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_ITEM(item_f32, float, LOAD_F32, STORE_F32, DOT_F32, 0)
DEFINE_ITEM(item_bf16, uint16_t, bf16_to_f32, f32_to_bf16, DOT_BF16, 1)
DEFINE_ENTRY(paged_decode_f32, item_f32, float)
DEFINE_ENTRY(paged_decode_bf16, item_bf16, uint16_t)
