"""Quantized layers of a tensor-parallel model: each rank packs its own shard and does the layer's
communication itself.

transformers shards a model's linear layers by its plan (`model.tp_plan`: DTensor weights) and wraps each
layer's forward with its style's communication. A `QuantizedLinear` put in a layer's place drops that
wrapper, so `ShardedQuantizedLinear` does the three styles a decoder's linear layers use itself, the way
transformers' own inference path does for a plain `nn.Linear`:

- colwise: the weight's output channels are split (Shard(0)). The input is the whole hidden state and the
  output stays this rank's slice of channels, which is what the next layer (the attention's heads, or a
  rowwise layer) takes.
- rowwise: the input channels are split (Shard(1)). Each rank's product is a partial sum over its slice,
  all-reduced over the group; the bias (replicated) is added once, after.
- colwise_gather_output / colwise_rep: colwise, then the slices are gathered into the whole output (the
  output layer, whose logits every rank samples from).

Every rank decides which layers to quantize from the unsharded shapes alone, so they all decide alike: a
layer under any other style, or one that does not split into whole groups of `GROUP_SIZE` input channels
(and equal slices) over the ranks, stays full precision with transformers' forward.

The packed tensors are DTensors with the weight's placement, so the state dict, the weights checksum and
weight updates see the whole layer. Gathered, they are exactly the unsharded weight quantized: a group
lies within one channel and never straddles two slices of input channels.
"""

from __future__ import annotations

import re
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from engine.parallel import whole_tensor
from engine.quantization.formats import GROUP_SIZE, QuantizedWeight, quantize
from engine.quantization.linear import QuantizedLinear


class ShardStyle(Enum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    GATHERED = "gathered"


_STYLES = {
    "colwise": ShardStyle.COLWISE,
    "rowwise": ShardStyle.ROWWISE,
    "colwise_gather_output": ShardStyle.GATHERED,
    "colwise_rep": ShardStyle.GATHERED,
}


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _whole(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else whole_tensor(tensor)


class ShardedQuantizedLinear(QuantizedLinear):
    """This rank's shard of a quantized linear layer under tensor parallelism (see the module docstring).

    `in_features` and `out_features` are the whole layer's, as on transformers' sharded `nn.Linear`: a
    weight update carries the whole weight, and `own_part` cuts this rank's shard of it.
    """

    def __init__(
        self,
        layer: torch.nn.Linear,
        style: ShardStyle,
        weight_format: str,
        name: str,
    ) -> None:
        weight = layer.weight
        assert isinstance(weight, DTensor)  # `shard_style` only picks DTensor layers
        local = quantize(name, weight.to_local(), weight_format)
        bias = layer.bias
        super().__init__(local, bias, name)
        self.style = style
        self.device_mesh = weight.device_mesh
        self.placement = Shard(0) if style is not ShardStyle.ROWWISE else Shard(1)
        self.group = self.device_mesh.get_group()
        self.out_features, self.in_features = weight.shape
        for part in ("packed", "scales", "mins"):
            tensor = getattr(self, part)
            if tensor is not None:
                # Even slices (`shard_style` checks), so each global shape is the local one times the ranks.
                sharded = DTensor.from_local(tensor, self.device_mesh, [self.placement], run_check=False)
                self.register_buffer(part, sharded)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        """The whole layer's weight, gathered: a collective, which every rank calls at once."""
        packed, scales, mins = (_whole(tensor) for tensor in (self.packed, self.scales, self.mins))
        assert packed is not None and scales is not None
        return QuantizedWeight(self.weight_format, packed, scales, mins, self.in_features)

    def local_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        packed, scales, mins = (_local(tensor) for tensor in (self.packed, self.scales, self.mins))
        assert packed is not None and scales is not None
        return packed, scales, mins

    def own_part(self, value: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `value`, the whole layer's weight: every rank holds all of it, so each
        cuts its own without communication."""
        return distribute_tensor(value, self.device_mesh, [self.placement], src_data_rank=None).to_local()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        bias = _local(self.bias)
        output = self.multiply(
            hidden_states, *self.local_parts(), None if self.style is ShardStyle.ROWWISE else bias
        )
        if self.style is ShardStyle.ROWWISE:
            dist.all_reduce(output, group=self.group)
            return output if bias is None else output + bias
        if self.style is ShardStyle.GATHERED:
            slices = [torch.empty_like(output) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(slices, output.contiguous(), group=self.group)
            return torch.cat(slices, dim=-1)
        return output

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, style={self.style.value}"


def _plan_style(model: torch.nn.Module, name: str) -> str | None:
    """The style transformers' plan gives the layer `name` (layer numbers are `*` in the plan)."""
    plan = getattr(model, "tp_plan", None) or {}
    return plan.get(name) or plan.get(re.sub(r"\.\d+\.", ".*.", name))


def shard_style(model: torch.nn.Module, name: str, layer: torch.nn.Linear) -> ShardStyle | str:
    """The style `layer` is quantized under, or why it stays full precision. Decided on the unsharded
    shapes, so that every rank decides alike."""
    weight = layer.weight
    if not isinstance(weight, DTensor):
        return "its weight is not sharded"
    style_name = _plan_style(model, name)
    style = _STYLES.get(style_name or "")
    if style is None:
        return f"style {style_name!r} is not one a quantized layer runs under"
    ranks = weight.device_mesh.size()
    expected = Shard(1) if style is ShardStyle.ROWWISE else Shard(0)
    if tuple(weight.placements) != (expected,):
        return f"its weight is placed {list(weight.placements)}, where {style.value} places it {[expected]}"
    if layer.bias is not None:
        bias_placement = Replicate() if style is ShardStyle.ROWWISE else Shard(0)
        if not isinstance(layer.bias, DTensor) or tuple(layer.bias.placements) != (bias_placement,):
            return f"its bias is not placed {[bias_placement]}"
    out_features, in_features = weight.shape
    if style is ShardStyle.ROWWISE and in_features % (GROUP_SIZE * ranks):
        return f"in_features {in_features} does not split into groups of {GROUP_SIZE} over {ranks} ranks"
    if style is not ShardStyle.ROWWISE and (in_features % GROUP_SIZE or out_features % ranks):
        return (
            f"out_features {out_features} does not split evenly over {ranks} ranks, or in_features "
            f"{in_features} is not a multiple of {GROUP_SIZE}"
        )
    return style
