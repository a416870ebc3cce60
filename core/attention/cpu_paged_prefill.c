/* Prefill (and chunked-prefill) attention on the CPU, reading K and V in place through the block tables.
 *
 * Queries: a step's prefill chunks, each sequence's rows contiguous in q [T, H, D]; `info` [P, 3] gives each
 * sequence's first row, number of new tokens and context length (cached + new keys; the new ones are already in
 * the cache). A query at position p sees the keys p - window < k <= p (no window: k <= p).
 *
 * Work item: one sequence, one KV head and a tile of its queries: the tile's rows are (query, head) pairs, the
 * G query heads that share the KV head for each of rows / G queries (rows: 16-64, chosen per call by
 * `choose_rows`), so each K and V row read serves all of them. Keys stream in tiles of KT, never across a cache
 * block, copied (widened) into a scratch; the scores of a tile are computed transposed (keys x rows: broadcasts
 * of K against row vectors of q), so the online softmax (a running max and sum per row, the accumulator rescaled
 * when the max moves) runs down the row vectors. Scores are formed as (q . k) * scale, then soft-capped, then
 * masked, as the torch path does. Tiles wholly below the diagonal (and inside the window) skip the mask. The
 * work of an item grows with its query positions (causal): OpenMP hands items out dynamically, last first.
 *
 * bf16: loads widen to fp32 and everything is computed in fp32 (torch's CPU flash kernel does the same);
 * only the output is rounded. Built by core/native/build.py; core/attention/cpu_paged_prefill.py calls it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "bf16.h"
#include "exp_nonpos.h"

#define KT 16           /* keys per tile: one 512-bit vector of fp32 scores */
#define MAX_ROWS 64     /* (query, head) rows per work item at most: 16, 32, 48 or 64 (chosen per call) */
#define MAX_D 256       /* head_dim at most (the scratch lives on the stack) */

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *info, *tables, *item_starts;
    int64_t q_row_stride, q_head_stride, block_stride, token_stride, head_stride, table_stride;
    int64_t out_row_stride, out_head_stride;
    int num_seqs, num_heads, num_kv_heads, head_dim, block_size, window, rows, queries_per_item;
    float scale, softcap;
} Args;

/* One tile's scores, transposed: st[j][r] = k_j . q_r over head_dim (qt is [D][ROWS], kt [KT][D]), four keys
 * at a time: per head_dim element, four broadcasts of k and two row vectors of q feed eight FMA chains. */
static inline __attribute__((always_inline)) void tile_scores(const float *qt, const float *kt, float *st,
                                                              const int head_dim, const int ROWS) {
    for (int j0 = 0; j0 < KT; j0 += 4) {
        float s[4][MAX_ROWS];
        for (int jj = 0; jj < 4; jj++)
            for (int r = 0; r < ROWS; r++) s[jj][r] = 0.0f;
        for (int d = 0; d < head_dim; d++) {
            const float *qd = qt + d * ROWS;
            for (int jj = 0; jj < 4; jj++) {
                const float kv = kt[(j0 + jj) * head_dim + d];
                _Pragma("omp simd")
                for (int r = 0; r < ROWS; r++) s[jj][r] += kv * qd[r];
            }
        }
        for (int jj = 0; jj < 4; jj++)
            for (int r = 0; r < ROWS; r++) st[(j0 + jj) * ROWS + r] = s[jj][r];
    }
}

/* acc[r] = acc[r] * correction[r] + sum_j p[j][r] v_j (pt is [KT][ROWS], vt [KT][D]): four rows and 64 columns
 * at a time, sixteen FMA chains. */
static inline __attribute__((always_inline)) void tile_pv(float *acc, const float *pt, const float *vt,
                                                          const float *correction, const int num_rows,
                                                          const int head_dim, const int ROWS) {
    for (int r0 = 0; r0 < num_rows; r0 += 4) {
        for (int d0 = 0; d0 < head_dim; d0 += 64) {
            const int w = head_dim - d0 < 64 ? head_dim - d0 : 64;
            float t[4][64];
            for (int rr = 0; rr < 4; rr++) {
                const float c = correction[r0 + rr];
                for (int dd = 0; dd < 64; dd++) t[rr][dd] = dd < w ? acc[(r0 + rr) * head_dim + d0 + dd] * c : 0.0f;
            }
            for (int j = 0; j < KT; j++) {
                const float *vrow = vt + j * head_dim + d0;
                for (int rr = 0; rr < 4; rr++) {
                    const float p = pt[j * ROWS + r0 + rr];
                    if (w == 64) {
                        _Pragma("omp simd")
                        for (int dd = 0; dd < 64; dd++) t[rr][dd] += p * vrow[dd];
                    } else {
                        for (int dd = 0; dd < w; dd++) t[rr][dd] += p * vrow[dd];
                    }
                }
            }
            for (int rr = 0; rr < 4; rr++)
                for (int dd = 0; dd < w; dd++) acc[(r0 + rr) * head_dim + d0 + dd] = t[rr][dd];
        }
    }
}

#define DEFINE_ITEM(NAME, T, LOAD, STORE)                                                                     \
static inline __attribute__((always_inline)) void NAME(const Args *a, const int seq, const int kvh,          \
                                                       const int tile, const int head_dim, const int ROWS) { \
    const int group = a->num_heads / a->num_kv_heads;                                                        \
    const int64_t q_first = a->info[3 * seq], q_len = a->info[3 * seq + 1], context = a->info[3 * seq + 2];  \
    const int64_t num_cached = context - q_len;                                                              \
    const int64_t i0 = (int64_t)tile * a->queries_per_item;                                                  \
    const int64_t i1 = i0 + a->queries_per_item < q_len ? i0 + a->queries_per_item : q_len;                  \
    const int num_rows = (int)(i1 - i0) * group;                                                             \
    const T *q = (const T *)a->q, *k_cache = (const T *)a->k_cache, *v_cache = (const T *)a->v_cache;        \
    T *out = (T *)a->out;                                                                                    \
    const int64_t *table = a->tables + (int64_t)seq * a->table_stride;                                       \
    const int block_size = a->block_size, window = a->window;                                                \
    const float scale = a->scale, softcap = a->softcap;                                                      \
    float qt[MAX_D * MAX_ROWS], acc[MAX_ROWS * MAX_D], kt[KT * MAX_D], vt[KT * MAX_D], st[KT * MAX_ROWS];                \
    float row_max[MAX_ROWS], row_sum[MAX_ROWS], correction[MAX_ROWS], row_pos[MAX_ROWS];                                     \
    for (int r = 0; r < ROWS; r++) {                                                                         \
        const int64_t i = i0 + r / group;                                                                    \
        const T *src = q + (q_first + i) * a->q_row_stride + (int64_t)(kvh * group + r % group) * a->q_head_stride; \
        for (int d = 0; d < head_dim; d++) qt[d * ROWS + r] = r < num_rows ? LOAD(src[d]) : 0.0f;            \
        row_pos[r] = (float)(num_cached + i);   /* exact: positions < 2^24 (checked by the caller) */        \
        row_max[r] = -INFINITY;                                                                              \
        row_sum[r] = 0.0f;                                                                                   \
    }                                                                                                        \
    for (int i = 0; i < ROWS * head_dim; i++) acc[i] = 0.0f;                                                 \
    const int64_t first_pos = num_cached + i0, last_pos = num_cached + i1 - 1;                               \
    int64_t key = 0;                                                                                         \
    if (window > 0 && first_pos - window + 1 > 0) key = first_pos - window + 1;                              \
    while (key <= last_pos) {                                                                                \
        const int64_t offset = key % block_size;                                                             \
        int num_keys = KT;                                                                                   \
        if (block_size - offset < num_keys) num_keys = (int)(block_size - offset);                           \
        if (last_pos + 1 - key < num_keys) num_keys = (int)(last_pos + 1 - key);                             \
        const int64_t base = table[key / block_size] * a->block_stride + offset * a->token_stride            \
                             + (int64_t)kvh * a->head_stride;                                                \
        for (int j = 0; j < KT; j++) {                                                                       \
            float *kd = kt + j * head_dim, *vd = vt + j * head_dim;                                          \
            if (j >= num_keys) {                                                                             \
                for (int d = 0; d < head_dim; d++) { kd[d] = 0.0f; vd[d] = 0.0f; }                           \
                continue;                                                                                    \
            }                                                                                                \
            const T *krow = k_cache + base + (int64_t)j * a->token_stride;                                   \
            const T *vrow = v_cache + base + (int64_t)j * a->token_stride;                                   \
            _Pragma("omp simd")                                                                              \
            for (int d = 0; d < head_dim; d++) { kd[d] = LOAD(krow[d]); vd[d] = LOAD(vrow[d]); }             \
        }                                                                                                    \
        tile_scores(qt, kt, st, head_dim, ROWS);                                                                   \
        /* no mask where every key of the tile is visible to every row: full, below the diagonal, in window */ \
        const int unmasked = num_keys == KT && key + KT - 1 <= first_pos                                     \
                             && (window <= 0 || key > last_pos - window);                                    \
        float tile_max[MAX_ROWS];                                                                                \
        for (int r = 0; r < ROWS; r++) tile_max[r] = -INFINITY;                                              \
        for (int j = 0; j < KT; j++) {                                                                       \
            float *s = st + j * ROWS;                                                                        \
            const float k = (float)(key + j);                                                                \
            _Pragma("omp simd")                                                                              \
            for (int r = 0; r < ROWS; r++) {                                                                 \
                float v = s[r] * scale;                                                                      \
                if (softcap > 0.0f) v = softcap * tanhf(v / softcap);                                        \
                if (!unmasked && (j >= num_keys || k > row_pos[r] || (window > 0 && k <= row_pos[r] - window))) \
                    v = -INFINITY;                                                                           \
                s[r] = v;                                                                                    \
                tile_max[r] = v > tile_max[r] ? v : tile_max[r];                                             \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < ROWS; r++) {                                                                     \
            const float m_new = tile_max[r] > row_max[r] ? tile_max[r] : row_max[r];                         \
            correction[r] = (m_new == -INFINITY || row_max[r] == m_new) ? 1.0f                               \
                            : (row_max[r] == -INFINITY ? 0.0f : exp_nonpos(row_max[r] - m_new));             \
            row_max[r] = m_new;                                                                              \
            row_sum[r] *= correction[r];                                                                     \
        }                                                                                                    \
        for (int j = 0; j < KT; j++) {                                                                       \
            float *s = st + j * ROWS;                                                                        \
            _Pragma("omp simd")                                                                              \
            for (int r = 0; r < ROWS; r++) {                                                                 \
                const float e = s[r] == -INFINITY ? 0.0f : exp_nonpos(s[r] - row_max[r]);                    \
                s[r] = e;                                                                                    \
                row_sum[r] += e;                                                                             \
            }                                                                                                \
        }                                                                                                    \
        tile_pv(acc, st, vt, correction, num_rows, head_dim, ROWS);                                                \
        key += num_keys;                                                                                     \
    }                                                                                                        \
    for (int r = 0; r < num_rows; r++) {                                                                     \
        const int64_t i = i0 + r / group;                                                                    \
        T *dst = out + (q_first + i) * a->out_row_stride + (int64_t)(kvh * group + r % group) * a->out_head_stride; \
        const float inv = 1.0f / row_sum[r];                                                                 \
        for (int d = 0; d < head_dim; d++) dst[d] = STORE(acc[r * head_dim + d] * inv);                      \
    }                                                                                                        \
}

/* The rows of a work item for this call: the multiple of 16 (16-64, at least the group) whose tiles compute the
 * fewest (row, key) pairs over every sequence, each tile paying for its rows up to its last query's keys plus
 * COPY_ROWS rows' worth for the K/V tile copies: large tiles suit short chunks over long contexts (GQA fills
 * them), small ones short fresh prompts (less of each diagonal tile masked). */
#define COPY_ROWS 8
static int choose_rows(const int64_t *info, int num_seqs, int group) {
    int best = 0;
    double best_cost = 0.0;
    for (int rows = 16; rows <= MAX_ROWS; rows += 16) {
        if (rows < group) continue;
        const int per_tile = rows / group;
        double cost = 0.0;
        for (int s = 0; s < num_seqs; s++) {
            const int64_t len = info[3 * s + 1], cached = info[3 * s + 2] - len;
            for (int64_t i0 = 0; i0 < len; i0 += per_tile) {
                const int64_t last = i0 + per_tile < len ? i0 + per_tile : len;
                cost += (double)(cached + last) * (rows + COPY_ROWS);
            }
        }
        if (!best || cost < best_cost) { best = rows; best_cost = cost; }
    }
    return best;
}

#define DISPATCH_D(ITEM, a, seq, kvh, tile, R)                                                               \
    switch ((a)->head_dim) {                                                                                 \
        case 64: ITEM(a, seq, kvh, tile, 64, R); break;                                                      \
        case 128: ITEM(a, seq, kvh, tile, 128, R); break;                                                    \
        default: ITEM(a, seq, kvh, tile, (a)->head_dim, R);                                                  \
    }

/* The entry point of one element type. Items: for each sequence, its KV heads x query tiles (item_starts [P + 1]
 * their prefix sums, filled here); handed out last first, so the longest tiles (the last queries of the longest
 * sequences see the most keys) start early. Returns 0, or 1 for shapes it does not take (the caller checks). */
#define DEFINE_ENTRY(NAME, ITEM, T)                                                                          \
int NAME(const T *q, int64_t q_row_stride, int64_t q_head_stride,                                            \
         const T *k_cache, const T *v_cache, int64_t block_stride, int64_t token_stride, int64_t head_stride, \
         const int64_t *info, const int64_t *tables, int64_t table_stride, int64_t *item_starts,             \
         T *out, int64_t out_row_stride, int64_t out_head_stride, int num_seqs, int num_heads,               \
         int num_kv_heads, int head_dim, int block_size, float scale, int window, float softcap,             \
         int num_threads) {                                                                                  \
    if (head_dim > MAX_D || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_ROWS) return 1;       \
    const int group = num_heads / num_kv_heads;                                                              \
    const int rows = choose_rows(info, num_seqs, group);                                                     \
    const int queries_per_item = rows / group;                                                               \
    item_starts[0] = 0;                                                                                      \
    for (int s = 0; s < num_seqs; s++) {                                                                     \
        const int64_t tiles = (info[3 * s + 1] + queries_per_item - 1) / queries_per_item;                   \
        item_starts[s + 1] = item_starts[s] + tiles * num_kv_heads;                                          \
    }                                                                                                        \
    const Args a = {q, k_cache, v_cache, out, info, tables, item_starts, q_row_stride, q_head_stride,         \
                    block_stride, token_stride, head_stride, table_stride, out_row_stride, out_head_stride,  \
                    num_seqs, num_heads, num_kv_heads, head_dim, block_size, window, rows, queries_per_item,  \
                    scale, softcap};                                                                         \
    const int64_t num_items = item_starts[num_seqs];                                                         \
    _Pragma("omp parallel for num_threads(num_threads) schedule(dynamic, 1)")                                \
    for (int64_t n = num_items - 1; n >= 0; n--) {                                                           \
        int seq = 0;                                                                                         \
        while (item_starts[seq + 1] <= n) seq++;                                                             \
        const int64_t local = n - item_starts[seq];                                                          \
        const int kvh = (int)(local % num_kv_heads), tile = (int)(local / num_kv_heads);                     \
        switch (rows) {                                                                                      \
            case 16: DISPATCH_D(ITEM, &a, seq, kvh, tile, 16); break;                                        \
            case 32: DISPATCH_D(ITEM, &a, seq, kvh, tile, 32); break;                                        \
            case 48: DISPATCH_D(ITEM, &a, seq, kvh, tile, 48); break;                                        \
            default: DISPATCH_D(ITEM, &a, seq, kvh, tile, 64);                                               \
        }                                                                                                    \
    }                                                                                                        \
    return 0;                                                                                                \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_ITEM(item_f32, float, LOAD_F32, STORE_F32)
DEFINE_ITEM(item_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ENTRY(paged_prefill_f32, item_f32, float)
DEFINE_ENTRY(paged_prefill_bf16, item_bf16, uint16_t)
