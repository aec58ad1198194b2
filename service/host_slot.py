"""Where servicers find the engine host, which exists only once the model has loaded."""

from __future__ import annotations

import grpc

from service.engine_host import EngineHost


class HostSlot:
    """Filled once loading is done. Servicers are registered before (ports open early so health can say
    NOT_SERVING while a model loads), and answer UNAVAILABLE until then."""

    def __init__(self) -> None:
        self.host: EngineHost | None = None

    async def require(self, context: grpc.aio.ServicerContext) -> EngineHost:
        if self.host is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.host is not None
        return self.host
