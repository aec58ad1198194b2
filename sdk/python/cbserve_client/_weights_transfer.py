"""One UpdateWeightsFromDistributed call in flight, split at the point where the trainer broadcasts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from cbserve_client._channel import Closeable
from cbserve_client._convert import weights_transfer_ready_from_proto, weights_update_from_proto
from cbserve_client._generated.cbserve.v1 import admin_pb2
from cbserve_client._types import WeightsTransferReady, WeightsUpdate
from cbserve_client.errors import CbserveError


class WeightsTransfer(Closeable):
    """An announced transfer of weights over the weight-update group (SGLang's
    update_weights_from_distributed, in its two halves).

    The server answers the announcement with ``ready`` once its engine holds between two steps and
    waits for the buckets, and with ``done`` once it applied them. Between the two the trainer
    broadcasts the buckets. Split this way, a trainer pushing to several servers announces to all of
    them, waits for every :meth:`wait_ready`, broadcasts each bucket once for all, then collects every
    :meth:`wait_done`; :class:`~cbserve_client.WeightSyncGroup` does exactly that.

    ``close()`` (or leaving a ``with`` block) cancels the call when it has not completed: a server that
    is still waiting for buckets then fails the update rather than waiting for its timeout.
    """

    def __init__(self, call: Any, error: Callable[[grpc.RpcError], CbserveError]) -> None:
        self._call = call
        self._error = error
        self._ready: WeightsTransferReady | None = None

    def wait_ready(self) -> WeightsTransferReady:
        """Blocks until the server waits for the buckets; raises the server's error if it refused the
        announcement (INVALID_ARGUMENT naming the tensor) or failed before receiving."""
        if self._ready is not None:
            return self._ready
        message = self._next("ready")
        if not message.HasField("ready"):
            raise CbserveError(grpc.StatusCode.UNKNOWN, "the server sent `done` before `ready`")
        self._ready = weights_transfer_ready_from_proto(message.ready)
        return self._ready

    def wait_done(self) -> WeightsUpdate:
        """Blocks until the server applied every bucket; call it after broadcasting them all (the
        server sends nothing until the last bucket lands)."""
        if self._ready is None:
            raise RuntimeError("wait_done before wait_ready: the buckets are broadcast between the two")
        message = self._next("done")
        if not message.HasField("done"):
            raise CbserveError(grpc.StatusCode.UNKNOWN, "the server sent a second `ready` instead of `done`")
        return weights_update_from_proto(message.done)

    def close(self) -> None:
        """Cancels the call (no-op once it has completed)."""
        self._call.cancel()

    def _next(self, expected: str) -> admin_pb2.UpdateWeightsFromDistributedResponse:
        try:
            message: admin_pb2.UpdateWeightsFromDistributedResponse = next(self._call)
        except StopIteration:
            raise CbserveError(
                grpc.StatusCode.UNKNOWN, f"the UpdateWeightsFromDistributed stream ended before `{expected}`"
            ) from None
        except grpc.RpcError as exc:
            raise self._error(exc) from exc
        return message
