"""Weight-only quantized linear layers on the CPU: 8-bit and 4-bit weights with a float32 scale (and, for
4-bit, a float32 minimum) per group of 32, read in their packed form by a C kernel.

formats: the formats, quantizing and dequantizing a weight, and the error naming a tensor and a format.
kernel: the C kernel (`quantized_linear_cpu.c`), built on first use.
linear: `QuantizedLinear`, the module that replaces `nn.Linear`.
model: quantizing a model's linear layers at load, and weight updates into them.
gguf_blocks: GGUF's Q8_0, Q4_0 and Q4_1 blocks into these formats without a round trip through float32.
"""
