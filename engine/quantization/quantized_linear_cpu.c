/* Linear layers on weight-only quantized weights, read in their packed form (engine.quantization.kernel).

   out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]), where w is never stored in full precision: each group of
   GROUP consecutive weights of one output channel is
     int8 (format 0):  w = scale * q,        q int8, one byte a weight;
     int4 (format 1):  w = scale * q + min,  q in 0..15, two a byte in GGUF's order (byte j of a group holds
                                             weight j in its low nibble and weight j + 16 in its high one).
   Scales and mins are float32, one per group ([N, K / GROUP], row-major); GGUF's Q8_0, Q4_0 and Q4_1 blocks
   map onto these exactly (engine.quantization.gguf_blocks).
     float32 (format 2):                     w itself, repacked into panels of PANEL channels
                                             (`pack_float32_panels`): panel p is [K][PANEL], weight k of
                                             channel p * PANEL + c at [p][k][c]; channels past N are zeros.
   The last serves full-precision layers at every row count (engine.runner.packed_linear), see
   `multiply_panels`.

   Work is split over output channels. A worker dequantizes CHANNEL_TILE channels at a time into a small
   float scratch (it stays in L1/L2) and multiplies every row of x by them, ROW_TILE rows at once: the
   packed weights are read from memory once per call whatever the number of rows, which is what one
   request's decode is bound by, and each dequantized value feeds ROW_TILE multiply-adds.
   Within a channel the products are summed in a fixed order that does not depend on the number of rows or
   threads: a row's output has the same bits whatever else shares the call.

   With quantize_activations, calls of at most INTEGER_MAX_ROWS rows (the decode of one request or a few)
   multiply in integers instead, as llama.cpp does: each row's group of GROUP inputs becomes int8 with one
   float scale (d = max|x| / 127, q = round(x / d)), and a group's product is one integer dot product of
   the bytes, scaled once: sum_j w_j x_j ~ scale_w * d * sum_j q_w,j q_x,j + min * sum_j x_j (the exact
   float sum of the inputs carries the int4 min). That replaces converting every weight to a float,
   which is what bounds the float path, by byte arithmetic on 32 weights at once (AVX2 maddubs). Each
   input moves by at most d / 2, so an output moves by at most the sum over groups of
   d / 2 * sum_j |w_j| (tests/engine/test_quantization.py asserts it); a row's result still does not
   depend on the other rows of its call. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#define CHANNEL_TILE 4
#define ROW_TILE 3
#define LANES 8
#define FUSED_MAX_ROWS 2
#define INTEGER_MAX_ROWS 4
#define FORMAT_FLOAT32 2
/* The float32 panels' vectors: AVX-512's 16 lanes where the build has them, else AVX2's 8. A panel is two
   vectors of channels; a tile of PANEL_ROWS rows holds twice as many accumulators: 24 of AVX-512's 32
   registers, 12 of AVX2's 16. */
#if defined(__AVX512F__)
#define PANEL_LANES 16
#define PANEL_ROWS 12
#else
#define PANEL_LANES 8
#define PANEL_ROWS 6
#endif
#define PANEL (2 * PANEL_LANES)
#define ROW_BLOCK_BYTES (768 * 1024)

typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));
typedef float panel_lanes_t __attribute__((vector_size(PANEL_LANES * sizeof(float))));

static inline lanes_t load_lanes(const float *source) {
    lanes_t value;
    memcpy(&value, source, sizeof(value));
    return value;
}

static inline float sum_lanes(lanes_t value) {
    float total = 0.0f;
    for (int lane = 0; lane < LANES; lane++) total += value[lane];
    return total;
}

#define PARTS (GROUP / LANES)

#if defined(__AVX2__)
#include <immintrin.h>

/* A group's quantized values as floats, LANES at a time, in weight order. GCC turns a portable conversion
   of eight bytes into eight scalar conversions, hence the intrinsics on x86. */
static inline __attribute__((always_inline)) void unpack_group(int format, const uint8_t *group,
                                                              lanes_t values[PARTS]) {
    if (format == 0) {
        for (int part = 0; part < PARTS; part++)
            values[part] = (lanes_t)_mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(group + part * LANES))));
        return;
    }
    __m128i bytes = _mm_loadu_si128((const __m128i *)group);
    __m128i mask = _mm_set1_epi8(15);
    /* Weights 0..15 are the low nibbles, 16..31 the high ones. */
    __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    values[0] = (lanes_t)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    values[1] = (lanes_t)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    values[2] = (lanes_t)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    values[3] = (lanes_t)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
}
#else
static inline __attribute__((always_inline)) void unpack_group(int format, const uint8_t *group,
                                                              lanes_t values[PARTS]) {
    for (int j = 0; j < GROUP; j++) {
        float value;
        if (format == 0)
            value = (float)((const int8_t *)group)[j];
        else
            value = (float)(j < GROUP / 2 ? group[j] & 15 : group[j - GROUP / 2] >> 4);
        values[j / LANES][j % LANES] = value;
    }
}
#endif

/* One channel's weights as floats: `in_features` of them into `target`. */
static void dequantize_channel(int format, const uint8_t *packed, const float *scales, const float *mins,
                               int64_t in_features, float *target) {
    int64_t groups = in_features / GROUP;
    int64_t group_bytes = format == 0 ? GROUP : GROUP / 2;
    for (int64_t group = 0; group < groups; group++) {
        lanes_t values[PARTS];
        unpack_group(format, packed + group * group_bytes, values);
        lanes_t scale = (lanes_t){0} + scales[group];
        lanes_t min = (lanes_t){0} + (format == 0 ? 0.0f : mins[group]);
        for (int part = 0; part < PARTS; part++) {
            lanes_t weights = scale * values[part] + min;
            memcpy(target + group * GROUP + part * LANES, &weights, sizeof(weights));
        }
    }
}

/* A tile reads its CHANNEL_TILE channels side by side, group by group: as many interleaved streams, which
   the hardware prefetcher follows poorly (on the 2-core EPYC, one request's int8 layers read their weights
   at about 14 GB/s where the float32 panels, one stream, read 24). So each group's step also asks for the
   same bytes of the next tile's channels, without keeping them in the outer caches (a hint of 0: they are
   read once). One request's int8 step took 28 % less time for it, int4's 18 % (bench/RESULTS.md). Only the
   integer tile does it: the same prefetch in the float tile (`multiply_packed_tile`, float inputs) sped
   that tile as much, but the compiler then built the many-row path 6-8 % slower. */
static inline __attribute__((always_inline)) void prefetch_next_tile(const uint8_t *next, int next_channels, int c,
                                                                    int64_t packed_row_bytes, int64_t offset) {
    if (next != NULL && c < next_channels) __builtin_prefetch(next + c * packed_row_bytes + offset, 0, 0);
}

/* Channels of the tile after `tile` (0 after the last). */
static inline int next_tile_channels(int64_t tile, int64_t tiles, int64_t out_features) {
    if (tile + 1 >= tiles) return 0;
    const int64_t first = (tile + 1) * CHANNEL_TILE;
    return out_features - first < CHANNEL_TILE ? (int)(out_features - first) : CHANNEL_TILE;
}

/* rows x CHANNEL_TILE dot products of length in_features; `rows` is a constant at each call site, so the
   compiler keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void multiply_tile(
    const int rows, const float *x, int64_t x_stride, const float *weights, int64_t in_features,
    float results[ROW_TILE][CHANNEL_TILE]) {
    lanes_t accumulators[ROW_TILE][CHANNEL_TILE];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHANNEL_TILE; c++) accumulators[r][c] = (lanes_t){0};
    for (int64_t k = 0; k < in_features; k += LANES) {
        lanes_t channel[CHANNEL_TILE];
        for (int c = 0; c < CHANNEL_TILE; c++) channel[c] = load_lanes(weights + c * in_features + k);
        for (int r = 0; r < rows; r++) {
            lanes_t row = load_lanes(x + r * x_stride + k);
            for (int c = 0; c < CHANNEL_TILE; c++) accumulators[r][c] += row * channel[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHANNEL_TILE; c++) results[r][c] = sum_lanes(accumulators[r][c]);
}

/* The same products for calls of at most FUSED_MAX_ROWS rows (one request's decode): each group is
   dequantized in registers and used at once, without the round trip through the scratch. The weights and
   the order of the sums are those of `multiply_tile`, so a row gets the same bits on either path. */
static inline __attribute__((always_inline)) void multiply_packed_tile(
    const int rows, const int format, const float *x, int64_t x_stride, const uint8_t *packed, int64_t packed_row_bytes,
    const float *scales, const float *mins, int64_t in_features, int channels,
    float results[ROW_TILE][CHANNEL_TILE]) {
    int64_t groups = in_features / GROUP;
    int64_t group_bytes = format == 0 ? GROUP : GROUP / 2;
    lanes_t accumulators[FUSED_MAX_ROWS][CHANNEL_TILE];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHANNEL_TILE; c++) accumulators[r][c] = (lanes_t){0};
    for (int64_t group = 0; group < groups; group++) {
        lanes_t inputs[FUSED_MAX_ROWS][PARTS];
        for (int r = 0; r < rows; r++)
            for (int part = 0; part < PARTS; part++)
                inputs[r][part] = load_lanes(x + r * x_stride + group * GROUP + part * LANES);
        for (int c = 0; c < CHANNEL_TILE; c++) {
            /* A missing channel of the last tile repeats the last one; its results are not written. */
            int64_t channel = c < channels ? c : channels - 1;
            lanes_t values[PARTS];
            unpack_group(format, packed + channel * packed_row_bytes + group * group_bytes, values);
            lanes_t scale = (lanes_t){0} + scales[channel * groups + group];
            lanes_t min = (lanes_t){0} + (format == 0 ? 0.0f : mins[channel * groups + group]);
            for (int part = 0; part < PARTS; part++) {
                lanes_t weights = scale * values[part] + min;
                for (int r = 0; r < rows; r++) accumulators[r][c] += inputs[r][part] * weights;
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHANNEL_TILE; c++) results[r][c] = sum_lanes(accumulators[r][c]);
}

#if defined(__AVX2__)
#define HAS_INTEGER_PATH 1

/* Row `x` quantized group by group into `quantized` (int8), `scales` and the groups' float `sums`. */
static void quantize_row(const float *x, int64_t in_features, int8_t *quantized, float *scales, float *sums) {
    for (int64_t group = 0; group < in_features / GROUP; group++) {
        const float *values = x + group * GROUP;
        float largest = 0.0f, sum = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            float magnitude = values[j] < 0 ? -values[j] : values[j];
            largest = magnitude > largest ? magnitude : largest;
            sum += values[j];
        }
        float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        for (int j = 0; j < GROUP; j++) quantized[group * GROUP + j] = (int8_t)__builtin_lrintf(values[j] * inverse);
        scales[group] = scale;
        sums[group] = sum;
    }
}

/* A group's 32 weights as bytes in weight order: int8 as they are, int4 unpacked from their nibbles. */
static inline __attribute__((always_inline)) __m256i weight_bytes(int format, const uint8_t *group) {
    if (format == 0) return _mm256_loadu_si256((const __m256i *)group);
    __m128i bytes = _mm_loadu_si128((const __m128i *)group);
    __m128i mask = _mm_set1_epi8(15);
    __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(high, low);
}

/* sum_j w_j q_j over a group as eight int32 partial sums converted to float. maddubs multiplies unsigned
   bytes by signed ones: int4 weights are unsigned already; int8 weights lend their sign to the inputs. */
static inline __attribute__((always_inline)) __m256 group_dot(int format, __m256i weights, __m256i inputs) {
    __m256i pairs = format == 0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(weights, weights), _mm256_sign_epi8(inputs, weights))
                                : _mm256_maddubs_epi16(weights, inputs);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

static inline float sum_m256(__m256 value) {
    float lanes[LANES];
    _mm256_storeu_ps(lanes, value);
    float total = 0.0f;
    for (int lane = 0; lane < LANES; lane++) total += lanes[lane];
    return total;
}

/* rows x CHANNEL_TILE outputs of the integer path; `rows` and `format` are constants at each call site.
   `next` (the next tile's weights, of `next_channels` channels; NULL for the last tile) is brought into
   cache meanwhile (see `prefetch_next_tile`). */
static inline __attribute__((always_inline)) void multiply_integer_tile(
    const int rows, const int format, const int8_t *quantized, const float *input_scales, const float *input_sums,
    const uint8_t *packed, int64_t packed_row_bytes, const float *scales, const float *mins, int64_t in_features,
    int channels, const uint8_t *next, int next_channels, float results[INTEGER_MAX_ROWS][CHANNEL_TILE]) {
    const int64_t groups = in_features / GROUP;
    const int64_t group_bytes = format == 0 ? GROUP : GROUP / 2;
    __m256 accumulators[INTEGER_MAX_ROWS][CHANNEL_TILE];
    float min_terms[INTEGER_MAX_ROWS][CHANNEL_TILE];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHANNEL_TILE; c++) {
            accumulators[r][c] = _mm256_setzero_ps();
            min_terms[r][c] = 0.0f;
        }
    for (int64_t group = 0; group < groups; group++) {
        __m256i inputs[INTEGER_MAX_ROWS];
        for (int r = 0; r < rows; r++)
            inputs[r] = _mm256_loadu_si256((const __m256i *)(quantized + r * in_features + group * GROUP));
        for (int c = 0; c < CHANNEL_TILE; c++) {
            /* A missing channel of the last tile repeats the last one; its results are not written. */
            const int64_t channel = c < channels ? c : channels - 1;
            prefetch_next_tile(next, next_channels, c, packed_row_bytes, group * group_bytes);
            const __m256i weights = weight_bytes(format, packed + channel * packed_row_bytes + group * group_bytes);
            const float weight_scale = scales[channel * groups + group];
            for (int r = 0; r < rows; r++) {
                const __m256 scale = _mm256_set1_ps(weight_scale * input_scales[r * groups + group]);
                accumulators[r][c] = _mm256_fmadd_ps(group_dot(format, weights, inputs[r]), scale, accumulators[r][c]);
                /* fmaf, not `+= a * b`: the compiler may contract that in one tile height and not in another. */
                if (format != 0)
                    min_terms[r][c] = fmaf(mins[channel * groups + group], input_sums[r * groups + group], min_terms[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHANNEL_TILE; c++) results[r][c] = sum_m256(accumulators[r][c]) + min_terms[r][c];
}
#else
#define HAS_INTEGER_PATH 0
#endif

/* Float32 weights in panels (format 2).

   A panel holds PANEL channels with their K weights interleaved, so that one step along K loads PANEL
   consecutive floats (two vectors) and a tile of PANEL_ROWS rows broadcasts one input per row against them:
   2 x PANEL_ROWS accumulators (12 of AVX2's 16 registers, 24 of AVX-512's 32), two loads of weights and
   PANEL_ROWS broadcasts for every 2 x PANEL_ROWS multiply-adds. Built for AVX-512, the panels are 32
   channels wide and the tile 12 rows tall: on a 2-core AVX-512 Xeon, SmolLM2's 210 products took 87.4 ms
   at 64 rows and 285.5 at 256 (oneDNN 98.2 and 248.6), against 152.1 and 542.8 with AVX2's 16-wide
   panels and 6-row tile (`python -m bench.linear_kernel`, 2026-12-04). The weights stream once per call in the order they
   lie, the way one request's decode (bound by reading them) wants; the tile keeps the FMA units busy when
   many rows share the call. Rows go in blocks of about ROW_BLOCK_BYTES of inputs, which stay in L2/L3
   while every panel passes over them; a panel is re-read from L2 by each tile of the block.

   On the 2-core EPYC (Zen 2, AVX2), SmolLM2's decoder layers (210 products, `python -m
   bench.linear_kernel`) took 17.9 ms at one row (oneDNN on its packed weight: 25.1), 33.8 ms at 16 rows
   (45.0), 50.1 ms at 32 (67.2), 82.3 ms at 64 (113.7), 291.2 ms at 256 rows (372.7; 187 GFLOP/s against
   the FMA units' 209).

   Each output is bias + the sum over k of x[r][k] * w[n][k], added one k after the other in one vector
   lane, whatever the tile, block or thread: a row's result has the same bits however many rows share
   the call. */

/* Returns 0. */
int pack_float32_panels(const float *weight, int64_t out_features, int64_t in_features, float *panels,
                        int threads) {
    int64_t count = (out_features + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t panel = 0; panel < count; panel++)
        for (int64_t k = 0; k < in_features; k++)
            for (int c = 0; c < PANEL; c++) {
                int64_t channel = panel * PANEL + c;
                panels[(panel * in_features + k) * PANEL + c] =
                    channel < out_features ? weight[channel * in_features + k] : 0.0f;
            }
    return 0;
}

/* `rows` (at most PANEL_ROWS) rows of x times one panel, into results [rows][PANEL]; `rows` is a constant
   at each call site, so the accumulators stay in registers. The first `prefetch_lines` steps along K each
   bring one 64-byte line from `prefetch` on into cache meanwhile (a share of the next panel). */
static inline __attribute__((always_inline)) void multiply_panel_tile(const int rows, const float *x,
                                                                     int64_t x_stride, const float *panel,
                                                                     int64_t in_features, const char *prefetch,
                                                                     int64_t prefetch_lines,
                                                                     float results[PANEL_ROWS][PANEL]) {
    enum { VECTORS = PANEL / PANEL_LANES };
    panel_lanes_t accumulators[PANEL_ROWS][VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < VECTORS; v++) accumulators[r][v] = (panel_lanes_t){0};
    /* One step along K: two vectors of weights, each row's input broadcast against them. A vector times a
       scalar broadcasts the scalar, not `(panel_lanes_t){0} + value`, which costs an add (the sign of
       zero). */
#define PANEL_STEP(k)                                                                                        \
    do {                                                                                                     \
        panel_lanes_t weights[VECTORS];                                                                      \
        for (int v = 0; v < VECTORS; v++)                                                                    \
            memcpy(&weights[v], panel + (k) * PANEL + v * PANEL_LANES, sizeof(panel_lanes_t));               \
        for (int r = 0; r < rows; r++) {                                                                     \
            float value = x[r * x_stride + (k)];                                                             \
            for (int v = 0; v < VECTORS; v++) accumulators[r][v] += weights[v] * value;                      \
        }                                                                                                    \
    } while (0)
    /* Two loops rather than a test at every step: the prefetching steps, then the others. */
    int64_t k = 0;
    const int64_t prefetching_steps = prefetch_lines < in_features ? prefetch_lines : in_features;
    for (; k < prefetching_steps; k++) {
        __builtin_prefetch(prefetch + k * 64, 0, 3);
        PANEL_STEP(k);
    }
    for (; k < in_features; k++) PANEL_STEP(k);
#undef PANEL_STEP
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < VECTORS; v++)
            memcpy(results[r] + v * PANEL_LANES, &accumulators[r][v], sizeof(panel_lanes_t));
}

static void multiply_panels(const float *x, int64_t rows, int64_t x_stride, const float *panels,
                            int64_t out_features, int64_t in_features, const float *bias, float *out,
                            int64_t out_stride, int threads) {
    int64_t count = (out_features + PANEL - 1) / PANEL;
    int64_t block = ROW_BLOCK_BYTES / (in_features * (int64_t)sizeof(float)) / PANEL_ROWS * PANEL_ROWS;
    if (block < PANEL_ROWS) block = PANEL_ROWS;
    const int64_t panel_lines = in_features * PANEL * (int64_t)sizeof(float) / 64;
    /* One team per block: the blocks run one after the other, each split over panels. */
    for (int64_t block_start = 0; block_start < rows; block_start += block) {
        int64_t block_end = block_start + block < rows ? block_start + block : rows;
        /* A block of several tiles reads its panel from memory in the first and from cache in the others,
           which are bound by the multiply-adds. Each tile fetches its share of the next panel, so that the
           memory works all along the panel, at the pace of its tiles (fetching the whole next panel in the
           first tile asked more of the memory than it gives one core, and the other tiles waited: on the
           2-core Xeon, SmolLM2's 210 products at 64 rows took 55.0-74.4 ms against 60.9-82.0, at 32 rows
           33.5-39.3 against 37.0-45.2, 2026-12-04). A block of one tile leaves the stream to the
           hardware's prefetcher (prefetching there made one row 10 % slower). */
        const int64_t tiles = (block_end - block_start + PANEL_ROWS - 1) / PANEL_ROWS;
        const int64_t share = (panel_lines + tiles - 1) / tiles;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t panel = 0; panel < count; panel++) {
            const float *panel_weights = panels + panel * in_features * PANEL;
            const char *next_panel = (const char *)(panel_weights + in_features * PANEL);
            const int prefetching = tiles > 1 && panel + 1 < count;
            int64_t first = panel * PANEL;
            int channels = out_features - first < PANEL ? (int)(out_features - first) : PANEL;
            for (int64_t row = block_start; row < block_end; row += PANEL_ROWS) {
                float results[PANEL_ROWS][PANEL];
                int left = block_end - row < PANEL_ROWS ? (int)(block_end - row) : PANEL_ROWS;
                const float *x_rows = x + row * x_stride;
                const int64_t from = (row - block_start) / PANEL_ROWS * share;
                const int64_t lines = !prefetching || from >= panel_lines ? 0
                                      : panel_lines - from < share ? panel_lines - from
                                                                   : share;
                /* Only a share that lies inside the next panel is pointed at (the last panel has none). */
                const char *prefetch = lines > 0 ? next_panel + from * 64 : (const char *)panel_weights;
#define PANEL_TILE(ROWS) \
    multiply_panel_tile(ROWS, x_rows, x_stride, panel_weights, in_features, prefetch, lines, results)
                switch (left) {
#if PANEL_ROWS > 6
                case 12: PANEL_TILE(12); break;
                case 11: PANEL_TILE(11); break;
                case 10: PANEL_TILE(10); break;
                case 9: PANEL_TILE(9); break;
                case 8: PANEL_TILE(8); break;
                case 7: PANEL_TILE(7); break;
#endif
                case 6: PANEL_TILE(6); break;
                case 5: PANEL_TILE(5); break;
                case 4: PANEL_TILE(4); break;
                case 3: PANEL_TILE(3); break;
                case 2: PANEL_TILE(2); break;
                default: PANEL_TILE(1);
                }
#undef PANEL_TILE
                _Static_assert(PANEL_ROWS == 6 || PANEL_ROWS == 12, "the switch above has a case for every tile height");
                for (int r = 0; r < left; r++)
                    for (int c = 0; c < channels; c++)
                        out[(row + r) * out_stride + first + c] = results[r][c] + (bias == NULL ? 0.0f : bias[first + c]);
            }
        }
    }
}

/* The channels a float32 panel holds (PANEL), which the caller sizes the panels by. */
int float32_panel_channels(void) { return PANEL; }

/* Returns 0, or 1 when a worker could not allocate its scratch. */
int quantized_linear(int format, const float *x, int64_t rows, int64_t x_stride, const uint8_t *packed,
                     const float *scales, const float *mins, int64_t out_features, int64_t in_features,
                     const float *bias, float *out, int64_t out_stride, int quantize_activations, int threads) {
    int64_t packed_row_bytes = format == 0 ? in_features : in_features / 2;
    int64_t groups = in_features / GROUP;
    int64_t tiles = (out_features + CHANNEL_TILE - 1) / CHANNEL_TILE;
    int failed = 0;
    if (rows == 0) return 0; /* a step that keeps no logits */
    if (format == FORMAT_FLOAT32) {
        multiply_panels(x, rows, x_stride, (const float *)packed, out_features, in_features, bias, out, out_stride,
                        threads);
        return 0;
    }
#if HAS_INTEGER_PATH
    if (quantize_activations && format != FORMAT_FLOAT32 && rows <= INTEGER_MAX_ROWS) {
        int8_t *quantized = malloc((size_t)(rows * in_features) + 2 * (size_t)(rows * groups) * sizeof(float));
        if (quantized == NULL) return 1;
        float *input_scales = (float *)(quantized + rows * in_features), *input_sums = input_scales + rows * groups;
        for (int64_t row = 0; row < rows; row++)
            quantize_row(x + row * x_stride, in_features, quantized + row * in_features, input_scales + row * groups,
                         input_sums + row * groups);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t first = tile * CHANNEL_TILE;
            const int channels = out_features - first < CHANNEL_TILE ? (int)(out_features - first) : CHANNEL_TILE;
            float results[INTEGER_MAX_ROWS][CHANNEL_TILE];
            const uint8_t *tile_packed = packed + first * packed_row_bytes;
            const float *tile_scales = scales + first * groups;
            const float *tile_mins = mins == NULL ? NULL : mins + first * groups;
            const uint8_t *next = tile + 1 < tiles ? tile_packed + CHANNEL_TILE * packed_row_bytes : NULL;
            const int next_channels = next_tile_channels(tile, tiles, out_features);
#define INTEGER_TILE(ROWS, FORMAT)                                                                        \
    multiply_integer_tile(ROWS, FORMAT, quantized, input_scales, input_sums, tile_packed, packed_row_bytes, \
                          tile_scales, tile_mins, in_features, channels, next, next_channels, results)
            if (format == 0) {
                if (rows == 1) INTEGER_TILE(1, 0); else if (rows == 2) INTEGER_TILE(2, 0);
                else if (rows == 3) INTEGER_TILE(3, 0); else INTEGER_TILE(4, 0);
            } else {
                if (rows == 1) INTEGER_TILE(1, 1); else if (rows == 2) INTEGER_TILE(2, 1);
                else if (rows == 3) INTEGER_TILE(3, 1); else INTEGER_TILE(4, 1);
            }
#undef INTEGER_TILE
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < channels; c++)
                    out[r * out_stride + first + c] = results[r][c] + (bias == NULL ? 0.0f : bias[first + c]);
        }
        free(quantized);
        return 0;
    }
#endif
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scratch = aligned_alloc(64, (size_t)(CHANNEL_TILE * in_features * sizeof(float)));
        failed = scratch == NULL;
        /* Every worker reaches the loop (a work-sharing construct), even one without scratch. */
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (scratch == NULL) continue;
            int64_t first = tile * CHANNEL_TILE;
            int channels = out_features - first < CHANNEL_TILE ? (int)(out_features - first) : CHANNEL_TILE;
            const float *weights = scratch;
            if (rows <= FUSED_MAX_ROWS) {
                float results[ROW_TILE][CHANNEL_TILE];
                const uint8_t *tile_packed = packed + first * packed_row_bytes;
                const float *tile_scales = scales + first * groups;
                const float *tile_mins = mins == NULL ? NULL : mins + first * groups;
                /* Rows and format as constants at each call, so that each inlined copy has neither
                   branch in its inner loop. */
#define FUSED_TILE(ROWS, FORMAT)                                                                         \
    multiply_packed_tile(ROWS, FORMAT, x, x_stride, tile_packed, packed_row_bytes, tile_scales, tile_mins, \
                         in_features, channels, results)
                if (format == 0) {
                    if (rows == 2) FUSED_TILE(2, 0); else FUSED_TILE(1, 0);
                } else {
                    if (rows == 2) FUSED_TILE(2, 1); else FUSED_TILE(1, 1);
                }
#undef FUSED_TILE
                for (int r = 0; r < rows; r++)
                    for (int c = 0; c < channels; c++)
                        out[r * out_stride + first + c] = results[r][c] + (bias == NULL ? 0.0f : bias[first + c]);
                continue;
            }
            for (int c = 0; c < CHANNEL_TILE; c++) {
                float *target = scratch + c * in_features;
                if (c >= channels) {
                    memset(target, 0, (size_t)in_features * sizeof(float));
                    continue;
                }
                int64_t channel = first + c;
                dequantize_channel(format, packed + channel * packed_row_bytes, scales + channel * groups,
                                   mins == NULL ? NULL : mins + channel * groups, in_features, target);
            }
            for (int64_t row = 0; row < rows; row += ROW_TILE) {
                float results[ROW_TILE][CHANNEL_TILE];
                int64_t left = rows - row;
                const float *x_rows = x + row * x_stride;
                if (left >= 3)
                    multiply_tile(3, x_rows, x_stride, weights, in_features, results);
                else if (left == 2)
                    multiply_tile(2, x_rows, x_stride, weights, in_features, results);
                else
                    multiply_tile(1, x_rows, x_stride, weights, in_features, results);
                int tile_rows = left >= ROW_TILE ? ROW_TILE : (int)left;
                for (int r = 0; r < tile_rows; r++)
                    for (int c = 0; c < channels; c++)
                        out[(row + r) * out_stride + first + c] =
                            results[r][c] + (bias == NULL ? 0.0f : bias[first + c]);
            }
        }
        free(scratch);
    }
    return failed;
}
