"""Triton kernels of batch-invariant mode on CUDA: a matmul and a row mean whose order per row is fixed.

On a GPU, cuBLAS picks its kernel by the problem's shape (tile sizes, and split-K, which sums partial
products of K across blocks) and torch's reductions split a row across more threads, or blocks, when few
rows are reduced; so a token's bits follow the number of rows in the batch. These kernels keep one tiling
for every shape:

- `matmul`: tiles of BLOCK_M x BLOCK_N outputs, each program walking K from 0 in steps of BLOCK_K, with
  one accumulator per output element and no split-K. An output element's sum is the same sequence of
  `tl.dot` steps whatever M is and wherever its row lies in the tile (rows past M load zeros and are not
  stored).
- `row_mean`: one program per row, BLOCK_COLUMNS lanes accumulating the row in order, then one tree sum
  of fixed shape: the norms' `pow(2).mean(-1)`.

Fixed tiles cost speed where cuBLAS would have chosen better ones (small M most), which is the price of the
mode. Written for the GPU check (bench/gpu_check.sh); the CPU tests run them under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32
BLOCK_COLUMNS = 1024


@triton.jit
def _matmul_kernel(
    rows_ptr,  # [M, K]
    weight_ptr,  # [N, K]
    bias_ptr,  # [N], read only with HAS_BIAS
    output_ptr,  # [M, N]
    num_rows,
    num_outputs,
    depth,
    stride_row,
    stride_row_k,
    stride_weight,
    stride_weight_k,
    stride_output_row,
    stride_output,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.arange(0, BLOCK_K)
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, depth, BLOCK_K):
        ks = start + steps
        block = tl.load(
            rows_ptr + rows[:, None] * stride_row + ks[None, :] * stride_row_k,
            mask=(rows[:, None] < num_rows) & (ks[None, :] < depth),
            other=0.0,
        )
        weights = tl.load(
            weight_ptr + outputs[None, :] * stride_weight + ks[:, None] * stride_weight_k,
            mask=(outputs[None, :] < num_outputs) & (ks[:, None] < depth),
            other=0.0,
        )
        accumulator = tl.dot(block, weights, accumulator, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + outputs, mask=outputs < num_outputs, other=0.0)
        accumulator += bias.to(tl.float32)[None, :]
    tl.store(
        output_ptr + rows[:, None] * stride_output_row + outputs[None, :] * stride_output,
        accumulator.to(output_ptr.dtype.element_ty),
        mask=(rows[:, None] < num_rows) & (outputs[None, :] < num_outputs),
    )


def matmul(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in rows' dtype, accumulated in fp32; fp32
    inputs multiply in IEEE precision (no TF32)."""
    if rows.dtype != weight.dtype:
        raise ValueError(f"matmul: {rows.dtype} rows for a {weight.dtype} weight")
    num_rows, depth = rows.shape
    num_outputs = weight.shape[0]
    output = torch.empty((num_rows, num_outputs), dtype=rows.dtype, device=rows.device)
    if num_rows == 0:
        return output
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(num_outputs, BLOCK_N))
    _matmul_kernel[grid](
        rows,
        weight,
        bias if bias is not None else weight,
        output,
        num_rows,
        num_outputs,
        depth,
        rows.stride(0),
        rows.stride(1),
        weight.stride(0),
        weight.stride(1),
        output.stride(0),
        output.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
    )
    return output


@triton.jit
def _row_mean_kernel(input_ptr, output_ptr, num_columns, stride_row, BLOCK_COLUMNS: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_COLUMNS)
    accumulator = tl.zeros((BLOCK_COLUMNS,), dtype=tl.float32)
    for start in range(0, num_columns, BLOCK_COLUMNS):
        columns = start + lanes
        values = tl.load(input_ptr + row * stride_row + columns, mask=columns < num_columns, other=0.0)
        accumulator += values.to(tl.float32)
    mean = tl.sum(accumulator, axis=0) / num_columns
    tl.store(output_ptr + row, mean.to(output_ptr.dtype.element_ty))


def row_mean(values: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """`values.mean(-1, keepdim=keepdim)`, each row reduced in one fixed order (in fp32)."""
    width = values.shape[-1]
    rows = values.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    output = torch.empty(rows.shape[0], dtype=values.dtype, device=values.device)
    if rows.shape[0]:
        _row_mean_kernel[(rows.shape[0],)](rows, output, width, rows.stride(0), BLOCK_COLUMNS=BLOCK_COLUMNS)
    shape = (*values.shape[:-1], 1) if keepdim else values.shape[:-1]
    return output.view(shape)
