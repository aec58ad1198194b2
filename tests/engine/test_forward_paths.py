"""The decode and varlen forward paths: padded shapes, torch.compile per path, CUDA graphs of both paths.

Greedy outputs must equal `model.generate` whichever path runs. The compile tests use real compilers on
the CPU (dynamo with the eager backend for speed, one run through inductor); the CUDA graph tests need
a GPU (bench/gpu_check.sh runs them there with CBSERVE_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import CompileConfig

from engine import ContinuousBatchingConfig
from engine.runner.forward_paths import MAX_VARLEN_GRAPH_TOKENS, StepGraphs
from engine.runner.padding import Padding, padded_size, padded_sizes
from tests.helpers.engine_runs import generate_greedy, run_greedy
from tests.helpers.models import TEST_DEVICE, fresh_tiny_model, random_prompt, tiny_model
from tests.helpers.oracle import assert_greedy_parity

PROMPT_LENGTHS = (1, 3, 16, 17, 40, 90, 130)
NEW_TOKENS = (20, 9, 33, 1, 25, 12, 18)
FAMILIES = ("llama", "qwen3", "mistral", "gemma2")
needs_cuda = pytest.mark.skipif(
    TEST_DEVICE.type != "cuda", reason="CUDA graphs need CBSERVE_TEST_DEVICE=cuda"
)


def _generate(model: torch.nn.Module, config: ContinuousBatchingConfig, warmup: bool = False):
    prompts = [random_prompt(length, seed=500 + length) for length in PROMPT_LENGTHS]
    generated, engine = generate_greedy(model, config, prompts, NEW_TOKENS, warmup)
    return prompts, generated, engine


def _assert_parity(model: torch.nn.Module, prompts, generated, label: str) -> None:
    assert_greedy_parity(model, prompts, NEW_TOKENS, generated, label)


def test_padded_sizes_are_powers_of_two_then_multiples_of_the_interval() -> None:
    assert [padded_size(n, 16) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17, 33, 48)] == [
        1,
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        32,
        48,
        48,
    ]
    assert padded_sizes(70, 16) == [1, 2, 4, 8, 16, 32, 48, 64, 80]
    assert padded_sizes(5, 4) == [1, 2, 4, 8]


@pytest.mark.parametrize("family", FAMILIES)
def test_static_shape_compile_pads_decode_steps_and_keeps_parity(family: str) -> None:
    """dynamic=False on the decode path pads decode steps (rows to 1, 2, 4, then multiples of 4; keys to
    multiples of 8): padding rows must not disturb real ones, in full and sliding-window groups."""
    model = tiny_model(family)
    config = ContinuousBatchingConfig(
        page_size=8,
        num_blocks=160,
        max_batch_tokens=48,  # chunked prefill: mixed varlen steps, and 1-token chunks that do not sample
        decode_compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager"),
        varlen_compile_config=CompileConfig(backend="eager"),
        q_padding_interval_size=4,
        kv_padding_interval_size=8,
    )
    prompts, generated, engine = _generate(model, config)
    assert engine.runner.forward_paths.padding == Padding(
        4, 8, 4, decode=True, varlen=False, varlen_max_tokens=MAX_VARLEN_GRAPH_TOKENS
    )
    assert engine.runner.num_padding_rows > 0, "no decode step was padded"
    _assert_parity(model, prompts, generated, f"{family}, padded static-shape decode")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_dynamic_compile_keeps_parity_without_padding(family: str) -> None:
    model = tiny_model(family)
    config = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=80,
        max_batch_tokens=64,
        decode_compile_config=CompileConfig(fullgraph=True, dynamic=True, backend="eager"),
        varlen_compile_config=CompileConfig(fullgraph=True, dynamic=True, backend="eager"),
    )
    prompts, generated, engine = _generate(model, config)
    assert engine.runner.forward_paths.padding is None
    assert engine.runner.num_padding_rows == 0
    _assert_parity(model, prompts, generated, f"{family}, dynamic compile")


def test_compile_level_one_through_inductor_keeps_parity() -> None:
    """The preset of level 1 (inductor, mode "default", dynamic, whole-graph on the decode path)."""
    model = tiny_model("llama")
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=80, max_batch_tokens=64, default_compile_level=1
    )
    prompts, generated, engine = _generate(model, config)
    compile_config = engine.runner.forward_paths.compile_configs["decode"]
    assert compile_config is not None and compile_config.backend == "inductor" and compile_config.dynamic
    _assert_parity(model, prompts, generated, "compile level 1")


class CountingBackend:
    """A torch.compile backend that runs graphs eagerly and counts how many it was given to compile."""

    def __init__(self) -> None:
        self.compilations = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **options: object):
        self.compilations += 1
        return graph.forward


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_dynamic_compilation_compiles_nothing_once_warmed_up(family: str) -> None:
    """A compile in the middle of serving stalls every request for as long as it takes (tens of seconds
    through inductor on a CPU), so warmup must leave both paths a graph for every shape class they meet
    here: decode steps of one row and of several, block tables of any width, varlen steps sampling one row
    and several. Requests span one to nine pages, alone and together, each prompt in one step's budget
    (a chunk that ends no prompt, sampling no row, is the one shape class warmup leaves out)."""
    decode, varlen = CountingBackend(), CountingBackend()
    model = tiny_model(family)
    config = ContinuousBatchingConfig(
        page_size=16,
        num_blocks=96,
        max_batch_tokens=256,
        decode_compile_config=CompileConfig(fullgraph=True, dynamic=True, backend=decode),
        varlen_compile_config=CompileConfig(dynamic=True, backend=varlen),
    )
    from engine import init_continuous_batching

    manager = init_continuous_batching(model, continuous_batching_config=config)
    manager.warmup()
    after_warmup = decode.compilations, varlen.compilations
    assert min(after_warmup) >= 1, f"warmup compiled (decode, varlen) {after_warmup} times"
    manager.start()
    try:
        lengths = (130, 3, 40, 1, 17, 90)
        prompts = [random_prompt(length, seed=700 + length) for length in lengths]
        new_tokens = (12, 30, 5, 20, 9, 14)
        # One request alone first (decode steps of one row with a wide table), then all of them together.
        run_greedy(manager, prompts[:1], new_tokens[:1])
        generated = run_greedy(manager, prompts, new_tokens)
    finally:
        manager.destroy()
    compilations = decode.compilations, varlen.compilations
    assert compilations == after_warmup, f"(decode, varlen) compiled {compilations}, {after_warmup} in warmup"
    assert_greedy_parity(model, prompts, new_tokens, generated, f"{family}, compiled after warmup")


def test_cuda_graphs_requested_on_the_cpu_warn_and_run_without(caplog: pytest.LogCaptureFixture) -> None:
    # On the CPU whatever the test device: the warning is for a model that is not on a CUDA device.
    model = fresh_tiny_model("llama").to("cpu")
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=80, max_batch_tokens=64, use_cuda_graph=(False, True)
    )
    with caplog.at_level(logging.WARNING, logger="engine.runner.forward_paths"):
        prompts, generated, engine = _generate(model, config)
    assert "CUDA graphs need a CUDA device" in caplog.text
    assert engine.runner.forward_paths.decode_graphs is None
    _assert_parity(model, prompts, generated, "graphs requested on the CPU")


@needs_cuda
@pytest.mark.parametrize("max_blocks_per_request", [0, 32], ids=["gather", "attention_kernel"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_cuda_graphs_keep_parity(family: str, max_blocks_per_request: int) -> None:
    model = tiny_model(family)
    config = ContinuousBatchingConfig(
        page_size=8,
        num_blocks=160,
        max_batch_tokens=48,
        use_cuda_graph=(False, True),
        kv_padding_interval_size=16,
        max_blocks_per_request=max_blocks_per_request,
    )
    prompts, generated, engine = _generate(model, config)
    graphs = engine.runner.forward_paths.decode_graphs
    assert graphs is not None and len(graphs.graphs) > 0, "no decode step replayed a graph"
    _assert_parity(model, prompts, generated, f"{family}, decode CUDA graphs")


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_cuda_graphs_keep_parity(family: str) -> None:
    """Steps with prefill chunks (a 48-token budget chunks the long prompts) padded on the kernel path and
    replayed from graphs, next to decode graphs."""
    model = tiny_model(family)
    config = ContinuousBatchingConfig(
        page_size=8,
        num_blocks=160,
        max_batch_tokens=48,
        use_cuda_graph=True,
        q_padding_interval_size=16,
        kv_padding_interval_size=16,
        max_blocks_per_request=32,
    )
    prompts, generated, engine = _generate(model, config)
    paths = engine.runner.forward_paths
    assert paths.varlen_graphs is not None and len(paths.varlen_graphs.graphs) > 0, "no varlen graph replayed"
    assert paths.decode_graphs is not None and len(paths.decode_graphs.graphs) > 0
    _assert_parity(model, prompts, generated, f"{family}, varlen and decode CUDA graphs")


@pytest.mark.parametrize(
    ("device", "flags", "max_blocks_per_request", "expected", "warning"),
    [
        ("cpu", True, 32, (False, False), "CUDA graphs need a CUDA device"),
        ("cuda", True, 32, (True, True), None),
        ("cuda", True, 0, (False, True), "varlen CUDA graphs need the attention kernel"),
        ("cuda", (True, False), 0, (False, False), "varlen CUDA graphs need the attention kernel"),
        ("cuda", (False, True), 0, (False, True), None),
        ("cuda", None, 32, (False, False), None),
    ],
)
def test_which_paths_replay_graphs(
    caplog: pytest.LogCaptureFixture, device, flags, max_blocks_per_request, expected, warning
) -> None:
    """Graphs only where asked for, on CUDA, and varlen graphs only with the kernel path (decided from the
    config and the device type alone, so it is checked without a GPU)."""
    from engine.runner.forward_paths import use_cuda_graphs

    config = ContinuousBatchingConfig(use_cuda_graph=flags, max_blocks_per_request=max_blocks_per_request)
    with caplog.at_level(logging.WARNING, logger="engine.runner.forward_paths"):
        decided = use_cuda_graphs(
            config, torch.device(device), tiny_model("llama"), has_attention_kernel=max_blocks_per_request > 0
        )
    assert decided == expected
    if warning is None:
        assert caplog.text == ""
    else:
        assert warning in caplog.text


def test_a_path_at_its_graph_limit_runs_new_shapes_without_capturing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past MAX_GRAPHS_PER_PATH a step of a new shape gets no graph (the runner runs it eagerly), and
    the limit is logged once. Nothing is captured, so this runs without a GPU."""
    from types import SimpleNamespace

    def never_called(*arguments: object) -> torch.Tensor:
        raise AssertionError("a step past the limit must not be captured")

    graphs = StepGraphs(never_called, torch.device("cpu"), pool=None, path="varlen", max_graphs=0)
    step = SimpleNamespace(
        input_ids=torch.zeros(1, 16, dtype=torch.long),
        position_ids=torch.zeros(1, 16, dtype=torch.long),
        logits_indices=torch.zeros(2, dtype=torch.long),
        metadata=SimpleNamespace(step_tensors=lambda: []),
    )
    with caplog.at_level(logging.WARNING, logger="engine.runner.forward_paths"):
        assert graphs.run(step) is None  # type: ignore[arg-type]
        assert graphs.run(step) is None  # type: ignore[arg-type]
    assert caplog.text.count("CUDA graphs held, the most allowed") == 1
    assert graphs.graphs == {}


@needs_cuda
def test_warmup_captures_a_decode_graph_per_batch_size_before_any_request() -> None:
    model = tiny_model("llama")
    config = ContinuousBatchingConfig(
        page_size=8,
        num_blocks=160,
        max_batch_tokens=48,
        max_requests_per_batch=20,
        use_cuda_graph=True,
        q_padding_interval_size=8,
        kv_padding_interval_size=16,
    )
    prompts, generated, engine = _generate(model, config, warmup=True)
    graphs = engine.runner.forward_paths.decode_graphs
    assert graphs is not None
    captured_rows = {key[0][1] for key in graphs.graphs}  # input_ids is [1, rows]
    assert captured_rows >= {1, 2, 4, 8, 16, 24}
    _assert_parity(model, prompts, generated, "decode CUDA graphs after warmup")
