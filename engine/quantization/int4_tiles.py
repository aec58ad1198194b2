"""int4 layers on a CUDA GPU: tinygemm's kernel (`torch._weight_int4pack_mm`), which reads the 4-bit
weights from a tensor-core tile layout and multiplies bfloat16 inputs by them.

The layer keeps its int4 weight in the engine's format (engine.quantization.formats: q in 0..15 two a
byte in GGUF's order, a float32 scale and min per 32), which is what its state dict, checksum and weight
updates see, and beside it the two tensors the kernel reads (`Int4Tiles`):
- the tiles, from `aten._convert_weight_to_int4pack`, which takes each channel's q two a byte with the
  even weight in the high nibble (`[out, in / 2]` uint8);
- the groups' scales and zeros in bfloat16, `[in / 32, out, 2]`, for the kernel's w = (q - 8) * scale + zero:
  zero = min + 8 * scale. bfloat16 rounds the scale and zero (8 significant bits against float32's 24),
  so a GPU layer's weights are within that rounding of the CPU's.

The same two ops exist for the CPU (`_for_cpu`: the tiles from q as int32 `[out, in]`, bfloat16 inputs and
scales), with the same meaning of the scales and zeros; the CPU tests run the layout through those. On the
CPU the engine's own kernel (engine.quantization.kernel) serves int4: several times faster than these.

The kernel wants out_features a multiple of 8 and in_features of 32 (its k-tiles of 16, two or more to a
32-bit word); layers that are not stay full precision.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.quantization.formats import GROUP_SIZE, QuantizedWeight

TILE_OUT_FEATURES = 8
_ZERO_LEVEL = 8


def unfit_reason(out_features: int, in_features: int) -> str | None:
    """Why tinygemm cannot hold a layer of this shape, or None."""
    if out_features % TILE_OUT_FEATURES or in_features % GROUP_SIZE:
        return f"out_features must be a multiple of {TILE_OUT_FEATURES} and in_features of {GROUP_SIZE}"
    return None


def _inner_k_tiles(in_features: int) -> int:
    """The most k-tiles of 16 (8, 4 or 2) the kernel packs side by side that divide `in_features`: the
    widest load its threads can make."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0)


@dataclass
class Int4Tiles:
    """An int4 weight in tinygemm's layout: `tiles` (int32) and `scales_and_zeros` (bfloat16)."""

    tiles: torch.Tensor
    scales_and_zeros: torch.Tensor

    @classmethod
    def of(cls, weight: QuantizedWeight, device: torch.device) -> Int4Tiles:
        """`weight` (int4, on the CPU) in the layout the kernel on `device` reads."""
        assert weight.mins is not None  # int4 weights have mins (QuantizedWeight.validate)
        rows, columns = weight.out_features, weight.in_features
        groups = columns // GROUP_SIZE
        packed = weight.packed.view(rows, groups, GROUP_SIZE // 2)
        # Byte j of a group holds weight j (low nibble) and weight j + 16 (high nibble).
        levels = torch.cat([packed & 15, packed >> 4], dim=-1).view(rows, columns).to(device)
        inner_k_tiles = _inner_k_tiles(columns)
        if device.type == "cuda":
            pairs = (levels[:, 0::2] << 4) | levels[:, 1::2]
            tiles = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)
        else:
            tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), inner_k_tiles)
        zeros = torch.addcmul(weight.mins, weight.scales, torch.full_like(weight.scales, _ZERO_LEVEL))
        scales_and_zeros = torch.stack([weight.scales, zeros], dim=-1).transpose(0, 1)
        return cls(tiles, scales_and_zeros.to(device=device, dtype=torch.bfloat16).contiguous())


def int4_tiles_linear(
    inputs: torch.Tensor, tiles: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`inputs` [..., in] (rounded to bfloat16) times the weight in `tiles`, in the inputs' dtype."""
    leading = inputs.shape[:-1]
    out_features = scales_and_zeros.shape[1]
    rows = inputs.reshape(-1, inputs.shape[-1]).to(torch.bfloat16).contiguous()
    if rows.shape[0] == 0:
        return inputs.new_empty(*leading, out_features)
    if rows.device.type == "cuda":
        output = torch.ops.aten._weight_int4pack_mm(rows, tiles, GROUP_SIZE, scales_and_zeros)
    else:
        output = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, tiles, GROUP_SIZE, scales_and_zeros)
    output = output.to(inputs.dtype)
    if bias is not None:
        output = output + bias
    return output.view(*leading, out_features)


@functools.cache
def int4_tiles_unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` (None when it can): one tiny layer there (tinygemm needs
    compute capability 8.0 or later)."""
    try:
        levels = torch.zeros(TILE_OUT_FEATURES, GROUP_SIZE // 2, dtype=torch.uint8)
        scales = torch.ones(TILE_OUT_FEATURES, 1)
        weight = QuantizedWeight("int4", levels, scales, torch.zeros_like(scales), GROUP_SIZE)
        layout = Int4Tiles.of(weight, device)
        int4_tiles_linear(
            torch.ones(1, GROUP_SIZE, device=device), layout.tiles, layout.scales_and_zeros, None
        )
    except (RuntimeError, NotImplementedError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return None
