"""Linear layers on fp8 weights: the H100/H200 path, through `torch._scaled_mm`.

A layer's weight is float8 e4m3 with a float32 scale per output channel (engine.quantization.formats).
Each call quantizes its inputs the same way, a scale per row (max |x| / 448, computed on the device in the
call, "dynamic per-token"), and multiplies the two fp8 matrices with the row and channel scales applied to
the float32 accumulators: on an H100 or H200, cuBLASLt's fp8 tensor-core matmul, twice the bf16 rate, with
half the weight bytes to read. This is what vLLM's and SGLang's fp8 "dynamic" scheme computes; as there,
the output layer stays full precision (engine.quantization.model).

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


def _rows_to_fp8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` [M, K] as float8 e4m3 and the float32 scale of each row [M, 1] (a zero row gets scale 1)."""
    values = rows.to(torch.float32)
    scales = values.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (values / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def _output_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    # cuBLASLt's row-wise scaled matmul writes bfloat16 only; the CPU's writes the inputs' own dtype.
    if device.type == "cuda" or dtype not in (torch.float32, torch.bfloat16):
        return torch.bfloat16
    return dtype


def fp8_linear(
    inputs: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`inputs` [..., in] times the fp8 `weight` [out, in] with its channel `scales` [out, 1] (+ `bias`),
    in the inputs' dtype."""
    leading = inputs.shape[:-1]
    rows = inputs.reshape(-1, inputs.shape[-1])
    out_features = weight.shape[0]
    if rows.shape[0] == 0:
        return inputs.new_empty(*leading, out_features)
    quantized, row_scales = _rows_to_fp8(rows)
    output = torch._scaled_mm(
        quantized,
        weight.t(),  # [in, out], column-major: the layout the matmul takes its second operand in
        scale_a=row_scales,
        scale_b=scales.reshape(1, out_features),
        out_dtype=_output_dtype(rows.device, rows.dtype),
    ).to(inputs.dtype)
    if bias is not None:
        output = output + bias
    return output.view(*leading, out_features)


@functools.cache
def fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 matmuls cannot run on `device` (None when they can): one tiny `_scaled_mm` there, the
    call every layer makes (cuBLASLt's fp8 needs compute capability 8.9 or later, row-wise scales 9.0)."""
    size = FP8_ALIGNMENT
    try:
        weight = torch.ones(size, size, device=device).to(torch.float8_e4m3fn)
        fp8_linear(torch.ones(1, size, device=device), weight, torch.ones(size, 1, device=device), None)
    except (RuntimeError, NotImplementedError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None
