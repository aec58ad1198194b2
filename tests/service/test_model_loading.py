"""Where `cbserve serve` puts the model and in what precision (--device, --dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service import model_loading
from service.model_loading import load_pretrained, resolve_placement
from tests.helpers.models import tiny_model


@pytest.mark.parametrize("has_amx", [False, True])
def test_auto_is_bfloat16_on_a_gpu_and_on_a_cpu_with_amx(
    monkeypatch: pytest.MonkeyPatch, has_amx: bool
) -> None:
    monkeypatch.setattr(model_loading, "cpu_has_bf16_matrix_units", lambda: has_amx)
    cpu_dtype = torch.bfloat16 if has_amx else torch.float32
    assert resolve_placement("cpu", "auto") == (torch.device("cpu"), cpu_dtype)
    assert resolve_placement("cuda:1", "auto") == (torch.device("cuda", 1), torch.bfloat16)
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_placement("auto", "auto")[0].type == expected_device


def test_an_explicit_dtype_is_loaded_as_asked(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path / "model")
    model, tokenizer = load_pretrained(str(tmp_path / "model"), device="cpu", dtype="bfloat16")
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}
    assert tokenizer is None  # the folder has no tokenizer: token-id prompts only


def test_an_unknown_dtype_names_the_choices() -> None:
    choices = r"\['auto', 'float32', 'bfloat16', 'float16'\]"
    with pytest.raises(ValueError, match=rf"dtype must be one of {choices}, got 'int4'"):
        resolve_placement("cpu", "int4")


def test_serve_flags_set_compilation_graphs_the_attention_kernel_async_batching_packing_and_activations() -> (
    None
):
    from service.cli import _parser, engine_config

    arguments = [
        "serve",
        "--compile-level",
        "2",
        "--cuda-graphs",
        "--max-blocks-per-request",
        "64",
        "--async-batching",
        "--no-pack-cpu-weights",
        "--lazy-kv-cache",
        "--quantization",
        "int4",
        "--no-quantize-activations",
    ]
    config = engine_config(_parser().parse_args(arguments))
    assert config.default_compile_level == 2
    assert config.use_cuda_graph is True
    assert config.max_blocks_per_request == 64
    assert config.use_async_batching is True
    assert config.pack_cpu_weights is False and config.populate_kv_cache is False
    assert config.quantization == "int4" and config.quantize_activations is False
    plain = engine_config(_parser().parse_args(["serve"]))
    assert plain.default_compile_level == 0 and plain.use_cuda_graph is None
    assert plain.max_blocks_per_request is None and plain.use_async_batching is None
    assert plain.pack_cpu_weights is True and plain.quantize_activations is True
    assert plain.populate_kv_cache is True
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--compile-level", "4"])


def test_serve_kv_cache_memory_bounds_the_cache_in_gib() -> None:
    from service.cli import _parser, engine_config

    assert engine_config(_parser().parse_args(["serve", "--kv-cache-memory", "1.5"])).kv_cache_memory == 1.5
    assert engine_config(_parser().parse_args(["serve"])).kv_cache_memory is None


def test_serve_logprobs_mode_sets_the_engines_default() -> None:
    from service.cli import _parser, engine_config

    processed = engine_config(_parser().parse_args(["serve", "--logprobs-mode", "processed_logprobs"]))
    assert processed.logprobs_mode == "processed_logprobs"
    assert engine_config(_parser().parse_args(["serve"])).logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--logprobs-mode", "processed_logits"])


def test_a_compiling_engine_is_warmed_up_before_it_serves() -> None:
    """Compilation happens at start, while health says NOT_SERVING, not on the first client's request."""
    from transformers import CompileConfig

    from engine import ContinuousBatchingConfig
    from service.engine_host import EngineHost

    compiled = ContinuousBatchingConfig(
        num_blocks=32, max_batch_tokens=64, decode_compile_config=CompileConfig(backend="eager")
    )
    for config, warmed in (
        (compiled, True),
        (ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64), False),
    ):
        host = EngineHost(tiny_model("llama"), config=config, model_name="tiny")
        try:
            assert host.start()
            assert host.manager.warmed_up is warmed
        finally:
            host.manager.destroy()
