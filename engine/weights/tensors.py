"""In-place weight updates: resolve a state dict or safetensors source, validate all of it, then copy.

`stage_weights` checks every tensor (known name, equal shape, castable dtype) and returns the new values
already cast to each parameter's dtype and device, so that `apply_weights` cannot fail halfway: a bad
update raises ValueError naming the tensor and changes nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from engine.quantization.linear import QuantizedLinear
from engine.quantization.model import quantize_update, quantized_update_targets, tied_output_weight

# safetensors' dtype names (also used on the wire by Admin.UpdateWeights).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

WeightsSource = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike[str]


@dataclass
class StagedTensor:
    name: str
    target: torch.Tensor
    value: torch.Tensor


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return SAFETENSORS_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(SAFETENSORS_DTYPES)}") from None


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied aliases included (e.g. lm_head.weight)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_buffers(remove_duplicate=False))
    tensors.update(model.named_parameters(remove_duplicate=False))
    for name, value in model.state_dict(keep_vars=True).items():
        tensors.setdefault(name, value)
    return tensors


def _castable(source: torch.dtype, target: torch.dtype) -> bool:
    if target.is_floating_point:
        return source.is_floating_point
    if target == torch.bool:
        return source == torch.bool
    if target.is_complex:
        return source.is_complex or source.is_floating_point
    # Integer targets take integer or bool sources only.
    return not source.is_floating_point and not source.is_complex


def check_tensor(
    targets: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The model tensor `name` updates; ValueError naming it when the update does not fit."""
    target = targets.get(name)
    if target is None:
        raise ValueError(f"tensor {name!r}: no parameter or buffer of that name in the model")
    if tuple(shape) != tuple(target.shape):
        raise ValueError(
            f"tensor {name!r}: shape {list(shape)} does not match the parameter's {list(target.shape)}"
        )
    if not _castable(dtype, target.dtype):
        raise ValueError(
            f"tensor {name!r}: dtype {dtype} cannot be converted to the parameter's {target.dtype}"
        )
    return target


@dataclass(frozen=True)
class UpdateTargets:
    """Every tensor a weight update may name, and where its new values go.

    A quantized layer (engine.quantization) no longer holds its full-precision weight, but an update
    names it all the same: `tensors` holds a stand-in for it (its whole shape and dtype, no storage), and
    a value for it is quantized into the layer's packed tensors by `staged`. An input embedding tied to a
    quantized output layer gets a stand-in too, so that its value reaches `staged` whole (under tensor
    parallelism, a sharded tensor's value would otherwise be cut to this rank's shard first), and
    `staged` writes a value of either name (checkpoints of tied models keep one, either) into both."""

    tensors: Mapping[str, torch.Tensor]
    quantized: Mapping[str, QuantizedLinear]
    model_tensors: Mapping[str, torch.Tensor]
    tied: Mapping[str, str]

    @classmethod
    def of(cls, model: torch.nn.Module) -> UpdateTargets:
        quantized = quantized_update_targets(model)
        tensors = model_tensors(model)
        standins = {
            name: torch.empty((), dtype=tensors[name].dtype if name in tensors else torch.float32).expand(
                layer.out_features, layer.in_features
            )
            for name, layer in quantized.items()
        }
        tied = tied_output_weight(model)
        return cls(tensors | standins, quantized, tensors, dict([tied]) if tied is not None else {})

    def staged(self, name: str, value: torch.Tensor) -> list[StagedTensor]:
        """The copies that write `value` (whole, already checked against `tensors[name]`): into a
        quantized layer its packed form, and into a tensor of the model (an embedding tied to a quantized
        output layer is both) the value cast for it. Raises QuantizationError naming the tensor."""
        staged: list[StagedTensor] = []
        layer = self.quantized.get(name)
        if layer is not None:
            pairs = quantize_update(name, layer, value)
            staged.extend(StagedTensor(name, buffer, packed) for buffer, packed in pairs)
        target = self.model_tensors.get(self.tied.get(name, name))
        if target is not None:
            staged.append(StagedTensor(name, target, cast_for_target(value, target)))
        return staged


def stage_weights(model: torch.nn.Module, source: Any) -> list[StagedTensor]:
    """Validates every tensor of `source` and returns them cast for the model; raises ValueError.

    A full-precision weight of a quantized layer is quantized here (`UpdateTargets`), so that applying
    it cannot fail either."""
    targets = UpdateTargets.of(model)
    staged = _stage_into(targets.tensors, source)
    return [
        copy
        for item in staged
        for copy in (targets.staged(item.name, item.value) if item.name in targets.quantized else [item])
    ]


def _stage_into(targets: Mapping[str, torch.Tensor], source: Any) -> list[StagedTensor]:
    if isinstance(source, (str, os.PathLike)):
        return _stage_safetensors(targets, os.fspath(source))
    items = source.items() if isinstance(source, Mapping) else source
    staged: list[StagedTensor] = []
    seen: set[str] = set()
    for name, value in items:
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be str, got {type(name).__name__}")
        if name in seen:
            raise ValueError(f"tensor {name!r}: given twice")
        seen.add(name)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"tensor {name!r}: expected a torch.Tensor, got {type(value).__name__}")
        target = check_tensor(targets, name, tuple(value.shape), value.dtype)
        staged.append(StagedTensor(name, target, cast_for_target(value, target)))
    if not staged:
        raise ValueError("the update has no tensors")
    return staged


def cast_for_target(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`value` as `target` stores it; for a tensor-parallel parameter, this rank's shard of it."""
    value = value.detach().to(device=target.device, dtype=target.dtype, copy=True)
    if isinstance(target, DTensor):
        # Every rank holds the full tensor, so each cuts its own shard without any communication.
        value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
    return value


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of `path`: the file itself, a folder's *.safetensors, or an index's shards."""
    if os.path.isdir(path):
        files = sorted(
            os.path.join(path, entry) for entry in os.listdir(path) if entry.endswith(".safetensors")
        )
        if not files:
            raise ValueError(f"{path!r}: no *.safetensors file in this folder")
        return files
    if not os.path.isfile(path):
        raise ValueError(f"{path!r}: no such safetensors file or folder")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map", {})
        folder = os.path.dirname(path)
        return sorted({os.path.join(folder, shard) for shard in weight_map.values()})
    return [path]


def _stage_safetensors(targets: Mapping[str, torch.Tensor], path: str) -> list[StagedTensor]:
    from safetensors import safe_open

    # First every header (names, shapes, dtypes), lazily, then the data: nothing is read for a bad update.
    plan: list[tuple[str, str, torch.Tensor]] = []
    seen: set[str] = set()
    for file in safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if name in seen:
                        raise ValueError(f"tensor {name!r}: present in more than one file")
                    seen.add(name)
                    view = handle.get_slice(name)
                    dtype = dtype_from_name(view.get_dtype())
                    target = check_tensor(targets, name, tuple(view.get_shape()), dtype)
                    plan.append((file, name, target))
        except ValueError:
            raise
        except Exception as exc:  # a truncated or malformed file
            raise ValueError(f"{file!r}: cannot read safetensors: {exc}") from exc
    if not plan:
        raise ValueError(f"{path!r}: the update has no tensors")
    staged: list[StagedTensor] = []
    for file in dict.fromkeys(file for file, _, _ in plan):
        with safe_open(file, framework="pt") as handle:
            for _, name, target in (entry for entry in plan if entry[0] == file):
                try:
                    value = handle.get_tensor(name)
                except Exception as exc:
                    raise ValueError(f"tensor {name!r}: cannot read it from {file!r}: {exc}") from exc
                staged.append(StagedTensor(name, target, cast_for_target(value, target)))
    return staged


def apply_weights(staged: list[StagedTensor]) -> None:
    """Copies validated tensors in place (tied parameters see the new value through their alias).

    The copy goes to the tensor itself, not its `.data`, so that its version counter moves: layers that
    keep a derived copy of a weight (engine.runner.packed_linear) see the write and redo it.
    """
    with torch.no_grad():
        for item in staged:
            target = item.target.to_local() if isinstance(item.target, DTensor) else item.target
            target.copy_(item.value)
