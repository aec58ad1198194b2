"""Loading a model folder (or a GGUF file) for serving: where it runs, in what precision, and the host
around it."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from engine import (
    ContinuousBatchingConfig,
    check_model_support,
    checkpoint_quantization,
    load_gguf_linears,
    load_quantized_checkpoint,
    load_sharded_model,
    tensor_parallel_size,
    torchrun_world_size,
)
from service.default_model import load_own_gguf_blocks
from service.engine_host import EngineHost

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bf16 matrices in AMX tiles (and the OS lets this process use them).

    Without AMX a CPU's bf16 matmuls run on vector dot products at about half its fp32 rate, so bf16
    does not pay there (bench/RESULTS.md, "bf16 on a CPU with AMX"); with it they run several times
    faster than fp32.
    """
    return bool(torch.cpu._is_amx_tile_supported())


def resolve_placement(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype]:
    """Where and in what precision the model runs: "auto" is the GPU when there is one, else the CPU,
    and bfloat16 on a GPU and on a CPU with AMX, float32 on other CPUs."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if dtype == "auto":
        bf16_pays = resolved.type == "cuda" or (resolved.type == "cpu" and cpu_has_bf16_matrix_units())
        dtype = "bfloat16" if bf16_pays else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return resolved, DTYPES[dtype]


def is_gguf_file(path: str) -> bool:
    """Whether `path` names a GGUF file (llama.cpp's format) rather than a model folder."""
    return path.endswith(".gguf") and os.path.isfile(path)


def serving_attention(source: str, from_pretrained_arguments: dict[str, Any]) -> str:
    """The attention implementation to load the model at `source` with, once its config shows that the
    engine serves its family (engine.check_model_support: refused before any weight is read): SDPA, or
    eager for a class that has no SDPA attention (Gemma 2). The engine's paged attention replaces either;
    this one serves the model's plain forwards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, **from_pretrained_arguments)
    model_class: Any = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None:
        raise ValueError(f"{source} holds a {type(config).__name__}, which has no causal-LM class")
    # A multimodal folder's causal-LM class is built on its text config (Llama 4): that is the model served.
    built_on = config.get_text_config() if model_class.config_class is not type(config) else config
    check_model_support(built_on, model_class.__name__)
    return "sdpa" if model_class._supports_sdpa else "eager"


def load_pretrained(
    path: str, device: str = "auto", dtype: str = "auto"
) -> tuple[torch.nn.Module, Any | None]:
    """The model at `path` (a folder, or a GGUF file) with SDPA attention (placed by `resolve_placement`),
    and its tokenizer when the folder or file has one.

    Under `torchrun` (or `cbserve serve --tp N`) the model is sharded over every rank, each on its own
    accelerator (LOCAL_RANK) or on the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved_device, resolved_dtype = resolve_placement(device, dtype)
    # transformers reads a GGUF file itself (every tensor dequantized to `dtype`, its tokenizer if it has one)
    # given the file's folder and name.
    source, gguf_arguments = path, {}
    if is_gguf_file(path):
        source, name = os.path.split(os.path.abspath(path))
        gguf_arguments = {"gguf_file": name, "local_files_only": True}
    attention = serving_attention(source, gguf_arguments)
    quantized_checkpoint = None if gguf_arguments else checkpoint_quantization(path)
    if quantized_checkpoint is not None:
        if torchrun_world_size() > 1 or resolved_device.type != "cpu":
            raise ValueError(
                f"{quantized_checkpoint['quant_method']} checkpoints are served on one CPU process (the int4 "
                f"kernel); got device {resolved_device.type} with {torchrun_world_size()} rank(s)"
            )
        model = load_quantized_checkpoint(path, resolved_dtype, attention)
    elif torchrun_world_size() > 1:
        if gguf_arguments:
            raise ValueError(f"a GGUF file is served on one process; got {torchrun_world_size()} ranks")
        model = load_sharded_model(path, resolved_dtype, attention)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=resolved_dtype,
            attn_implementation=attention,
            device_map=str(resolved_device),
            **gguf_arguments,
        )
    logger.info("model %s on %s in %s", path, next(model.parameters()).device, resolved_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **gguf_arguments)
    except (OSError, ValueError):
        logger.info("no tokenizer at %s: only token-id prompts will be accepted", path)
        tokenizer = None
    return model.eval(), tokenizer


def serve_gguf_blocks(path: str, model: torch.nn.Module, quantization: str) -> int:
    """Puts the quantized blocks of the GGUF file behind `path` into `model` where they serve; returns how
    many layers. A GGUF file's own blocks serve with any quantization but 'none'; the embedded model's
    converted folder serves its file's blocks with 'int4' (with 'int8' the engine quantizes its floats).
    With 'fp8' the engine quantizes the floats transformers read from the file.

    Blocks do not shard and serve on the CPU: a model sharded over tensor-parallel ranks, or on a GPU,
    takes none, and the engine quantizes (each rank's shard of) its floats instead (a GGUF file itself is
    refused under tensor parallelism by `load_pretrained`)."""
    if quantization not in ("int8", "int4"):  # blocks are the CPU's formats; fp8 quantizes the floats
        return 0
    if tensor_parallel_size(model) > 1:
        logger.info("tensor parallelism: each rank quantizes its shard of the floats to %s", quantization)
        return 0
    if next(model.parameters()).device.type != "cpu":
        logger.info(
            "on a GPU the engine quantizes the floats to %s: GGUF blocks serve on the CPU", quantization
        )
        return 0
    if is_gguf_file(path):
        return load_gguf_linears(model, path)
    return load_own_gguf_blocks(path, model) if quantization == "int4" else 0


def load_host(
    path: str, config: ContinuousBatchingConfig | None = None, device: str = "auto", dtype: str = "auto"
) -> EngineHost:
    """The engine host serving the model folder (or GGUF file) at `path`, named after it, with the blocks
    `serve_gguf_blocks` puts in (engine.load_gguf_linears: Q8_0, Q4_0, Q4_1 and Q4_K exactly, the 5- and
    6-bit types as int8); the engine quantizes the layers left in floats to the configured format."""
    model, tokenizer = load_pretrained(path, device, dtype)
    serve_gguf_blocks(path, model, config.quantization if config is not None else "none")
    name = os.path.basename(os.path.normpath(path)).removesuffix(".gguf")
    return EngineHost(model, tokenizer, config, model_name=name, model_path=os.path.abspath(path))
