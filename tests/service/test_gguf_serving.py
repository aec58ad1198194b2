"""`cbserve serve --model FILE.gguf`: a GGUF file read by transformers (every tensor dequantized) serves its
own quantized blocks, whose greedy tokens are those of `model.generate` on the file's dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.quantization.model import quantized_layers
from service.cli import check_model_folder
from service.model_loading import is_gguf_file, load_pretrained, serve_gguf_blocks
from tests.helpers.engine_runs import assert_exact_kernel_greedy_parity
from tests.helpers.gguf_files import llama_gguf_writer, permute_like_llama_cpp
from tests.helpers.models import COMMON

gguf = pytest.importorskip("gguf")

# K-quant rows are whole 256-weight super-blocks.
CONFIG = LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512})


def _write_llama_gguf(path: Path) -> torch.nn.Module:
    """A tiny llama as llama.cpp's converter lays it out: the metadata transformers reads, float norms and
    embedding, Q8_0 attention (q and k rows permuted) and Q4_0 MLP blocks. Returns the model written."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32)
    with llama_gguf_writer(path) as writer:
        writer.add_context_length(CONFIG.max_position_embeddings)
        writer.add_block_count(CONFIG.num_hidden_layers)
        writer.add_embedding_length(CONFIG.hidden_size)
        writer.add_feed_forward_length(CONFIG.intermediate_size)
        writer.add_head_count(CONFIG.num_attention_heads)
        writer.add_head_count_kv(CONFIG.num_key_value_heads)
        writer.add_layer_norm_rms_eps(CONFIG.rms_norm_eps)
        writer.add_rope_freq_base(CONFIG.rope_parameters["rope_theta"])
        writer.add_vocab_size(CONFIG.vocab_size)
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, CONFIG.num_hidden_layers)
        for name, tensor in model.state_dict().items():
            module_name = name.removesuffix(".weight")
            gguf_name = name_map.get_name(module_name)
            assert gguf_name is not None, name
            values = tensor.numpy()
            if values.ndim == 1 or gguf_name == "token_embd":
                writer.add_tensor(f"{gguf_name}.weight", values)
                continue
            if gguf_name.endswith((".attn_q", ".attn_k")):
                heads = CONFIG.num_attention_heads if gguf_name.endswith("q") else CONFIG.num_key_value_heads
                values = permute_like_llama_cpp(values, heads)
            quant_type = (
                gguf.GGMLQuantizationType.Q8_0 if ".attn_" in gguf_name else gguf.GGMLQuantizationType.Q4_0
            )
            writer.add_tensor(
                f"{gguf_name}.weight", gguf.quants.quantize(values, quant_type), raw_dtype=quant_type
            )
    return model


def test_a_gguf_file_serves_its_own_blocks_with_greedy_parity_against_its_dequantized_weights(tmp_path):
    path = tmp_path / "tiny-llama.Q4_0.gguf"
    original = _write_llama_gguf(path)
    check_model_folder(str(path))  # the CLI takes the file
    assert is_gguf_file(str(path))

    reference, tokenizer = load_pretrained(str(path), device="cpu", dtype="float32")
    assert tokenizer is None  # the file carries none: token-id prompts only
    with torch.no_grad():  # q and k rows back in the model's order: each within its Q8_0 rounding
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
            written, read = original.get_submodule(name).weight, reference.get_submodule(name).weight
            assert torch.allclose(read, written, rtol=0, atol=float(written.abs().max()) / 127), name
    served, _ = load_pretrained(str(path), device="cpu", dtype="float32")
    assert serve_gguf_blocks(str(path), served, "int4") == 7 * CONFIG.num_hidden_layers + 1
    layers = quantized_layers(served)
    assert {layer.weight_format for name, layer in layers.items() if ".self_attn." in name} == {"int8"}
    assert {layer.weight_format for name, layer in layers.items() if ".mlp." in name} == {"int4"}
    with torch.no_grad():
        for name, layer in layers.items():
            # transformers' dequantization of the file is exactly what the blocks hold.
            expected = reference.get_submodule(name).weight
            assert torch.equal(layer.quantized_weight.dequantize(), expected), name

    assert_exact_kernel_greedy_parity(served, reference, "int4", "GGUF Q8_0/Q4_0")


def test_a_gguf_file_with_quantization_none_serves_the_dequantized_floats(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    _write_llama_gguf(path)
    model, _ = load_pretrained(str(path), device="cpu", dtype="float32")
    assert serve_gguf_blocks(str(path), model, "none") == 0
    assert not quantized_layers(model)
