"""`StateSlotManager`: which state slot each running request holds, for layers that keep a fixed-size state
per request instead of pages (recurrent layers: engine.kv.layer_groups.StateGroupSpec).

A recurrent layer's state summarises every token the request has computed so far, so it cannot be paged,
shared or rebuilt from pages: each request holds one slot, from its first computed token to its end::

    slot:   0 (null)   1        2        3       ...
    holds:  padding    req a    free     req b

Slot 0 is the null slot, as block 0 is the null block: padding rows read and write it, and no request
holds it. The runner finds a request's slot where it finds its block tables (`ScheduledRequest.block_ids`,
this group's "table" is `[slot]`).

A slot is handed out only to a request starting at position 0 (admitted, or readmitted after preemption to
recompute), so whatever an earlier holder left in it is never read: the runner starts the state of a
request at position 0 from zeros (engine.runner.recurrent.step_inputs). A forked sequence (n > 1) is the
one exception: it takes a copy of its source's slot at the position it is forked at.
"""

from __future__ import annotations

from engine.kv.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from engine.request import Request


class StateSlotManager:
    """Owns each request's state slot in one state group.

    Invariant: a request holds one slot (never the null slot) or none; `_slot_ids[r]` is `[its slot]`,
    the list the runner reads, kept while the request holds it.
    """

    def __init__(self, num_slots: int) -> None:
        """`num_slots` counts the null slot: `num_slots - 1` requests can hold one at once."""
        self.block_pool = BlockPool(num_slots)
        self._slots: dict[str, KVBlock] = {}
        self._slot_ids: dict[str, list[int]] = {}

    def block_ids(self, request_id: str) -> list[int]:
        """`[slot]` of the request (the manager's own list: read it, never change it); empty when it holds
        none."""
        return self._slot_ids.get(request_id, [])

    def can_allocate(self, request_id: str, num_computed: int, num_new_tokens: int) -> bool:
        return request_id in self._slots or self.block_pool.num_free_blocks > 0

    def allocate(self, request: Request, num_computed: int, num_new_tokens: int) -> list[KVBlock]:
        """Gives `request` a slot on its first step; later steps keep it. The caller has checked
        `can_allocate`."""
        if request.request_id in self._slots:
            return []
        if num_computed:
            raise RuntimeError(
                f"request {request.request_id!r} asks for a state slot with {num_computed} tokens computed: "
                "a recurrent state is built from position 0 only (no prefix hit, no restore)"
            )
        return [self._take(request.request_id)]

    def num_fork_blocks(self, num_tokens: int) -> int:
        return 1

    def fork(self, source: Request, child: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Gives `child` a slot holding a copy of `source`'s state, which is the state after `num_tokens`
        tokens: the scheduler forks a source that computed exactly that far (no prefix hit can carry it
        further where a state group turns prefix caching off). The caller has checked the free slots.
        Returns the (source slot, child slot) copy to make."""
        assert source.num_computed_tokens == num_tokens, (source, num_tokens)
        return [(self._slots[source.request_id].block_id, self._take(child.request_id).block_id)]

    def free(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        self._slot_ids.pop(request_id, None)
        if slot is not None:
            self.block_pool.free([slot])

    def _take(self, request_id: str) -> KVBlock:
        (slot,) = self.block_pool.allocate(1)
        assert slot.block_id != NULL_BLOCK_ID
        self._slots[request_id] = slot
        self._slot_ids[request_id] = [slot.block_id]
        return slot
