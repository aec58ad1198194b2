"""Multi-head latent attention (DeepSeek V2/V3 and kin) over a cache of latents
(engine.runner.latent_attention): one row per token and layer, the latent and the rotary key, which
attention reads as keys and values; greedy tokens equal to model.generate's on every attention path; the
combinations the engine refuses, refused at load naming the family.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from engine import ContinuousBatchingConfig, generate_batch, trainer_exact
from engine.errors import UnsupportedModelError
from engine.runner.batch_invariant import BatchInvariantUnsupported
from engine.runner.kv_cache import HostKVCache, KVCacheShape, PagedKVCache
from engine.runner.latent_attention import unsupported_combination
from tests.helpers.families import LATENT_ATTENTION_SIZES, SIZES, tiny_family_config, tiny_family_model
from tests.helpers.models import random_prompt
from tests.helpers.oracle import reference_greedy

NEW_TOKENS = 10
# A latent and a rotary key per token and layer.
LATENT_WIDTH = LATENT_ATTENTION_SIZES["kv_lora_rank"] + LATENT_ATTENTION_SIZES["qk_rope_head_dim"]
FLOAT32_BYTES = 4


def latent_shape() -> KVCacheShape:
    return KVCacheShape.from_model_config(tiny_family_config("deepseek_v3"), torch.float32)


def test_an_mla_layer_caches_one_row_of_latent_and_rotary_key_per_token():
    shape = latent_shape()
    assert (shape.num_kv_heads, shape.head_dim, shape.values_are_keys) == (1, LATENT_WIDTH, True)
    layers = SIZES["num_hidden_layers"]
    assert shape.bytes_per_token() == layers * LATENT_WIDTH * FLOAT32_BYTES
    cache = PagedKVCache(shape, num_blocks=4, page_size=8, device=torch.device("cpu"))
    assert len(cache.tensors) == layers, "one tensor per layer: the values are the keys"
    assert all(values is keys for keys, values in zip(cache.key_caches, cache.value_caches, strict=True))


def test_latent_blocks_round_trip_through_cpu_offload_byte_for_byte():
    device = PagedKVCache(latent_shape(), num_blocks=8, page_size=4, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for tensor in device.tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    original = {block: device.block_bytes(block) for block in (2, 5)}
    host = HostKVCache(device, num_blocks=2)
    host.offload([2, 5], [1, 0])
    for tensor in device.tensors:
        tensor.fill_(-1.0)
    host.restore([6, 3], [1, 0])
    assert (device.block_bytes(6), device.block_bytes(3)) == (original[2], original[5])


def engine_tokens(model, prompts: list[list[int]], **config) -> list[list[int]]:
    outputs = generate_batch(
        model,
        prompts,
        generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None),
        continuous_batching_config=ContinuousBatchingConfig(
            **{**dict(page_size=8, num_blocks=96, max_batch_tokens=64), **config}
        ),
        warmup=False,
    )
    errors = [output.error for output in outputs.values() if output.error]
    assert not errors, errors[0]
    return [list(output.generated_tokens) for output in outputs.values()]


# The gather path; steps of 16 tokens, which split prompts into chunks beside decodes; a cache of 15 usable
# blocks for 18 blocks' worth of requests (which wait or are preempted, offloaded to the host with
# cpu_offload_space); two prompts sharing their first 40 tokens.
@pytest.mark.parametrize(
    "config",
    [
        dict(max_blocks_per_request=0),
        dict(max_batch_tokens=16),
        dict(num_blocks=16),
        dict(num_blocks=16, cpu_offload_space=0.01),
        dict(),
    ],
    ids=["gather", "chunked", "small-cache", "offloaded", "shared-prefix"],
)
def test_mla_gives_model_generates_tokens_on_every_attention_path(config):
    model = tiny_family_model("deepseek_v3")
    if config:
        prompts = [random_prompt(length, seed=length) for length in (5, 31, 70)]
    else:
        prefix = random_prompt(40, seed=40)
        prompts = [prefix + random_prompt(9, seed=9), prefix + random_prompt(3, seed=3)]
    expected = [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    got = engine_tokens(model, prompts, **config)
    for prompt, tokens, reference in zip(prompts, got, expected, strict=True):
        assert tokens == reference, (
            f"deepseek_v3 {config}, prompt of {len(prompt)} tokens, differs from model.generate\n"
            f"  engine:   {tokens}\n  generate: {reference}"
        )


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (dict(quantization="int8"), "deepseek_v3 with quantization 'int8'"),
        (dict(batch_invariant=True), "deepseek_v3 with batch_invariant"),
    ],
)
def test_mla_is_refused_at_load_with_what_it_cannot_combine_with(config, named):
    with pytest.raises(UnsupportedModelError, match=named):
        engine_tokens(tiny_family_model("deepseek_v3"), [random_prompt(5, seed=5)], **config)


def test_mla_under_tensor_parallelism_is_refused_naming_the_family():
    reason = unsupported_combination(tiny_family_config("deepseek_v3"), ContinuousBatchingConfig(), 2)
    assert reason is not None and reason.startswith("deepseek_v3 under tensor parallelism"), reason


def test_trainer_exact_refuses_mla_rather_than_give_other_bits():
    model = tiny_family_model("deepseek_v3")
    refused = pytest.raises(BatchInvariantUnsupported, match="deepseek_v3 is not served in batch-invariant")
    with refused, trainer_exact(model):
        pass
