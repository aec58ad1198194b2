"""Quantized linear layers: on the CPU, 8-bit and 4-bit weights with a float32 scale (and, for 4-bit, a
float32 minimum) per group of 32, read in their packed form by a C kernel; on the GPU, fp8 weights with a
scale per output channel, multiplied by fp8 inputs, and int4 in tinygemm's tile layout.

formats: the formats, quantizing and dequantizing a weight, and the error naming a tensor and a format.
kernel: the C kernel (`quantized_linear_cpu.c`), built on first use.
fp8: fp8 layers through torch's scaled matmul (cuBLASLt on the GPU, oneDNN on the CPU).
int4_tiles: int4 layers on a GPU, through tinygemm's kernel.
linear: `QuantizedLinear`, the module that replaces `nn.Linear`.
sharding: a rank's shard of a quantized layer under tensor parallelism, and its communication.
model: quantizing a model's linear layers at load, and weight updates into them.
gguf_blocks: GGUF's blocks into these formats (Q8_0, Q4_0, Q4_1 and Q4_K exactly, the 5- and 6-bit types
as int8).
gptq: GPTQ and AWQ 4-bit checkpoints into int4.
"""
