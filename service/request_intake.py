"""Where a generation request of either protocol enters the engine host: its span starts, its wire fields
are checked, and a refusal is counted and traced, once per request."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.context import Context

from service.engine_host import EngineHost
from service.metrics import MetricsObserver
from service.sequence_group import SequenceGroup
from service.tracing import RequestTracer
from service.validation import PreparedRequest, RequestRejected


class RequestIntake:
    def __init__(self, tracer: RequestTracer, metrics: MetricsObserver) -> None:
        self.tracer = tracer
        self.metrics = metrics

    def submit(
        self,
        host: EngineHost,
        requested: Mapping[str, Any],
        prepare: Callable[[], PreparedRequest],
        trace_parent: Context,
        detokenize: bool = True,
    ) -> SequenceGroup:
        """Checks the request (`prepare`: its protocol's translation into the engine's request) and
        queues it; raises RequestRejected with the caller's status code.

        The request's span, parented by the caller's trace context and carrying what it `requested`,
        starts here and ends with the request (or now, with an error, if it is refused).
        `detokenize=False` leaves the output without text (stop strings still match on it), for callers
        that decode tokens themselves.
        """
        span = self.tracer.start(requested, host.model_name, trace_parent)
        # Refusals are counted here because every request passes through once; a call refused before it
        # carries a request (model loading, malformed message) has no request to count.
        try:
            group = host.submit(prepare(), detokenize=detokenize)
        except RequestRejected as exc:
            self.metrics.observe_rejected(exc.code.name)
            span.reject(exc.code.name, exc.message)
            raise
        except Exception as exc:
            self.metrics.observe_rejected("INTERNAL")
            span.reject("INTERNAL", str(exc) or type(exc).__name__)
            raise
        span.attach(group)
        return group
