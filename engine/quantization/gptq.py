"""GPTQ and AWQ 4-bit checkpoints (safetensors) served from their own 4-bit values, exactly.

The layouts, per linear layer `<name>` [out, in], with `group` the checkpoint's group size:

- GPTQ (`quant_method: "gptq"`, the AutoGPTQ / GPTQModel / optimum layout): `<name>.qweight` int32
  [in / 8, out], eight 4-bit values a word along the input, the lowest nibble first; `<name>.qzeros` int32
  [in / group, out / 8], eight zeros a word along the output; `<name>.scales` float16 [in / group, out];
  `<name>.g_idx` int32 [in], the group of each input. w[o, i] = scale[g, o] * (q[i, o] - zero[g, o]) with
  g = g_idx[i]. The original format (`checkpoint_format` "gptq") stores each zero less one; "gptq_v2"
  stores it as it is.
- AWQ (`quant_method: "awq"`, version "gemm"): `<name>.qweight` int32 [in, out / 8] and `<name>.qzeros`
  int32 [in / group, out / 8], eight values a word along the output in the order 0 2 4 6 1 3 5 7;
  `<name>.scales` float16 [in / group, out]; no g_idx (groups are consecutive inputs).

Both map onto the engine's int4 format (engine.quantization.formats: w = scale * q + min over groups of
32 consecutive inputs) with min = -scale * zero, which is exact in float32: a float16 scale times an
integer below 16 fits a float32's mantissa, and so does scale * (q - zero). A checkpoint group of 32,
64 or 128 inputs becomes that many groups of 32 with its scale and zero. Anything these formats cannot
hold exactly fails naming the tensor and the format: other bit widths, groups that are not whole runs of
32 consecutive inputs (act-order g_idx that reorders them, a group size not a multiple of 32), AWQ's
other versions.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from engine.quantization.formats import GROUP_SIZE, QuantizationError, QuantizedWeight
from engine.quantization.linear import QuantizedLinear, is_linear_map
from engine.quantization.model import replace_module

logger = logging.getLogger(__name__)

QUANT_METHODS = ("gptq", "awq")
_NIBBLES_PER_WORD = 8
# AWQ's order of the eight output channels within a word: nibble k holds channel _AWQ_ORDER[k].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def checkpoint_quantization(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The `quantization_config` of the model folder at `path` when its method is GPTQ or AWQ, else None."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return None
    quantization = json.loads(config_path.read_text()).get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") not in QUANT_METHODS:
        return None
    return quantization


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their eight 4-bit values each, lowest first: [..., n, 8] uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 15).to(torch.uint8)


def _group_of_each_input(
    name: str, method: str, in_features: int, group_size: int, g_idx: torch.Tensor | None
) -> torch.Tensor:
    """The checkpoint group of each input [in], checked to change only at multiples of 32 inputs."""
    size = in_features if group_size <= 0 else group_size
    consecutive = torch.arange(in_features, dtype=torch.int64) // size
    groups = consecutive if g_idx is None else g_idx.to(torch.int64)
    if groups.shape != (in_features,):
        raise QuantizationError(
            f"{name}.g_idx", method, f"shape {list(groups.shape)}, expected [{in_features}]"
        )
    runs = groups.view(-1, GROUP_SIZE)
    if not (runs == runs[:, :1]).all():
        reason = (
            f"group size {group_size} is not a multiple of {GROUP_SIZE}"
            if g_idx is None or torch.equal(groups, consecutive)
            else "act-order (desc_act) groups that are not runs of 32 consecutive inputs"
        )
        raise QuantizationError(name, method, f"{reason}: the engine's int4 groups cannot hold it exactly")
    return runs[:, 0]


def _check_shape(
    name: str, method: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise QuantizationError(
            name, method, f"expected {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
        )


def weight_from_checkpoint(
    name: str,
    tensors: dict[str, torch.Tensor],
    quantization: dict[str, Any],
    out_features: int,
    in_features: int,
) -> QuantizedWeight:
    """The int4 weight of layer `name` [out_features, in_features] from its checkpoint tensors
    (`<name>.qweight`, ...), in the layout `quantization` (a GPTQ or AWQ `quantization_config`) names.
    Raises QuantizationError naming the tensor and the format for anything the int4 format cannot hold."""
    method = str(quantization.get("quant_method"))
    if quantization.get("bits") != 4:
        raise QuantizationError(name, method, f"{quantization.get('bits')}-bit weights; only 4-bit ones load")
    if method == "awq" and str(quantization.get("version", "gemm")).lower() != "gemm":
        raise QuantizationError(
            name, method, f"AWQ version {quantization.get('version')!r}; only 'gemm' loads"
        )
    if in_features % GROUP_SIZE or out_features % _NIBBLES_PER_WORD:
        raise QuantizationError(
            name, method, f"shape {[out_features, in_features]}: in must be a multiple of 32, out of 8"
        )
    group_size = int(quantization.get("group_size", 128))
    num_groups = 1 if group_size <= 0 else -(-in_features // group_size)
    try:
        qweight, qzeros, scales = (tensors[f"{name}.{part}"] for part in ("qweight", "qzeros", "scales"))
    except KeyError as missing:
        raise QuantizationError(name, method, f"the checkpoint has no tensor {missing.args[0]!r}") from None
    _check_shape(f"{name}.scales", method, scales, (num_groups, out_features), torch.float16)
    _check_shape(f"{name}.qzeros", method, qzeros, (num_groups, out_features // 8), torch.int32)
    if method == "gptq":
        _check_shape(f"{name}.qweight", method, qweight, (in_features // 8, out_features), torch.int32)
        levels = _nibbles(qweight.t()).reshape(out_features, in_features)  # [out, in / 8, 8] -> [out, in]
        zeros = _nibbles(qzeros).reshape(num_groups, out_features)
        if quantization.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1  # the original format stores each zero less one
        g_idx = tensors.get(f"{name}.g_idx")
    else:
        _check_shape(f"{name}.qweight", method, qweight, (in_features, out_features // 8), torch.int32)
        order = torch.tensor(_AWQ_ORDER)
        unordered = torch.empty(in_features, out_features // 8, 8, dtype=torch.uint8)
        unordered[..., order] = _nibbles(qweight)
        levels = unordered.reshape(in_features, out_features).t()
        unordered_zeros = torch.empty(num_groups, out_features // 8, 8, dtype=torch.uint8)
        unordered_zeros[..., order] = _nibbles(qzeros)
        zeros = unordered_zeros.reshape(num_groups, out_features)
        g_idx = None
    group_of_run = _group_of_each_input(name, method, in_features, group_size, g_idx)
    if int(group_of_run.min()) < 0 or int(group_of_run.max()) >= num_groups:
        raise QuantizationError(f"{name}.g_idx", method, f"groups outside 0..{num_groups - 1}")
    run_scales = scales.float().t()[:, group_of_run].contiguous()  # [out, in / 32]
    run_zeros = zeros.float().t()[:, group_of_run]
    if not torch.isfinite(run_scales).all():
        raise QuantizationError(f"{name}.scales", method, "non-finite scales")
    runs = levels.contiguous().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    half = GROUP_SIZE // 2
    packed = (runs[..., :half] | (runs[..., half:] << 4)).reshape(out_features, in_features // 2)
    weight = QuantizedWeight(
        "int4", packed.contiguous(), run_scales, (-run_scales * run_zeros).contiguous(), in_features
    )
    weight.validate(name)
    return weight


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QuantizationError(os.fspath(path), "safetensors", "no .safetensors file in the model folder")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(os.fspath(file)))
    return tensors


def load_quantized_checkpoint(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """The causal LM at `path`, a GPTQ or AWQ 4-bit checkpoint (`checkpoint_quantization`), with each
    quantized linear layer a `QuantizedLinear` holding its 4-bit values and the rest in `dtype`. Raises
    QuantizationError naming a tensor the int4 format cannot hold, or one the checkpoint lacks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    quantization = checkpoint_quantization(folder)
    if quantization is None:
        raise QuantizationError(os.fspath(folder), "config.json", "no GPTQ or AWQ quantization_config")
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # transformers would hand the model to GPTQ's or AWQ's own libraries
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    tensors = _checkpoint_tensors(folder)
    loaded = []
    for module_name, module in list(model.named_modules()):
        if is_linear_map(module) and f"{module_name}.qweight" in tensors:
            weight = weight_from_checkpoint(
                module_name, tensors, quantization, module.out_features, module.in_features
            )
            bias = tensors.get(f"{module_name}.bias")
            if bias is not None:
                module.bias.data = bias.to(dtype)
            replace_module(model, module_name, QuantizedLinear(weight, module.bias, f"{module_name}.qweight"))
            loaded.append(module_name)
    if not loaded:
        raise QuantizationError(
            os.fspath(folder), str(quantization["quant_method"]), "no layer has a qweight"
        )
    quantized_parts = {
        f"{name}.{part}" for name in loaded for part in ("qweight", "qzeros", "scales", "g_idx", "bias")
    }
    rest = {name: tensor for name, tensor in tensors.items() if name not in quantized_parts}
    missing, unexpected = model.load_state_dict(rest, strict=False)
    # A tied head has no tensor of its own; the quantized layers' own buffers come from their weights.
    missing = [
        name
        for name in missing
        if not name.startswith(tuple(f"{layer}." for layer in loaded))
        and not (name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))
    ]
    if missing or unexpected:
        raise QuantizationError(
            os.fspath(folder),
            str(quantization["quant_method"]),
            f"tensors missing from the checkpoint {missing[:5]}, or not in the model {unexpected[:5]}",
        )
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    logger.info(
        "%d linear layers serve the checkpoint's own %s 4-bit values (%s)",
        len(loaded),
        quantization["quant_method"],
        os.fspath(folder),
    )
    return model.eval()
