"""GPTQ and AWQ 4-bit checkpoints (engine.quantization.gptq), written here from a tiny Llama's weights in
the layouts those libraries document, then loaded: each layer holds exactly the checkpoint's own
dequantized values, the logits are those of a float model holding the same values up to float32
summation order, greedy outputs through the engine equal `generate` on that float model, and files the
int4 format cannot hold fail naming the tensor and the format. On the CPU, where the int4 kernel runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import ContinuousBatchingConfig, generate_batch
from engine.quantization.formats import QuantizationError
from engine.quantization.gptq import load_quantized_checkpoint
from engine.quantization.linear import QuantizedLinear
from service.model_loading import load_pretrained
from tests.helpers.models import fresh_tiny_model, random_prompt
from tests.helpers.oracle import reference_greedy

# AWQ's GEMM layout: nibble k of a word holds output channel AWQ_NIBBLE_CHANNEL[k] of its eight.
AWQ_NIBBLE_CHANNEL = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _words(nibbles: np.ndarray) -> torch.Tensor:
    """[..., 8] values below 16 -> [...] int32 words, nibble k at bits 4k."""
    words = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for k in range(8):
        words |= nibbles[..., k].astype(np.uint32) << np.uint32(4 * k)
    return torch.from_numpy(words.view(np.int32).copy())


def _quantize(
    weight: torch.Tensor, group_size: int
) -> tuple[np.ndarray, torch.Tensor, np.ndarray, torch.Tensor]:
    """Asymmetric 4-bit groups along the input: levels [out, in], float16 scales [groups, out], zeros
    [groups, out], and the float32 weight they stand for."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-3).half()
    zeros = torch.round(-low / scales.float()).clamp(0, 15)
    levels = torch.round(groups / scales.float()[..., None] + zeros[..., None]).clamp(0, 15)
    values = (scales.float()[..., None] * (levels - zeros[..., None])).reshape(out_features, in_features)
    return (
        levels.reshape(out_features, in_features).to(torch.uint8).numpy(),
        scales.t().contiguous(),
        zeros.t().to(torch.uint8).numpy(),
        values,
    )


def _layer_tensors(
    name: str, weight: torch.Tensor, method: str, group_size: int, zero_offset: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    levels, scales, zeros, values = _quantize(weight, group_size)
    out_features, in_features = levels.shape
    if method == "gptq":
        # qweight [in / 8, out]: inputs 8w .. 8w + 7 of a channel in one word; qzeros along the output.
        qweight = _words(levels.T.reshape(in_features // 8, 8, out_features).transpose(0, 2, 1))
        qzeros = _words((zeros.astype(np.int64) - zero_offset).reshape(-1, out_features // 8, 8))
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
        tensors["g_idx"] = torch.arange(in_features, dtype=torch.int32) // group_size
    else:
        order = list(AWQ_NIBBLE_CHANNEL)
        qweight = _words(levels.T.reshape(in_features, out_features // 8, 8)[..., order])
        qzeros = _words(zeros.reshape(-1, out_features // 8, 8)[..., order])
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    return {f"{name}.{part}": tensor for part, tensor in tensors.items()}, values


def write_checkpoint(
    folder: Path,
    method: str = "gptq",
    group_size: int = 32,
    checkpoint_format: str = "gptq",
    **config_overrides: Any,
) -> torch.nn.Module:
    """A tiny Llama's decoder projections saved as a 4-bit `method` checkpoint in `folder`; returns the
    float model holding exactly the values the checkpoint stands for (the head and norms as they were)."""
    model = fresh_tiny_model("llama").cpu()
    model.save_pretrained(folder)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    zero_offset = 1 if method == "gptq" and checkpoint_format == "gptq" else 0
    for layer_index, layer in enumerate(model.model.layers):
        for projection in PROJECTIONS:
            block = "self_attn" if projection in PROJECTIONS[:4] else "mlp"
            name = f"model.layers.{layer_index}.{block}.{projection}"
            module = getattr(getattr(layer, block), projection)
            tensors, values = _layer_tensors(name, module.weight.detach(), method, group_size, zero_offset)
            state.pop(f"{name}.weight")
            state.update(tensors)
            with torch.no_grad():
                module.weight.copy_(values)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    quantization = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "gptq":
        quantization.update(desc_act=False, sym=False, checkpoint_format=checkpoint_format)
    else:
        quantization.update(version="gemm", zero_point=True)
    quantization.update(config_overrides)
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return model


CASES = [("gptq", 32, "gptq"), ("gptq", 64, "gptq_v2"), ("awq", 32, "gptq"), ("awq", 64, "gptq")]


@pytest.mark.parametrize(("method", "group_size", "checkpoint_format"), CASES)
def test_a_checkpoint_serves_its_own_values_exactly(
    tmp_path: Path, method: str, group_size: int, checkpoint_format: str
) -> None:
    reference = write_checkpoint(tmp_path, method, group_size, checkpoint_format)
    loaded = load_quantized_checkpoint(tmp_path)
    quantized = {
        name: module for name, module in loaded.named_modules() if isinstance(module, QuantizedLinear)
    }
    assert len(quantized) == 7 * len(reference.model.layers)
    for name, module in quantized.items():
        expected = reference.get_submodule(name).weight.detach()
        assert torch.equal(module.quantized_weight.dequantize(), expected), name
    prompt = random_prompt(20, seed=1)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    # Float inputs: the kernel then computes the dequantized weights' product, up to summation order.
    config = ContinuousBatchingConfig(page_size=8, num_blocks=64, quantize_activations=False)
    served = generate_batch(
        loaded, [prompt], max_new_tokens=12, eos_token_id=[], continuous_batching_config=config
    )
    tokens = next(iter(served.values())).generated_tokens
    expected_tokens = reference_greedy(reference, prompt, 12)
    assert tokens == expected_tokens, f"\n  engine:   {tokens}\n  generate: {expected_tokens}"


def test_the_server_loads_a_gptq_folder_without_gptq_libraries(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    model, _ = load_pretrained(str(tmp_path), device="cpu", dtype="float32")
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)


@pytest.mark.parametrize(
    ("method", "group_size", "overrides", "words"),
    [
        ("gptq", 32, dict(bits=8), "8-bit"),
        ("awq", 32, dict(version="gemv"), "version"),
        ("gptq", 16, {}, "group size 16 is not a multiple of 32"),
    ],
    ids=["bits", "awq-version", "group-size"],
)
def test_what_int4_cannot_hold_fails_naming_the_tensor_and_the_format(
    tmp_path: Path, method: str, group_size: int, overrides: dict[str, Any], words: str
) -> None:
    write_checkpoint(tmp_path, method, group_size, **overrides)
    with pytest.raises(QuantizationError, match=words) as raised:
        load_quantized_checkpoint(tmp_path)
    assert raised.value.tensor == "model.layers.0.self_attn.q_proj" and raised.value.weight_format == method


def test_act_order_groups_and_missing_tensors_fail_naming_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    write_checkpoint(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    # Act-order: each input's group by its activation rank, here every other input in another group.
    state[f"{name}.g_idx"] = torch.arange(64, dtype=torch.int32) % 2
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(QuantizationError, match="act-order") as raised:
        load_quantized_checkpoint(tmp_path)
    assert raised.value.tensor == name
    del state[f"{name}.qzeros"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(QuantizationError, match="qzeros") as raised:
        load_quantized_checkpoint(tmp_path)
    assert raised.value.tensor == name
