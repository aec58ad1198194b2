"""Quantized linear layers (engine.quantization): the kernel against a dequantized reference, greedy parity
with `model.generate` on the dequantized weights, weight updates into a quantized engine, and the errors a
bad config or file gives.

Greedy parity holds on the kernel's exact path, float inputs (`quantize_activations=False`, the
`EXACT` configs here); the integer path's outputs are held to its own bound instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine import ContinuousBatchingConfig, init_continuous_batching
from engine.errors import WeightTransferError
from engine.quantization import kernel
from engine.quantization.formats import GROUP_SIZE, QuantizationError, quantize
from engine.quantization.linear import QuantizedLinear
from engine.quantization.model import quantize_model, quantized_layers
from tests.helpers.engine_runs import dequantized_copy, generate_greedy, run_greedy
from tests.helpers.families import tiny_family_model
from tests.helpers.models import random_prompt, tiny_config
from tests.helpers.oracle import assert_greedy_parity
from tests.helpers.update_group import Trainer, bucket_plan, join_group, push

FORMATS = ("int8", "int4")
PROMPTS = [random_prompt(length, seed=length) for length in (1, 5, 17, 40)]
NEW_TOKENS = [12, 20, 7, 16]
EXACT = {"quantize_activations": False}


def _tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def _dequantized_copy(quantized: torch.nn.Module, family: str) -> torch.nn.Module:
    return dequantized_copy(quantized, _tiny_model(family))


def _summation_bound(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Two float32 dot products of length K over the same values differ by at most 2 K u sum |x w|
    (u = 2^-24; each is within K u of the exact sum): the kernel sums in another order than the BLAS."""
    in_features = inputs.shape[-1]
    return 2 * in_features * 2.0**-24 * (inputs.abs() @ weight.abs().T) + 1e-6


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 32])
def test_quantized_linear_matches_the_dequantized_weight_within_the_summation_bound(weight_format, rows):
    generator = torch.Generator().manual_seed(rows)
    # 101 outputs: not a multiple of the kernel's channel tile; 3 groups of 32 inputs.
    weight = torch.randn(101, 96, generator=generator)
    bias = torch.randn(101, generator=generator)
    inputs = torch.randn(rows, 96, generator=generator)
    quantized = quantize("layer.weight", weight, weight_format)
    layer = QuantizedLinear(quantized, torch.nn.Parameter(bias), "layer.weight")
    layer.quantize_activations = False
    dequantized = quantized.dequantize()
    output = layer(inputs)
    expected = F.linear(inputs, dequantized, bias)
    excess = (output - expected).abs() - _summation_bound(inputs, dequantized)
    assert excess.max() <= 0, f"{weight_format}, {rows} rows: beyond the bound by {excess.max().item()}"


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("rows", range(1, kernel.INTEGER_MAX_ROWS + 1))
def test_the_integer_path_moves_an_output_by_at_most_half_an_input_step_times_the_weights(
    weight_format, rows
):
    """Each input of a group moves by at most half its step d = max|x| / 127 when quantized to int8, so an
    output moves by at most sum over groups of d / 2 * sum |w| (and the float sums' own rounding)."""
    generator = torch.Generator().manual_seed(100 + rows)
    weight = torch.randn(101, 96, generator=generator)
    bias = torch.randn(101, generator=generator)
    inputs = torch.randn(rows, 96, generator=generator) * torch.logspace(-2, 1, 96)  # groups of unlike scales
    quantized = quantize("layer.weight", weight, weight_format)
    layer = QuantizedLinear(quantized, torch.nn.Parameter(bias), "layer.weight")
    dequantized = quantized.dequantize()
    output = layer(inputs)
    expected = F.linear(inputs, dequantized, bias)
    steps = inputs.view(rows, -1, GROUP_SIZE).abs().amax(-1) / 127  # [rows, groups]
    weight_sums = dequantized.abs().view(101, -1, GROUP_SIZE).sum(-1)  # [out, groups]
    bound = steps / 2 @ weight_sums.T + 2 * _summation_bound(inputs, dequantized)
    excess = (output - expected).abs() - bound
    assert excess.max() <= 0, f"{weight_format}, {rows} rows: beyond the bound by {excess.max().item()}"
    layer.quantize_activations = False
    assert not torch.equal(output, layer(inputs)), "the call did not take the integer path"


@pytest.mark.parametrize("weight_format", FORMATS)
@pytest.mark.parametrize("quantize_activations", [False, True], ids=["float", "integer"])
# 2048 outputs: 32 rows are work enough for every thread (kernel.MIN_WORK_PER_THREAD), one row is not.
@pytest.mark.parametrize("out_features", [64, 2048])
def test_a_row_gets_the_same_bits_whatever_else_shares_the_call(
    weight_format, quantize_activations, out_features
):
    """On either path: the float path at any number of rows, the integer one up to its most."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, 128, generator=generator)
    layer = QuantizedLinear(quantize("w", weight, weight_format), None, "w")
    layer.quantize_activations = quantize_activations
    inputs = torch.randn(kernel.INTEGER_MAX_ROWS if quantize_activations else 32, 128, generator=generator)
    together = layer(inputs)
    for row in sorted({0, 1, 2, 3, len(inputs) - 1}):
        assert torch.equal(layer(inputs[row : row + 1])[0], together[row]), f"row {row}"


def test_the_engine_gives_every_quantized_layer_its_activations_setting():
    for setting in (True, False):
        model = _tiny_model("llama")
        config = ContinuousBatchingConfig(
            page_size=16, num_blocks=64, quantization="int8", quantize_activations=setting
        )
        manager = init_continuous_batching(model, continuous_batching_config=config)
        try:
            manager.start()
        finally:
            manager.destroy()
        assert {layer.quantize_activations for layer in quantized_layers(model).values()} == {setting}


@pytest.mark.parametrize("weight_format", FORMATS)
def test_leading_dims_and_bf16_inputs_keep_their_shape_and_dtype(weight_format):
    layer = QuantizedLinear(quantize("w", torch.randn(48, 64), weight_format), None, "w")
    inputs = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    output = layer(inputs)
    assert output.shape == (2, 3, 48) and output.dtype == torch.bfloat16
    # A step that keeps no logits calls the output layer on no rows, on either path.
    for quantize_activations in (True, False):
        layer.quantize_activations = quantize_activations
        assert layer(torch.empty(0, 64)).shape == (0, 48)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_quantizing_rounds_each_weight_to_within_half_a_step_of_its_group(weight_format):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    quantized = quantize("w", weight, weight_format)
    groups = weight.view(16, -1, GROUP_SIZE)
    if weight_format == "int8":
        step = groups.abs().amax(-1) / 127
    else:
        step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (quantized.dequantize() - weight).abs().view(16, -1, GROUP_SIZE)
    assert (error <= step[..., None] / 2 * (1 + 1e-5)).all(), (error / step[..., None]).max()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("weight_format", FORMATS)
def test_a_quantized_engine_matches_generate_on_the_dequantized_weights(family, weight_format):
    model = _tiny_model(family)
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64, quantization=weight_format, **EXACT)
    generated, _ = generate_greedy(model, config, PROMPTS, NEW_TOKENS)
    layers = quantized_layers(model)
    # Every linear layer: 7 a decoder layer, and the output layer.
    assert len(layers) == 7 * model.config.num_hidden_layers + 1
    assert {layer.weight_format for layer in layers.values()} == {weight_format}
    assert_greedy_parity(_dequantized_copy(model, family), PROMPTS, NEW_TOKENS, generated, weight_format)


@pytest.mark.parametrize("weight_format", FORMATS)
def test_falcons_linear_subclass_is_quantized_and_matches_generate_on_the_dequantized_weights(weight_format):
    """FalconLinear subclasses nn.Linear with a forward that is exactly its linear map: it is quantized
    like a plain layer, not left in full precision."""
    model = tiny_family_model("falcon")
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64, quantization=weight_format, **EXACT)
    generated, _ = generate_greedy(model, config, PROMPTS, NEW_TOKENS)
    layers = quantized_layers(model)
    # Every linear layer: 4 a decoder layer (fused projection, dense, the MLP's two), and the output layer.
    assert len(layers) == 4 * model.config.num_hidden_layers + 1, sorted(layers)
    assert not [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    blank = tiny_family_model("falcon")
    assert_greedy_parity(dequantized_copy(model, blank), PROMPTS, NEW_TOKENS, generated, weight_format)


def test_a_linear_subclass_whose_forward_is_not_known_stays_full_precision_named_in_the_log(caplog):
    class Router(torch.nn.Linear):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states).topk(2).values

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), Router(64, 8))
    with caplog.at_level("WARNING", logger="engine.quantization.model"):
        assert quantize_model(model, "int8") == 1
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is Router
    assert "1 linear layers stay full precision under int8" in caplog.text and "1 (Router)" in caplog.text


@pytest.mark.parametrize("weight_format", FORMATS)
def test_a_full_precision_push_into_a_quantized_engine_serves_its_quantization(weight_format):
    model = _tiny_model("llama")
    pushed = _tiny_model("llama", seed=7)
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64, quantization=weight_format, **EXACT)
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        before = run_greedy(manager, PROMPTS, NEW_TOKENS)
        manager.update_weights(pushed.state_dict())
        after = run_greedy(manager, PROMPTS, NEW_TOKENS)
    finally:
        manager.destroy()
    assert after != before, "the push changed nothing"
    expected = pushed
    quantize_model(expected, weight_format)
    assert_greedy_parity(_dequantized_copy(expected, "llama"), PROMPTS, NEW_TOKENS, after, "after the push")


def test_a_push_over_the_weight_update_group_into_a_quantized_engine_serves_its_quantization():
    """A trainer broadcasts full-precision buckets, as it does to any server; the quantized layers
    quantize them as each bucket lands."""
    model = _tiny_model("llama")
    pushed = _tiny_model("llama", seed=7)
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64, quantization="int4", **EXACT)
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    trainer = Trainer()
    try:
        join_group(manager, trainer)
        state = pushed.state_dict()
        names = list(state)
        plan = bucket_plan(
            [[(name, state[name]) for name in names[:5]], [(name, state[name]) for name in names[5:]]]
        )
        push(manager, trainer, plan, state).result(timeout=60)
        after = run_greedy(manager, PROMPTS, NEW_TOKENS)
    finally:
        trainer.shutdown()
        manager.destroy()
    expected = pushed
    quantize_model(expected, "int4")
    assert_greedy_parity(_dequantized_copy(expected, "llama"), PROMPTS, NEW_TOKENS, after, "after the push")


def test_a_bucket_whose_weight_does_not_quantize_fails_before_any_of_it_is_written():
    model = _tiny_model("llama")
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64, quantization="int8")
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    norm = model.get_submodule("model.layers.0.input_layernorm").weight
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    norm_before, packed_before = norm.detach().clone(), layer.packed.clone()
    trainer = Trainer()
    try:
        join_group(manager, trainer)
        tensors = {
            "model.layers.0.input_layernorm.weight": torch.full_like(norm_before, 2.0),
            "model.layers.0.mlp.down_proj.weight": torch.full((64, 128), float("nan")),
        }
        plan = bucket_plan([list(tensors.items())])
        with pytest.raises(WeightTransferError, match=r"weights unchanged.*down_proj\.weight' \(int8\)"):
            push(manager, trainer, plan, tensors).result(timeout=60)
        assert torch.equal(norm.detach(), norm_before) and torch.equal(layer.packed, packed_before)
        assert not manager.stats().weights_incomplete
    finally:
        trainer.shutdown()
        manager.destroy()


def test_a_push_of_a_wrong_shape_into_a_quantized_layer_names_it_and_changes_nothing():
    model = _tiny_model("llama")
    quantize_model(model, "int4")
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    packed = layer.packed.clone()
    manager = init_continuous_batching(
        model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=16)
    )
    manager.start()
    try:
        with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\[64, 64\]"):
            manager.update_weights({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 64)})
    finally:
        manager.destroy()
    assert torch.equal(layer.packed, packed)


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_a_tied_output_layer_is_quantized_and_follows_updates_of_the_embedding(name):
    """A tied model's checkpoint keeps one name for the shared table, either one (safetensors'
    `save_model` keeps lm_head.weight): an update of either writes the embedding and the output layer."""
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    quantize_model(model, "int8")
    embedding = torch.randn_like(model.get_input_embeddings().weight)
    from engine.weights.tensors import apply_weights, stage_weights

    apply_weights(stage_weights(model, {name: embedding}))
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert torch.equal(
        model.lm_head.quantized_weight.dequantize(), quantize("e", embedding, "int8").dequantize()
    )


def test_layers_whose_inputs_do_not_fill_groups_stay_full_precision():
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 4))
    assert quantize_model(model, "int8") == 1
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is torch.nn.Linear


def test_a_weight_that_cannot_be_quantized_is_named_with_the_format():
    with pytest.raises(
        QuantizationError, match=r"tensor 'layer\.weight' \(int4\): the weight has non-finite"
    ):
        quantize("layer.weight", torch.full((4, 32), float("nan")), "int4")
    with pytest.raises(QuantizationError, match=r"tensor 'w' \(int8\): in_features 40 is not a multiple"):
        quantize("w", torch.zeros(4, 40), "int8")


def test_config_names_the_field_and_the_allowed_values():
    allowed = "'none', 'int8', 'int4', 'fp8', 'fp8_tensor'"
    with pytest.raises(ValueError, match=rf"quantization must be one of {allowed}, got 'int3'"):
        ContinuousBatchingConfig(quantization="int3")
    with pytest.raises(ValueError, match=r"batch_invariant needs full-precision linear layers"):
        ContinuousBatchingConfig(batch_invariant=True, quantization="int8", max_blocks_per_request=64)
    assert ContinuousBatchingConfig().quantization == "none"
