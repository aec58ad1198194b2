"""GGUF's quantized blocks as `QuantizedWeight`s: 4- and 8-bit types exactly, 5- and 6-bit ones as int8.

A GGUF block of the 32-weight types holds 32 weights of one row: Q8_0 = float16 d + 32 int8 q (w = d q);
Q4_0 = float16 d + 16 bytes of nibbles (w = d (q - 8)); Q4_1 = float16 d, float16 m + 16 bytes (w = d q +
m). The nibbles are in the order `formats` keeps, so the bytes are copied as they are and only d and m
widen to float32 (exact).

Q4_K (the bulk of the Q4_K_M files users download) has 256-weight super-blocks: float16 d and dmin, eight
6-bit scales sc and mins m, and 128 bytes of nibbles; sub-block j's 32 weights are w = (d sc_j) q - (dmin
m_j). That is int4 with scale d sc_j and min -(dmin m_j), both exact in float32 (an 11-bit mantissa times
a 6-bit integer), once the nibbles move to `formats`' order (low nibbles of 32 bytes hold one sub-block,
the high ones the next): exact too.

The 5- and 6-bit types (Q5_0, Q5_1, Q5_K, and Q6_K, which Q4_K_M files use for attn_v, half the ffn_down
and the output layer) have more levels than int4 holds, and Q6_K's 16-weight sub-blocks have two scales
in one of our groups. They load as gguf's own dequantization quantized to int8 (`formats.quantize`): each
weight then differs from the file's by at most its group's int8 step / 2, max |w| / 254, a quarter of
Q6_K's own step or finer. Other types (Q2_K, Q3_K, the IQ types) fail naming the tensor and its type.

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

from engine.parallel import tensor_parallel_size
from engine.quantization.formats import GROUP_SIZE, QuantizationError, QuantizedWeight, quantize
from engine.quantization.linear import QuantizedLinear
from engine.quantization.model import quantized_layers, replace_module

logger = logging.getLogger(__name__)

# GGUF type name -> (our format, bytes a block, whether the block has a min).
BLOCK_LAYOUTS: dict[str, tuple[str, int, bool]] = {
    "Q8_0": ("int8", 2 + GROUP_SIZE, False),
    "Q4_0": ("int4", 2 + GROUP_SIZE // 2, False),
    "Q4_1": ("int4", 4 + GROUP_SIZE // 2, True),
}
# 256-weight super-blocks: float16 d, float16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles.
SUPER_BLOCK = 256
_Q4_K_BYTES = 4 + 12 + SUPER_BLOCK // 2
# Types with more levels than int4: gguf dequantizes them, and they serve as int8.
REQUANTIZED_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")
SUPPORTED_TYPES = (*BLOCK_LAYOUTS, "Q4_K", *REQUANTIZED_TYPES)
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
    if type_name not in SUPPORTED_TYPES:
        raise QuantizationError(
            name,
            f"GGUF {type_name}",
            f"unsupported block type; supported: {', '.join(SUPPORTED_TYPES)}, "
            "or a float type (quantized at load)",
        )
    rows, columns = shape
    if type_name == "Q4_K":
        return _q4_k_weight(name, _blocks(name, type_name, data, shape, SUPER_BLOCK, _Q4_K_BYTES))
    if type_name in REQUANTIZED_TYPES:
        return _requantized_weight(name, type_name, data, shape)
    weight_format, block_bytes, has_min = BLOCK_LAYOUTS[type_name]
    blocks = _blocks(name, type_name, data, shape, GROUP_SIZE, block_bytes)
    scales = _float16_column(blocks, 0)
    header = 4 if has_min else 2
    values = torch.from_numpy(np.ascontiguousarray(blocks[..., header:]).reshape(rows, -1))
    if weight_format == "int8":
        return QuantizedWeight("int8", values.view(torch.int8), scales, None, columns)
    # Q4_0's w = d (q - 8) is d q + (-8 d): exact in float32.
    mins = _float16_column(blocks, 2) if has_min else -8.0 * scales
    return _int4_weight(name, type_name, values, scales, mins, columns)


def _int4_weight(
    name: str, type_name: str, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, columns: int
) -> QuantizedWeight:
    if not (torch.isfinite(scales).all() and torch.isfinite(mins).all()):
        raise QuantizationError(name, f"GGUF {type_name}", "non-finite block scales")
    return QuantizedWeight("int4", packed, scales.contiguous(), mins.contiguous(), columns)


def _blocks(
    name: str, type_name: str, data: np.ndarray, shape: tuple[int, int], block_weights: int, block_bytes: int
) -> np.ndarray:
    """`data` as [rows, blocks a row, block_bytes], once its length is checked against `shape`."""
    rows, columns = shape
    if columns % block_weights:
        raise QuantizationError(
            name, f"GGUF {type_name}", f"row length {columns} is not a multiple of {block_weights}"
        )
    blocks_per_row = columns // block_weights
    if data.dtype != np.uint8 or data.size != rows * blocks_per_row * block_bytes:
        raise QuantizationError(
            name,
            f"GGUF {type_name}",
            f"{data.size} bytes of {data.dtype} for shape {[rows, columns]}, expected "
            f"{rows * blocks_per_row * block_bytes} bytes",
        )
    return data.reshape(rows, blocks_per_row, block_bytes)


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of each super-block from its 12 bytes [..., 12] (ggml's
    get_scale_min_k4): sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks
    4-7 take a nibble of bytes 8-11 and the top 2 bits of bytes 0-3 (scales) or 4-7 (mins)."""
    low_scales, low_mins, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low_scales & 63, (high & 15) | ((low_scales >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_mins & 63, (high >> 4) | ((low_mins >> 6) << 4)], axis=-1)
    return scales, mins


def _q4_k_weight(name: str, blocks: np.ndarray) -> QuantizedWeight:
    rows, super_blocks, _ = blocks.shape
    d, dmin = _float16_column(blocks, 0), _float16_column(blocks, 2)
    six_bit_scales, six_bit_mins = _q4_k_scales_and_mins(blocks[..., 4:16])
    # d sc and dmin m are exact in float32: the products the file means, rounded nowhere.
    scales = (d[..., None] * torch.from_numpy(six_bit_scales.astype(np.float32))).reshape(rows, -1)
    mins = (-dmin[..., None] * torch.from_numpy(six_bit_mins.astype(np.float32))).reshape(rows, -1)
    # 128 bytes = four runs of 32; run i's low nibbles are sub-block 2i, its high nibbles sub-block 2i + 1.
    runs = blocks[..., 16:].reshape(rows, super_blocks, 4, 32)
    sub_blocks = np.stack([runs & 15, runs >> 4], axis=3).reshape(rows, super_blocks * 8, 32)
    # `formats`' order: byte j of a group holds weight j (low nibble) and weight j + 16 (high).
    packed = np.ascontiguousarray(sub_blocks[..., :16] | (sub_blocks[..., 16:] << 4)).reshape(rows, -1)
    return _int4_weight(name, "Q4_K", torch.from_numpy(packed), scales, mins, super_blocks * SUPER_BLOCK)


def _requantized_weight(
    name: str, type_name: str, data: np.ndarray, shape: tuple[int, int]
) -> QuantizedWeight:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    quant_type = GGMLQuantizationType[type_name]
    block_weights, block_bytes = GGML_QUANT_SIZES[quant_type]
    blocks = _blocks(name, type_name, data, shape, block_weights, block_bytes)
    values = dequantize(blocks.reshape(shape[0], -1), quant_type)
    return quantize(name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), "int8")


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
    """Replaces the model's linear layers whose GGUF tensors are quantized blocks of `SUPPORTED_TYPES` with
    `QuantizedLinear`s holding those blocks (as int8 for `REQUANTIZED_TYPES`); returns how many. Layers
    stored as floats are left to quantizing at load. Raises QuantizationError naming a tensor whose blocks
    are unsupported or bad, ValueError for a model sharded over tensor-parallel ranks (blocks do not shard:
    quantize its floats there, engine.quantization.sharding)."""
    import gguf

    if tensor_parallel_size(model) > 1:
        raise ValueError(
            f"{os.fspath(path)!r}: GGUF blocks are served on one process, and this model is sharded over "
            f"{tensor_parallel_size(model)} tensor-parallel ranks"
        )
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
