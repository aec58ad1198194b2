"""GGUF's Q8_0, Q4_0 and Q4_1 blocks as `QuantizedWeight`s, exactly and without a round trip through float32.

A GGUF block holds 32 weights of one row: Q8_0 = float16 d + 32 int8 q (w = d q); Q4_0 = float16 d + 16
bytes of nibbles (w = d (q - 8)); Q4_1 = float16 d, float16 m + 16 bytes (w = d q + m). The nibbles are in
the order `formats` keeps, so the bytes are copied as they are and only d and m widen to float32 (exact).
The K-quants (Q4_K, Q6_K, ...) have 256-weight super-blocks with 6-bit sub-block scales, which these
formats cannot hold exactly: loading one fails naming the tensor and its type.

`load_gguf_linears` maps the model's linear layers to the file's tensors with gguf's own name map, and
undoes the row permutation llama.cpp's converter applies to llama's q and k projections (as transformers'
GGUF loader does), which moves whole rows, so it stays exact.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from engine.quantization.formats import GROUP_SIZE, QuantizationError, QuantizedWeight
from engine.quantization.linear import QuantizedLinear
from engine.quantization.model import quantized_layers, replace_module

logger = logging.getLogger(__name__)

# GGUF type name -> (our format, bytes a block, whether the block has a min).
BLOCK_LAYOUTS: dict[str, tuple[str, int, bool]] = {
    "Q8_0": ("int8", 2 + GROUP_SIZE, False),
    "Q4_0": ("int4", 2 + GROUP_SIZE // 2, False),
    "Q4_1": ("int4", 4 + GROUP_SIZE // 2, True),
}
# Architectures whose converter permutes the rows of attn_q and attn_k (transformers' LlamaTensorProcessor).
_PERMUTED_ARCHITECTURES = ("llama",)


def _float16_column(blocks: np.ndarray, offset: int) -> torch.Tensor:
    values = np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(values.astype(np.float32))


def weight_from_blocks(
    name: str, type_name: str, data: np.ndarray, shape: tuple[int, int]
) -> QuantizedWeight:
    """The weight [rows, columns] stored as GGUF blocks of `type_name` in `data` (uint8, the file's bytes
    for the tensor). Raises QuantizationError naming the tensor and type for anything else."""
    layout = BLOCK_LAYOUTS.get(type_name)
    if layout is None:
        raise QuantizationError(
            name,
            f"GGUF {type_name}",
            f"unsupported block type; supported: {', '.join(BLOCK_LAYOUTS)}, "
            "or a float type (quantized at load)",
        )
    weight_format, block_bytes, has_min = layout
    rows, columns = shape
    if columns % GROUP_SIZE:
        raise QuantizationError(name, f"GGUF {type_name}", f"row length {columns} is not a multiple of 32")
    blocks_per_row = columns // GROUP_SIZE
    if data.dtype != np.uint8 or data.size != rows * blocks_per_row * block_bytes:
        raise QuantizationError(
            name,
            f"GGUF {type_name}",
            f"{data.size} bytes of {data.dtype} for shape {[rows, columns]}, expected "
            f"{rows * blocks_per_row * block_bytes} bytes",
        )
    blocks = data.reshape(rows, blocks_per_row, block_bytes)
    scales = _float16_column(blocks, 0)
    header = 4 if has_min else 2
    values = torch.from_numpy(np.ascontiguousarray(blocks[..., header:]).reshape(rows, -1))
    if weight_format == "int8":
        return QuantizedWeight("int8", values.view(torch.int8), scales, None, columns)
    # Q4_0's w = d (q - 8) is d q + (-8 d): exact in float32.
    mins = _float16_column(blocks, 2) if has_min else -8.0 * scales
    weight = QuantizedWeight("int4", values, scales, mins.contiguous(), columns)
    if not (torch.isfinite(scales).all() and torch.isfinite(mins).all()):
        raise QuantizationError(name, f"GGUF {type_name}", "non-finite block scales")
    return weight


def _rows_permutation(rows: int, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's q/k row permutation, as row indices (transformers'
    `_reverse_permute_weights` applied to the row numbers)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def _permute_rows(weight: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    mins = None if weight.mins is None else weight.mins[order].contiguous()
    return QuantizedWeight(
        weight.weight_format,
        weight.packed[order].contiguous(),
        weight.scales[order].contiguous(),
        mins,
        weight.in_features,
    )


def _field(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def load_gguf_linears(model: torch.nn.Module, path: str | os.PathLike[str]) -> int:
    """Replaces the model's linear layers whose GGUF tensors are Q8_0, Q4_0 or Q4_1 blocks with
    `QuantizedLinear`s holding those blocks; returns how many. Layers stored as floats are left to
    quantizing at load. Raises QuantizationError naming a tensor whose blocks are unsupported or bad."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(path))
    architecture = _field(reader, "general.architecture")
    arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise QuantizationError(os.fspath(path), "GGUF", f"unknown architecture {architecture!r}")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = model.config.get_text_config()  # type: ignore[operator, union-attr]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    float_types = {"F32", "F16", "BF16"}
    loaded = 0
    already = quantized_layers(model)
    for module_name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module_name in already:
            continue
        gguf_name = name_map.get_name(module_name)
        if gguf_name is None:
            continue
        tensor = tensors.get(f"{gguf_name}.weight")
        if tensor is None and gguf_name == "output" and getattr(config, "tie_word_embeddings", False):
            tensor = tensors.get("token_embd.weight")
        if tensor is None or tensor.tensor_type.name in float_types:
            continue
        columns, rows = (int(size) for size in tensor.shape)  # GGUF lists the fastest dimension first
        if [rows, columns] != [module.out_features, module.in_features]:
            raise QuantizationError(
                tensor.name,
                f"GGUF {tensor.tensor_type.name}",
                f"shape {[rows, columns]} does not match {module_name}'s "
                f"{[module.out_features, module.in_features]}",
            )
        weight = weight_from_blocks(
            tensor.name, tensor.tensor_type.name, np.asarray(tensor.data), (rows, columns)
        )
        if architecture in _PERMUTED_ARCHITECTURES and gguf_name.endswith((".attn_q", ".attn_k")):
            heads = (
                config.num_attention_heads if gguf_name.endswith(".attn_q") else config.num_key_value_heads
            )
            weight = _permute_rows(weight, _rows_permutation(rows, heads))
        replace_module(model, module_name, QuantizedLinear(weight, module.bias, tensor.name))
        loaded += 1
    logger.info("%d linear layers serve the GGUF file's own blocks (%s)", loaded, os.fspath(path))
    return loaded
