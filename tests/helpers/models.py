"""Tiny random causal LMs built from configs with a fixed seed (model hubs are unreachable in tests), and
random prompts for them.

They live on the CPU unless CBSERVE_TEST_DEVICE names another device (e.g. "cuda"), which moves them
there, so the parity tests run on a GPU (bench/gpu_check.sh).

On the CPU, Triton kernels (the kernel path) run under Triton's interpreter, which tests/conftest.py
chooses before anything imports triton.
"""

from __future__ import annotations

import functools
import os

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.gemma2 import Gemma2Config
from transformers.models.llama import LlamaConfig
from transformers.models.mistral import MistralConfig
from transformers.models.qwen2 import Qwen2Config
from transformers.models.qwen3 import Qwen3Config

VOCAB_SIZE = 256
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

FULL_ATTENTION_FAMILIES = ("llama", "qwen3")
TEST_DEVICE = torch.device(os.environ.get("CBSERVE_TEST_DEVICE", "cpu"))


def tiny_config(family: str) -> PretrainedConfig:
    if family == "llama":
        return LlamaConfig(**COMMON)
    if family == "qwen2":  # biases on the query, key and value projections
        return Qwen2Config(**COMMON)
    if family == "qwen3":
        return Qwen3Config(**COMMON, head_dim=16)
    if family == "mistral":
        return MistralConfig(**COMMON, sliding_window=24)
    if family == "gemma2":
        return Gemma2Config(**COMMON, head_dim=16, sliding_window=24, attn_implementation="eager")
    raise ValueError(family)


@functools.cache
def _build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(family)
    attn = "eager" if family == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    # Built on the CPU, then moved: the same seeded weights on every device.
    return model.to(TEST_DEVICE).eval()


def tiny_model(family: str) -> torch.nn.Module:
    """A shared tiny model of `family`; engines restore its attention implementation when destroyed."""
    return _build(family)


def seeded_tiny_llama(seed: int) -> torch.nn.Module:
    """A tiny llama with other weights than `tiny_model("llama")`'s: new weights for an update."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def fresh_tiny_model(family: str) -> torch.nn.Module:
    """A model of `family` with the same weights as `tiny_model`'s but its own: an oracle that can run
    `generate` while a server holds the shared one."""
    return _build.__wrapped__(family)


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 3 up: 0..2 are pad, bos and eos in the tiny configs.
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()
