"""`StateCache`: the state tensors of one state group (engine.kv.layer_groups.StateGroupSpec), on the
engine's device beside the KV cache.

Each layer of the group has one tensor `[num_slots, *state_shape]`; slot s of every layer is the state of
the request holding slot s (engine.kv.state_slots), slot 0 the null slot that padding rows use::

    layer l:  | slot 0 (null, zeros) | slot 1 | slot 2 | ... |      each slot: (K - 1, channels)
"""

from __future__ import annotations

import torch

from engine.kv.block_pool import NULL_BLOCK_ID
from engine.kv.layer_groups import StateGroupSpec
from engine.system.device_copies import to_device
from engine.weights.sleep import release_storage, restore_storage


def state_bytes(group: StateGroupSpec, num_slots: int, dtype: torch.dtype) -> int:
    """The bytes a `StateCache` of `num_slots` slots takes (what the cache plan reserves for it)."""
    per_slot = 1
    for size in group.spec.state_shape:
        per_slot *= size
    return len(group.layer_indices) * num_slots * per_slot * dtype.itemsize


class StateCache:
    def __init__(
        self, group: StateGroupSpec, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.group = group
        self.num_slots = num_slots
        self.device = device
        shape = (num_slots, *group.spec.state_shape)
        self.states = [torch.empty(shape, dtype=dtype, device=device) for _ in group.layer_indices]
        self._zero_null_slot()

    def layer_states(self) -> dict[int, torch.Tensor]:
        """Each layer's tensor, by model layer index."""
        return dict(zip(self.group.layer_indices, self.states, strict=True))

    def _zero_null_slot(self) -> None:
        for states in self.states:
            states[NULL_BLOCK_ID].zero_()

    def copy_blocks(self, source_slots: list[int], target_slots: list[int]) -> None:
        """Copies the state of each source slot into its target slot, every layer (a forked sequence's)."""
        sources, targets = to_device([source_slots, target_slots], torch.long, self.device)
        for states in self.states:
            states.index_copy_(0, targets, states.index_select(0, sources))

    def release_storage(self) -> int:
        """Gives every tensor's memory back (sleep); returns the bytes freed. Every request holding a slot
        was put back to recompute first, so no state is lost that a request reads again."""
        return release_storage(self.states)

    def restore_storage(self) -> None:
        restore_storage(self.states)
        self._zero_null_slot()
