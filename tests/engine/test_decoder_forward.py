"""The engine's own forward for the Llama family (engine.runner.decoder_forward) and its fused operations.

That it computes what the model's own forward computes is asserted end to end elsewhere, on the models it
serves: greedy parity with `generate` (test_greedy_parity: Llama, Qwen3; test_sliding_window: Mistral)
and prompt logprobs within 1e-5 of a plain forward's (test_prompt_logprobs: Llama, Qwen2, Qwen3,
Mistral). Here: which models and configurations it serves, each fused operation against the
transformers code it replaces, and its layers in one C call (engine.runner.decoder_layers) against its
layer loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine import ContinuousBatchingConfig, init_continuous_batching
from engine.engine_core import EngineCore
from engine.request import Request, RequestStatus
from engine.runner import fused_ops
from engine.runner.decoder_forward import DecoderForward, unsupported_reason
from engine.runner.decoder_layers import DecoderLayers
from engine.sampling.params import SamplingParams
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import TEST_DEVICE, fresh_tiny_model, random_prompt, tiny_model


def _forwards(family: str, **config: object) -> set[str]:
    manager = init_continuous_batching(
        tiny_model(family), continuous_batching_config=ContinuousBatchingConfig(**config)
    )
    try:
        return {
            type(function).__name__
            for function in engine_core(manager).runner.forward_paths.functions.values()
        }
    finally:
        manager.destroy()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_llama_family_runs_the_engines_forward_on_both_paths_on_the_cpu(family):
    """On the CPU; on another device (CBSERVE_TEST_DEVICE) both paths run the model's own forward."""
    assert unsupported_reason(tiny_model(family)) is None
    own_forward = "function"  # engine.runner.forward_paths's eager closures
    expected = DecoderForward.__name__ if TEST_DEVICE.type == "cpu" else own_forward
    assert _forwards(family) == {expected}


def test_other_models_and_configurations_run_the_models_own_forward():
    assert "Gemma2ForCausalLM is not one of" in (unsupported_reason(tiny_model("gemma2")) or "")
    assert DecoderForward.__name__ not in _forwards("gemma2")
    # Batch-invariant forwards run under their own mode; the gather path has no kernel to feed.
    assert DecoderForward.__name__ not in _forwards("llama", batch_invariant=True)
    assert DecoderForward.__name__ not in _forwards("llama", max_blocks_per_request=0)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows of 128 spread over threads
def test_rms_norm_with_its_residual_equals_transformers_norm_of_the_sum(rows):
    generator = torch.Generator().manual_seed(rows)
    hidden, addend = (torch.randn(rows, 128, generator=generator) * 3 for _ in range(2))
    norm = LlamaRMSNorm(128, eps=1e-6)
    norm.weight.data = torch.randn(128, generator=generator)
    expected_sum = hidden + addend
    expected = norm(expected_sum)
    output = fused_ops.rms_norm(hidden, norm.weight, norm.variance_epsilon, addend)
    assert torch.equal(hidden, expected_sum), "the residual is not added in place exactly"
    # Only the mean of squares sums in another order: a few ulps of the output.
    torch.testing.assert_close(output, expected, rtol=4e-6, atol=1e-6)
    torch.testing.assert_close(fused_ops.rms_norm(hidden, norm.weight, 1e-6), expected, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 400])
def test_rotary_in_place_has_the_bits_of_apply_rotary_pos_emb(rows):
    generator = torch.Generator().manual_seed(rows)
    queries, keys = (
        torch.randn(rows, 4, 16, generator=generator),
        torch.randn(rows, 2, 16, generator=generator),
    )
    angles = torch.rand(rows, 8, generator=generator) * 100
    cos, sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), dim=-1).sin()
    # transformers' layout: [batch, heads, tokens, head_dim], angles [batch, tokens, head_dim].
    expected_queries, expected_keys = apply_rotary_pos_emb(
        queries.transpose(0, 1)[None], keys.transpose(0, 1)[None], cos[None], sin[None]
    )
    fused_ops.rotary(queries, cos, sin)
    fused_ops.rotary(keys, cos, sin)
    assert torch.equal(queries, expected_queries[0].transpose(0, 1))
    assert torch.equal(keys, expected_keys[0].transpose(0, 1))


def test_rotary_turns_strided_heads_of_a_wider_row():
    """Queries viewed out of a wider projection output: each row's heads are rotated, the rest untouched."""
    generator = torch.Generator().manual_seed(0)
    projection = torch.randn(3, 80, generator=generator)
    angles = torch.rand(3, 8, generator=generator)
    cos, sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), dim=-1).sin()
    expected, _ = apply_rotary_pos_emb(
        projection[:, :64].reshape(3, 4, 16).transpose(0, 1)[None],
        torch.zeros(1, 1, 3, 16),
        cos[None],
        sin[None],
    )
    untouched = projection[:, 64:].clone()
    fused_ops.rotary(projection[:, :64].view(3, 4, 16), cos, sin)
    assert torch.equal(projection[:, :64].view(3, 4, 16), expected[0].transpose(0, 1))
    assert torch.equal(projection[:, 64:], untouched)


@pytest.mark.parametrize("rows", [1, 300])
def test_silu_and_mul_equals_the_llama_mlp_gate(rows):
    generator = torch.Generator().manual_seed(rows)
    gate, up = (torch.randn(rows, 256, generator=generator) * 4 for _ in range(2))
    torch.testing.assert_close(fused_ops.silu_and_mul(gate, up), F.silu(gate) * up, rtol=2e-6, atol=1e-7)


def _step_until_done(engine: EngineCore, requests: list[Request]) -> None:
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    for request in requests:
        assert request.status == RequestStatus.FINISHED, request


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_every_layer_in_one_call_gives_the_bits_of_the_layer_loop(family, quantization):
    """Each step runs both: the module-at-a-time loop first, then every layer in one C call, on the same
    inputs (both write the same keys and values), at every row count: three requests' decode, prefill
    chunks of 42 rows, then, after those steps left their intermediates in the call's scratch, a prefill
    of 59 rows that grows it; quantized layers decode on the integer path and prefill on the float one.
    Mistral's prompts outrun its window of 24. On CPU models whatever the test device: the decoder
    forward serves the CPU."""
    config = ContinuousBatchingConfig(num_blocks=64, page_size=8, quantization=quantization)
    engine = EngineCore(fresh_tiny_model(family).cpu(), config)
    try:
        paths = engine.runner.forward_paths
        one_call_rows: list[int] = []
        for path, one_call in list(paths.functions.items()):
            assert isinstance(one_call, DecoderForward)
            loop = DecoderForward(one_call.model, one_call.own_forward, layers_in_one_call=False)

            def both(input_ids, position_ids, logits_indices, metadata, one_call=one_call, loop=loop):
                looped = loop(input_ids, position_ids, logits_indices, metadata)
                logits = one_call(input_ids, position_ids, logits_indices, metadata)
                assert torch.equal(logits, looped), (input_ids.shape, (logits - looped).abs().max())
                if one_call._layers_of(metadata) is not None:
                    one_call_rows.append(input_ids.shape[1])
                return logits

            paths.functions[path] = both
        for first, lengths in ((0, [5, 7, 30]), (3, [50, 9])):
            requests = [
                Request(f"r{index}", random_prompt(length, seed=index), SamplingParams(max_new_tokens=20))
                for index, length in enumerate(lengths, start=first)
            ]
            _step_until_done(engine, requests)
    finally:
        engine.release_model()
    assert 3 in one_call_rows and 42 in one_call_rows and max(one_call_rows) == 59, one_call_rows


def test_a_layer_wrapped_by_another_library_keeps_every_step_on_the_layer_loop():
    model = fresh_tiny_model("llama").cpu()  # the decoder forward serves the CPU, whatever the test device
    engine = EngineCore(model, ContinuousBatchingConfig(num_blocks=16, page_size=8))
    try:
        assert DecoderLayers.build(model) is not None
        layer = model.model.layers[1].mlp.up_proj
        installed = layer.forward
        layer.forward = lambda hidden: installed(hidden)  # another library's hook on the instance
        assert DecoderLayers.build(model) is None
        layer.forward = installed
        assert DecoderLayers.build(model) is not None
    finally:
        engine.release_model()
    assert DecoderLayers.build(model) is None, "a plain layer's calls run on the BLAS, not the kernel"
