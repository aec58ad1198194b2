"""Loading a model folder for serving: where it runs, in what precision, and the host around it."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from engine import (
    ContinuousBatchingConfig,
    checkpoint_quantization,
    load_quantized_checkpoint,
    load_sharded_model,
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


def load_pretrained(
    path: str, device: str = "auto", dtype: str = "auto"
) -> tuple[torch.nn.Module, Any | None]:
    """The model at `path` with SDPA attention (placed by `resolve_placement`), and its tokenizer when the
    folder has one.

    Under `torchrun` (or `cbserve serve --tp N`) the model is sharded over every rank, each on its own
    accelerator (LOCAL_RANK) or on the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved_device, resolved_dtype = resolve_placement(device, dtype)
    quantized_checkpoint = checkpoint_quantization(path)
    if quantized_checkpoint is not None:
        if torchrun_world_size() > 1 or resolved_device.type != "cpu":
            raise ValueError(
                f"{quantized_checkpoint['quant_method']} checkpoints are served on one CPU process (the int4 "
                f"kernel); got device {resolved_device.type} with {torchrun_world_size()} rank(s)"
            )
        model = load_quantized_checkpoint(path, resolved_dtype, "sdpa")
    elif torchrun_world_size() > 1:
        model = load_sharded_model(path, resolved_dtype, "sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolved_dtype, attn_implementation="sdpa", device_map=str(resolved_device)
        )
    logger.info("model %s on %s in %s", path, next(model.parameters()).device, resolved_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        logger.info("no tokenizer at %s: only token-id prompts will be accepted", path)
        tokenizer = None
    return model.eval(), tokenizer


def load_host(
    path: str, config: ContinuousBatchingConfig | None = None, device: str = "auto", dtype: str = "auto"
) -> EngineHost:
    """The engine host serving the model folder at `path`, named after the folder."""
    model, tokenizer = load_pretrained(path, device, dtype)
    if config is not None and config.quantization == "int4":
        load_own_gguf_blocks(path, model)
    name = os.path.basename(os.path.normpath(path))
    return EngineHost(model, tokenizer, config, model_name=name, model_path=os.path.abspath(path))
