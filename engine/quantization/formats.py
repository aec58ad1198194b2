"""The quantized weight formats and their exact meaning.

Both keep the weight [out_features, in_features] by output channel, in groups of `GROUP_SIZE` consecutive
weights of one channel, each group with its own float32 scale:

- int8: w = scale * q, q in -127..127 (int8, one a byte). GGUF's Q8_0 is exactly this.
- int4: w = scale * q + min, q in 0..15, two a byte: byte j of a group holds weight j in its low nibble and
  weight j + 16 in its high one, GGUF's own order. GGUF's Q4_1 (d * q + m) is exactly this with scale d and
  min m, Q4_0 (d * (q - 8)) with scale d and min -8 d.

Groups of 32 are GGUF's block size, so GGUF blocks load without repacking; a per-group scale also bounds
the rounding error by the group's own range rather than the whole channel's. The float32 scales cost 1 bit
a weight for int8 and 2 for int4 (GGUF's float16 ones cost half) and hold every GGUF scale exactly.

- fp8: w = scale * q, q float8 e4m3 (one a byte), one float32 scale per output channel (max |w| / 448), the
  H100/H200 path (engine.quantization.fp8). Its scales are [out, 1]: one group the whole channel. A layer
  sharded rowwise over N tensor-parallel ranks has a scale per channel per slice, so its scales gathered
  whole are [out, N], groups of in / N.
- fp8_tensor: the same with one scale for the whole weight (max |w| / 448), held as fp8's [out, 1] with every
  value equal: the scheme of fp8 checkpoints with per-tensor scales, and the one GPUs of compute capability
  8.9 (no row-wise scales in their fp8 matmul) run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32
WEIGHT_FORMATS = ("int8", "int4", "fp8", "fp8_tensor")
FP8_FORMATS = ("fp8", "fp8_tensor")
_INT4_LEVELS = 15
_INT8_LEVEL = 127
# The largest float8 e4m3 value; and the multiple of 16 that fp8 matrix multiplies (cuBLASLt) want of a
# layer's in and out features.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
FP8_ALIGNMENT = 16


def unfit_reason(weight_format: str, out_features: int, in_features: int) -> str | None:
    """Why a linear layer of this shape cannot take `weight_format` (it stays full precision), or None."""
    if weight_format in FP8_FORMATS:
        if in_features % FP8_ALIGNMENT or out_features % FP8_ALIGNMENT:
            return f"in_features and out_features must be multiples of {FP8_ALIGNMENT}"
        return None
    if in_features % GROUP_SIZE:
        return f"in_features not a multiple of {GROUP_SIZE}"
    return None


class QuantizationError(ValueError):
    """A tensor cannot be quantized or loaded in a format; the message names both."""

    def __init__(self, tensor: str, weight_format: str, reason: str) -> None:
        super().__init__(f"tensor {tensor!r} ({weight_format}): {reason}")
        self.tensor = tensor
        self.weight_format = weight_format


@dataclass
class QuantizedWeight:
    """A weight in one of `WEIGHT_FORMATS`.

    Invariants (checked by `validate`): `packed` is int8 [out, in] (int8), uint8 [out, in / 2] (int4) or
    float8_e4m3fn [out, in] (fp8 and fp8_tensor); `scales` (and `mins`, int4 only) are float32
    [out, in / GROUP_SIZE], or [out, groups] with groups dividing in for the fp8 formats; all contiguous on
    one device, the CPU but for the fp8 formats.
    """

    weight_format: str
    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    in_features: int

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in (self.packed, self.scales, self.mins) if tensor is not None)

    def validate(self, name: str) -> None:
        """Raises QuantizationError naming `name` when the tensors break the format's invariants."""
        rows, columns = self.out_features, self.in_features
        fp8, int4 = self.weight_format in FP8_FORMATS, self.weight_format == "int4"
        groups = self.scales.shape[-1] if fp8 else columns // GROUP_SIZE
        if not fp8 and columns % GROUP_SIZE:
            raise QuantizationError(
                name, self.weight_format, f"in_features {columns} is not a multiple of {GROUP_SIZE}"
            )
        if fp8 and (groups < 1 or columns % groups):
            raise QuantizationError(
                name, self.weight_format, f"in_features {columns} does not split into {groups} scale groups"
            )
        packed_dtype = torch.float8_e4m3fn if fp8 else torch.uint8 if int4 else torch.int8
        expected = {
            "packed": ((rows, columns // 2 if int4 else columns), packed_dtype),
            "scales": ((rows, groups), torch.float32),
        }
        if int4:
            expected["mins"] = ((rows, groups), torch.float32)
        elif self.mins is not None:
            raise QuantizationError(name, self.weight_format, f"{self.weight_format} weights have no mins")
        device = self.packed.device
        for part, (shape, dtype) in expected.items():
            tensor = getattr(self, part)
            if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                found = None if tensor is None else (list(tensor.shape), tensor.dtype)
                raise QuantizationError(
                    name, self.weight_format, f"{part} must be {dtype} {list(shape)}, got {found}"
                )
            if not tensor.is_contiguous() or tensor.device != device or (device.type != "cpu" and not fp8):
                where = "the packed weight's device" if fp8 else "the CPU"
                raise QuantizationError(name, self.weight_format, f"{part} must be contiguous on {where}")

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] this stands for, exactly (each value one rounding of scale * q + min,
        as the kernel computes it)."""
        rows, groups = self.out_features, self.in_features // GROUP_SIZE
        if self.weight_format in FP8_FORMATS:
            groups = self.scales.shape[-1]
            values = self.packed.view(rows, groups, self.in_features // groups).float()
            return (values * self.scales[..., None]).view(rows, self.in_features)
        if self.weight_format == "int8":
            values = self.packed.view(rows, groups, GROUP_SIZE).float()
            return (values * self.scales[..., None]).view(rows, self.in_features)
        assert self.mins is not None  # validate() keeps it
        packed = self.packed.view(rows, groups, GROUP_SIZE // 2)
        values = torch.cat([packed & 15, packed >> 4], dim=-1).float()
        # scale * q is exact (a float16-or-coarser scale times q < 16), so this rounds once, like an FMA.
        return torch.addcmul(self.mins[..., None], values, self.scales[..., None]).view(
            rows, self.in_features
        )


def quantize(name: str, weight: torch.Tensor, weight_format: str) -> QuantizedWeight:
    """`weight` [out, in] (any float dtype) in `weight_format`, rounding each value to the nearest level of
    its group: int8 symmetric (scale = max |w| / 127), int4 over the group's range (scale = (max - min) / 15,
    min = the group's minimum). Error per weight: at most scale / 2."""
    if weight_format not in WEIGHT_FORMATS:
        raise QuantizationError(name, weight_format, f"unknown format; expected one of {WEIGHT_FORMATS}")
    if weight.dim() != 2:
        raise QuantizationError(name, weight_format, f"expected a 2-D weight, got shape {list(weight.shape)}")
    if not weight.dtype.is_floating_point:
        raise QuantizationError(name, weight_format, f"expected a floating-point weight, got {weight.dtype}")
    rows, columns = weight.shape
    if weight_format in FP8_FORMATS:
        return _quantize_fp8(name, weight, weight_format)
    if columns % GROUP_SIZE:
        raise QuantizationError(
            name, weight_format, f"in_features {columns} is not a multiple of the group size {GROUP_SIZE}"
        )
    groups = weight.detach().to(device="cpu", dtype=torch.float32).reshape(rows, columns // GROUP_SIZE, -1)
    if not torch.isfinite(groups).all():
        raise QuantizationError(name, weight_format, "the weight has non-finite values")
    if weight_format == "int8":
        scales = groups.abs().amax(dim=-1) / _INT8_LEVEL
        levels = torch.round(groups / torch.where(scales > 0, scales, 1.0)[..., None])
        packed = levels.clamp(-_INT8_LEVEL, _INT8_LEVEL).to(torch.int8).reshape(rows, columns)
        quantized = QuantizedWeight(weight_format, packed.contiguous(), scales.contiguous(), None, columns)
    else:
        mins = groups.amin(dim=-1)
        scales = (groups.amax(dim=-1) - mins) / _INT4_LEVELS
        levels = torch.round((groups - mins[..., None]) / torch.where(scales > 0, scales, 1.0)[..., None])
        levels = levels.clamp(0, _INT4_LEVELS).to(torch.uint8)
        half = GROUP_SIZE // 2
        packed = (levels[..., :half] | (levels[..., half:] << 4)).reshape(rows, columns // 2)
        quantized = QuantizedWeight(weight_format, packed.contiguous(), scales.contiguous(), mins, columns)
    return quantized


def _quantize_fp8(name: str, weight: torch.Tensor, weight_format: str) -> QuantizedWeight:
    """`weight_format` fp8 (a scale per output channel) or fp8_tensor (one scale), the scale max |w| / 448
    so that the largest weight is e4m3's largest value, on the weight's own device; float8 conversion
    rounds to nearest even. Error per weight: at most 2^-4 of its magnitude (3 mantissa bits), or half of
    e4m3's subnormal step times the scale for the smallest."""
    values = weight.detach().to(torch.float32)
    if not torch.isfinite(values).all():
        raise QuantizationError(name, weight_format, "the weight has non-finite values")
    largest = values.abs().amax(dim=-1, keepdim=True)
    if weight_format == "fp8_tensor":
        largest = largest.amax().expand_as(largest)
    scales = largest / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    packed = (values / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(weight_format, packed.contiguous(), scales.contiguous(), None, weight.shape[1])
