/* Paged attention on the CPU, reading keys and values in place through block tables.

   The same contract as the Triton kernel (engine/runner/paged_attention_kernel.py): request r owns packed
   query rows query_starts[r] .. query_starts[r + 1] - 1, the last of its seq_lens[r] positions, and finds
   its keys through row r of the block table; each query attends causally, within the sliding window, to
   its own request's keys. A tile is up to queries_per_tile consecutive queries of one request
   (tile_requests[p] = -1: a padding tile, skipped).

   One OpenMP task per tile, covering every head: a key's slot holds all KV heads side by side, so the
   tile reads each slot it needs once, front to back, which is what keeps this memory-bound loop near the
   machine's bandwidth. The gather path it replaces copies every key into a dense tensor, then reads the
   copy again, and builds a mask as large as the scores.

   The softmax is the online one, a chunk of keys at a time, in fp32 whatever the cache dtype. Built with
   the process's own OpenMP runtime (torch's libgomp), so its parallel region reuses torch's worker team
   instead of starting a second one on the same cores.

   A step of fewer tiles than threads (one request's decode is one tile) would leave threads idle, so each
   tile's keys are then split into one part per thread, chunk-aligned: every part runs the online softmax
   over its own keys into a partial (maximum, sum, accumulator) per row, and the parts are merged in part
   order once all are done (the split-softmax of flash decoding). Not in fixed_order, where a query's
   output must not depend on how many tiles share the step.

   With fixed_order (batch-invariant mode), a query's output depends on its own keys and values alone,
   not on the tile it shares: every tile transposes its keys (scores then come from one loop whatever the
   tile's size, where a decode tile would otherwise take dot products), and chunks of keys start at
   multiples of KEYS_PER_CHUNK (with a sliding window they would start at the tile's first key). Without
   it, a query's scores and softmax sums round differently in a decode tile than in a prefill tile.

   With ALiBi slopes (Bloom, MPT, Falcon's ALiBi variant), each score gets its head's slope times the key's
   distance behind the query, slope * (key position - query position): the model adds slope * key
   position, which differs by a constant per row, and a softmax does not see such a constant. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Keys per step of the online softmax: enough to amortise the rescaling, few enough for the stack. */
#define KEYS_PER_CHUNK 32
/* Floats per vector register on AVX-512; on narrower machines the compiler splits each such loop. */
#define LANES 16
/* Rows sharing a KV head in a tile from which the chunk's keys are transposed first. Scores then come
   KEYS_PER_CHUNK at a time from multiply-adds over head_dim (a small matrix product), instead of one
   dot product and one horizontal sum per key; the transposition costs about what one row's dot products
   do, so only tiles of several queries (prefill) pay for it. */
#define MIN_ROWS_TO_TRANSPOSE 8
/* Keys a request must reach before its tile is split over threads: below it, waking a second thread and
   merging cost more than they save. On the 2-core EPYC (9 heads of 64 dims, one query) a tile took 27 us
   whole and 30 split at 64 keys, 52 and 42 at 256, 139 and 88 at 1024. */
#define MIN_KEYS_TO_SPLIT 128

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

static inline float bfloat16_to_float(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, sizeof result);
    return result;
}

static inline uint16_t float_to_bfloat16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);                                           /* nearest, ties even */
    return (uint16_t)(bits >> 16);
}

static inline void load_row(const void *source, int64_t offset, int dtype, float *target, int64_t count) {
    if (dtype == DTYPE_FLOAT32) {
        memcpy(target, (const float *)source + offset, sizeof(float) * count);
        return;
    }
    const uint16_t *row = (const uint16_t *)source + offset;
    for (int64_t d = 0; d < count; d++) target[d] = bfloat16_to_float(row[d]);
}

/* Per-thread scratch, sized for the largest tile. */
typedef struct {
    float *queries;       /* [rows][head_dim], pre-multiplied by the scale */
    float *accumulators;  /* [rows][head_dim] */
    float *running_max;   /* [rows] */
    float *running_sum;   /* [rows] */
    int64_t *positions;   /* [rows] position of the row's query */
    int64_t *firsts;      /* [rows] first key position the row sees (its window start) */
    float *keys;          /* [KEYS_PER_CHUNK][kv_heads * head_dim]: a chunk converted to fp32 (bf16 caches) */
    float *values;
    float *transposed_keys; /* [kv_heads][head_dim][KEYS_PER_CHUNK]: the chunk's keys, position innermost */
} Scratch;

static int scratch_allocate(Scratch *scratch, int64_t rows, int64_t head_dim, int64_t slot_width) {
    scratch->queries = malloc(sizeof(float) * rows * head_dim);
    scratch->accumulators = malloc(sizeof(float) * rows * head_dim);
    scratch->running_max = malloc(sizeof(float) * rows);
    scratch->running_sum = malloc(sizeof(float) * rows);
    scratch->positions = malloc(sizeof(int64_t) * rows);
    scratch->firsts = malloc(sizeof(int64_t) * rows);
    scratch->keys = malloc(sizeof(float) * KEYS_PER_CHUNK * slot_width);
    scratch->values = malloc(sizeof(float) * KEYS_PER_CHUNK * slot_width);
    scratch->transposed_keys = malloc(sizeof(float) * KEYS_PER_CHUNK * slot_width);
    return scratch->queries && scratch->accumulators && scratch->running_max && scratch->running_sum
           && scratch->positions && scratch->firsts && scratch->keys && scratch->values
           && scratch->transposed_keys;
}

static void scratch_free(Scratch *scratch) {
    free(scratch->queries);
    free(scratch->accumulators);
    free(scratch->running_max);
    free(scratch->running_sum);
    free(scratch->positions);
    free(scratch->firsts);
    free(scratch->keys);
    free(scratch->values);
    free(scratch->transposed_keys);
}

typedef struct {
    int dtype;
    const void *queries;
    int64_t stride_query_row, stride_query_head;
    const void *key_cache, *value_cache;
    int64_t stride_cache_slot, stride_cache_head;
    const int32_t *block_table;
    int64_t stride_table_row;
    const int32_t *query_starts, *seq_lens, *tile_requests, *tile_offsets;
    void *output;
    int64_t stride_output_row, stride_output_head;
    int64_t num_kv_heads, group_size, head_dim, queries_per_tile, page_size;
    float scale, softcap; /* softcap <= 0: none */
    int64_t sliding_window;
    int64_t attention_chunk; /* keys a query sees start at its chunk's first position (Llama 4) */
    int fixed_order;
    const float *sinks; /* [num_heads] or NULL: a learned logit per query head in every softmax (gpt-oss) */
    const float *alibi_slopes; /* [num_heads] or NULL: ALiBi's slope per query head */
} Step;

/* Writes the chunk's keys of every KV head into scratch->transposed_keys, position innermost; positions
   past num_keys are zero, so the products over a whole chunk stay finite. */
static void transpose_keys(const Step *step, Scratch *scratch, int64_t num_keys, const float *const *key_rows,
                           int64_t head_stride) {
    const int64_t head_dim = step->head_dim;
    for (int64_t kv_head = 0; kv_head < step->num_kv_heads; kv_head++) {
        float *restrict target = scratch->transposed_keys + kv_head * head_dim * KEYS_PER_CHUNK;
        for (int64_t key = 0; key < num_keys; key++) {
            const float *restrict key_row = key_rows[key] + kv_head * head_stride;
            for (int64_t d = 0; d < head_dim; d++) target[d * KEYS_PER_CHUNK + key] = key_row[d];
        }
        for (int64_t key = num_keys; key < KEYS_PER_CHUNK; key++)
            for (int64_t d = 0; d < head_dim; d++) target[d * KEYS_PER_CHUNK + key] = 0.0f;
    }
}

/* Independent partial sums per score in transposed_scores: a multiply-add waits for the one before it on
   the same sum, so several sums in flight keep the FMA units busy instead of waiting on their latency. */
#define PARTIAL_SUMS 4

/* scores[key] = query . key for every key of the chunk, from its transposed keys: multiply-adds of
   KEYS_PER_CHUNK lanes over head_dim, which stay in registers. */
static void transposed_scores(const float *restrict query, const float *restrict transposed, int64_t head_dim,
                              float *restrict scores) {
    float sums[PARTIAL_SUMS][KEYS_PER_CHUNK] = {{0.0f}};
    int64_t d = 0;
    for (; d + PARTIAL_SUMS <= head_dim; d += PARTIAL_SUMS) {
        for (int64_t part = 0; part < PARTIAL_SUMS; part++) {
            const float component = query[d + part];
            const float *restrict column = transposed + (d + part) * KEYS_PER_CHUNK;
#pragma omp simd
            for (int64_t key = 0; key < KEYS_PER_CHUNK; key++) sums[part][key] += component * column[key];
        }
    }
    for (; d < head_dim; d++) {
        const float component = query[d];
        const float *restrict column = transposed + d * KEYS_PER_CHUNK;
#pragma omp simd
        for (int64_t key = 0; key < KEYS_PER_CHUNK; key++) sums[0][key] += component * column[key];
    }
    for (int64_t part = 1; part < PARTIAL_SUMS; part++) {
#pragma omp simd
        for (int64_t key = 0; key < KEYS_PER_CHUNK; key++) sums[0][key] += sums[part][key];
    }
    memcpy(scores, sums[0], sizeof sums[0]);
}

#if defined(__AVX2__) && defined(__FMA__)
/* Eight lanes' sum in the order key_scores' tree of horizontal adds takes. */
static inline float tree_sum(__m256 lanes) {
    float v[8];
    _mm256_storeu_ps(v, lanes);
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
#endif

/* scores[key] = query . key for keys begin .. end - 1, the dot products of a decode tile. With AVX2 and
   head_dim a multiple of 8, eight keys at a time: each key's products go into its own vector of partial
   sums, and one tree of horizontal adds turns the eight vectors into eight scores, where a dot product
   per key would end in a horizontal sum of its own. On the 2-core EPYC, 32 decode tiles of 130 keys (9
   heads of 64 dims, the cache in L3) took 203 us against 282. */
static void key_scores(const float *restrict query, const float *const *key_rows, int64_t head_offset,
                       int64_t head_dim, int64_t begin, int64_t end, float *restrict scores) {
    int64_t key = begin;
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 8 == 0) {
        for (; key + 8 <= end; key += 8) {
            __m256 sums[8];
            for (int k = 0; k < 8; k++) sums[k] = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 8) {
                const __m256 q = _mm256_loadu_ps(query + d);
                for (int k = 0; k < 8; k++)
                    sums[k] = _mm256_fmadd_ps(q, _mm256_loadu_ps(key_rows[key + k] + head_offset + d), sums[k]);
            }
            const __m256 pairs01 = _mm256_hadd_ps(sums[0], sums[1]), pairs23 = _mm256_hadd_ps(sums[2], sums[3]);
            const __m256 pairs45 = _mm256_hadd_ps(sums[4], sums[5]), pairs67 = _mm256_hadd_ps(sums[6], sums[7]);
            const __m256 low = _mm256_hadd_ps(pairs01, pairs23), high = _mm256_hadd_ps(pairs45, pairs67);
            _mm256_storeu_ps(scores + key, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                                         _mm256_permute2f128_ps(low, high, 0x31)));
        }
        for (; key < end; key++) {
            __m256 sum = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 8)
                sum = _mm256_fmadd_ps(_mm256_loadu_ps(query + d), _mm256_loadu_ps(key_rows[key] + head_offset + d), sum);
            scores[key] = tree_sum(sum);
        }
        return;
    }
#endif
    for (; key < end; key++) {
        const float *restrict key_row = key_rows[key] + head_offset;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; d++) dot += query[d] * key_row[d];
        scores[key] = dot;
    }
}

/* Folds keys chunk .. chunk + num_keys - 1 into every row's running softmax and accumulator. With
   `transposed` set, scratch->transposed_keys holds the chunk's keys (transpose_keys). */
static void attend_chunk(const Step *step, Scratch *scratch, int64_t num_rows, int64_t chunk, int64_t num_keys,
                         const float *const *key_rows, const float *const *value_rows, int64_t head_stride,
                         int transposed) {
    const int64_t num_heads = step->num_kv_heads * step->group_size;
    const int64_t head_dim = step->head_dim;
    float scores[KEYS_PER_CHUNK];
    for (int64_t row = 0; row < num_rows; row++) {
        /* The row's keys in this chunk: causal, and inside its window. */
        int64_t begin = scratch->firsts[row] - chunk, end = scratch->positions[row] + 1 - chunk;
        if (begin < 0) begin = 0;
        if (end > num_keys) end = num_keys;
        if (begin >= end) continue;
        const int64_t kv_head = (row % num_heads) / step->group_size;
        const int64_t head_offset = kv_head * head_stride;
        const float *restrict query = scratch->queries + row * head_dim;
        if (transposed)
            transposed_scores(query, scratch->transposed_keys + kv_head * head_dim * KEYS_PER_CHUNK, head_dim,
                              scores);
        else
            key_scores(query, key_rows, head_offset, head_dim, begin, end, scores);
        if (step->softcap > 0.0f)
            for (int64_t key = begin; key < end; key++)
                scores[key] = step->softcap * tanhf(scores[key] / step->softcap);
        if (step->alibi_slopes != NULL) {
            const float slope = step->alibi_slopes[row % num_heads];
            const int64_t distance = chunk - scratch->positions[row]; /* of the chunk's first key */
            for (int64_t key = begin; key < end; key++) scores[key] += slope * (float)(distance + key);
        }
        /* Its own loop, so the maximum is taken a vector at a time rather than one key after another. */
        float chunk_max = -INFINITY;
#pragma omp simd reduction(max : chunk_max)
        for (int64_t key = begin; key < end; key++) chunk_max = scores[key] > chunk_max ? scores[key] : chunk_max;
        const float previous_max = scratch->running_max[row];
        const float new_max = chunk_max > previous_max ? chunk_max : previous_max;
        const float correction = exp_nonpositive(previous_max - new_max); /* 0 for the first chunk */
        float chunk_sum = 0.0f;
#pragma omp simd reduction(+ : chunk_sum)
        for (int64_t key = begin; key < end; key++) {
            const float probability = exp_nonpositive(scores[key] - new_max);
            scores[key] = probability;
            chunk_sum += probability;
        }
        scratch->running_sum[row] = scratch->running_sum[row] * correction + chunk_sum;
        scratch->running_max[row] = new_max;
        float *restrict accumulator = scratch->accumulators + row * head_dim;
        /* LANES dims at a time, keys innermost: the lanes stay in one vector register across the chunk,
           with two of them taking alternate keys so consecutive multiply-adds do not wait on each other. */
        int64_t d0 = 0;
        for (; d0 + LANES <= head_dim; d0 += LANES) {
            float even[LANES], odd[LANES];
#pragma omp simd
            for (int64_t lane = 0; lane < LANES; lane++) {
                even[lane] = accumulator[d0 + lane] * correction;
                odd[lane] = 0.0f;
            }
            int64_t key = begin;
            for (; key + 1 < end; key += 2) {
                const float *restrict first = value_rows[key] + head_offset + d0;
                const float *restrict second = value_rows[key + 1] + head_offset + d0;
                const float first_probability = scores[key], second_probability = scores[key + 1];
#pragma omp simd
                for (int64_t lane = 0; lane < LANES; lane++) {
                    even[lane] += first_probability * first[lane];
                    odd[lane] += second_probability * second[lane];
                }
            }
            if (key < end) {
                const float *restrict last = value_rows[key] + head_offset + d0;
#pragma omp simd
                for (int64_t lane = 0; lane < LANES; lane++) even[lane] += scores[key] * last[lane];
            }
#pragma omp simd
            for (int64_t lane = 0; lane < LANES; lane++) accumulator[d0 + lane] = even[lane] + odd[lane];
        }
        for (int64_t d = d0; d < head_dim; d++) {
            float sum = accumulator[d] * correction;
            for (int64_t key = begin; key < end; key++) sum += scores[key] * value_rows[key][head_offset + d];
            accumulator[d] = sum;
        }
    }
}

/* A row's softmax sum (relative to its maximum score `maximum`) with its head's sink added: the sink is one
   more score that takes probability mass and contributes no value. exp(sink - maximum) may exceed 1; the
   output then tends to 0 as it should, and the maximum is finite (every row sees a key). */
static inline float with_sink(const Step *step, int64_t head, float maximum, float sum) {
    return step->sinks == NULL ? sum : sum + expf(step->sinks[head] - maximum);
}

/* One query head's output at `offset` of the output: its accumulator over its softmax's sum. */
static void write_output(const Step *step, int64_t offset, const float *accumulator, float sum) {
    const float inverse = 1.0f / sum;
    if (step->dtype == DTYPE_FLOAT32) {
        float *target = (float *)step->output + offset;
        for (int64_t d = 0; d < step->head_dim; d++) target[d] = accumulator[d] * inverse;
    } else {
        uint16_t *target = (uint16_t *)step->output + offset;
        for (int64_t d = 0; d < step->head_dim; d++) target[d] = float_to_bfloat16(accumulator[d] * inverse);
    }
}

/* Where one part of a split tile leaves its rows: [rows][head_dim + 2], each row's accumulator, then its
   running maximum and sum. */
typedef struct {
    float *rows;
    int64_t part, parts;
} Partial;

/* Attends tile `tile`'s queries to their keys. With `partial`, only to part partial->part of
   partial->parts of the keys, chunk-aligned, leaving the unnormalised state in partial->rows instead of
   writing the output (merge_parts does). */
static void attend_tile(const Step *step, Scratch *scratch, int64_t tile, const Partial *partial) {
    const int64_t request = step->tile_requests[tile];
    if (request < 0) return;
    const int64_t num_heads = step->num_kv_heads * step->group_size;
    const int64_t head_dim = step->head_dim;
    const int64_t slot_width = step->num_kv_heads * head_dim;
    const int64_t query_start = step->query_starts[request];
    const int64_t query_len = step->query_starts[request + 1] - query_start;
    const int64_t seq_len = step->seq_lens[request];
    const int64_t context_len = seq_len - query_len;
    const int64_t first_query = step->tile_offsets[tile];
    int64_t num_queries = query_len - first_query;
    if (num_queries > step->queries_per_tile) num_queries = step->queries_per_tile;
    const int64_t num_rows = num_queries * num_heads;

    /* Row i is query i / num_heads of the tile, head i % num_heads. */
    int64_t lowest = seq_len, highest = 0;
    for (int64_t row = 0; row < num_rows; row++) {
        const int64_t query = first_query + row / num_heads, head = row % num_heads;
        float *query_row = scratch->queries + row * head_dim;
        load_row(step->queries, (query_start + query) * step->stride_query_row + head * step->stride_query_head,
                 step->dtype, query_row, head_dim);
        for (int64_t d = 0; d < head_dim; d++) query_row[d] *= step->scale;
        const int64_t position = context_len + query;
        const int64_t window_first = position - step->sliding_window + 1;
        const int64_t chunk_first = position - position % step->attention_chunk;
        const int64_t first = window_first > chunk_first ? window_first : chunk_first;
        scratch->positions[row] = position;
        scratch->firsts[row] = first > 0 ? first : 0;
        if (scratch->firsts[row] < lowest) lowest = scratch->firsts[row];
        if (position + 1 > highest) highest = position + 1;
        scratch->running_max[row] = -INFINITY;
        scratch->running_sum[row] = 0.0f;
    }
    memset(scratch->accumulators, 0, sizeof(float) * num_rows * head_dim);

    const int32_t *table = step->block_table + request * step->stride_table_row;
    const int transposed = step->fixed_order || num_queries * step->group_size >= MIN_ROWS_TO_TRANSPOSE;
    const float *key_rows[KEYS_PER_CHUNK], *value_rows[KEYS_PER_CHUNK];
    /* fp32 caches are read where they are; bf16 ones are converted a chunk at a time. */
    const int64_t head_stride = step->dtype == DTYPE_FLOAT32 ? step->stride_cache_head : head_dim;
    int64_t first_chunk = step->fixed_order ? lowest - lowest % KEYS_PER_CHUNK : lowest;
    if (partial != NULL) {
        const int64_t chunks = (highest - first_chunk + KEYS_PER_CHUNK - 1) / KEYS_PER_CHUNK;
        const int64_t part_end = first_chunk + chunks * (partial->part + 1) / partial->parts * KEYS_PER_CHUNK;
        first_chunk += chunks * partial->part / partial->parts * KEYS_PER_CHUNK;
        if (part_end < highest) highest = part_end;
    }
    for (int64_t chunk = first_chunk; chunk < highest; chunk += KEYS_PER_CHUNK) {
        const int64_t num_keys = highest - chunk < KEYS_PER_CHUNK ? highest - chunk : KEYS_PER_CHUNK;
        for (int64_t key = 0; key < num_keys; key++) {
            const int64_t position = chunk + key;
            const int64_t slot = (int64_t)table[position / step->page_size] * step->page_size
                                 + position % step->page_size;
            const int64_t offset = slot * step->stride_cache_slot;
            if (step->dtype == DTYPE_FLOAT32) {
                key_rows[key] = (const float *)step->key_cache + offset;
                value_rows[key] = (const float *)step->value_cache + offset;
                continue;
            }
            float *keys = scratch->keys + key * slot_width, *values = scratch->values + key * slot_width;
            for (int64_t kv_head = 0; kv_head < step->num_kv_heads; kv_head++) {
                const int64_t head_offset = offset + kv_head * step->stride_cache_head;
                load_row(step->key_cache, head_offset, step->dtype, keys + kv_head * head_dim, head_dim);
                load_row(step->value_cache, head_offset, step->dtype, values + kv_head * head_dim, head_dim);
            }
            key_rows[key] = keys;
            value_rows[key] = values;
        }
        if (transposed) transpose_keys(step, scratch, num_keys, key_rows, head_stride);
        attend_chunk(step, scratch, num_rows, chunk, num_keys, key_rows, value_rows, head_stride, transposed);
    }

    if (partial != NULL) {
        for (int64_t row = 0; row < num_rows; row++) {
            float *target = partial->rows + row * (head_dim + 2);
            memcpy(target, scratch->accumulators + row * head_dim, sizeof(float) * head_dim);
            target[head_dim] = scratch->running_max[row];
            target[head_dim + 1] = scratch->running_sum[row];
        }
        return;
    }
    for (int64_t row = 0; row < num_rows; row++) {
        const int64_t query = first_query + row / num_heads, head = row % num_heads;
        const int64_t offset = (query_start + query) * step->stride_output_row + head * step->stride_output_head;
        /* Every row sees at least its own key, so its sum is positive. */
        write_output(step, offset, scratch->accumulators + row * head_dim,
                     with_sink(step, head, scratch->running_max[row], scratch->running_sum[row]));
    }
}

/* Merges the `parts` partial states of tile `tile` (rows of `part_rows` floats apart) into its output, in
   part order: each part's sum and accumulator rescaled to the largest maximum. A part whose keys the
   row does not see (its window, or causality) holds maximum -inf and sum 0, and adds nothing. */
static void merge_parts(const Step *step, int64_t tile, const float *partials, int64_t parts, int64_t part_rows) {
    const int64_t request = step->tile_requests[tile];
    if (request < 0) return;
    const int64_t num_heads = step->num_kv_heads * step->group_size, head_dim = step->head_dim;
    const int64_t query_start = step->query_starts[request];
    const int64_t query_len = step->query_starts[request + 1] - query_start;
    const int64_t first_query = step->tile_offsets[tile];
    int64_t num_queries = query_len - first_query;
    if (num_queries > step->queries_per_tile) num_queries = step->queries_per_tile;
    for (int64_t row = 0; row < num_queries * num_heads; row++) {
        float largest = -INFINITY;
        for (int64_t part = 0; part < parts; part++) {
            const float maximum = partials[(part * part_rows + row) * (head_dim + 2) + head_dim];
            if (maximum > largest) largest = maximum;
        }
        float total = 0.0f, merged[head_dim];
        for (int64_t d = 0; d < head_dim; d++) merged[d] = 0.0f;
        for (int64_t part = 0; part < parts; part++) {
            const float *state = partials + (part * part_rows + row) * (head_dim + 2);
            if (state[head_dim + 1] == 0.0f) continue;
            const float weight = exp_nonpositive(state[head_dim] - largest);
            total += state[head_dim + 1] * weight;
            for (int64_t d = 0; d < head_dim; d++) merged[d] += state[d] * weight;
        }
        const int64_t query = first_query + row / num_heads, head = row % num_heads;
        const int64_t offset = (query_start + query) * step->stride_output_row + head * step->stride_output_head;
        /* Every row sees at least its own key, in some part, so the total is positive. */
        write_output(step, offset, merged, with_sink(step, head, largest, total));
    }
}

/* Returns 0, or -1 when a thread could not allocate its scratch (the output is then incomplete). */
int paged_attention(int dtype, const void *queries, int64_t stride_query_row, int64_t stride_query_head,
                    const void *key_cache, const void *value_cache, int64_t stride_cache_slot,
                    int64_t stride_cache_head, const int32_t *block_table, int64_t stride_table_row,
                    const int32_t *query_starts, const int32_t *seq_lens, const int32_t *tile_requests,
                    const int32_t *tile_offsets, int64_t num_tiles, void *output, int64_t stride_output_row,
                    int64_t stride_output_head, int64_t num_kv_heads, int64_t group_size, int64_t head_dim,
                    int64_t queries_per_tile, int64_t page_size, float scale, float softcap,
                    int64_t sliding_window, int64_t attention_chunk, int fixed_order, const float *sinks,
                    const float *alibi_slopes, int num_threads) {
    const Step step = {dtype, queries, stride_query_row, stride_query_head, key_cache, value_cache,
                       stride_cache_slot, stride_cache_head, block_table, stride_table_row, query_starts,
                       seq_lens, tile_requests, tile_offsets, output, stride_output_row, stride_output_head,
                       num_kv_heads, group_size, head_dim, queries_per_tile, page_size, scale, softcap,
                       sliding_window, attention_chunk, fixed_order, sinks, alibi_slopes};
    const int64_t max_rows = queries_per_tile * num_kv_heads * group_size;
    /* Parts per tile: enough that every thread has work, when the tiles alone do not give it and their
       requests are long enough to pay for it. */
    int64_t longest = 0;
    for (int64_t tile = 0; tile < num_tiles && num_tiles < num_threads; tile++)
        if (tile_requests[tile] >= 0 && seq_lens[tile_requests[tile]] > longest) longest = seq_lens[tile_requests[tile]];
    const int64_t parts = !fixed_order && num_tiles < num_threads && longest >= MIN_KEYS_TO_SPLIT
                              ? num_threads / num_tiles : 1;
    /* No more threads than work items: a thread woken for nothing still costs its wake-up. */
    if (num_threads > num_tiles * parts) num_threads = (int)(num_tiles * parts > 0 ? num_tiles * parts : 1);
    float *partials = NULL;
    if (parts > 1) {
        partials = malloc(sizeof(float) * num_tiles * parts * max_rows * (head_dim + 2));
        if (partials == NULL) return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        Scratch scratch;
        if (!scratch_allocate(&scratch, max_rows, head_dim, num_kv_heads * head_dim)) failed = 1;
        /* Every thread takes part in each loop (worksharing constructs), allocation failed or not. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_tiles * parts; item++) {
            if (failed) continue;
            if (parts == 1) {
                attend_tile(&step, &scratch, item, NULL);
                continue;
            }
            const int64_t tile = item / parts;
            const Partial partial = {partials + (tile * parts + item % parts) * max_rows * (head_dim + 2),
                                     item % parts, parts};
            attend_tile(&step, &scratch, tile, &partial);
        }
        if (parts > 1) {
            /* The loop's implicit barrier: every part is done. */
#pragma omp for schedule(static)
            for (int64_t tile = 0; tile < num_tiles; tile++)
                merge_parts(&step, tile, partials + tile * parts * max_rows * (head_dim + 2), parts, max_rows);
        }
        scratch_free(&scratch);
    }
    free(partials);
    return failed ? -1 : 0;
}
