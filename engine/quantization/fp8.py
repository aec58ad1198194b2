"""Linear layers on fp8 weights: the H100/H200 path, through `torch._scaled_mm`.

A layer's weight is float8 e4m3 with a float32 scale per output channel (engine.quantization.formats).
Each call quantizes its inputs the same way, a scale per row (max |x| / 448, computed on the device in the
call, "dynamic per-token"), and multiplies the two fp8 matrices with the row and channel scales applied to
the float32 accumulators: on an H100 or H200, cuBLASLt's fp8 tensor-core matmul, twice the bf16 rate, with
half the weight bytes to read. This is what vLLM's and SGLang's fp8 "dynamic" scheme computes; as there,
the output layer stays full precision (engine.quantization.model). fp8_tensor has one scale for the
weight and one for each call's inputs ("dynamic per-tensor", vLLM's own default for `--quantization fp8`).

`torch._scaled_mm` runs on the CPU too (oneDNN), so the CPU tests exercise the very call a GPU makes. The
CPU's is a slow reference path (SmolLM2's 576 x 1536 layer at one row: 3.5 ms against 0.15 in float32 on
the 2-core EPYC): on a CPU, int8 and int4 are the formats to serve.

A row's result depends on its own inputs only in exact arithmetic; the matmul's summation order may change
with the number of rows, as float32's does.
"""

from __future__ import annotations

import functools

import torch

from engine.quantization.formats import FP8_ALIGNMENT, FP8_MAX


def _to_fp8(rows: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` [M, K] as float8 e4m3 and their float32 scale: one per row [M, 1], or with `per_tensor` one
    for all (a 0-d tensor); a zero row (or input) gets scale 1."""
    values = rows.to(torch.float32)
    largest = values.abs().amax() if per_tensor else values.abs().amax(dim=-1, keepdim=True)
    scales = largest / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (values / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def _output_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    # cuBLASLt's row-wise scaled matmul writes bfloat16 only; the CPU's writes the inputs' own dtype.
    if device.type == "cuda" or dtype not in (torch.float32, torch.bfloat16):
        return torch.bfloat16
    return dtype


def fp8_linear(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    per_tensor: bool = False,
) -> torch.Tensor:
    """`inputs` [..., in] times the fp8 `weight` [out, in] with its channel `scales` [out, 1] (+ `bias`),
    in the inputs' dtype. With `per_tensor` (fp8_tensor, whose scales are all one value) the inputs too get
    one scale, and the matmul scales the whole product once: the tensor-wise form, which GPUs without
    row-wise fp8 scales (compute capability 8.9) run."""
    leading = inputs.shape[:-1]
    rows = inputs.reshape(-1, inputs.shape[-1])
    out_features = weight.shape[0]
    if rows.shape[0] == 0:
        return inputs.new_empty(*leading, out_features)
    quantized, input_scales = _to_fp8(rows, per_tensor)
    output = torch._scaled_mm(
        quantized,
        weight.t(),  # [in, out], column-major: the layout the matmul takes its second operand in
        scale_a=input_scales,
        scale_b=scales[0, 0] if per_tensor else scales.reshape(1, out_features),
        out_dtype=_output_dtype(rows.device, rows.dtype),
    ).to(inputs.dtype)
    if bias is not None:
        output = output + bias
    return output.view(*leading, out_features)


@functools.cache
def fp8_unavailable_reason(device: torch.device, per_tensor: bool) -> str | None:
    """Why fp8 matmuls (row-wise scaled, or tensor-wise with `per_tensor`) cannot run on `device` (None
    when they can): one tiny `_scaled_mm` there, the call every layer makes (cuBLASLt's fp8 needs compute
    capability 8.9 or later, row-wise scales 9.0)."""
    size = FP8_ALIGNMENT
    try:
        weight = torch.ones(size, size, device=device).to(torch.float8_e4m3fn)
        scales = torch.ones(size, 1, device=device)
        fp8_linear(torch.ones(1, size, device=device), weight, scales, None, per_tensor)
    except (RuntimeError, NotImplementedError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None
