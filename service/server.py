"""The two grpc.aio servers around one engine: generation (cbserve's GenerationService, the gateways'
vllm.grpc.engine.VllmEngine, health, reflection) and admin (AdminService, reflection), and the HTTP control
port (vLLM's admin routes) when asked for one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
from cbserve_client.proto import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from engine import call_on_steps_thread, default_num_threads
from service.admin_operations import AdminOperations
from service.admin_servicer import AdminServicer
from service.auth import BearerTokenInterceptor
from service.control_routes import ControlRoutes
from service.control_server import ControlServer
from service.engine_host import EngineHost
from service.generation_servicer import GenerationServicer
from service.host_slot import HostSlot
from service.message_decoding import MalformedMessageInterceptor
from service.metrics import ServerMetrics
from service.ports import bind_grpc_port
from service.tls import ServerTls
from service.tracing import RequestTracer, build_tracer_provider
from service.vllm_engine_servicer import VllmEngineServicer

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
VLLM_ENGINE_SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# How long the servers wait for open calls once the engine has drained (streams then end promptly).
SERVER_STOP_GRACE_S = 5.0
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "[::1]", "localhost"})


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    admin_port: int = 50052
    grace_period_s: float = 30.0
    max_pause_lease_s: float = 300.0
    admin_token: str | None = None
    # Both ports serve TLS (mutual TLS when it has a client CA) when set; plaintext otherwise.
    tls: ServerTls | None = None
    # OTLP/gRPC collector for traces; None: $OTEL_EXPORTER_OTLP_ENDPOINT, and no export when that is unset.
    otlp_endpoint: str | None = None
    # Prometheus text on http://host:metrics_port/metrics; 0 or None: no metrics endpoint.
    metrics_port: int | None = None
    # Let other servers listen on the same gRPC ports (SO_REUSEPORT; they split the connections).
    reuse_port: bool = False
    # The admin operations as vLLM's HTTP routes on http://host:control_port (plaintext, the admin token
    # required); 0 picks a free port; None: no control port.
    control_port: int | None = None


class CbserveServer:
    """Serves one engine: health is NOT_SERVING until `load` finishes and again while draining or stopped.

    The ports open before the model loads, so orchestrators can watch health during a long load.
    Request spans go to `tracer_provider` when given (the caller keeps ownership: tests pass one with an
    in-memory exporter), else to a provider the server builds from the options and shuts down itself.
    """

    def __init__(self, options: ServerOptions, tracer_provider: TracerProvider | None = None) -> None:
        self.options = options
        self._owns_tracer_provider = tracer_provider is None
        if tracer_provider is None:
            tracer_provider = build_tracer_provider(options.otlp_endpoint)
        self.tracer_provider = tracer_provider
        self.slot = HostSlot()
        # Owned by this server (never prometheus_client's global registry); served only with a metrics port.
        self.metrics = ServerMetrics(self.slot)
        self.metrics_port: int | None = None
        # Health updates run as tasks (listeners are plain callbacks); kept here so none is collected early.
        self._health_updates: set[asyncio.Future[None]] = set()
        self.health = health.aio.HealthServicer()
        # gRPC shares a port with any other server by default (SO_REUSEPORT): only when asked to here.
        port_sharing = [("grpc.so_reuseport", int(options.reuse_port))]
        self.main_server = grpc.aio.server(interceptors=[MalformedMessageInterceptor()], options=port_sharing)
        self.admin_server = grpc.aio.server(
            # Authentication answers first: a caller without the token learns nothing about its messages.
            interceptors=[BearerTokenInterceptor(options.admin_token), MalformedMessageInterceptor()],
            options=port_sharing,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.main_server)
        tracer = RequestTracer(self.tracer_provider)
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.slot, tracer, self.metrics), self.main_server
        )
        # The gateways' protocol on the same port: one health, one TLS setup, one engine behind both.
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(self.slot, tracer, self.metrics), self.main_server
        )
        # One set of admin operations behind both admin front ends: their pauses count together.
        operations = AdminOperations(self.slot, options.max_pause_lease_s, self.metrics)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(operations), self.admin_server)
        self.control_routes = ControlRoutes(operations)
        self.control_server = ControlServer(self.control_routes.table(), options.admin_token)
        self.control_port: int | None = None
        served = (GENERATION_SERVICE, VLLM_ENGINE_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(served, self.main_server)
        reflection.enable_server_reflection((ADMIN_SERVICE, reflection.SERVICE_NAME), self.admin_server)
        host, shared = options.host, options.reuse_port
        credentials = None if options.tls is None else options.tls.credentials()
        if credentials is None and host not in LOOPBACK_HOSTS:
            logger.warning("serving plaintext on %s: pass --tls-cert and --tls-key for TLS", host)
        # A port in use raises PortError, naming it, before anything listens.
        self.port = bind_grpc_port(self.main_server, host, options.port, "--port", credentials, shared)
        self.admin_port = bind_grpc_port(
            self.admin_server, host, options.admin_port, "--admin-port", credentials, shared
        )

    async def start(self) -> None:
        """Opens both ports with health NOT_SERVING."""
        await self._set_health(False)
        await self.main_server.start()
        await self.admin_server.start()
        if self.options.metrics_port:
            self.metrics_port = self.metrics.serve(self.options.host, self.options.metrics_port)
        if self.options.control_port is not None:
            self.control_port = await self.control_server.start(self.options.host, self.options.control_port)
        tls = self.options.tls
        security = "plaintext" if tls is None else "mutual TLS" if tls.mutual else "TLS"
        logger.info(
            "listening on %s:%d (admin port %d, %s)", self.options.host, self.port, self.admin_port, security
        )

    async def load(self, make_host: Callable[[], EngineHost]) -> EngineHost:
        """Builds the engine host off the event loop, starts it, hands it to the servicers, turns SERVING.

        `make_host` runs on a thread that ends with it, not on one of the executor's, which live on:
        loading (and the embedded model's first conversion) runs torch ops that leave the thread running
        them an OpenMP team, and one more team than cores makes every engine step wait for its workers to
        wake (`engine.call_on_steps_thread`)."""
        loop = asyncio.get_running_loop()
        host = await loop.run_in_executor(
            None,
            call_on_steps_thread,
            make_host,
            default_num_threads(torch.get_num_threads()),
            "cbserve-load",
        )
        host.add_state_listener(lambda: self._watch_host(host))
        host.add_request_end_listener(self.metrics.observe_request_end)
        await host.start_async()
        self.slot.host = host
        return host

    def _watch_host(self, host: EngineHost) -> None:
        update = asyncio.ensure_future(self._set_health(host.serving))
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", GENERATION_SERVICE, VLLM_ENGINE_SERVICE):
            await self.health.set(service, status)

    async def shutdown(self) -> None:
        """Graceful: NOT_SERVING, refuse new work, let in-flight requests finish within the grace period."""
        # A pause taken through the control port would hold the drain up to the grace period: given back.
        await self.control_routes.close()
        host = self.slot.host
        if host is not None:
            host.begin_drain()
            if not await host.wait_idle(self.options.grace_period_s):
                logger.warning(
                    "grace period of %s s over: failing the requests still running",
                    self.options.grace_period_s,
                )
            await host.stop(hard=True, drain_timeout_s=None)
        await self._set_health(False)
        await asyncio.gather(
            self.main_server.stop(SERVER_STOP_GRACE_S),
            self.admin_server.stop(SERVER_STOP_GRACE_S),
            self.control_server.stop(),
        )
        if host is not None:
            host.destroy()
        self.metrics.close()
        # Every request has ended by now, so every span has ended: flush them (and stop the exporter).
        provider = self.tracer_provider
        flush = provider.shutdown if self._owns_tracer_provider else provider.force_flush
        await asyncio.get_running_loop().run_in_executor(None, flush)
