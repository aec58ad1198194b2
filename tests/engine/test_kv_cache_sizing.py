"""How many KV blocks an auto-sized cache gets, and when the CPU cap applies."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import ContinuousBatchingConfig
from engine.engine_core import EngineCore
from engine.kv.layer_groups import kv_cache_groups
from engine.runner import cache_plan
from engine.runner.kv_cache import DEFAULT_CPU_CACHE_BUDGET_BYTES, KVCacheShape, resolve_cache_sizes
from tests.helpers.families import tiny_family_config
from tests.helpers.models import tiny_config, tiny_model

GiB = 1 << 30


def sizes(max_budget_bytes: int | None, config: Any = None) -> tuple[list[int], int, int]:
    """The tiny Llama's (or `config`'s) blocks, max_batch_tokens and bytes per block of 16 tokens."""
    config = config if config is not None else tiny_config("llama")
    shape = KVCacheShape.from_model_config(config, torch.float32)
    groups = kv_cache_groups(config)
    blocks, max_batch_tokens = resolve_cache_sizes(
        shape,
        groups,
        torch.device("cpu"),
        page_size=16,
        num_blocks=None,
        max_batch_tokens=256,
        max_memory_percent=0.9,
        max_tokens_needed=1 << 40,  # more than any memory: the budget decides
        max_requests=64,
        activation_bytes_per_token=0,
        max_budget_bytes=max_budget_bytes,
    )
    return blocks, max_batch_tokens, shape.bytes_per_token() * 16


def test_a_budget_cap_bounds_the_cache_bytes() -> None:
    blocks, _, block_bytes = sizes(max_budget_bytes=GiB // 4)
    assert sum(blocks) * block_bytes <= GiB // 4
    assert sum(blocks) * block_bytes > GiB // 4 - block_bytes, "the whole capped budget is used"


def test_an_mla_cache_fits_blocks_by_its_latent_bytes() -> None:
    """DeepSeek V3's layers cache one row a token, its latent and rotary key (engine.runner.latent_attention):
    2 layers of 32 + 8 float32 values."""
    blocks, _, block_bytes = sizes(GiB // 64, tiny_family_config("deepseek_v3"))
    assert block_bytes == 2 * (32 + 8) * 4 * 16
    assert blocks == [GiB // 64 // block_bytes], (blocks, block_bytes)


def test_the_cpu_caps_the_budget_at_4_gib_unless_a_fraction_lifts_it_or_kv_cache_memory_replaces_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caps: list[int | None] = []
    original = cache_plan.resolve_cache_sizes

    def recording(*args: Any, **kwargs: Any) -> tuple[list[int], int]:
        caps.append(kwargs.get("max_budget_bytes"))
        return original(*args, **kwargs)

    monkeypatch.setattr(cache_plan, "resolve_cache_sizes", recording)
    model = tiny_model("llama")
    for config in (
        ContinuousBatchingConfig(page_size=16, max_batch_tokens=256),
        ContinuousBatchingConfig(page_size=16, max_batch_tokens=256, max_memory_percent=0.5),
        ContinuousBatchingConfig(page_size=16, max_batch_tokens=256, kv_cache_memory=8.0),
    ):
        # Released: an engine gives the shared model its own layers back.
        EngineCore(model, config).release_model()
    assert caps == [DEFAULT_CPU_CACHE_BUDGET_BYTES, None, 8 * GiB]


def test_kv_cache_memory_bounds_the_cache_bytes() -> None:
    model = tiny_model("llama")
    cache_bytes = []
    for gib in (1 / 64, 1 / 16):
        config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=256, kv_cache_memory=gib)
        plan = cache_plan.plan_cache(model, config, tp_size=1)
        cache_bytes.append(sum(plan.num_blocks) * plan.shape.bytes_per_token() * config.page_size)
        assert cache_bytes[-1] <= gib * GiB, f"{cache_bytes[-1]} bytes of KV cache for kv_cache_memory={gib}"
    assert cache_bytes[0] < cache_bytes[1], cache_bytes
