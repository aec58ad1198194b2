"""GGUF's quantized blocks served as they are (engine.quantization.gguf_blocks): exact against gguf's own
dequantization, greedy parity with `model.generate` on those weights, and errors naming the tensor and its
GGUF type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import ContinuousBatchingConfig
from engine.quantization.formats import QuantizationError
from engine.quantization.gguf_blocks import load_gguf_linears, weight_from_blocks
from engine.quantization.model import quantized_layers
from tests.helpers.engine_runs import generate_greedy
from tests.helpers.models import random_prompt, tiny_config
from tests.helpers.oracle import assert_greedy_parity

gguf = pytest.importorskip("gguf")

BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32
    ).eval()


def _gguf_round_trip(weight: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, gguf's own dequantization of them)."""
    quant_type = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(weight, quant_type)
    return blocks, gguf.quants.dequantize(blocks, quant_type)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_blocks_load_exactly_as_gguf_dequantizes_them(type_name):
    weight = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    blocks, expected = _gguf_round_trip(weight, type_name)
    loaded = weight_from_blocks("blk.0.ffn_up.weight", type_name, blocks, (8, 96))
    assert torch.equal(loaded.dequantize(), torch.from_numpy(expected))


def _permute_like_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row permutation of q and k (what the loader must undo)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(model: torch.nn.Module, path: Path, type_name: str) -> dict[str, np.ndarray]:
    """Writes the model's linear layers as `type_name` blocks the way llama.cpp lays them out; returns what
    each layer's weight must dequantize to."""
    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    expected: dict[str, np.ndarray] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        gguf_name = name_map.get_name(name)
        weight = module.weight.detach().numpy()
        blocks, dequantized = _gguf_round_trip(weight, type_name)
        stored = blocks
        if gguf_name.endswith((".attn_q", ".attn_k")):
            heads = config.num_attention_heads if gguf_name.endswith("q") else config.num_key_value_heads
            stored = gguf.quants.quantize(
                _permute_like_llama_cpp(weight, heads), gguf.GGMLQuantizationType[type_name]
            )
        writer.add_tensor(f"{gguf_name}.weight", stored, raw_dtype=gguf.GGMLQuantizationType[type_name])
        expected[name] = dequantized
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_a_gguf_file_serves_its_own_blocks_with_greedy_parity(tmp_path, type_name):
    model = _tiny_llama()
    expected = _write_gguf(model, tmp_path / "model.gguf", type_name)
    assert load_gguf_linears(model, tmp_path / "model.gguf") == len(expected)
    reference = _tiny_llama()
    with torch.no_grad():
        for name, layer in quantized_layers(model).items():
            # Exact, q and k included: their rows come back in the model's order.
            assert torch.equal(layer.quantized_weight.dequantize(), torch.from_numpy(expected[name])), name
            reference.get_submodule(name).weight.copy_(torch.from_numpy(expected[name]))
    prompts = [random_prompt(length, seed=length) for length in (3, 30)]
    new_tokens = [16, 9]
    quantization = "int8" if type_name == "Q8_0" else "int4"
    # Float inputs: the kernel's exact path, whose greedy tokens are those of the dequantized weights.
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=32, quantization=quantization, quantize_activations=False
    )
    generated, _ = generate_greedy(model, config, prompts, new_tokens)
    assert_greedy_parity(reference, prompts, new_tokens, generated, type_name)


def test_an_unsupported_block_type_names_the_tensor_and_the_type():
    weight = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(
        QuantizationError, match=r"tensor 'blk\.3\.ffn_down\.weight' \(GGUF Q6_K\): unsupported"
    ):
        weight_from_blocks("blk.3.ffn_down.weight", "Q6_K", blocks, (2, 256))


def test_truncated_blocks_name_the_tensor_and_the_type():
    blocks, _ = _gguf_round_trip(np.ones((4, 64), dtype=np.float32), "Q4_1")
    with pytest.raises(QuantizationError, match=r"tensor 'blk\.0\.attn_v\.weight' \(GGUF Q4_1\): 120 bytes"):
        weight_from_blocks("blk.0.attn_v.weight", "Q4_1", blocks[:3], (4, 64))


def test_a_file_whose_shapes_do_not_match_the_model_names_the_tensor(tmp_path):
    model = _tiny_llama()
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    blocks, _ = _gguf_round_trip(np.ones((64, 32), dtype=np.float32), "Q4_0")
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        QuantizationError, match=r"tensor 'blk\.0\.attn_q\.weight' \(GGUF Q4_0\): shape \[64, 32\]"
    ):
        load_gguf_linears(model, tmp_path / "bad.gguf")


def test_the_embedded_model_serves_its_own_blocks_exactly():
    """The embedded SmolLM2's Q4_1 and Q8_0 blocks give exactly the weights of its converted fp32 folder."""
    from service.default_model import default_model_dir, is_converted, load_own_gguf_blocks

    folder = default_model_dir()
    if not is_converted(folder):
        pytest.skip(f"the embedded model is not converted at {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    full_precision = {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    assert load_own_gguf_blocks(folder, model) == len(full_precision)
    layers = quantized_layers(model)
    assert {layer.weight_format for layer in layers.values()} == {"int4", "int8"}  # Q4_1, and Q8_0 lm_head
    for name, layer in layers.items():
        assert torch.equal(layer.quantized_weight.dequantize(), full_precision[name]), name
