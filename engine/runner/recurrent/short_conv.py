"""The engine's forward for short-convolution layers (LFM2's `conv` layers): gated, depthwise, causal.

The model's own forward convolves its whole input as one sequence, with its state in a transformers
cache the engine does not pass (`use_cache=False`): over a packed step it would mix requests and forget
every earlier step. The engine's forward takes its place on each such module while the engine owns the
model and computes, for the step's rows of every request at once::

    B, C, x = in_proj(hidden).chunk(3)
    y[t] = C[t] * (bias + sum_j weight[:, j] * (B * x)[t - (K - 1) + j])     (K taps, oldest first)
    out = out_proj(y)

where inputs before a request's first row in the step come from its state slot (engine.runner.recurrent.
step_inputs), and the last K - 1 inputs of each request are written back to its slot. A forward without
the engine's step metadata (model.generate on the engine's model) runs the module's own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kv.layer_groups import ConvStateSpec
from engine.runner.recurrent.step_inputs import StatefulStepMetadata


def is_short_conv(module: torch.nn.Module, spec: ConvStateSpec) -> bool:
    """Whether `module` has the parts the engine's forward computes with, in the spec's sizes: a depthwise
    `conv` of `kernel_size` taps over `channels` channels between an `in_proj` to three times the channels
    and an `out_proj`."""
    conv = getattr(module, "conv", None)
    in_proj = getattr(module, "in_proj", None)
    return (
        isinstance(conv, torch.nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels == spec.channels
        and conv.kernel_size == (spec.kernel_size,)
        and isinstance(in_proj, torch.nn.Module)
        and getattr(in_proj, "out_features", None) == 3 * spec.channels
        and isinstance(getattr(module, "out_proj", None), torch.nn.Module)
    )


def short_conv_step(
    module: Any, hidden_states: torch.Tensor, states: torch.Tensor, meta: StatefulStepMetadata
) -> torch.Tensor:
    """hidden_states [1, T, hidden] -> [1, T, hidden] for one step, reading and writing the layer's
    `states` [slots, K - 1, channels]. `module` is one `is_short_conv` accepts."""
    inputs = meta.state_inputs
    gates, outputs, values = module.in_proj(hidden_states[0]).chunk(3, dim=-1)
    gated = (gates * values).to(states.dtype)  # [T, C]
    num_requests, state_len, channels = inputs.slots.shape[0], states.shape[1], states.shape[2]
    # Zeros for a request starting at position 0: its slot holds an earlier request's state, or memory never
    # written (not even finite), so it is selected away, never multiplied by 0.
    carried = torch.where(inputs.continues, states.index_select(0, inputs.slots), 0.0)  # [R, K - 1, C]
    source = torch.cat([carried.reshape(-1, channels), gated])
    num_rows, kernel_size = inputs.tap_index.shape
    taps = source.index_select(0, inputs.tap_index.flatten()).view(num_rows, kernel_size, channels)
    weight = module.conv.weight[:, 0, :]  # [C, K]
    # The taps are added oldest first, one at a time: each row's sum has the same order whatever else the
    # step holds (batch-invariant by construction).
    convolved = taps[:, 0] * weight[:, 0]
    for tap in range(1, kernel_size):
        convolved = convolved + taps[:, tap] * weight[:, tap]
    if module.conv.bias is not None:
        convolved = convolved + module.conv.bias
    new_states = source.index_select(0, inputs.new_state_index.flatten())
    states.index_copy_(0, inputs.slots, new_states.view(num_requests, state_len, channels))
    return module.out_proj((outputs * convolved.to(outputs.dtype))[None])


def install(module: torch.nn.Module, states: torch.Tensor) -> None:
    """Makes the engine's forward `module`'s, over the layer's `states`; `uninstall` gives it back."""
    own_forward = module.forward

    def forward(
        hidden_states: torch.Tensor, *args: Any, paged_metadata: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        if not isinstance(paged_metadata, StatefulStepMetadata):
            return own_forward(hidden_states, *args, **kwargs)
        return short_conv_step(module, hidden_states, states, paged_metadata)

    module.forward = forward


def uninstall(module: torch.nn.Module) -> None:
    """The module's own forward again (the instance attribute `install` set hid the class's)."""
    del module.forward
