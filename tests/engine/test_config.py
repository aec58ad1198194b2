import json
import re
import warnings
from typing import Any

import pytest

from engine.config import DEFAULT_SAFETY_MARGIN, SCHEDULER_TYPES, ContinuousBatchingConfig

DOCUMENTED_DEFAULTS: dict[str, Any] = {
    "page_size": 256,
    "num_blocks": None,
    "max_batch_tokens": None,
    "max_memory_percent": None,
    "kv_cache_memory": None,
    "max_requests_per_batch": None,
    "max_blocks_per_request": None,
    "allow_block_sharing": True,
    "use_async_batching": None,
    "use_cuda_graph": None,
    "q_padding_interval_size": 0,
    "kv_padding_interval_size": 0,
    "varlen_compile_config": None,
    "decode_compile_config": None,
    "default_compile_level": 0,
    "scheduler_type": "fifo",
    "safety_margin": None,
    "return_logprobs": False,
    "logprobs_mode": "raw_logprobs",
    "seed": None,
    "auto_switch_to_flash": True,
    "cpu_offload_space": 0.0,
    "cpu_offload_space_safety_threshold": 0.8,
    "max_queue_size": 0,
    "per_request_processors": False,
    "drop_unsupported_processors": True,
    "disable_nccl_graph_mixing": True,
    "cpu_group_timeout": 300.0,
    "num_threads": None,
    "pack_cpu_weights": True,
    "populate_kv_cache": False,
    "batch_invariant": False,
    "quantization": "none",
    "quantize_activations": True,
    "use_default_compile_configs": None,
    "max_cached_graphs": None,
    "block_size": None,
}

INVALID_VALUES: list[tuple[str, Any]] = [
    ("page_size", 3),
    ("page_size", 0),
    ("page_size", 16.0),
    ("page_size", True),
    ("page_size", "256"),
    ("num_blocks", 0),
    ("num_blocks", -1),
    ("num_blocks", True),
    ("max_batch_tokens", 0),
    ("max_batch_tokens", 1.5),
    ("max_memory_percent", 0),
    ("max_memory_percent", 0.0),
    ("max_memory_percent", 1.01),
    ("max_memory_percent", -0.5),
    ("max_memory_percent", float("nan")),
    ("max_memory_percent", True),
    ("max_requests_per_batch", 0),
    ("max_requests_per_batch", False),
    ("max_blocks_per_request", -1),
    ("max_blocks_per_request", 2.0),
    ("allow_block_sharing", 1),
    ("allow_block_sharing", None),
    ("use_async_batching", "yes"),
    ("use_cuda_graph", 1),
    ("use_cuda_graph", (True,)),
    ("use_cuda_graph", (True, False, True)),
    ("use_cuda_graph", (True, 0)),
    ("use_cuda_graph", [True, False]),
    ("q_padding_interval_size", -1),
    ("q_padding_interval_size", None),
    ("kv_padding_interval_size", -8),
    ("varlen_compile_config", "max-autotune"),
    ("decode_compile_config", 3),
    ("default_compile_level", -1),
    ("default_compile_level", 4),
    ("default_compile_level", True),
    ("scheduler_type", "lifo"),
    ("scheduler_type", "FIFO"),
    ("scheduler_type", None),
    ("safety_margin", -0.1),
    ("safety_margin", 1.5),
    ("safety_margin", float("inf")),
    ("return_logprobs", "false"),
    ("logprobs_mode", "processed_logits"),
    ("logprobs_mode", None),
    ("seed", 1.0),
    ("seed", True),
    ("auto_switch_to_flash", 0),
    ("cpu_offload_space", -1.0),
    ("cpu_offload_space", float("inf")),
    ("cpu_offload_space", "4"),
    ("kv_cache_memory", 0.0),
    ("kv_cache_memory", float("inf")),
    ("kv_cache_memory", "1"),
    ("cpu_offload_space_safety_threshold", 0.0),
    ("cpu_offload_space_safety_threshold", 1.2),
    ("cpu_offload_space_safety_threshold", None),
    ("max_queue_size", -1),
    ("max_queue_size", None),
    ("per_request_processors", None),
    ("drop_unsupported_processors", "true"),
    ("disable_nccl_graph_mixing", 1),
    ("cpu_group_timeout", 0),
    ("cpu_group_timeout", -5.0),
    ("cpu_group_timeout", float("nan")),
    ("num_threads", 0),
    ("num_threads", 1.5),
    ("pack_cpu_weights", "yes"),
    ("populate_kv_cache", "yes"),
    ("batch_invariant", 1),
    ("quantization", "int3"),
    ("quantization", None),
    ("quantize_activations", "no"),
]


def _error_pattern(field: str, value: Any) -> str:
    return rf"{field}.*got {re.escape(repr(value))}"


def test_module_constants_match_documented_schedulers() -> None:
    assert SCHEDULER_TYPES == ("fifo", "prefill_first", "priority")
    assert DEFAULT_SAFETY_MARGIN == {"fifo": 0.15, "prefill_first": 0.0, "priority": 0.15}


def test_defaults_equal_documented_defaults() -> None:
    assert ContinuousBatchingConfig().to_dict() == DOCUMENTED_DEFAULTS


def test_defaults_construct_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ContinuousBatchingConfig()


@pytest.mark.parametrize(("field", "bad_value"), INVALID_VALUES)
def test_invalid_value_raises_naming_field_and_value(field: str, bad_value: Any) -> None:
    with pytest.raises(ValueError, match=field) as excinfo:
        ContinuousBatchingConfig(**{field: bad_value})
    assert re.search(_error_pattern(field, bad_value), str(excinfo.value))


@pytest.mark.parametrize(
    ("field", "bad_value", "message"),
    [
        ("page_size", 2, "page_size must be an int >= 4, got 2"),
        ("safety_margin", 1.5, "safety_margin must be in [0, 1], got 1.5"),
        (
            "scheduler_type",
            "lifo",
            "scheduler_type must be one of 'fifo', 'prefill_first', 'priority', got 'lifo'",
        ),
    ],
)
def test_error_message_states_allowed_range(field: str, bad_value: Any, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        ContinuousBatchingConfig(**{field: bad_value})
    assert str(excinfo.value) == message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 4),
        ("num_blocks", 1),
        ("max_batch_tokens", 1),
        ("max_memory_percent", 1),
        ("max_memory_percent", 1e-6),
        ("max_requests_per_batch", 1),
        ("max_blocks_per_request", 0),
        ("use_async_batching", False),
        ("use_cuda_graph", True),
        ("use_cuda_graph", (True, False)),
        ("q_padding_interval_size", 0),
        ("default_compile_level", 3),
        ("scheduler_type", "prefill_first"),
        ("safety_margin", 0),
        ("safety_margin", 1),
        ("seed", -7),
        ("cpu_offload_space", None),
        ("cpu_offload_space", 4),
        ("cpu_offload_space_safety_threshold", 1),
        ("max_queue_size", 0),
        ("cpu_group_timeout", None),
        ("cpu_group_timeout", 0.5),
    ],
)
def test_boundary_values_are_accepted(field: str, value: Any) -> None:
    assert getattr(ContinuousBatchingConfig(**{field: value}), field) == value


def test_block_size_warns_and_sets_page_size() -> None:
    with pytest.warns(FutureWarning, match="block_size is deprecated since transformers 5.17; use page_size"):
        config = ContinuousBatchingConfig(block_size=64)
    assert config.page_size == 64
    assert config.block_size is None


def test_block_size_equal_to_explicit_page_size_is_accepted() -> None:
    with pytest.warns(FutureWarning, match="block_size"):
        config = ContinuousBatchingConfig(page_size=128, block_size=128)
    assert config.page_size == 128


def test_kv_cache_memory_and_num_blocks_are_refused_together() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_memory \(2 GiB\) and num_blocks \(64\) both size"):
        ContinuousBatchingConfig(kv_cache_memory=2.0, num_blocks=64)


def test_block_size_conflicting_with_page_size_raises() -> None:
    with pytest.raises(ValueError, match=r"block_size.*page_size"):
        ContinuousBatchingConfig(page_size=128, block_size=64)


def test_invalid_block_size_raises_naming_block_size() -> None:
    with pytest.raises(ValueError, match=_error_pattern("block_size", 2)):
        ContinuousBatchingConfig(block_size=2)


def test_use_default_compile_configs_true_warns_and_sets_level_one() -> None:
    with pytest.warns(
        FutureWarning, match="use_default_compile_configs is deprecated since transformers 5.11"
    ):
        config = ContinuousBatchingConfig(use_default_compile_configs=True)
    assert config.default_compile_level == 1
    assert config.use_default_compile_configs is None


def test_use_default_compile_configs_true_keeps_explicit_level() -> None:
    with pytest.warns(FutureWarning, match="use_default_compile_configs"):
        config = ContinuousBatchingConfig(use_default_compile_configs=True, default_compile_level=3)
    assert config.default_compile_level == 3


def test_use_default_compile_configs_false_warns_and_keeps_level() -> None:
    with pytest.warns(FutureWarning, match="use_default_compile_configs"):
        config = ContinuousBatchingConfig(use_default_compile_configs=False, default_compile_level=2)
    assert config.default_compile_level == 2
    assert config.use_default_compile_configs is None


def test_max_cached_graphs_warns_that_it_is_ignored() -> None:
    with pytest.warns(
        FutureWarning, match=r"max_cached_graphs is deprecated since transformers 5\.13.*ignored"
    ):
        config = ContinuousBatchingConfig(max_cached_graphs=32)
    assert config.max_cached_graphs is None
    assert config.to_dict() == DOCUMENTED_DEFAULTS


def test_deprecated_field_set_after_construction_fails_validate() -> None:
    config = ContinuousBatchingConfig()
    config.block_size = 64
    with pytest.raises(ValueError, match="block_size"):
        config.validate()


@pytest.mark.parametrize("scheduler_type", SCHEDULER_TYPES)
def test_resolved_safety_margin_defaults_per_scheduler(scheduler_type: str) -> None:
    config = ContinuousBatchingConfig(scheduler_type=scheduler_type)
    assert config.resolved_safety_margin() == DEFAULT_SAFETY_MARGIN[scheduler_type]


def test_resolved_safety_margin_prefers_explicit_value() -> None:
    assert (
        ContinuousBatchingConfig(scheduler_type="prefill_first", safety_margin=0.3).resolved_safety_margin()
        == 0.3
    )


@pytest.mark.parametrize(("has_logit_processing", "expected"), [(False, 0.9), (True, 0.8)])
def test_resolved_max_memory_percent_default_depends_on_logit_processing(
    has_logit_processing: bool, expected: float
) -> None:
    assert ContinuousBatchingConfig().resolved_max_memory_percent(has_logit_processing) == expected


def test_resolved_max_memory_percent_prefers_explicit_value() -> None:
    config = ContinuousBatchingConfig(max_memory_percent=0.5)
    assert config.resolved_max_memory_percent(has_logit_processing=True) == 0.5


@pytest.mark.parametrize(
    ("use_cuda_graph", "expected"),
    [(None, (None, None)), (True, (True, True)), (False, (False, False)), ((True, False), (True, False))],
)
def test_cuda_graph_flags_normalise_to_varlen_decode_pair(
    use_cuda_graph: bool | tuple[bool, bool] | None, expected: tuple[bool | None, bool | None]
) -> None:
    assert ContinuousBatchingConfig(use_cuda_graph=use_cuda_graph).cuda_graph_flags() == expected


@pytest.mark.parametrize("path", ["varlen", "decode"])
def test_compile_level_zero_gives_no_compile_config(path: str) -> None:
    assert ContinuousBatchingConfig(default_compile_level=0).compile_config_for(path) is None


@pytest.mark.parametrize(
    ("level", "mode", "dynamic"),
    [
        (1, "default", True),
        (2, "max-autotune-no-cudagraphs", True),
        (3, "max-autotune-no-cudagraphs", False),
    ],
)
@pytest.mark.parametrize("path", ["varlen", "decode"])
def test_compile_level_maps_to_preset(path: str, level: int, mode: str, dynamic: bool) -> None:
    from transformers import CompileConfig

    compile_config = ContinuousBatchingConfig(default_compile_level=level).compile_config_for(path)
    assert isinstance(compile_config, CompileConfig)
    assert compile_config.mode == mode
    assert compile_config.dynamic is dynamic
    assert compile_config.fullgraph is True


def test_explicit_compile_config_overrides_level_for_its_path_only() -> None:
    from transformers import CompileConfig

    explicit = CompileConfig(mode="reduce-overhead", dynamic=False)
    config = ContinuousBatchingConfig(decode_compile_config=explicit, default_compile_level=2)
    assert config.compile_config_for("decode") is explicit
    varlen = config.compile_config_for("varlen")
    assert varlen is not None
    assert varlen.mode == "max-autotune-no-cudagraphs"


def test_compile_config_for_unknown_path_raises() -> None:
    with pytest.raises(ValueError, match=r"path.*'prefill'"):
        ContinuousBatchingConfig().compile_config_for("prefill")


def test_from_dict_converts_compile_config_dict() -> None:
    from transformers import CompileConfig

    config = ContinuousBatchingConfig.from_dict(
        {"varlen_compile_config": {"mode": "default", "dynamic": True}}
    )
    assert config.varlen_compile_config == CompileConfig(mode="default", dynamic=True)


def test_compile_config_dict_with_unknown_key_raises() -> None:
    with pytest.raises(ValueError, match="decode_compile_config"):
        ContinuousBatchingConfig.from_dict({"decode_compile_config": {"no_such_option": 1}})


def test_to_dict_from_dict_round_trip() -> None:
    from transformers import CompileConfig

    config = ContinuousBatchingConfig(
        page_size=64,
        num_blocks=128,
        max_memory_percent=0.5,
        use_cuda_graph=(False, True),
        varlen_compile_config=CompileConfig(mode="default", dynamic=True),
        default_compile_level=2,
        scheduler_type="prefill_first",
        safety_margin=0.2,
        seed=1234,
        cpu_offload_space=None,
        cpu_group_timeout=None,
    )
    assert ContinuousBatchingConfig.from_dict(config.to_dict()) == config


def test_json_round_trip_restores_cuda_graph_tuple_and_compile_config() -> None:
    from transformers import CompileConfig

    config = ContinuousBatchingConfig(
        use_cuda_graph=(True, False), decode_compile_config=CompileConfig(mode="default")
    )
    restored = ContinuousBatchingConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config
    assert restored.use_cuda_graph == (True, False)


def test_round_trip_after_deprecated_alias_does_not_warn_again() -> None:
    with pytest.warns(FutureWarning):
        config = ContinuousBatchingConfig(block_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = ContinuousBatchingConfig.from_dict(config.to_dict())
    assert restored.page_size == 32


def test_from_dict_unknown_key_raises_naming_key() -> None:
    with pytest.raises(ValueError, match="page_sise"):
        ContinuousBatchingConfig.from_dict({"page_sise": 64})


def test_from_dict_validates_values() -> None:
    with pytest.raises(ValueError, match="max_queue_size"):
        ContinuousBatchingConfig.from_dict({"max_queue_size": -1})


def test_validate_after_mutation_catches_bad_value() -> None:
    config = ContinuousBatchingConfig()
    config.safety_margin = 1.5
    with pytest.raises(ValueError, match=_error_pattern("safety_margin", 1.5)):
        config.validate()


def test_validate_after_valid_mutation_passes() -> None:
    config = ContinuousBatchingConfig()
    config.page_size = 16
    config.use_cuda_graph = (True, True)
    config.validate()


@pytest.mark.parametrize(
    "settings",
    [{"default_compile_level": 1}, {"decode_compile_config": {"backend": "eager"}}],
    ids=["compile-level", "compile-config"],
)
def test_batch_invariant_refuses_compiled_forwards(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="batch_invariant needs eager forwards, but these paths compile"):
        ContinuousBatchingConfig(batch_invariant=True, **settings)


def test_batch_invariant_refuses_the_gather_path() -> None:
    with pytest.raises(
        ValueError, match=r"batch_invariant needs the attention kernel.*max_blocks_per_request is 0"
    ):
        ContinuousBatchingConfig(batch_invariant=True, max_blocks_per_request=0)
