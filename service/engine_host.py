"""Owns the model, its tokenizer and the engine, and the wire-side state of every request."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from smg_grpc_proto.generated import common_pb2

from engine import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    DuplicateRequestError,
    ManagerStats,
    QueueFullError,
    RequestStatus,
    default_max_new_tokens,
    sequence_request_id,
)
from service.engine_admin import EngineAdmin
from service.engine_load import GenerationRate, engine_load
from service.kv_event_stream import KvEventStream
from service.request_record import RequestRecord
from service.sequence_group import SequenceGroup
from service.validation import ModelLimits, PreparedRequest, RequestRejected

logger = logging.getLogger(__name__)

# How long an ended request's outputs stay readable through StreamResults.
DEFAULT_RETENTION_S = 300.0


@dataclass
class Counters:
    """Totals since the server started (the engine's own counters reset on restart)."""

    finished_requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class EngineHost:
    """The engine plus the per-request records that StreamResults, Generate and Cancel read.

    Every method runs on the server's event loop (the engine calls back onto it), so records need no
    lock. Ended requests stay readable for `retention_s` seconds so that a reader can reconnect.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any | None = None,
        config: ContinuousBatchingConfig | None = None,
        model_name: str = "",
        retention_s: float = DEFAULT_RETENTION_S,
        model_path: str = "",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        # Where the model was loaded from, as gateways ask for it (GetModelInfo); the name otherwise.
        self.model_path = model_path or self.model_name
        # The tokenizer also compiles structured-output grammars for the model's vocabulary.
        self.manager = ContinuousBatchingManager(
            model, continuous_batching_config=config, tokenizer=tokenizer
        )
        self.retention_s = retention_s
        self.counters = Counters()
        self._records: dict[str, SequenceGroup] = {}
        self._draining = False
        self._watches_loop_exit = False
        self._state_listeners: list[Callable[[], None]] = []
        # Called once per sequence (one per request unless n > 1) when it ends (metrics hook).
        self._end_listeners: list[Callable[[RequestRecord], None]] = []
        model_config: Any = model.config
        text_config = model_config.get_text_config()
        generation_config = getattr(model, "generation_config", None)
        self.eos_token_ids = _as_list(getattr(generation_config, "eos_token_id", None))
        self.limits = ModelLimits(
            vocab_size=int(text_config.vocab_size),
            max_context_length=int(getattr(text_config, "max_position_embeddings", 0) or 2**31 - 1),
            default_max_new_tokens=default_max_new_tokens(generation_config),
            generation_config=generation_config,
            default_logprobs_mode=self.manager.config.logprobs_mode,
        )
        self._generation_rate = GenerationRate()
        # The prefix cache's events for gateways (SubscribeKvEvents), recorded from the start so that a
        # subscriber's snapshot holds every block the engine can reuse.
        self.kv_events = KvEventStream(self.page_size, self.engine_load)
        self.manager.add_kv_event_listener(self.kv_events.publish)
        # What the AdminService may do to the engine; servicers reach the engine through it and this host.
        self.admin = EngineAdmin(self.manager, model)

    # ------------------------------------------------------------------ lifecycle

    @property
    def serving(self) -> bool:
        """Whether new requests are accepted (health follows it); see `unavailable_reason`."""
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """Why new requests are refused with UNAVAILABLE, or None when they are accepted: the engine
        stopped, its loop failed (a tensor-parallel rank lost), a drain or stop is under way, it sleeps,
        or its weights are a mix of two versions (a transfer from the trainer failed midway). A router
        retries the request on another replica."""
        loop_error = self.manager.loop_error
        if loop_error is not None:
            return f"the engine failed: {loop_error}"
        if not self.manager.is_running() or self._draining:
            return "the server is stopped or draining"
        stats = self.manager.stats()
        if stats.sleep_level:
            return f"the server is asleep (sleep level {stats.sleep_level}) until Admin.WakeUp"
        if stats.weights_incomplete is not None:
            return f"the weights are incomplete until a complete update arrives ({stats.weights_incomplete})"
        return None

    def add_state_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` runs on the event loop whenever `serving` may have changed (health follows it)."""
        self._state_listeners.append(listener)

    def add_request_end_listener(self, listener: Callable[[RequestRecord], None]) -> None:
        """`listener(record)` runs on the event loop once for each request's sequence (n > 1: each of
        them), when it has ended."""
        self._end_listeners.append(listener)

    def state_changed(self) -> None:
        """Tells the listeners that `serving` may have changed (after sleep, wake or a weight transfer)."""
        for listener in self._state_listeners:
            listener()

    def start(self) -> bool:
        """Starts the engine; False when it already ran. Blocking (builds the KV cache the first time)."""
        if self.manager.is_running():
            return False
        if _compiles_or_captures(self.manager.config):
            # Compile and capture before serving (health stays NOT_SERVING), not on the first requests.
            self.manager.warmup()
        self.manager.start()
        self._draining = False
        return True

    async def start_async(self) -> bool:
        loop = asyncio.get_running_loop()
        if not self._watches_loop_exit:
            # The loop can end on its own (a tensor-parallel rank lost): health must follow at once.
            self.manager.add_loop_exit_handler(lambda: _call_soon(loop, self.state_changed))
            self._watches_loop_exit = True
        started = await loop.run_in_executor(None, self.start)
        self.state_changed()
        return started

    async def stop(self, hard: bool, drain_timeout_s: float | None) -> tuple[int, int]:
        """Stops the engine, draining first unless `hard`; returns (finished normally, failed or cancelled).

        A drain that outlives `drain_timeout_s` fails the requests still running.
        """
        live = [group for group in self._records.values() if not group.finished]
        self._draining = True
        self.state_changed()
        try:
            if not hard:
                await self.wait_idle(drain_timeout_s)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: self.manager.stop(block=True, hard_stop=True))
            await asyncio.gather(*(group.wait_finished() for group in live))
        finally:
            self.state_changed()
        drained = sum(
            1 for group in live if all(record.status == RequestStatus.FINISHED for record in group.records)
        )
        return drained, len(live) - drained

    def begin_drain(self) -> None:
        """Refuses new requests from now on; in-flight ones keep running."""
        self._draining = True
        self.state_changed()

    async def wait_idle(self, timeout: float | None) -> bool:
        """Waits until no request is live (at most `timeout` seconds); True when that happened."""
        live = [group.wait_finished() for group in self._records.values() if not group.finished]
        if not live:
            return True
        _, pending = await asyncio.wait([asyncio.ensure_future(wait) for wait in live], timeout=timeout)
        for task in pending:
            task.cancel()
        return not pending

    def destroy(self) -> None:
        self.manager.destroy()

    # ------------------------------------------------------------------ requests

    def submit(self, prepared: PreparedRequest, detokenize: bool = True) -> SequenceGroup:
        """Queues a validated request; raises RequestRejected with the code the caller gets. Returns the
        records of its sequences (one unless n > 1).

        Without `detokenize` (and without stop strings, which match on text) the records decode no text:
        a gateway detokenizes itself, and decoding every token twice would cost the engine's cores.

        Availability is checked here, once, for every door; the engine makes the remaining checks (a
        request that can never run, a full queue) and answers None once it has stopped."""
        unavailable = self.unavailable_reason()
        if unavailable is not None:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, unavailable)
        existing = self._records.get(prepared.request_id)
        if existing is not None and not existing.finished:
            raise RequestRejected(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {prepared.request_id!r} is already in flight"
            )
        try:
            request_id = self.manager.add_request(
                prepared.input_ids,
                request_id=prepared.request_id,
                streaming=True,
                record_timestamps=prepared.record_timestamps,
                sampling_params=prepared.sampling,
                priority=prepared.priority,
                kv_on_weight_update=prepared.kv_on_weight_update,
            )
        except QueueFullError as exc:
            raise RequestRejected(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except DuplicateRequestError as exc:
            # The engine still holds a request whose record here has ended (a stop string ended it and
            # its cancel has not reached the loop yet): the same answer as a live record's.
            raise RequestRejected(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from exc
        except ValueError as exc:  # a check only the engine makes
            raise RequestRejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        if request_id is None:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "the engine is stopped")
        records = [
            RequestRecord(
                request_id,
                len(prepared.input_ids),
                self.tokenizer if detokenize or prepared.stop_strings else None,
                self.weight_version,
                logprobs=prepared.sampling.logprobs,
                record_timestamps=prepared.record_timestamps,
                stop_strings=prepared.stop_strings,
                skip_special_tokens=prepared.skip_special_tokens,
                index=index,
            )
            for index in range(prepared.sampling.n)
        ]
        group = SequenceGroup(records)
        self._records[request_id] = group
        self.counters.prompt_tokens += len(prepared.input_ids)
        for record in records:
            self.manager.register_result_handler(
                sequence_request_id(request_id, record.index),
                functools.partial(self._on_output, group, record),
            )
        return group

    def _on_output(self, group: SequenceGroup, record: RequestRecord, output: Any) -> None:
        if record.finished:
            return  # the engine's own end of a sequence a stop string already ended
        record.on_output(output)
        if record.stopped_by_text and output.status < RequestStatus.FINISHED:
            # Frees its KV blocks and batch slot; the request's other sequences run on.
            self.manager.cancel_request(record.request_id, index=record.index)
        if record.finished:
            self.counters.generated_tokens += len(record.token_ids)
            if group.finished:
                self.counters.finished_requests += 1
            for listener in self._end_listeners:
                try:
                    listener(record)
                except Exception:
                    logger.exception("a request-end listener failed for %s", record.request_id)
            if group.finished:
                asyncio.get_running_loop().call_later(self.retention_s, self._forget, group)

    def _forget(self, group: SequenceGroup) -> None:
        # A later request may have reused the id; only drop the group this timer was set for.
        if self._records.get(group.request_id) is group:
            del self._records[group.request_id]

    def get(self, request_id: str) -> SequenceGroup | None:
        return self._records.get(request_id)

    def cancel(self, request_id: str, index: int | None = None) -> bool:
        """Cancels a live request, or with `index` only that sequence of it (n > 1); False when it is
        unknown or already ended."""
        group = self._records.get(request_id)
        if group is None:
            return False
        targets = group.records if index is None else group.records[index : index + 1]
        if all(record.finished for record in targets):
            return False
        self.manager.cancel_request(request_id, index=index)
        return True

    def stats(self) -> ManagerStats:
        return self.manager.stats()

    @property
    def page_size(self) -> int:
        return self.manager.config.page_size

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_requests_per_batch(self) -> int:
        return self.manager.max_requests_per_batch

    @property
    def max_request_tokens(self) -> int:
        """The most tokens, prompt and output together, that one request can hold."""
        capacity = self.manager.max_tokens_per_request()
        context = self.limits.max_context_length
        return min(context, capacity) if capacity is not None else context

    @property
    def num_live_requests(self) -> int:
        return sum(1 for group in self._records.values() if not group.finished)

    def engine_load(self) -> common_pb2.EngineLoad:
        """The load gateways route on (runs on the event loop)."""
        stats = self.stats()
        rate = self._generation_rate.update(stats.num_generated_tokens)
        return engine_load(stats, self.page_size, self.max_requests_per_batch, rate)

    @property
    def weight_version(self) -> int:
        """Version of the weights served now (1 at start, +1 per update)."""
        return self.admin.weight_version


def _as_list(eos_token_id: Any) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(token) for token in eos_token_id]


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(callback)


def _compiles_or_captures(config: ContinuousBatchingConfig) -> bool:
    """Whether the engine compiles code (torch.compile, the Triton attention kernel) or captures graphs."""
    compiles = any(config.compile_config_for(path) is not None for path in ("varlen", "decode"))
    return compiles or any(config.cuda_graph_flags()) or bool(config.max_blocks_per_request)
