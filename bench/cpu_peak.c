/* Peak arithmetic of one core: fp32 fused multiply-adds against bf16 dot products (AVX-512).

   Each loop runs CHAINS independent accumulators, more than enough to cover the instructions' latency,
   so it measures throughput; each starts from its own value, or the compiler would merge identical
   chains into one. vfmadd231ps does 16 multiply-adds (32 FLOPs); vdpbf16ps does 16 lanes of two
   bf16 products summed into fp32 (64 FLOPs). Where bf16 runs on these instructions alone (no AMX), the
   two figures say how much bf16 can gain on arithmetic. Prints one JSON object. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define CHAINS 20
#define ITERATIONS 100000000L

static double seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec * 1e-9;
}

int main(void) {
    const __m512 x = _mm512_set1_ps(1e-9f), y = _mm512_set1_ps(1e-9f);
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = a;
    __m512 acc[CHAINS];
    float checksum = 0.0f;

    for (int chain = 0; chain < CHAINS; chain++) acc[chain] = _mm512_set1_ps((float)chain);
    double start = seconds();
    for (long i = 0; i < ITERATIONS; i++) {
#pragma GCC unroll 20
        for (int chain = 0; chain < CHAINS; chain++) acc[chain] = _mm512_fmadd_ps(x, y, acc[chain]);
        __asm__ volatile("");
    }
    const double fma_seconds = seconds() - start;
    for (int chain = 0; chain < CHAINS; chain++) checksum += _mm512_reduce_add_ps(acc[chain]);

    for (int chain = 0; chain < CHAINS; chain++) acc[chain] = _mm512_set1_ps((float)chain);
    start = seconds();
    for (long i = 0; i < ITERATIONS; i++) {
#pragma GCC unroll 20
        for (int chain = 0; chain < CHAINS; chain++) acc[chain] = _mm512_dpbf16_ps(acc[chain], a, b);
        __asm__ volatile("");
    }
    const double dot_seconds = seconds() - start;
    for (int chain = 0; chain < CHAINS; chain++) checksum += _mm512_reduce_add_ps(acc[chain]);

    const double operations = (double)ITERATIONS * CHAINS;
    printf("{\"fp32_fma_gflops_per_core\": %.1f, \"bf16_dot_gflops_per_core\": %.1f, \"checksum\": %g}\n",
           operations * 32 / fma_seconds / 1e9, operations * 64 / dot_seconds / 1e9, checksum);
    return 0;
}
