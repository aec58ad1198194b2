"""Quantizing a model's linear layers where the engine prepares the model, and weight updates into them.

`quantize_model` replaces each plain `nn.Linear` (and each subclass whose forward is exactly its linear
map, engine.quantization.linear.LINEAR_MAP_SUBCLASSES: Falcon's) with a `QuantizedLinear` in the model
object itself; any other linear layer stays full precision, logged by name. The full-precision weight is
dropped (that is the memory quantization saves), so the model stays quantized
after the engine that asked for it stops. Layers that are already quantized (loaded from GGUF blocks by
engine.quantization.gguf_blocks) are kept as they are, and the engine's packing
(engine.runner.packed_linear) only takes the linear layers quantizing takes, so it packs whatever stays
full precision.

A tied output layer (lm_head sharing the input embedding's weight) is quantized too: the embedding keeps
its full-precision table, which a lookup reads one row of per token, while the output layer reads all of
it every step.

Under tensor parallelism each rank quantizes its own shard of a layer (engine.quantization.sharding).
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

from engine.config import QUANTIZATION_CHOICES
from engine.quantization import kernel
from engine.quantization.formats import FP8_FORMATS, QuantizationError, quantize, unfit_reason
from engine.quantization.fp8 import fp8_unavailable_reason
from engine.quantization.int4_tiles import Int4Tiles, int4_tiles_unavailable_reason
from engine.quantization.int4_tiles import unfit_reason as int4_tiles_unfit_reason
from engine.quantization.linear import QuantizedLinear, is_linear_map
from engine.quantization.sharding import ShardedQuantizedLinear, shard_style
from engine.system.native_library import KernelUnavailable

logger = logging.getLogger(__name__)


def quantized_layers(model: torch.nn.Module) -> dict[str, QuantizedLinear]:
    """The model's quantized layers by module name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}


# transformers' GPT-2-style projection: a linear map with its weight stored [in_features, out_features].
TRANSPOSED_LINEAR_CLASS = "transformers.pytorch_utils.Conv1D"


def _unquantizable_linears(model: torch.nn.Module) -> dict[str, str]:
    """The model's linear layers the engine does not quantize, by name, each with its class: subclasses of
    `nn.Linear` whose forward may compute more than the linear map, and transposed projections."""
    found = {}
    for name, module in model.named_modules():
        module_class = type(module)
        qualified = f"{module_class.__module__}.{module_class.__qualname__}"
        subclass = isinstance(module, torch.nn.Linear) and not is_linear_map(module)
        if subclass or qualified == TRANSPOSED_LINEAR_CLASS:
            found[name] = module_class.__name__
    return found


def _check_quantizable(model: torch.nn.Module, weight_format: str) -> None:
    placements = {parameter.device for parameter in model.parameters()}
    gpus = sorted(str(device) for device in placements if device.type != "cpu")
    if weight_format in FP8_FORMATS:
        for device in placements:
            reason = fp8_unavailable_reason(device, weight_format == "fp8_tensor")
            if reason is not None:
                hint = "'fp8_tensor' (no row-wise scales) or " if weight_format == "fp8" else ""
                raise ValueError(
                    f"quantization {weight_format!r} cannot run on {device} ({reason}); serve {hint}'none'"
                )
        if not gpus:
            logger.warning(
                "quantization %r on the CPU runs oneDNN's reference fp8 matmul, slower than float32: it is "
                "the GPU's format; on a CPU serve int8 or int4",
                weight_format,
            )
        return
    if weight_format == "int8" and gpus:
        raise ValueError(
            f"quantization 'int8' runs on the CPU only; the model is on {gpus} (on a GPU serve fp8 or int4)"
        )
    for device in placements - {torch.device("cpu")}:
        reason = int4_tiles_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"quantization 'int4' cannot run on {device} ({reason}); serve with 'none'")
    if gpus:
        return
    try:
        kernel.load()
    except KernelUnavailable as error:
        raise ValueError(
            f"quantization {weight_format!r} needs its C kernel, which cannot be built here ({error}); "
            "set CC to a C compiler or serve with quantization 'none'"
        ) from error


def _unfit_reason(model: torch.nn.Module, weight_format: str, module: torch.nn.Linear) -> str | None:
    """Why `module` stays full precision under `weight_format`, or None.

    fp8 keeps the output layer in full precision, as vLLM's fp8 does: on SmolLM2 (perplexity on
    bench/quantization.py's text) fp8 moved fp32's 12.742 to 13.134 without it and to 13.597 with it."""
    get_output = getattr(model, "get_output_embeddings", None)
    if weight_format in FP8_FORMATS and get_output is not None and get_output() is module:
        return "fp8 keeps the output layer in full precision"
    reason = unfit_reason(weight_format, module.out_features, module.in_features)
    if reason is None and weight_format == "int4" and module.weight.device.type != "cpu":
        reason = int4_tiles_unfit_reason(module.out_features, module.in_features)
    return reason


def replace_module(model: torch.nn.Module, name: str, replacement: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, replacement)


def quantize_model(model: torch.nn.Module, weight_format: str, quantize_activations: bool = True) -> int:
    """Quantizes the model's plain linear layers to `weight_format` in place; returns how many. Every
    quantized layer, those already loaded quantized included, then takes `quantize_activations` (the
    integer path at a few rows: engine.quantization.kernel).

    'none' quantizes nothing. Layers whose shape does not fit the format (`unfit_reason`) stay full
    precision (logged). Raises QuantizationError naming a layer that cannot be quantized, ValueError for
    int8 or int4 on a model off the CPU or without the kernel, or fp8 on a device without fp8 matmuls.
    """
    if weight_format not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {weight_format!r}")
    if weight_format == "none":
        # Layers a checkpoint loaded quantized (GPTQ, AWQ) still take the engine's activation path.
        for layer in quantized_layers(model).values():
            layer.quantize_activations = quantize_activations
        return 0
    _check_quantizable(model, weight_format)
    linears = [(name, module) for name, module in model.named_modules() if is_linear_map(module)]
    unquantizable = _unquantizable_linears(model)
    if unquantizable:
        logger.warning(
            "%d linear layers stay full precision under %s: the engine quantizes nn.Linear and the "
            "subclasses whose forward it knows to be the linear map only (%s)",
            len(unquantizable),
            weight_format,
            ", ".join(f"{name} ({class_name})" for name, class_name in unquantizable.items()),
        )
    unfit = {
        name: reason
        for name, module in linears
        if (reason := _unfit_reason(model, weight_format, module)) is not None
    }
    for reason in dict.fromkeys(unfit.values()):
        names = [name for name, kept in unfit.items() if kept == reason]
        logger.info("%d linear layers stay full precision: %s (%s)", len(names), reason, ", ".join(names[:4]))
    quantized_bytes = 0
    count = 0
    for name, module in linears:
        if name in unfit:
            continue
        replacement = _quantized_layer(model, name, module, weight_format)
        if replacement is None:
            continue
        replacement.lay_out_for(module.weight.device)
        replace_module(model, name, replacement)
        quantized_bytes += replacement.packed_bytes
        count += 1
    for layer in quantized_layers(model).values():
        layer.quantize_activations = quantize_activations
    # A model loaded from its own quantized blocks (a GGUF file) has no full-precision linear left: the
    # loader has said what it serves, and a line counting none would only read as a failure.
    if count:
        logger.info(
            "%d linear layers quantized to %s (%.1f MiB of packed weights)",
            count,
            weight_format,
            quantized_bytes / 2**20,
        )
    return count


def _quantized_layer(
    model: torch.nn.Module, name: str, module: torch.nn.Linear, weight_format: str
) -> QuantizedLinear | None:
    """`module` quantized: this rank's shard of it under tensor parallelism (None, logged, when it stays
    full precision there: engine.quantization.sharding)."""
    if not isinstance(module.weight, DTensor):
        weight = quantize(f"{name}.weight", module.weight, weight_format)
        return QuantizedLinear(weight, module.bias, f"{name}.weight")
    style = shard_style(model, name, module)
    if isinstance(style, str):
        logger.info("%s stays full precision under tensor parallelism: %s", name, style)
        return None
    return ShardedQuantizedLinear(module, style, weight_format, f"{name}.weight")


def _tied_output_name(model: torch.nn.Module, layers: dict[str, QuantizedLinear]) -> tuple[str, str] | None:
    """(input embedding's weight name, quantized output layer's name) when the model ties them."""
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    text_config = get_text_config() if get_text_config is not None else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return None
    get_output, get_input = (
        getattr(model, "get_output_embeddings", None),
        getattr(model, "get_input_embeddings", None),
    )
    if get_output is None or get_input is None:
        return None
    output, embedding = get_output(), get_input()
    output_name = next((name for name, layer in layers.items() if layer is output), None)
    embedding_weight = getattr(embedding, "weight", None)
    weight_name = next(
        (name for name, parameter in model.named_parameters() if parameter is embedding_weight), None
    )
    if output_name is None or weight_name is None:
        return None
    return weight_name, output_name


def tied_output_weight(model: torch.nn.Module) -> tuple[str, str] | None:
    """(`<output layer>.weight`, the input embedding's weight name) when the model ties a quantized output
    layer to its input embedding: an update of either name writes both."""
    tied = _tied_output_name(model, quantized_layers(model))
    return None if tied is None else (f"{tied[1]}.weight", tied[0])


def quantized_update_targets(model: torch.nn.Module) -> dict[str, QuantizedLinear]:
    """The full-precision tensor names a weight update may carry for quantized layers: `<layer>.weight`
    for each, and the input embedding's weight for a tied output layer (an update of the embedding
    updates both)."""
    layers = quantized_layers(model)
    targets = {f"{name}.weight": layer for name, layer in layers.items()}
    tied = _tied_output_name(model, layers)
    if tied is not None:
        targets[tied[0]] = layers[tied[1]]
    return targets


def quantize_update(
    name: str, layer: QuantizedLinear, value: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A full-precision update `value` of `layer`'s weight, quantized to the layer's format: (buffer, new
    value) pairs to copy in place. Raises QuantizationError naming `name` for a wrong shape or dtype."""
    expected = [layer.out_features, layer.in_features]
    if list(value.shape) != expected:
        raise QuantizationError(
            name,
            layer.weight_format,
            f"shape {list(value.shape)} does not match the quantized layer's {expected}",
        )
    # On the layer's device: fp8 layers live on the GPU, and quantizing there is the fast way.
    weight = quantize(name, layer.own_part(value).to(layer.packed.device), layer.weight_format)
    pairs = [(layer.packed, weight.packed), (layer.scales, weight.scales)]
    if layer.mins is not None and weight.mins is not None:
        pairs.append((layer.mins, weight.mins))
    if layer.int4_tiles is not None and layer.int4_scales_and_zeros is not None:
        # Copied into the layout's own storage, which captured CUDA graphs read.
        layout = Int4Tiles.of(weight, layer.int4_tiles.device)
        pairs += [(layer.int4_tiles, layout.tiles), (layer.int4_scales_and_zeros, layout.scales_and_zeros)]
    return pairs
