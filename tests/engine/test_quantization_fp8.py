"""fp8 weights (engine.quantization.fp8), the GPU's format, on the CPU: `torch._scaled_mm` runs here through
oneDNN, so these tests make the very call an H100/H200 makes (bench/gpu_check.sh runs them there too, with
CBSERVE_TEST_DEVICE=cuda).

The bounds: a weight moves by at most 2^-4 of itself when rounded to e4m3 (3 mantissa bits), or half the
smallest subnormal step (2^-10) times its channel's scale; each input likewise within its row. So an
output moves by at most 2 * 2^-4 * sum_k |x_k| |w_k| (plus float32 summation and the subnormal terms) from
the full-precision product."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import ContinuousBatchingConfig, init_continuous_batching
from engine.quantization.formats import FP8_MAX, QuantizationError, quantize
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


def test_an_fp8_weight_is_within_e4m3_rounding_of_the_original():
    generator = torch.Generator().manual_seed(0)
    # Channels of very different magnitudes, one all zeros: each gets its own scale.
    weight = torch.randn(48, 64, generator=generator) * torch.logspace(-3, 2, 48)[:, None]
    weight[7] = 0
    quantized = quantize("w", weight.to(TEST_DEVICE), "fp8")
    assert quantized.packed.dtype == torch.float8_e4m3fn and list(quantized.scales.shape) == [48, 1]
    scales = quantized.scales.cpu()
    # The largest weight of each channel is e4m3's largest value.
    assert torch.equal(
        quantized.packed.float().abs().amax(dim=1).cpu()[scales[:, 0] != 1], torch.full((47,), FP8_MAX)
    )
    error = (quantized.dequantize().cpu() - weight).abs()
    bound = weight.abs() * E4M3_RELATIVE + scales * E4M3_SUBNORMAL_HALF_STEP
    assert bool((error <= bound).all()), f"worst excess {(error - bound).max().item()}"
    assert torch.equal(quantized.dequantize().cpu()[7], torch.zeros(64))


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_an_fp8_layer_is_within_its_bound_of_the_full_precision_product(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 96, generator=generator)
    bias = torch.randn(80, generator=generator)
    inputs = torch.randn(rows, 96, generator=generator) * torch.logspace(-2, 1, rows)[:, None]
    layer = QuantizedLinear(quantize("layer.weight", weight.to(TEST_DEVICE), "fp8"), None, "layer.weight")
    layer.bias = torch.nn.Parameter(bias.to(TEST_DEVICE))
    output = layer(inputs.to(TEST_DEVICE)).cpu()
    assert output.dtype == torch.float32 and output.shape == (rows, 80)
    expected = inputs @ weight.T + bias
    magnitudes = inputs.abs() @ weight.abs().T
    bound = 2 * E4M3_RELATIVE * magnitudes + 96 * 2.0**-22 * magnitudes + 1e-5
    excess = (output - expected).abs() - bound
    assert bool((excess <= 0).all()), f"worst excess {excess.max().item()} over the bound"
    # Leading dimensions pass through, and a step that keeps no rows gets none back.
    assert layer(inputs.to(TEST_DEVICE).view(1, rows, 96)).shape == (1, rows, 80)
    assert layer(torch.empty(0, 96, device=TEST_DEVICE)).shape == (0, 80)


def test_the_engine_on_fp8_weights_gives_generate_s_tokens_on_the_same_layers():
    """fp8 rounds every layer's inputs, so its oracle is `generate` on the fp8 model itself: the engine's
    paging, batching and sampling must add nothing to what the layers compute."""
    model = _tiny_llama(0)
    assert quantize_model(model, "fp8") == 7 * tiny_config("llama").num_hidden_layers + 1
    reference = copy.deepcopy(model)
    prompts = [random_prompt(length, seed=length) for length in (3, 30)]
    new_tokens = [16, 9]
    config = ContinuousBatchingConfig(page_size=16, num_blocks=32, quantization="fp8")
    generated, _ = generate_greedy(model, config, prompts, new_tokens)
    assert_greedy_parity(reference, prompts, new_tokens, generated, "fp8")


def test_a_full_precision_update_is_quantized_into_the_fp8_layers():
    model = _tiny_llama(0)
    new_weights = _tiny_llama(1).state_dict()
    config = ContinuousBatchingConfig(page_size=16, num_blocks=32, quantization="fp8")
    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.start()
    try:
        assert manager.update_weights(new_weights) == 2
        assert run_greedy(manager, [[1, 2, 3]], [2])[0], "the updated engine serves"
    finally:
        manager.destroy()
    for name, layer in quantized_layers(model).items():
        expected = quantize(name, new_weights[f"{name}.weight"], "fp8")
        # Bit for bit: the float8 bytes and their scales.
        assert torch.equal(layer.packed.view(torch.uint8), expected.packed.view(torch.uint8)), name
        assert torch.equal(layer.scales, expected.scales), name


def test_layers_fp8_cannot_multiply_stay_full_precision_and_bad_weights_are_named():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 24), torch.nn.Linear(24, 16))
    assert quantize_model(model.to(TEST_DEVICE), "fp8") == 1  # out 24, then in 24: not multiples of 16
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is type(model[2]) is torch.nn.Linear
    with pytest.raises(QuantizationError, match=r"tensor 'layer\.weight' \(fp8\): the weight has non-finite"):
        quantize("layer.weight", torch.full((16, 16), float("inf")), "fp8")
