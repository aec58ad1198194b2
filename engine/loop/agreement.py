"""How the tensor-parallel ranks agree on the outcome of a collective command (joining the trainer's
weight-update group, receiving a transfer): each rank passes what it saw, and every rank gets the same
element-wise minimum back, so that all of them go on, or all of them fail, together.

Injected into what needs it (engine.loop.weights_and_sleep): `SINGLE_PROCESS` in one process, where
agreeing is the identity; under tensor parallelism the engine's `engine.parallel.TensorParallelGroup`,
whose `smallest` is an all-reduce over the group's CPU channel.
"""

from __future__ import annotations

from typing import Protocol


class RankAgreement(Protocol):
    @property
    def rank(self) -> int:
        """This process's rank among the tensor-parallel ranks (0: the driver)."""
        ...

    @property
    def tp_size(self) -> int:
        """How many tensor-parallel ranks there are."""
        ...

    def smallest(self, values: list[int]) -> list[int]:
        """The element-wise minimum of `values` over every rank (each passes as many)."""
        ...


class SingleProcessAgreement:
    """One process: its rank is 0, and what it saw is what every rank saw."""

    rank = 0
    tp_size = 1

    def smallest(self, values: list[int]) -> list[int]:
        return values


SINGLE_PROCESS = SingleProcessAgreement()
