"""The conformance matrix: every causal-LM family of the installed transformers is served with
`model.generate`'s greedy tokens or refused at load with what the engine lacks (engine.families).

A served family runs a tiny random model (tests/helpers/families.py) with one prompt alone and three
batched, one of them longer than any sliding window; a refused family is refused before anything is
built, through the public API, with the table's reason in the message.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig, PretrainedConfig

from engine import ContinuousBatchingConfig, generate_batch
from engine.errors import UnsupportedModelError
from engine.families import REFUSED_FAMILIES, SERVED_FAMILIES, UNVERIFIED_FAMILY, refusal_reason
from engine.runner.kv_cache import KVCacheShape
from engine.runner.own_attention.alibi import geometric_slopes, mpt_slopes
from engine.runner.own_attention.registry import ADAPTERS
from tests.helpers.families import (
    LONG_PROMPT,
    causal_lm_families,
    tiny_family_config,
    tiny_family_model,
    weightless_family_model,
)
from tests.helpers.models import random_prompt
from tests.helpers.oracle import reference_greedy

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 10
PROMPT_LENGTHS = (5, 31, LONG_PROMPT)
CONFIG = dict(page_size=8, num_blocks=96, max_batch_tokens=64)


def engine_tokens(model, prompts: list[list[int]], **config) -> list[list[int]]:
    outputs = generate_batch(
        model,
        prompts,
        generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None),
        continuous_batching_config=ContinuousBatchingConfig(**{**CONFIG, **config}),
        warmup=False,
    )
    errors = [output.error for output in outputs.values() if output.error]
    assert not errors, errors[0]
    return [list(output.generated_tokens) for output in outputs.values()]


def test_every_causal_lm_family_is_either_served_or_refused_by_name():
    installed = set(causal_lm_families())
    unclassified = sorted(installed - SERVED_FAMILIES - set(REFUSED_FAMILIES))
    assert not unclassified, f"families of the installed transformers in neither table: {unclassified}"
    both = sorted(SERVED_FAMILIES & set(REFUSED_FAMILIES))
    assert not both, f"families both served and refused: {both}"


def test_the_readme_counts_the_families_these_tables_serve():
    readme = (ROOT / "README.md").read_text()
    served, installed = len(SERVED_FAMILIES), len(SERVED_FAMILIES) + len(REFUSED_FAMILIES)
    claim = f"{served} of the {installed} model types of transformers"
    assert claim in readme, f"README.md should say {claim!r}: it counts another number"


def test_the_documented_family_table_is_the_one_these_tables_give():
    check = subprocess.run(
        [sys.executable, "scripts/generate_family_table.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("model_type", sorted(SERVED_FAMILIES))
def test_a_served_family_gives_model_generates_greedy_tokens_alone_and_batched(model_type):
    model = tiny_family_model(model_type)
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    expected = [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    assert len({tuple(tokens) for tokens in expected}) > 1, (
        f"{model_type}: every prompt gives the same tokens, so parity would prove nothing: {expected}"
    )
    runs = {"alone": engine_tokens(model, prompts[-1:]), "batched": engine_tokens(model, prompts)}
    for label, (got, wanted) in (
        ("alone", (runs["alone"], expected[-1:])),
        ("batched", (runs["batched"], expected)),
    ):
        for prompt, tokens, reference in zip(prompts[-len(got) :], got, wanted, strict=True):
            assert tokens == reference, (
                f"{model_type} {label}, prompt of {len(prompt)} tokens, differs from model.generate\n"
                f"  engine:   {tokens}\n  generate: {reference}"
            )


# The gather path (no kernel) and steps of 16 tokens, which split every prompt into chunks beside decodes.
@pytest.mark.parametrize(
    "config", [dict(max_blocks_per_request=0), dict(max_batch_tokens=16)], ids=["gather", "chunked"]
)
def test_attention_sinks_give_model_generates_tokens_on_every_attention_path(config):
    model = tiny_family_model("gpt_oss")  # sinks on every layer, sliding and full layers alternating
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    expected = [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    assert engine_tokens(model, prompts, **config) == expected


def test_chunked_attention_is_refused_where_only_the_gather_path_would_run_it():
    with pytest.raises(ValueError, match="chunked attention layers"):
        engine_tokens(tiny_family_model("llama4_text"), [random_prompt(5, seed=5)], max_blocks_per_request=0)


def test_llama4_position_scaled_queries_bound_requests_below_floor_scale():
    """Its layers without rotary embeddings scale queries by the token's index in the input, which the
    engine's packed steps do not keep: exact only below floor_scale, so requests are bounded there."""
    config = tiny_family_config("llama4_text")
    config.floor_scale = 32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="at most 31") as refused:
        engine_tokens(model, [random_prompt(25, seed=25)])  # 25 + 10 new tokens
    assert "the shorter length the engine computes it exactly up to" in str(refused.value)
    prompts = [random_prompt(length, seed=length) for length in (5, 21)]
    assert engine_tokens(model, prompts) == [
        reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts
    ]


@pytest.mark.parametrize("model_type", sorted(REFUSED_FAMILIES))
def test_a_refused_family_is_refused_at_load_naming_what_the_engine_lacks(model_type):
    model = weightless_family_model(model_type)
    if model is None:  # its default config builds no model: the engine would read the type alone
        config = PretrainedConfig()
        config.model_type = model_type
        assert refusal_reason(config) == REFUSED_FAMILIES[model_type]
        return
    # A multimodal family's causal-LM class is built on its text config, which the engine reads: where
    # that family is served (Llama 4's text model), only the multimodal class itself is refused.
    served_type = model.config.model_type
    if served_type in SERVED_FAMILIES:
        assert served_type != model_type, f"{model_type} is both served and refused"
        return
    with pytest.raises(UnsupportedModelError) as refused:
        generate_batch(model, [[3, 4, 5]], max_new_tokens=1, warmup=False)
    message = str(refused.value)
    assert f"cannot serve {type(model).__name__} (model type {served_type!r})" in message, message
    assert REFUSED_FAMILIES.get(served_type, UNVERIFIED_FAMILY) in message, message


def test_a_family_outside_both_tables_is_refused_as_unverified():
    config = tiny_family_config("llama")
    config.model_type = "llama_from_the_future"
    assert refusal_reason(config) == UNVERIFIED_FAMILY


@pytest.mark.parametrize(
    ("layer_kind", "lacking"),
    [
        ("linear_attention", "recurrent state"),
        ("conv", "convolution state"),
        ("moe_attention", "'moe_attention'"),
    ],
)
def test_a_served_family_with_a_layer_kind_the_engine_lacks_is_refused_naming_it(layer_kind, lacking):
    model = tiny_family_model("qwen2")
    model.config.layer_types = ["full_attention", layer_kind]
    with pytest.raises(UnsupportedModelError, match=lacking):
        generate_batch(model, [[3, 4, 5]], max_new_tokens=1, warmup=False)


# Families whose attention module the engine stands in for (engine.runner.own_attention), on the gather
# path and with prompts split into chunks beside decodes.
@pytest.mark.parametrize(
    "config", [dict(max_blocks_per_request=0), dict(max_batch_tokens=16)], ids=["gather", "chunked"]
)
@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_an_adapted_family_gives_model_generates_tokens_on_every_attention_path(model_type, config):
    model = tiny_family_model(model_type)
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    expected = [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    assert engine_tokens(model, prompts, **config) == expected


@pytest.mark.parametrize(
    "layout",
    [
        dict(new_decoder_architecture=True, num_kv_heads=2),
        dict(multi_query=False, parallel_attn=False),
    ],
    ids=["grouped_query", "one_key_per_head"],
)
def test_falcons_other_rotary_layouts_give_model_generates_tokens(layout):
    config = tiny_family_config("falcon")
    for name, value in layout.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    assert engine_tokens(model, prompts) == [
        reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts
    ]


@pytest.mark.parametrize(
    ("layout", "kv_heads"),
    [
        (dict(), 1),
        (dict(new_decoder_architecture=True, num_kv_heads=2), 2),
        (dict(multi_query=False, parallel_attn=False), 4),
    ],
    ids=["multi_query", "grouped_query", "one_key_per_head"],
)
def test_falcons_cache_holds_the_key_heads_its_layout_computes(layout, kv_heads):
    """FalconConfig has no num_key_value_heads: the cache reads each layout's own fields, so a
    multi-query Falcon caches one head, not one per query head."""
    config = tiny_family_config("falcon")
    for name, value in layout.items():
        setattr(config, name, value)
    shape = KVCacheShape.from_model_config(config, torch.float32)
    assert (shape.num_kv_heads, shape.head_dim) == (kv_heads, 16), shape


# ALiBi families (engine.runner.own_attention.alibi) beside the conformance test's default configs: Falcon's
# ALiBi variant in each of its fused layouts, and Bloom with 6 heads, past the largest power of two.
ALIBI_CONFIGS = {
    "falcon_multi_query": ("falcon", dict(alibi=True)),
    "falcon_grouped_query": ("falcon", dict(alibi=True, new_decoder_architecture=True, num_kv_heads=2)),
    "falcon_one_key_per_head": ("falcon", dict(alibi=True, multi_query=False, parallel_attn=False)),
    "bloom_six_heads": ("bloom", dict(n_head=6, hidden_size=96)),
}


@pytest.mark.parametrize(
    "config",
    [dict(), dict(max_blocks_per_request=0), dict(max_batch_tokens=16)],
    ids=["kernel", "gather", "chunked"],
)
@pytest.mark.parametrize("variant", sorted(ALIBI_CONFIGS))
def test_alibi_configs_give_model_generates_tokens_alone_and_batched(variant, config):
    model_type, fields = ALIBI_CONFIGS[variant]
    model_config = tiny_family_config(model_type)
    for name, value in fields.items():
        setattr(model_config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).eval()
    prompts = [random_prompt(length, seed=length) for length in PROMPT_LENGTHS]
    expected = [reference_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    for label, batch, wanted in (("alone", prompts[-1:], expected[-1:]), ("batched", prompts, expected)):
        for prompt, tokens, reference in zip(
            batch, engine_tokens(model, batch, **config), wanted, strict=True
        ):
            assert tokens == reference, (
                f"{variant} {label}, prompt of {len(prompt)} tokens, differs from model.generate\n"
                f"  engine:   {tokens}\n  generate: {reference}"
            )


def test_falcon_alibi_is_served_only_where_its_bf16_bias_is_reproduced():
    """Falcon rounds each slope x key position to bf16: exact for power-of-two slopes below 256 positions,
    so 4 heads are served bounded there, and 32 heads (Falcon-RW-1B's) are refused."""
    config = tiny_family_config("falcon")
    config.alibi = True
    assert config.num_attention_heads == 4 and refusal_reason(config) is None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="at most 256") as refused:
        engine_tokens(model, [random_prompt(250, seed=250)])  # 250 + 10 new tokens
    assert "max_new_tokens" in str(refused.value)
    config.num_attention_heads, config.hidden_size = 32, 256
    reason = refusal_reason(config)
    assert reason is not None and "ALiBi variant with 32 heads" in reason and "1, 2, 4, 8 heads" in reason
    with torch.device("meta"):
        wide = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match="ALiBi variant with 32 heads"):
        engine_tokens(wide, [random_prompt(5, seed=5)])


@pytest.mark.parametrize("num_heads", range(1, 72))
def test_alibi_slopes_have_the_bits_of_the_models_own_bias(num_heads):
    """Bloom's slope * position at position 1, Falcon's (its bf16 slopes), MPT's relative to the last key."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    cpu = torch.device("cpu")
    two_tokens = torch.ones(1, 2, dtype=torch.long)
    slopes = geometric_slopes(num_heads, cpu)
    assert torch.equal(slopes, bloom_alibi(two_tokens, num_heads, torch.float32)[:, 0, 1])
    assert torch.equal(slopes.bfloat16().float(), falcon_alibi(two_tokens, num_heads, torch.float32)[:, 0, 1])
    assert torch.equal(mpt_slopes(num_heads, 8, cpu), -build_mpt_alibi_tensor(num_heads, 2)[:, 0, 0])


@pytest.mark.parametrize(
    ("config", "combination"),
    [
        (dict(batch_invariant=True), "with batch_invariant"),
        (dict(decode_compile_config=CompileConfig()), "with torch.compile"),
    ],
    ids=["batch_invariant", "compile"],
)
def test_an_adapted_family_is_refused_with_what_its_adapter_cannot_run_with(config, combination):
    with pytest.raises(UnsupportedModelError, match=f"gptj {combination}"):
        engine_tokens(tiny_family_model("gptj"), [random_prompt(5, seed=5)], **config)
