"""On the CPU, the engine runs linear layers on weights packed once (engine.runner.packed_linear):
float32 layers on its kernel's panels, others for oneDNN. Outputs stay exact, the packed copies follow
every weight change, and the model gets its own layers back when the engine is done.

The tiny test models' weights are far below the size where oneDNN's packing pays, so these tests pack
every linear layer (`pack_every_linear`); they run on the CPU whatever CBSERVE_TEST_DEVICE says, since
packing is a CPU path.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from engine.engine_core import packs_linear_weights
from engine.runner import packed_linear
from engine.runner.packed_linear import PackedLinears
from tests.helpers.models import fresh_tiny_model, random_prompt, seeded_tiny_llama
from tests.helpers.oracle import reference_greedy

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def pack_every_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT_ELEMENTS", 0)


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [module for module in model.modules() if isinstance(module, torch.nn.Linear)]


def _packed_layers(model: torch.nn.Module) -> int:
    return sum("forward" in module.__dict__ for module in _linears(model))


def _manager(model: torch.nn.Module) -> ContinuousBatchingManager:
    config = ContinuousBatchingConfig(page_size=8, num_blocks=128, max_batch_tokens=128)
    manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    manager.start()
    return manager


def _generate(manager: ContinuousBatchingManager, prompt: list[int], count: int) -> list[int]:
    request_id = manager.add_request(prompt, max_new_tokens=count, eos_token_id=[])
    output = manager.get_result(request_id, timeout=120)
    assert output is not None and output.status == RequestStatus.FINISHED, output
    return output.generated_tokens


def _assert_equal(engine_tokens: list[int], expected: list[int], what: str) -> None:
    assert engine_tokens == expected, f"{what}\n  engine:   {engine_tokens}\n  generate: {expected}"


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2"])
def test_greedy_outputs_on_packed_weights_equal_generate(family: str) -> None:
    model = fresh_tiny_model(family).to(CPU)
    prompts = [random_prompt(length, seed=length) for length in (5, 40, 120)]
    manager = _manager(model)
    try:
        assert _packed_layers(model) == len(_linears(model)), "every linear layer should run packed"
        generated = [_generate(manager, prompt, 24) for prompt in prompts]
    finally:
        manager.destroy()
    assert _packed_layers(model) == 0, "destroy should give every layer its own forward back"
    for index, (prompt, tokens) in enumerate(zip(prompts, generated, strict=True)):
        _assert_equal(tokens, reference_greedy(model, prompt, 24), f"{family} request {index}")


def test_packed_layers_follow_update_weights() -> None:
    model = fresh_tiny_model("llama").to(CPU)
    prompt = random_prompt(30, seed=3)
    other = seeded_tiny_llama(123)
    manager = _manager(model)
    try:
        before = _generate(manager, prompt, 12)
        manager.update_weights(other.state_dict())
        after = _generate(manager, prompt, 12)
    finally:
        manager.destroy()
    _assert_equal(after, reference_greedy(other, prompt, 12), "after update_weights")
    assert after != before


def test_packed_layers_follow_in_place_writes_by_the_caller() -> None:
    """A colocated trainer's optimizer writes the parameters in place between requests. (Written this way,
    the prefix cache is not reset, so the request after the write has a prompt of its own.)"""
    model = fresh_tiny_model("llama").to(CPU)
    first, second = random_prompt(30, seed=4), random_prompt(30, seed=5)
    other = seeded_tiny_llama(321)
    manager = _manager(model)
    try:
        _generate(manager, first, 12)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(other.get_parameter(name))
        after = _generate(manager, second, 12)
    finally:
        manager.destroy()
    _assert_equal(after, reference_greedy(other, second, 12), "after writing the parameters in place")


def test_a_packed_layer_computes_what_linear_does_and_keeps_gradients() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 96)
    packed = PackedLinears(layer)
    inputs = torch.randn(2, 5, 48, requires_grad=True)
    try:
        assert packed.num_packed == 1
        with torch.inference_mode():
            torch.testing.assert_close(
                layer(inputs.detach()), F.linear(inputs.detach(), layer.weight, layer.bias)
            )
        # With gradients wanted the layer takes the differentiable path.
        layer(inputs).sum().backward()
        assert layer.weight.grad is not None and inputs.grad is not None
    finally:
        packed.restore()
    assert "forward" not in layer.__dict__


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every call the engine's kernel gets from a layer, in order."""
    calls: list[int] = []
    float_linear = packed_linear.kernel.float_linear

    def counted(
        inputs: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        calls.append(inputs.reshape(-1, inputs.shape[-1]).shape[0])
        return float_linear(inputs, panels, out_features, bias)

    monkeypatch.setattr(packed_linear.kernel, "float_linear", counted)
    return calls


def test_float32_calls_of_every_row_count_run_on_the_kernel_within_the_summation_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A float32 layer runs on the kernel's panels (97 channels: a last panel of one), whatever its size
    and however many rows; each row gets the same bits whatever rows share the call (tiles of six rows,
    blocks of rows), and every output is within float32's summation bound of the exact product."""
    calls = _count_kernel_calls(monkeypatch)
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT_ELEMENTS", 1 << 30)
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 97)
    packed = PackedLinears(layer)
    inputs = torch.randn(40, 48)
    try:
        assert packed.num_packed == 1
        with torch.inference_mode():
            alone = [layer(inputs[row : row + 1]) for row in range(len(inputs))]
            together = [layer(inputs[:count]) for count in (7, 40)]
    finally:
        packed.restore()
    assert "forward" not in layer.__dict__
    assert calls == [1] * 40 + [7, 40]
    for rows in together:
        assert torch.equal(torch.cat(alone)[: len(rows)], rows)
    exact = inputs.double() @ layer.weight.double().T + layer.bias.double()
    bound = 2 * 48 * 2.0**-24 * (inputs.abs() @ layer.weight.abs().T + layer.bias.abs())
    assert ((together[1].double() - exact).abs() <= bound.double() + 1e-7).all()


def test_a_repack_writes_the_panels_where_they_lie() -> None:
    """The one-call decoder (engine.runner.decoder_layers) holds the panels' address: a weight written in
    place is repacked into the same storage, and so is one whose panels sleep dropped."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 40, bias=False)
    packed = PackedLinears(layer)
    try:
        panelled = packed_linear.panelled_weight(layer)
        assert panelled is not None
        address = panelled.current(layer.weight).data_ptr()
        with torch.no_grad():
            layer.weight.mul_(2)
        inputs = torch.randn(3, 32)
        with torch.inference_mode():
            torch.testing.assert_close(layer(inputs), F.linear(inputs, layer.weight))
        assert panelled.current(layer.weight).data_ptr() == address
        # 40 channels in whole panels: three of 16 (AVX2), two of 32 (AVX-512).
        panel = packed_linear.kernel.panel_channels()
        assert packed.drop_copies() == -(-40 // panel) * panel * 32 * 4
        with torch.inference_mode():
            torch.testing.assert_close(layer(inputs), F.linear(inputs, layer.weight))
        assert panelled.current(layer.weight).data_ptr() == address
    finally:
        packed.restore()


def _mapping_of(address: int) -> dict[str, str]:
    """The fields of the /proc/self/smaps entry of the mapping holding `address`."""
    fields: dict[str, str] = {}
    holds = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(bound, 16) for bound in head.split("-"))
            holds = low <= address < high
        elif holds:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def test_a_models_panels_lie_in_one_mapping_on_huge_pages_which_sleep_gives_back() -> None:
    """Every float32 layer's panels, in the model's order, in one mapping that starts on a 2 MiB boundary
    and asks the kernel for huge pages where it has them (the weights a step streams then cost a page walk
    per 2 MiB, not per 4 KiB); dropping the copies hands its pages back and the layers still compute
    `F.linear`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 1024, bias=False) for _ in range(3)])
    packed = PackedLinears(model)
    try:
        panels = [packed_linear.panelled_weight(layer).current(layer.weight) for layer in model]  # type: ignore[union-attr]
        start = panels[0].data_ptr()
        assert start % (2 << 20) == 0
        for before, after in itertools.pairwise(panels):
            assert after.data_ptr() == before.data_ptr() + before.nbytes
        mapping = _mapping_of(start)
        # A kernel built without transparent huge pages has no such flag to set (nor this folder).
        if Path("/sys/kernel/mm/transparent_hugepage").exists():
            assert "hg" in mapping["VmFlags"].split(), mapping
        assert int(mapping["Rss"].split()[0]) * 1024 >= 3 * 512 * 1024 * 4
        assert packed.drop_copies() == 3 * 512 * 1024 * 4
        assert int(_mapping_of(start)["Rss"].split()[0]) * 1024 < 3 * 512 * 1024 * 4 // 10
        inputs = torch.randn(4, 512)
        with torch.inference_mode():
            torch.testing.assert_close(model[0](inputs), F.linear(inputs, model[0].weight))
    finally:
        packed.restore()


def test_without_the_kernel_a_layer_too_small_for_onednn_stays_on_the_blas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the engine's kernel cannot be built, float32 layers are packed for oneDNN only; there a layer
    below MIN_PACKED_WEIGHT_ELEMENTS keeps its own forward."""
    calls = _count_kernel_calls(monkeypatch)
    monkeypatch.setattr(packed_linear.kernel, "available", lambda: False)
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHT_ELEMENTS", 48 * 97 + 1)
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 97)
    packed = PackedLinears(layer)
    inputs = torch.randn(5, 48)
    try:
        assert packed.num_packed == 0 and "forward" not in layer.__dict__
        with torch.inference_mode():
            assert torch.equal(layer(inputs), F.linear(inputs, layer.weight, layer.bias))
    finally:
        packed.restore()
    assert calls == []


def test_bf16_layers_compute_what_linear_does_whether_or_not_this_cpu_packs_them() -> None:
    """oneDNN packs bf16 only on some CPUs; elsewhere the layers stay on the BLAS."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 128, dtype=torch.bfloat16)
    packed = PackedLinears(layer)
    inputs = torch.randn(7, 64, dtype=torch.bfloat16)
    try:
        with torch.inference_mode():
            torch.testing.assert_close(layer(inputs), F.linear(inputs, layer.weight, layer.bias))
    finally:
        packed.restore()


def test_weights_are_packed_only_for_eager_cpu_steps_when_turned_on() -> None:
    model = fresh_tiny_model("llama").to(CPU)
    assert packs_linear_weights(model, ContinuousBatchingConfig(), CPU)
    assert not packs_linear_weights(model, ContinuousBatchingConfig(pack_cpu_weights=False), CPU)
    assert not packs_linear_weights(model, ContinuousBatchingConfig(default_compile_level=1), CPU)
    assert not packs_linear_weights(model, ContinuousBatchingConfig(), torch.device("cuda"))


def test_sleep_level_2_frees_the_packed_copies_and_the_layers_pack_again_after_waking() -> None:
    model = fresh_tiny_model("llama").to(CPU)
    prompt = random_prompt(20, seed=6)
    manager = _manager(model)
    try:
        kv_cache_only = manager.sleep(level=1).released_bytes
        manager.wake_up()
        with_weights = manager.sleep(level=2).released_bytes
        manager.wake_up()
        tokens = _generate(manager, prompt, 16)
        assert _packed_layers(model) == len(_linears(model))
    finally:
        manager.destroy()
    # The panels round each layer's channels up to whole panels.
    panel_bytes = sum(
        -(-linear.out_features // packed_linear.kernel.panel_channels())
        * packed_linear.kernel.panel_channels()
        * linear.in_features
        * 4
        for linear in _linears(model)
    )
    assert with_weights - kv_cache_only == panel_bytes
    _assert_equal(tokens, reference_greedy(model, prompt, 16), "after sleeping at level 2")


def test_an_engine_that_fails_to_build_leaves_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing comes first (free memory is measured with the copies), so a failure after it, here in
    sizing the cache, must give the layers back."""
    from engine import engine_core

    def no_memory(*args: object, **kwargs: object) -> None:
        raise MemoryError("no room for the cache")

    monkeypatch.setattr(engine_core, "plan_cache", no_memory)
    model = fresh_tiny_model("llama").to(CPU)
    with pytest.raises(MemoryError, match="no room for the cache"):
        engine_core.EngineCore(model, ContinuousBatchingConfig(page_size=8, num_blocks=16))
    assert _packed_layers(model) == 0


def test_falcons_linear_subclass_is_packed_and_a_subclass_of_unknown_forward_is_not() -> None:
    """FalconLinear's forward is exactly its linear map, so it runs on packed weights; a subclass whose
    forward may compute more keeps it."""
    from tests.helpers.families import tiny_family_model

    class Router(torch.nn.Linear):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states).topk(2).values

    model = tiny_family_model("falcon")
    falcon_linears = [module for module in model.modules() if type(module).__name__ == "FalconLinear"]
    router = Router(8, 4)
    packed = PackedLinears(torch.nn.ModuleList([model, router]))
    try:
        assert falcon_linears and all("forward" in module.__dict__ for module in falcon_linears)
        assert "forward" not in router.__dict__
        inputs = torch.randn(3, model.config.hidden_size)
        layer = falcon_linears[0]
        with torch.inference_mode():
            torch.testing.assert_close(layer(inputs), F.linear(inputs, layer.weight, layer.bias))
    finally:
        packed.restore()
