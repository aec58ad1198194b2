"""GGUF's quantized blocks served as they are (engine.quantization.gguf_blocks): exact against gguf's own
dequantization (the 5- and 6-bit types within int8's rounding of it), greedy parity with `model.generate`
on those weights, and errors naming the tensor and its GGUF type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.quantization.formats import QuantizationError
from engine.quantization.gguf_blocks import REQUANTIZED_TYPES, load_gguf_linears, weight_from_blocks
from engine.quantization.model import quantized_layers
from tests.helpers.engine_runs import assert_exact_kernel_greedy_parity
from tests.helpers.gguf_files import llama_gguf_writer, permute_like_llama_cpp
from tests.helpers.models import COMMON, tiny_config

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


def _random_blocks(type_name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random blocks of a K-quant or 5-bit type (every bit pattern is a valid block) whose float16 scales
    are set to finite values, as [rows, bytes a row]; gguf's own dequantization says what they mean."""
    quant_type = gguf.GGMLQuantizationType[type_name]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[quant_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // block_weights, block_bytes), dtype=np.uint8)
    # Where each type keeps its float16 scales: Q6_K's d closes the block; the others open it with d (and
    # dmin or m when they have one).
    offsets = {"Q6_K": [block_bytes - 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2]}
    for offset in offsets[type_name]:
        scales = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_K", *REQUANTIZED_TYPES])
def test_k_quant_and_5_bit_blocks_load_as_gguf_dequantizes_them(type_name):
    """Q4_K exactly; the types with more levels than int4 as int8, within half an int8 step of each group."""
    blocks = _random_blocks(type_name, 6, 512, seed=2)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name]))
    loaded = weight_from_blocks("blk.0.ffn_down.weight", type_name, blocks, (6, 512))
    if type_name == "Q4_K":
        assert loaded.weight_format == "int4"
        assert torch.equal(loaded.dequantize(), expected)
        return
    assert loaded.weight_format == "int8"
    error = (loaded.dequantize() - expected).abs().view(6, -1, 32).amax(dim=-1)
    step = expected.abs().view(6, -1, 32).amax(dim=-1) / 127
    assert bool((error <= step / 2 * (1 + 1e-5)).all()), f"worst {error.max()}, steps from {step.min()}"
    assert error.max() > 0  # the file's levels are finer than int8's here: a real requantization


def _write_gguf(model: torch.nn.Module, path: Path, type_name: str) -> dict[str, np.ndarray]:
    """Writes the model's linear layers as `type_name` blocks the way llama.cpp lays them out; returns what
    each layer's weight must dequantize to."""
    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    expected: dict[str, np.ndarray] = {}
    with llama_gguf_writer(path) as writer:
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
                    permute_like_llama_cpp(weight, heads), gguf.GGMLQuantizationType[type_name]
                )
            writer.add_tensor(f"{gguf_name}.weight", stored, raw_dtype=gguf.GGMLQuantizationType[type_name])
            expected[name] = dequantized
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
    quantization = "int8" if type_name == "Q8_0" else "int4"
    assert_exact_kernel_greedy_parity(model, reference, quantization, type_name)


def test_a_q4_k_m_file_serves_q4_k_exactly_and_q6_k_as_int8_with_greedy_parity(tmp_path):
    """The mix llama.cpp's Q4_K_M writes: Q4_K for most layers, Q6_K for attn_v, ffn_down and the output."""
    torch.manual_seed(0)
    # K-quant rows are whole 256-weight super-blocks.
    config = LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    expected: dict[str, tuple[str, torch.Tensor]] = {}
    with llama_gguf_writer(tmp_path / "model.gguf") as writer:
        for seed, (name, module) in enumerate(model.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            gguf_name = name_map.get_name(name)
            type_name = "Q6_K" if gguf_name.endswith((".attn_v", ".ffn_down", "output")) else "Q4_K"
            blocks = _random_blocks(type_name, module.out_features, module.in_features, seed)
            meaning = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name])
            stored = blocks
            if gguf_name.endswith((".attn_q", ".attn_k")):
                heads = config.num_attention_heads if gguf_name.endswith("q") else config.num_key_value_heads
                stored = permute_like_llama_cpp(blocks, heads)
            writer.add_tensor(f"{gguf_name}.weight", stored, raw_dtype=gguf.GGMLQuantizationType[type_name])
            expected[name] = (type_name, torch.from_numpy(meaning))

    assert load_gguf_linears(model, tmp_path / "model.gguf") == len(expected)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    reference.eval()
    with torch.no_grad():
        for name, layer in quantized_layers(model).items():
            type_name, meaning = expected[name]
            served = layer.quantized_weight.dequantize()
            assert layer.weight_format == ("int4" if type_name == "Q4_K" else "int8"), name
            if type_name == "Q4_K":
                assert torch.equal(served, meaning), name
            else:
                assert torch.allclose(served, meaning, rtol=0, atol=float(meaning.abs().max()) / 254), name
            reference.get_submodule(name).weight.copy_(served)
        reference.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        reference.model.norm.weight.copy_(model.model.norm.weight)
    assert_exact_kernel_greedy_parity(model, reference, "none", "Q4_K_M")


def test_an_unsupported_block_type_names_the_tensor_and_the_type():
    weight = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(
        QuantizationError, match=r"tensor 'blk\.3\.ffn_down\.weight' \(GGUF Q3_K\): unsupported"
    ):
        weight_from_blocks("blk.3.ffn_down.weight", "Q3_K", blocks, (2, 256))


def test_truncated_blocks_name_the_tensor_and_the_type():
    blocks, _ = _gguf_round_trip(np.ones((4, 64), dtype=np.float32), "Q4_1")
    with pytest.raises(QuantizationError, match=r"tensor 'blk\.0\.attn_v\.weight' \(GGUF Q4_1\): 120 bytes"):
        weight_from_blocks("blk.0.attn_v.weight", "Q4_1", blocks[:3], (4, 64))


def test_a_file_whose_shapes_do_not_match_the_model_names_the_tensor(tmp_path):
    model = _tiny_llama()
    blocks, _ = _gguf_round_trip(np.ones((64, 32), dtype=np.float32), "Q4_0")
    with llama_gguf_writer(tmp_path / "bad.gguf") as writer:
        writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
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
