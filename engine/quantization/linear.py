"""`QuantizedLinear`: a linear layer whose weight is held only in a quantized format and read packed."""

from __future__ import annotations

from typing import TypeGuard

import torch

from engine.quantization import kernel
from engine.quantization.formats import FP8_FORMATS, QuantizedWeight
from engine.quantization.fp8 import fp8_linear
from engine.quantization.int4_tiles import Int4Tiles, int4_tiles_linear

# Subclasses of `nn.Linear` whose forward computes exactly the layer's linear map, `input @ weight.T +
# bias`, so that the engine quantizes and packs them as it does plain layers. Named one by one, by
# qualified class name: a subclass's forward may compute anything besides (Llama 4's and Phimoe's routers
# take a top-k of theirs), so none is taken on trust.
LINEAR_MAP_SUBCLASSES = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


def is_linear_map(module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    """Whether `module` is a plain `nn.Linear` or one of `LINEAR_MAP_SUBCLASSES` (the class itself, not a
    further subclass of it, whose forward may differ)."""
    module_class = type(module)
    if module_class is torch.nn.Linear:
        return True
    return f"{module_class.__module__}.{module_class.__qualname__}" in LINEAR_MAP_SUBCLASSES


class QuantizedLinear(torch.nn.Module):
    """Stands in for an `nn.Linear` [out_features, in_features]: same call, same output up to float32
    summation order, on `weight.dequantize()` (int8 and int4, through the CPU kernel; fp8 also rounds each
    input row to fp8, engine.quantization.fp8).

    The packed tensors are buffers (`packed`, `scales`, and `mins` for int4), so they move with the model's
    state dict and a weight update can write them in place; `bias`, when present, stays a full-precision
    parameter. A full-precision update of the layer's weight is quantized on the way in
    (engine.quantization.model.quantize_update). `quantize_activations` chooses the kernel's integer path
    for calls of a few rows (engine.quantization.kernel); the engine sets it from its config.
    """

    quantize_activations = True

    packed: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    int4_tiles: torch.Tensor | None
    int4_scales_and_zeros: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight, bias: torch.nn.Parameter | None, name: str) -> None:
        super().__init__()
        weight.validate(name)
        self.weight_format = weight.weight_format
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        # An int4 layer on a GPU: tinygemm's layout of the weight (`lay_out_for`), derived from the three
        # above, which stay on the CPU; not in the state dict.
        self.register_buffer("int4_tiles", None, persistent=False)
        self.register_buffer("int4_scales_and_zeros", None, persistent=False)
        self.bias = bias

    def lay_out_for(self, device: torch.device) -> None:
        """Readies the layer for calls on `device`: on a GPU, an int4 layer gets tinygemm's layout there
        (engine.quantization.int4_tiles). int8 and int4 otherwise run on the CPU, fp8 where it lies."""
        if self.weight_format == "int4" and device.type != "cpu":
            layout = Int4Tiles.of(self.local_weight(), device)
            self.int4_tiles, self.int4_scales_and_zeros = layout.tiles, layout.scales_and_zeros

    def local_weight(self) -> QuantizedWeight:
        """The weight this process holds (its shard, under tensor parallelism)."""
        packed, scales, mins = self.local_parts()
        in_features = packed.shape[1] * 2 if self.weight_format == "int4" else packed.shape[1]
        return QuantizedWeight(self.weight_format, packed, scales, mins, in_features)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.weight_format, self.packed, self.scales, self.mins, self.in_features)

    def local_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`packed`, `scales` and `mins` as this process holds them (its shard, under tensor parallelism)."""
        return self.packed, self.scales, self.mins

    @property
    def packed_bytes(self) -> int:
        """The bytes of packed weight this process holds."""
        return sum(tensor.nbytes for tensor in self.local_parts() if tensor is not None)

    def own_part(self, value: torch.Tensor) -> torch.Tensor:
        """The part of `value`, a full-precision weight of the layer's shape, that this layer holds: all of
        it (a tensor-parallel shard holds a slice: engine.quantization.sharding)."""
        return value

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.multiply(hidden_states, self.packed, self.scales, self.mins, self.bias)

    def multiply(
        self,
        hidden_states: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        # The kernel on the buffers themselves: a layer runs once per step, so no QuantizedWeight is built.
        if self.weight_format in FP8_FORMATS:
            return fp8_linear(hidden_states, packed, scales, bias, self.weight_format == "fp8_tensor")
        if self.int4_tiles is not None and self.int4_scales_and_zeros is not None:
            return int4_tiles_linear(hidden_states, self.int4_tiles, self.int4_scales_and_zeros, bias)
        code = kernel.FORMAT_CODES[self.weight_format]
        return kernel.on_rows(hidden_states, code, packed, scales, mins, bias, self.quantize_activations)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.weight_format}, bias={self.bias is not None}"
        )
