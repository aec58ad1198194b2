/* The small operations between a decoder layer's matrix products, one call each instead of several torch
   operators (engine.runner.fused_ops). All tensors are float32 with unit stride along their last axis.

   Each computes what the transformers code it replaces computes, in the same order of operations, so that
   the results differ from it only where torch sums in another order (the norms' mean of squares):
     rms_norm:      out = weight * (x * (1 / sqrt(mean(x^2) + eps)))   (LlamaRMSNorm, float32)
                    optionally after hidden += addend in place (the residual connection before the norm);
     rotary:        x = x * cos + rotate_half(x) * sin, in place        (apply_rotary_pos_emb)
     silu_and_mul:  out = gate / (1 + exp(-gate)) * up                  (LlamaMLP's act_fn(gate) * up),
                    with exp from a polynomial that vectorises (vector_math.h)
   Built without contracting a * b + c into a fused multiply-add (-ffp-contract=off): torch's eager
   operators round the product and the sum separately, and so does this code.

   Rows are split over threads only when a call has enough of them to pay for waking the team (a prefill
   chunk); one request's decode step runs on the calling thread.

   decoder_layers runs every decoder layer of one step in one call (engine.runner.decoder_layers): the same
   operations in the same order as engine.runner.decoder_forward's layer loop, with the linear layers and
   the attention on the engine's kernels, reached through the function pointers the caller passes (they
   live in libraries of their own). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* Elements of work per thread below which a call stays on one thread. */
#define MIN_ELEMENTS_PER_THREAD (1 << 15)

static int threads_for(int64_t elements, int threads) {
    int64_t wanted = elements / MIN_ELEMENTS_PER_THREAD;
    if (wanted < 1) return 1;
    return wanted < threads ? (int)wanted : threads;
}

/* Running sums of a row's mean of squares: lane l sums squares l, l + SQUARE_LANES, ..., and the lanes then
   add in lane order. A fixed order whatever the row, call or thread, so a row's norm has the same bits in
   every batch; and independent sums, where one running sum waited four cycles on its previous add at every
   element (SmolLM2's 576-wide norm of a 64-row decode step took about 55 us on one thread). */
#define SQUARE_LANES 16

static void rms_norm_row(float *hidden, const float *addend, const float *weight, int64_t width, float eps,
                         float *out) {
    if (addend != 0)
        for (int64_t i = 0; i < width; i++) hidden[i] += addend[i];
    /* The mean of squares in double: at least as close to the exact value as torch's float reduction (a
       float's square is exact in double; only the sums round). */
    double lanes[SQUARE_LANES] = {0.0};
    int64_t i = 0;
    for (; i + SQUARE_LANES <= width; i += SQUARE_LANES)
#pragma omp simd
        for (int64_t lane = 0; lane < SQUARE_LANES; lane++) lanes[lane] += (double)hidden[i + lane] * hidden[i + lane];
    double squares = 0.0;
    for (int64_t lane = 0; lane < SQUARE_LANES; lane++) squares += lanes[lane];
    for (; i < width; i++) squares += (double)hidden[i] * hidden[i];
    const float variance = (float)(squares / (double)width);
    const float inverse = 1.0f / sqrtf(variance + eps);
    for (int64_t i = 0; i < width; i++) out[i] = weight[i] * (hidden[i] * inverse);
}

int rms_norm(float *hidden, int64_t hidden_stride, const float *addend, int64_t addend_stride, const float *weight,
             int64_t rows, int64_t width, float eps, float *out, int64_t out_stride, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * width, threads)) schedule(static)
    for (int64_t row = 0; row < rows; row++)
        rms_norm_row(hidden + row * hidden_stride, addend == 0 ? 0 : addend + row * addend_stride, weight, width,
                     eps, out + row * out_stride);
    return 0;
}

/* x [rows, heads, head_dim] (strides row_stride, head_stride) rotated in place by the row's cos and sin
   [rows, head_dim] (stride angle_stride). rotate_half(x) is (-x[half:], x[:half]). */
int rotary(float *x, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride, int64_t head_dim,
           const float *cos, const float *sin, int64_t angle_stride, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(rows * heads * head_dim, threads)) schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const float *row_cos = cos + row * angle_stride, *row_sin = sin + row * angle_stride;
        for (int64_t head = 0; head < heads; head++) {
            float *vector = x + row * row_stride + head * head_stride;
            for (int64_t i = 0; i < half; i++) {
                const float first = vector[i], second = vector[i + half];
                vector[i] = first * row_cos[i] + -second * row_sin[i];
                vector[i + half] = second * row_cos[i + half] + first * row_sin[i + half];
            }
        }
    }
    return 0;
}

int silu_and_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t rows,
                 int64_t width, float *out, int64_t out_stride, int threads) {
#pragma omp parallel for num_threads(threads_for(rows * width, threads)) schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const float *gate_row = gate + row * gate_stride, *up_row = up + row * up_stride;
        float *out_row = out + row * out_stride;
        /* Elementwise (out may be gate itself): no iteration reads what another writes. */
#pragma omp simd
        for (int64_t i = 0; i < width; i++) {
            /* exp of -|gate| only, which cannot overflow: silu(g) = g / (1 + e^-g) = g e^g / (1 + e^g). */
            const float g = gate_row[i], e = exp_nonpositive(-fabsf(g));
            const float numerator = g < 0.0f ? g * e : g;
            out_row[i] = numerator / (1.0f + e) * up_row[i];
        }
    }
    return 0;
}

/* engine.quantization.kernel's quantized_linear (every linear layer the step runs) and
   engine.runner.paged_attention_cpu's paged_attention. */
typedef int (*LinearKernel)(int format, const float *x, int64_t rows, int64_t x_stride, const void *packed,
                            const float *scales, const float *mins, int64_t out_features, int64_t in_features,
                            const float *bias, float *out, int64_t out_stride, int quantize_activations,
                            int threads);
typedef int (*AttentionKernel)(int dtype, const void *queries, int64_t query_row_stride, int64_t query_head_stride,
                               const void *key_cache, const void *value_cache, int64_t slot_stride,
                               int64_t cache_head_stride, const int32_t *block_table, int64_t table_stride,
                               const int32_t *query_starts, const int32_t *seq_lens, const int32_t *tile_requests,
                               const int32_t *tile_offsets, int64_t num_tiles, void *output,
                               int64_t output_row_stride, int64_t output_head_stride, int64_t num_kv_heads,
                               int64_t group_size, int64_t head_dim, int64_t queries_per_tile, int64_t page_size,
                               float scale, float softcap, int64_t sliding_window, int64_t attention_chunk,
                               int fixed_order, const float *sinks, const float *alibi_slopes, int threads);
/* The Llama family's layers attend without chunks (a chunk longer than any position), sinks or ALiBi. */
#define NO_ATTENTION_CHUNK INT64_MAX

/* One linear layer as the linear kernel reads it: its format code, weight (packed bytes, or the float32
   weight itself), scales and mins (NULL where the format has none) and bias (NULL: none). */
typedef struct {
    int64_t format, quantize_activations, out_features, in_features, weight_bytes;
    const void *packed;
    const float *scales, *mins, *bias;
} Linear;

/* One decoder layer's weights; query_norm and key_norm are NULL but for Qwen3. */
typedef struct {
    Linear query, key, value, output, gate, up, down;
    const float *input_norm, *post_attention_norm, *query_norm, *key_norm;
    double input_norm_eps, post_attention_norm_eps, query_norm_eps, key_norm_eps, scale;
} Layer;

/* What every layer shares: the model's widths and the kernels. */
typedef struct {
    int64_t num_layers, width, heads, kv_heads, head_dim, intermediate, min_work_per_thread;
    LinearKernel linear;
    AttentionKernel attention;
} Decoder;

/* One step. Caches are [num_slots, kv_heads, head_dim], contiguous, one pair per layer; layer_groups names
   each layer's cache group; write_slots[group] holds each row's slot in the group's caches; block tables,
   one per group, have their own row strides. */
typedef struct {
    int64_t rows;
    float *hidden;
    const float *cos, *sin;
    int64_t angle_stride;
    float *const *key_caches, *const *value_caches;
    const int64_t *layer_groups;
    int64_t num_slots;
    const int64_t *const *write_slots;
    const int32_t *const *block_tables;
    const int64_t *table_strides, *sliding_windows;
    const int32_t *query_starts, *seq_lens, *tile_requests, *tile_offsets;
    int64_t num_tiles, queries_per_tile, page_size, has_unowned_rows, threads;
    /* rows * decoder_scratch_floats(decoder) floats for the intermediates, owned by the caller so that it
       lives from one step to the next (see decoder_layers). */
    float *scratch;
} StepInputs;

/* The threads engine.quantization.kernel.quantized_matmul gives a call: one per min_work_per_thread bytes of
   weight times rows, at least one, at most the step's. */
static int linear(const Decoder *decoder, const StepInputs *step, const Linear *layer, const float *x, float *out) {
    int64_t threads = layer->weight_bytes * step->rows / decoder->min_work_per_thread;
    if (threads > step->threads) threads = step->threads;
    if (threads < 1) threads = 1;
    return decoder->linear((int)layer->format, x, step->rows, layer->in_features, layer->packed, layer->scales,
                           layer->mins, layer->out_features, layer->in_features, layer->bias, out,
                           layer->out_features, (int)layer->quantize_activations, (int)threads);
}

/* Copies the step's keys and values [rows, kv_heads * head_dim] to their slots; -2 for a slot outside the
   caches. */
static int write_cache(const Decoder *decoder, const StepInputs *step, int64_t index, const float *keys,
                       const float *values) {
    const int64_t slot_width = decoder->kv_heads * decoder->head_dim;
    const int64_t *slots = step->write_slots[step->layer_groups[index]];
    for (int64_t row = 0; row < step->rows; row++) {
        if (slots[row] < 0 || slots[row] >= step->num_slots) return -2;
        memcpy(step->key_caches[index] + slots[row] * slot_width, keys + row * slot_width, slot_width * sizeof(float));
        memcpy(step->value_caches[index] + slots[row] * slot_width, values + row * slot_width,
               slot_width * sizeof(float));
    }
    return 0;
}

/* Floats of scratch decoder_layers needs per row of a step: the norm's output, queries, keys, values,
   attention's output, the block's pending output, gate and up. */
int decoder_scratch_floats(const Decoder *decoder) {
    const int64_t query_width = decoder->heads * decoder->head_dim, key_width = decoder->kv_heads * decoder->head_dim;
    return (int)(2 * decoder->width + 2 * query_width + 2 * key_width + 2 * decoder->intermediate);
}

/* Every layer of the step: hidden [rows, width] holds the embeddings on the way in and the residual stream
   after the last layer on the way out. Every intermediate lives in step->scratch: a buffer allocated
   here at every step would be fresh pages at every prefill chunk (tens of MB, above the size malloc
   keeps for reuse), each first write a page fault. Returns 0; 1 when a kernel could not allocate its
   scratch; -2 for a write slot outside the caches. */
int decoder_layers(const Decoder *decoder, const Layer *layers, const StepInputs *step) {
    const int64_t rows = step->rows, width = decoder->width, head_dim = decoder->head_dim;
    const int64_t query_width = decoder->heads * head_dim, key_width = decoder->kv_heads * head_dim;
    const int threads = (int)step->threads;
    float *normed = step->scratch, *queries = normed + rows * width, *keys = queries + rows * query_width;
    float *values = keys + rows * key_width, *attended = values + rows * key_width;
    /* The output of the attention or MLP block not yet added to hidden: each norm adds it on its way in. */
    float *pending = attended + rows * query_width, *gate = pending + rows * width;
    float *up = gate + rows * decoder->intermediate;
    int status = 0;
    for (int64_t index = 0; index < decoder->num_layers && status == 0; index++) {
        const Layer *layer = layers + index;
        rms_norm(step->hidden, width, index == 0 ? NULL : pending, width, layer->input_norm, rows, width,
                 (float)layer->input_norm_eps, normed, width, threads);
        status |= linear(decoder, step, &layer->query, normed, queries);
        status |= linear(decoder, step, &layer->key, normed, keys);
        status |= linear(decoder, step, &layer->value, normed, values);
        if (status != 0) break;
        if (layer->query_norm != NULL) { /* Qwen3: a norm over each head, before the rotation, in place */
            rms_norm(queries, head_dim, NULL, 0, layer->query_norm, rows * decoder->heads, head_dim,
                     (float)layer->query_norm_eps, queries, head_dim, threads);
            rms_norm(keys, head_dim, NULL, 0, layer->key_norm, rows * decoder->kv_heads, head_dim,
                     (float)layer->key_norm_eps, keys, head_dim, threads);
        }
        rotary(queries, rows, decoder->heads, query_width, head_dim, head_dim, step->cos, step->sin,
               step->angle_stride, threads);
        rotary(keys, rows, decoder->kv_heads, key_width, head_dim, head_dim, step->cos, step->sin,
               step->angle_stride, threads);
        status = write_cache(decoder, step, index, keys, values);
        if (status != 0) break;
        if (step->has_unowned_rows) memset(attended, 0, rows * query_width * sizeof(float)); /* no kernel writes them */
        const int64_t group = step->layer_groups[index];
        status = decoder->attention(0, queries, query_width, head_dim, step->key_caches[index], step->value_caches[index],
                                    key_width, head_dim, step->block_tables[group], step->table_strides[group],
                                    step->query_starts, step->seq_lens, step->tile_requests, step->tile_offsets,
                                    step->num_tiles, attended, query_width, head_dim, decoder->kv_heads,
                                    decoder->heads / decoder->kv_heads, head_dim, step->queries_per_tile,
                                    step->page_size, (float)layer->scale, 0.0f, step->sliding_windows[group],
                                    NO_ATTENTION_CHUNK, 0, NULL, NULL, threads);
        if (status != 0) {
            status = 1;
            break;
        }
        status = linear(decoder, step, &layer->output, attended, pending);
        if (status != 0) break;
        rms_norm(step->hidden, width, pending, width, layer->post_attention_norm, rows, width,
                 (float)layer->post_attention_norm_eps, normed, width, threads);
        status |= linear(decoder, step, &layer->gate, normed, gate);
        status |= linear(decoder, step, &layer->up, normed, up);
        if (status != 0) break;
        silu_and_mul(gate, decoder->intermediate, up, decoder->intermediate, rows, decoder->intermediate, gate,
                     decoder->intermediate, threads);
        status = linear(decoder, step, &layer->down, gate, pending);
    }
    if (status == 0 && decoder->num_layers > 0)
        for (int64_t i = 0; i < rows * width; i++) step->hidden[i] += pending[i];
    return status;
}
