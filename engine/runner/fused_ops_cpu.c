/* The small operations between a decoder layer's matrix products, one call each instead of several torch
   operators (engine.runner.fused_ops). All tensors are float32 with unit stride along their last axis.

   Each computes what the transformers code it replaces computes, in the same order of operations, so that
   the results differ from it only where torch sums in another order (the norms' mean of squares):
     rms_norm:      out = weight * (x * (1 / sqrt(mean(x^2) + eps)))   (LlamaRMSNorm, float32)
                    optionally after hidden += addend in place (the residual connection before the norm);
     rotary:        x = x * cos + rotate_half(x) * sin, in place        (apply_rotary_pos_emb)
     silu_and_mul:  out = gate / (1 + exp(-gate)) * up                  (LlamaMLP's act_fn(gate) * up)
   Built without contracting a * b + c into a fused multiply-add (-ffp-contract=off): torch's eager
   operators round the product and the sum separately, and so does this code.

   Rows are split over threads only when a call has enough of them to pay for waking the team (a prefill
   chunk); one request's decode step runs on the calling thread. */

#include <math.h>
#include <stdint.h>

/* Elements of work per thread below which a call stays on one thread. */
#define MIN_ELEMENTS_PER_THREAD (1 << 15)

static int threads_for(int64_t elements, int threads) {
    int64_t wanted = elements / MIN_ELEMENTS_PER_THREAD;
    if (wanted < 1) return 1;
    return wanted < threads ? (int)wanted : threads;
}

static void rms_norm_row(float *hidden, const float *addend, const float *weight, int64_t width, float eps,
                         float *out) {
    if (addend != 0)
        for (int64_t i = 0; i < width; i++) hidden[i] += addend[i];
    /* The mean of squares in double: at least as close to the exact value as torch's float reduction. */
    double squares = 0.0;
    for (int64_t i = 0; i < width; i++) squares += (double)hidden[i] * hidden[i];
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
        for (int64_t i = 0; i < width; i++) out_row[i] = gate_row[i] / (1.0f + expf(-gate_row[i])) * up_row[i];
    }
    return 0;
}
