"""The engine's forwards for recurrent layers, which keep a fixed-size state per request in slots
(engine.kv.state_slots, `state_cache.StateCache`) instead of pages: one file per layer kind and one row of
`LAYER_FORWARDS`, keyed by the config's `layer_types` name as engine.kv.layer_groups.STATE_LAYER_SPECS is.

The engine installs a kind's forward on every module of its layers at load and gives the modules their own
forwards back when it lets the model go (`RecurrentForwards`). What such a layer's state cannot go with is
refused at load, before anything serves (`check_recurrent_support`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ContinuousBatchingConfig
from engine.errors import UnsupportedModelError
from engine.kv.layer_groups import ConvStateSpec, StateGroupSpec
from engine.runner.recurrent import short_conv
from engine.runner.recurrent.state_cache import StateCache


@dataclass(frozen=True)
class LayerForward:
    """How the engine computes one recurrent layer kind: which modules it serves, and how its forward is put
    on such a module (over the layer's state tensor) and taken off again."""

    description: str
    serves: Callable[[torch.nn.Module, ConvStateSpec], bool]
    install: Callable[[torch.nn.Module, torch.Tensor], None]
    uninstall: Callable[[torch.nn.Module], None]


LAYER_FORWARDS = {
    "conv": LayerForward(
        "short-convolution", short_conv.is_short_conv, short_conv.install, short_conv.uninstall
    ),
}


def check_recurrent_support(
    model: torch.nn.Module, group: StateGroupSpec | None, config: ContinuousBatchingConfig, tp_size: int
) -> None:
    """Raises `UnsupportedModelError` naming the family, the layer kind and what is missing when the
    configuration asks for something a recurrent layer's state does not go with."""
    lacking = []
    if tp_size > 1:
        lacking.append("tensor parallelism (the state slots are not sharded with the layers' channels)")
    if any(config.cuda_graph_flags()):
        lacking.append(
            "use_cuda_graph (graphs do not copy the state slots in, and varlen graphs pad steps with tokens "
            "no request owns); leave it off"
        )
    if group is None or not lacking:
        return
    model_type = getattr(model.config, "model_type", "")
    raise UnsupportedModelError(
        f"cbserve cannot serve {type(model).__name__} (model type {model_type!r}) with {'; '.join(lacking)}: "
        f"its {LAYER_FORWARDS[group.kind].description} layers keep a state per request"
    )


class RecurrentForwards:
    """The engine's forwards on a model's recurrent layers, each over its layer's states in `caches`."""

    def __init__(self, model: torch.nn.Module, caches: Sequence[StateCache]) -> None:
        self._installed: list[tuple[torch.nn.Module, LayerForward]] = []
        for cache in caches:
            forward = LAYER_FORWARDS[cache.group.kind]
            states = cache.layer_states()
            modules = _layer_modules(model, cache.group, forward)
            for layer, module in modules.items():
                forward.install(module, states[layer])
                self._installed.append((module, forward))

    def restore(self) -> None:
        """Gives every module its own forward back (the engine is done with the model)."""
        for module, forward in self._installed:
            forward.uninstall(module)
        self._installed.clear()


def _layer_modules(
    model: torch.nn.Module, group: StateGroupSpec, forward: LayerForward
) -> dict[int, torch.nn.Module]:
    """The module of each layer of `group` that `forward` serves, by layer index; raises when a layer has
    none (its forward would compute something else)."""
    modules: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        layer: Any = getattr(module, "layer_idx", None)
        if layer in group.layer_indices and forward.serves(module, group.spec):
            modules[layer] = module
    missing = sorted(set(group.layer_indices) - set(modules))
    if missing:
        raise UnsupportedModelError(
            f"cbserve cannot serve {type(model).__name__}: its {forward.description} layers {missing} have "
            f"no module of the shape the engine's forward computes ({group.spec})"
        )
    return modules
