"""Tiny random models of any causal-LM family of the installed transformers, built from its config class
with a fixed seed (for the conformance test, tests/engine/test_model_families.py).

One recipe serves every family: the config class's own defaults, with the sizes below set wherever the
class has a field of that name, so each family keeps its own architecture switches (norm kinds, rotary
layout, layer types) and only shrinks. Sliding windows shrink to `SLIDING_WINDOW` tokens, so that a
prompt of `LONG_PROMPT` tokens runs past the window.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB_SIZE = 512
SLIDING_WINDOW = 24
LONG_PROMPT = 70
SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
SPECIAL_TOKENS: dict[str, Any] = dict(
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False
)
# Mixture-of-experts fields, under each family's own name: 4 experts of width 32, 2 per token.
EXPERT_WIDTHS = ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk")
# Multi-head latent attention (DeepSeek and kin): a latent of 32, query and key heads of 16 + 8 rotary
# dimensions and value heads of 12, so that keys and values differ in width as at full size. Every head
# expands from the latent, so there are as many key heads as query heads.
LATENT_ATTENTION_SIZES: dict[str, Any] = dict(
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    head_dim=8,  # the rotary embedding's width
    num_key_value_heads=SIZES["num_attention_heads"],
)


def causal_lm_families() -> list[str]:
    """Every model type of the installed transformers' causal-LM mapping."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_family_config(model_type: str) -> PretrainedConfig:
    """The family's default config, shrunk (see the module docstring)."""
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    # A size some class computes (a read-only property) stays computed.
    sizes = {
        name: value
        for name, value in SIZES.items()
        if hasattr(default, name) and not isinstance(getattr(config_class, name, None), property)
    }
    if getattr(default, "multi_query", False):  # one KV head (GPT-BigCode, Falcon), which the class derives
        sizes.pop("num_key_value_heads", None)
    if getattr(default, "sliding_window", None) is not None:
        sizes["sliding_window"] = SLIDING_WINDOW
    if getattr(default, "attention_chunk_size", None):  # Llama 4: prompts of LONG_PROMPT span chunks
        sizes["attention_chunk_size"] = 16
    if getattr(default, "no_rope_layers", None):  # Llama 4: the second layer without rotary embeddings
        sizes["no_rope_layers"] = [1, 0]
    if getattr(default, "attention_types", None):  # GPT-Neo: a global layer, then a local (sliding) one
        sizes["attention_types"] = [[["global", "local"], 1]]
        sizes["window_size"] = SLIDING_WINDOW
    if getattr(default, "rotary_dim", None):  # GPT-J and CodeGen rotate the first dimensions of each head
        sizes["rotary_dim"] = 8
    if getattr(default, "kv_lora_rank", None):
        sizes.update(_latent_attention_sizes(config_class, default))
    if hasattr(default, "conv_L_cache"):  # LFM2: short convolutions before and after an attention layer
        sizes.update(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"])
        if hasattr(default, "num_dense_layers"):  # LFM2-MoE: experts from the second layer on
            sizes["num_dense_layers"] = 1
    sizes.update({name: 32 for name in EXPERT_WIDTHS if hasattr(default, name)})
    sizes.update({name: 4 for name in EXPERT_COUNTS if getattr(default, name, None)})
    sizes.update(
        {
            name: 2
            for name in EXPERTS_PER_TOKEN
            if isinstance(getattr(default, name, None), int) and getattr(default, name)
        }
    )
    return config_class(**sizes, **SPECIAL_TOKENS)


def _latent_attention_sizes(config_class: type, default: PretrainedConfig) -> dict[str, Any]:
    """An MLA family's sizes: `LATENT_ATTENTION_SIZES`, with its routing shrunk to the 4 experts (one group
    of them) and, where a layer holds two attention blocks (LongCat-Flash), one layer."""
    sizes = {name: value for name, value in LATENT_ATTENTION_SIZES.items() if hasattr(default, name)}
    if hasattr(default, "qk_head_dim"):
        sizes["qk_head_dim"] = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    if getattr(default, "n_group", None):
        sizes.update(n_group=1, topk_group=1)
    if hasattr(default, "num_experts_per_tok") and default.num_experts_per_tok is None:
        sizes["num_experts_per_tok"] = 2
    if isinstance(getattr(config_class, "num_hidden_layers", None), property):
        sizes["num_layers"] = SIZES["num_hidden_layers"] // 2
    widths = ("ffn_hidden_size", "expert_ffn_hidden_size")
    sizes.update({name: 32 for name in widths if hasattr(default, name)})
    if getattr(default, "zero_expert_num", None):
        sizes["zero_expert_num"] = 2
    return sizes


def tiny_family_model(model_type: str) -> torch.nn.Module:
    """A tiny fp32 model of the family on the CPU, seeded."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_family_config(model_type), dtype=torch.float32).eval()


def weightless_family_model(model_type: str) -> torch.nn.Module | None:
    """A model of the family at its default sizes on the meta device: no memory and no initialisation,
    so even a multimodal class builds at once. It can be refused, never run. None where the family's own
    default config builds no model (a defect of that transformers class, not of the engine)."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type]())
    except Exception:  # transformers raises whatever its class's code raises
        return None
