"""Which families run on an attention adapter, installing the adapters for the engine's lifetime, and the
combinations an adapted family is refused with.

An adapter is installed on each attention module of the family's classes as the instance's own `forward`,
so the model's parameters, their names and its class stay as they are (weight updates find every tensor
where they were), and `restore` takes it off again. The installed forward serves the engine's steps only:
outside them (no step metadata bound on the thread) it calls the module's own forward, so
`model.generate` and a trainer's forwards compute exactly what the model alone computes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.runner.attention import bound_step_metadata
from engine.runner.own_attention import bloom, codegen, falcon, gpt_neo, gptj, mpt

# One row per family: the module whose `forward` stands in for its attention modules' own, and whose
# `install_model_hooks`, where it has one, adapts what the model builds around attention for the steps.
ADAPTERS: dict[str, ModuleType] = {
    "bloom": bloom,
    "codegen": codegen,
    "falcon": falcon,
    "gpt_neo": gpt_neo,
    "gptj": gptj,
    "mpt": mpt,
}


def adapted_family(model: torch.nn.Module) -> str | None:
    """The model's family when its attention runs on an adapter, else None."""
    model_type = getattr(model.config, "model_type", None)
    return model_type if model_type in ADAPTERS else None


def unsupported_combination(
    model: torch.nn.Module, config: ContinuousBatchingConfig, tp_size: int
) -> str | None:
    """Why the engine cannot run this adapted family with this configuration, or None when it can (or
    the family needs no adapter). One line naming the family and the combination."""
    family = adapted_family(model)
    if family is None:
        return None
    if tp_size > 1:
        return (
            f"{family} under tensor parallelism: its attention adapter splits heads by the model's whole "
            "head count, which a sharded projection does not produce"
        )
    if config.batch_invariant:
        return (
            f"{family} with batch_invariant: a trainer's forwards run the model's own attention, not the "
            "engine's kernel, so their logprobs would not have the engine's bits"
        )
    if any(config.compile_config_for(path) is not None for path in ("varlen", "decode")):
        return (
            f"{family} with torch.compile: its attention adapter finds the step's caches through the "
            "running step, which a compiled graph cannot bind; serve it without compile_config"
        )
    return None


def _adapted_forward(module: torch.nn.Module, adapter: ModuleType) -> Callable[..., Any]:
    own_forward = module.forward

    @functools.wraps(own_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        metadata = bound_step_metadata()
        if metadata is None:
            return own_forward(*args, **kwargs)
        return adapter.forward(module, metadata, *args, **kwargs)

    return forward


class InstalledAdapters:
    """The adapters installed on one model's attention modules, until `restore`."""

    def __init__(self, model: torch.nn.Module) -> None:
        family = adapted_family(model)
        self._modules: list[torch.nn.Module] = []
        self._restore_model_hooks: Callable[[], None] | None = None
        if family is None:
            return
        adapter = ADAPTERS[family]
        for module in model.modules():
            if type(module).__name__ in adapter.ATTENTION_CLASSES:
                module.forward = _adapted_forward(module, adapter)
                self._modules.append(module)
        if not self._modules:
            raise ValueError(
                f"{type(model).__name__} has no module of class {', '.join(adapter.ATTENTION_CLASSES)} "
                "for its attention adapter to stand in for"
            )
        install_model_hooks = getattr(adapter, "install_model_hooks", None)
        if install_model_hooks is not None:
            self._restore_model_hooks = install_model_hooks(model)

    def restore(self) -> None:
        """Gives every adapted module its own forward back (idempotent)."""
        for module in self._modules:
            del module.forward
        self._modules = []
        if self._restore_model_hooks is not None:
            self._restore_model_hooks()
            self._restore_model_hooks = None
