"""The GPU's quantized formats, on the CPU: fp8 (engine.quantization.fp8), and int4 in tinygemm's tile
layout (engine.quantization.int4_tiles). `torch._scaled_mm` runs here through oneDNN, so the fp8 tests make
the very call an H100/H200 makes; tinygemm has a CPU twin of its kernel with the same scales and zeros,
which the int4 tests run the layout through. bench/gpu_check.sh runs this file on the GPU
(CBSERVE_TEST_DEVICE=cuda), where the engine tests take the GPU's paths.

fp8's bounds: a weight moves by at most 2^-4 of itself when rounded to e4m3 (3 mantissa bits), or half the
smallest subnormal step (2^-10) times its channel's scale; each input likewise within its row. So an
output moves by at most 2 * 2^-4 * sum_k |x_k| |w_k| (plus float32 summation and the subnormal terms) from
the full-precision product."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import ContinuousBatchingConfig, init_continuous_batching
from engine.quantization.formats import FP8_FORMATS, FP8_MAX, QuantizationError, quantize
from engine.quantization.int4_tiles import Int4Tiles, int4_tiles_linear
from engine.quantization.linear import QuantizedLinear
from engine.quantization.model import quantize_model, quantized_layers
from tests.helpers.engine_runs import generate_greedy, run_greedy
from tests.helpers.models import TEST_DEVICE, random_prompt, tiny_config
from tests.helpers.oracle import assert_greedy_parity

E4M3_RELATIVE = 2.0**-4
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10


def _tiny_llama(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float32
    )
    return model.to(TEST_DEVICE).eval()


@pytest.mark.parametrize("weight_format", FP8_FORMATS)
def test_an_fp8_weight_is_within_e4m3_rounding_of_the_original(weight_format):
    generator = torch.Generator().manual_seed(0)
    # Channels of very different magnitudes, one all zeros: with fp8 each gets its own scale, with
    # fp8_tensor the small ones fall among e4m3's subnormals.
    weight = torch.randn(48, 64, generator=generator) * torch.logspace(-3, 2, 48)[:, None]
    weight[7] = 0
    quantized = quantize("w", weight.to(TEST_DEVICE), weight_format)
    assert quantized.packed.dtype == torch.float8_e4m3fn and list(quantized.scales.shape) == [48, 1]
    scales = quantized.scales.cpu()
    # The largest weight of each channel (of the whole weight, for fp8_tensor) is e4m3's largest value.
    largest = quantized.packed.float().abs().amax(dim=1).cpu()
    if weight_format == "fp8":
        assert torch.equal(largest[scales[:, 0] != 1], torch.full((47,), FP8_MAX))
    else:
        assert largest.max() == FP8_MAX and torch.equal(scales, scales[:1].expand(48, 1))
    error = (quantized.dequantize().cpu() - weight).abs()
    bound = weight.abs() * E4M3_RELATIVE + scales * E4M3_SUBNORMAL_HALF_STEP
    assert bool((error <= bound).all()), f"worst excess {(error - bound).max().item()}"
    assert torch.equal(quantized.dequantize().cpu()[7], torch.zeros(64))


@pytest.mark.parametrize("weight_format", FP8_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_an_fp8_layer_is_within_its_bound_of_the_full_precision_product(weight_format, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 96, generator=generator)
    bias = torch.randn(80, generator=generator)
    inputs = torch.randn(rows, 96, generator=generator) * torch.logspace(-2, 1, rows)[:, None]
    quantized = quantize("layer.weight", weight.to(TEST_DEVICE), weight_format)
    layer = QuantizedLinear(quantized, None, "layer.weight")
    layer.bias = torch.nn.Parameter(bias.to(TEST_DEVICE))
    output = layer(inputs.to(TEST_DEVICE)).cpu()
    assert output.dtype == torch.float32 and output.shape == (rows, 80)
    expected = inputs @ weight.T + bias
    # Each weight and input within 2^-4 of itself or half a subnormal step of its scale (a row's, or the
    # call's for fp8_tensor); their products' errors add, plus float32 summation and the second order.
    input_scales = inputs.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    if weight_format == "fp8_tensor":
        input_scales = input_scales.amax().expand_as(input_scales)
    weight_scales = quantized.scales.cpu()
    magnitudes = inputs.abs() @ weight.abs().T
    subnormals = E4M3_SUBNORMAL_HALF_STEP * (
        input_scales * weight.abs().sum(dim=1) + inputs.abs().sum(dim=1, keepdim=True) * weight_scales.T
    )
    bound = (2 * E4M3_RELATIVE + 2.0**-8 + 96 * 2.0**-22) * magnitudes + 2 * subnormals + 1e-5
    excess = (output - expected).abs() - bound
    assert bool((excess <= 0).all()), f"worst excess {excess.max().item()} over the bound"
    # Leading dimensions pass through, and a step that keeps no rows gets none back.
    assert layer(inputs.to(TEST_DEVICE).view(1, rows, 96)).shape == (1, rows, 80)
    assert layer(torch.empty(0, 96, device=TEST_DEVICE)).shape == (0, 80)


@pytest.mark.parametrize("weight_format", [*FP8_FORMATS, "int4"])
def test_the_engine_on_quantized_weights_gives_generate_s_tokens_on_the_same_layers(weight_format):
    """fp8 rounds every layer's inputs, and a GPU's int4 layer rounds them to bfloat16, so the oracle is
    `generate` on the quantized model itself: the engine's paging, batching and sampling must add nothing
    to what the layers compute. On the CPU, int4 runs the engine's kernel; on a GPU, tinygemm's.
    fp8_tensor rounds a call's inputs with one scale for all its rows, so a row's result depends on the
    rows beside it, as in vLLM's per-tensor fp8: its prompts are served one at a time, each step then
    holding the rows `generate` gives the layers."""
    model = _tiny_llama(0)
    # Every decoder layer's seven, and the output layer but under fp8 (which keeps it full precision).
    output_layers = 0 if weight_format in FP8_FORMATS else 1
    assert quantize_model(model, weight_format) == 7 * tiny_config("llama").num_hidden_layers + output_layers
    assert isinstance(model.lm_head, QuantizedLinear) == (weight_format not in FP8_FORMATS)
    reference = copy.deepcopy(model)
    prompts = [random_prompt(length, seed=length) for length in (3, 30)]
    new_tokens = [16, 9]
    config = ContinuousBatchingConfig(page_size=16, num_blocks=32, quantization=weight_format)
    if weight_format == "fp8_tensor":
        generated = [
            generate_greedy(model, config, [prompt], [count])[0][0]
            for prompt, count in zip(prompts, new_tokens, strict=True)
        ]
    else:
        generated, _ = generate_greedy(model, config, prompts, new_tokens)
    assert_greedy_parity(reference, prompts, new_tokens, generated, weight_format)


@pytest.mark.parametrize("weight_format", [*FP8_FORMATS, "int4"])
def test_a_full_precision_update_is_quantized_into_the_layers(weight_format):
    model = _tiny_llama(0)
    new_weights = _tiny_llama(1).state_dict()
    config = ContinuousBatchingConfig(page_size=16, num_blocks=32, quantization=weight_format)
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        assert manager.update_weights(new_weights) == 2
        assert run_greedy(manager, [[1, 2, 3]], [2])[0], "the updated engine serves"
    finally:
        manager.destroy()
    for name, layer in quantized_layers(model).items():
        expected = quantize(name, new_weights[f"{name}.weight"], weight_format)
        # Bit for bit: the packed bytes and their scales (and, on a GPU, the int4 layout the kernel reads).
        assert torch.equal(layer.packed.view(torch.uint8), expected.packed.view(torch.uint8)), name
        assert torch.equal(layer.scales, expected.scales.to(layer.scales.device)), name
        if layer.int4_tiles is not None:
            layout = Int4Tiles.of(expected, layer.int4_tiles.device)
            assert torch.equal(layer.int4_tiles, layout.tiles), name
            assert torch.equal(layer.int4_scales_and_zeros, layout.scales_and_zeros), name


def test_layers_fp8_cannot_multiply_stay_full_precision_and_bad_weights_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 24), torch.nn.Linear(24, 16))
    assert quantize_model(model.to(TEST_DEVICE), "fp8") == 1  # out 24, then in 24: not multiples of 16
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is type(model[2]) is torch.nn.Linear
    with pytest.raises(QuantizationError, match=r"tensor 'layer\.weight' \(fp8\): the weight has non-finite"):
        quantize("layer.weight", torch.full((16, 16), float("inf")), "fp8")


def _int4_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, object]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    return weight, quantize("layer.weight", weight, "int4")


@pytest.mark.parametrize("in_features", [32, 64, 96, 256])
def test_the_int4_tile_layout_computes_the_weight_with_bfloat16_scales_and_zeros(in_features):
    """Every inner k-tile count (8, 4, 2) and group count: each weight is (q - 8) * scale + zero with
    zero = min + 8 * scale, both in bfloat16, and each group's scale lands on its own 32 inputs."""
    _, quantized = _int4_weight(32, in_features, in_features)  # the CPU twin wants out_features % 16
    layout = Int4Tiles.of(quantized, torch.device("cpu"))
    inputs = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1))
    output = int4_tiles_linear(inputs, layout.tiles, layout.scales_and_zeros, None)
    groups = in_features // 32
    scales = layout.scales_and_zeros[..., 0].T.float()  # [out, groups]
    zeros = layout.scales_and_zeros[..., 1].T.float()
    levels = quantized.dequantize().view(32, groups, 32) - quantized.mins[..., None]
    levels = torch.round(levels / quantized.scales[..., None])  # q, exactly: q * scale is exact in float32
    weight = ((levels - 8) * scales[..., None] + zeros[..., None]).view(32, in_features)
    rounded = inputs.to(torch.bfloat16).float()
    expected = rounded @ weight.T
    bound = 2.0**-8 * expected.abs() + in_features * 2.0**-22 * (rounded.abs() @ weight.abs().T) + 1e-6
    assert bool(((output - expected).abs() <= bound).all()), f"worst {(output - expected).abs().max().item()}"
    # And within bfloat16's rounding of the CPU kernel's weights.
    assert torch.allclose(weight, quantized.dequantize(), rtol=2.0**-6, atol=2.0**-6 * quantized.scales.max())


def test_an_int4_layer_on_tiles_follows_a_weight_update_in_place():
    """A GPU's int4 layer keeps tinygemm's layout beside its weight; an update writes both, into the
    layout's own storage (which captured CUDA graphs read). Run here with the CPU twin of the layout."""
    from engine.quantization.model import quantize_update

    _, quantized = _int4_weight(16, 64, 3)  # 16 outputs: the CPU twin's least
    layer = QuantizedLinear(quantized, None, "layer.weight")
    layout = Int4Tiles.of(quantized, torch.device("cpu"))
    layer.int4_tiles, layer.int4_scales_and_zeros = layout.tiles, layout.scales_and_zeros
    storage = layer.int4_tiles.data_ptr()
    inputs = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    before = layer(inputs)
    new_weight, new_quantized = _int4_weight(16, 64, 4)
    with torch.no_grad():
        for buffer, value in quantize_update("layer.weight", layer, new_weight):
            buffer.copy_(value)
    new_layout = Int4Tiles.of(new_quantized, torch.device("cpu"))
    expected = int4_tiles_linear(inputs, new_layout.tiles, new_layout.scales_and_zeros, None)
    assert layer.int4_tiles.data_ptr() == storage
    assert torch.equal(layer(inputs), expected) and not torch.equal(before, expected)
