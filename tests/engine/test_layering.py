"""Imports run one way: each engine module imports only from its own layer or the layers below it, and
the service reaches the engine only through `engine/__init__`.

A new module has to be placed in `ENGINE_LAYERS`, which is the map of the engine from the bottom up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom first. A module may import from its own layer and the layers below, never from a layer above.
ENGINE_LAYERS: list[set[str]] = [
    {
        # The packages' own modules are their docstrings: nothing to import.
        "engine.loop",
        "engine.weights",
        "engine.sampling",
        "engine.system",
        "engine.errors",
        "engine.config",
        "engine.sampling.params",
        "engine.system.device_copies",
        "engine.weights.tensors",
        "engine.weights.checksum",
        # Sleep mode's levels and memory mechanics; the engine does each level (EngineCore).
        "engine.weights.sleep",
        "engine.parallel",
        "engine.weights.transfer",
        "engine.weights.cuda_ipc",
        "engine.system.cache_root",
        "engine.system.container_limits",
        "engine.system.thread_budget",
        "engine.system.native_library",
        "engine.system.untouched_memory",
        # Quantized linear layers: their formats, kernel and loaders; weight updates quantize through them.
        "engine.quantization",
        "engine.quantization.formats",
        "engine.quantization.fp8",
        "engine.quantization.int4_tiles",
        "engine.quantization.kernel",
        "engine.quantization.linear",
        "engine.quantization.sharding",
        "engine.quantization.model",
        "engine.quantization.gguf_blocks",
        "engine.quantization.gptq",
        # How tensor-parallel ranks agree on a collective outcome: a protocol and its one-process identity.
        "engine.loop.agreement",
        # Plain records of host-resident blocks, which a request carries while preempted.
        "engine.kv.offload",
        "engine.scheduling",
    },
    {"engine.request"},
    # The queue requests wait in, and the running sums of the work the scheduler holds, which the load
    # record reports.
    {"engine.scheduling.waiting_queue", "engine.scheduling.pending_work"},
    {
        "engine.kv",
        "engine.kv.prefix_hash",
        "engine.kv.events",
        "engine.kv.block_pool",
        "engine.kv.full_attention",
        "engine.kv.sliding_window",
        "engine.kv.cache_manager",
        "engine.kv.layer_groups",
        "engine.kv.state_slots",
    },
    # Which model families the engine serves exactly: checked before any cache is planned.
    {"engine.families"},
    # The one admission decision: what a request must fit (the cache's sizes) and the ledger of live ids.
    {"engine.loop.admission"},
    {"engine.scheduling.scheduler"},
    {"engine.sampling.penalties", "engine.sampling.structured_output", "engine.sampling.sampler"},
    {
        "engine.runner",
        "engine.runner.attention",
        # Multi-head latent attention over a cache of latents: the cache shape and the forwards read it.
        "engine.runner.latent_attention",
        "engine.runner.paged_attention_kernel",
        "engine.runner.paged_attention_cpu",
        "engine.runner.padding",
        "engine.runner.inputs",
        "engine.runner.kv_cache",
        "engine.runner.forward_paths",
        "engine.runner.packed_linear",
        # The engine's own forward for the Llama family, the fused operations it calls and its layers in
        # one C call.
        "engine.runner.fused_ops",
        "engine.runner.decoder_layers",
        "engine.runner.decoder_forward",
        # Attention adapters for families whose attention is the model's own code, installed by the engine.
        "engine.runner.own_attention",
        "engine.runner.own_attention.adapter",
        "engine.runner.own_attention.alibi",
        "engine.runner.own_attention.bloom",
        "engine.runner.own_attention.codegen",
        "engine.runner.own_attention.falcon",
        "engine.runner.own_attention.gpt_neo",
        "engine.runner.own_attention.gptj",
        "engine.runner.own_attention.mpt",
        "engine.runner.own_attention.registry",
        "engine.runner.model_runner",
        # Recurrent layers: their engine forwards, state tensors and per-step state inputs.
        "engine.runner.recurrent",
        "engine.runner.recurrent.short_conv",
        "engine.runner.recurrent.state_cache",
        "engine.runner.recurrent.step_inputs",
        "engine.runner.exact_attention",
        "engine.runner.batch_invariant_cuda",
        # Batch-invariant mode: the runner's forwards enter it, and it serves trainers with the runner's
        # kernels.
        "engine.runner.batch_invariant",
    },
    {"engine.runner.cache_plan"},
    {"engine.engine_core"},
    {
        "engine.loop.commands",
        "engine.loop.output_router",
        "engine.loop.listeners",
        "engine.stats",
    },
    {"engine.loop.weights_and_sleep"},
    {"engine.loop.generation_loop"},
    {"engine.loop.lockstep"},
    {"engine.weights.operations"},
    {"engine.manager"},
    {"engine.api"},
    {"engine"},
    {"engine.demo"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-local and TYPE_CHECKING imports too)."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
    return imported


def _layer_of(module: str) -> int:
    for index, layer in enumerate(ENGINE_LAYERS):
        if module in layer:
            return index
    raise AssertionError(f"{module} is in no layer of ENGINE_LAYERS: place it there")


ENGINE_FILES = sorted((ROOT / "engine").rglob("*.py"))
SERVICE_FILES = sorted((ROOT / "service").rglob("*.py"))


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda path: _module_name(path))
def test_an_engine_module_imports_only_from_its_layer_or_below(path: Path) -> None:
    module = _module_name(path)
    layer = _layer_of(module)
    upward = sorted(
        imported
        for imported in _imports(path)
        if (imported == "engine" or imported.startswith("engine.")) and _layer_of(imported) > layer
    )
    assert not upward, f"{module} (layer {layer}) imports from layers above it: {upward}"


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda path: _module_name(path))
def test_the_engine_never_imports_the_service_or_grpc(path: Path) -> None:
    outward = sorted(
        imported
        for imported in _imports(path)
        if imported.split(".")[0] in {"service", "grpc", "cbserve_client"}
    )
    assert not outward, f"{_module_name(path)} imports {outward}"


@pytest.mark.parametrize("path", SERVICE_FILES, ids=lambda path: _module_name(path))
def test_the_service_imports_the_engine_only_through_its_package(path: Path) -> None:
    deep = sorted(imported for imported in _imports(path) if imported.startswith("engine."))
    assert not deep, f"{_module_name(path)} reaches past engine/__init__: {deep}"


def test_every_layered_module_exists() -> None:
    """The map stays true: a module removed or renamed leaves no stale entry behind."""
    existing = {_module_name(path) for path in ENGINE_FILES}
    stale = sorted(set().union(*ENGINE_LAYERS) - existing)
    assert not stale, f"ENGINE_LAYERS names modules that do not exist: {stale}"
