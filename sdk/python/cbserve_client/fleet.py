"""Every replica of one deployment at once, for trainers that pause them all and push weights to all.

Behind a Kubernetes Service a call reaches *one* pod; a weight update must reach every replica. A
headless Service's name resolves to one address per ready pod: :meth:`AdminFleet.resolve` opens an
:class:`AdminClient` to each, and the fleet fans each call out to all of them in parallel.

    from cbserve_client import AdminFleet

    with AdminFleet.resolve("cbserve.cbserve.svc.cluster.local:50052", token=token) as fleet:
        with fleet.paused():
            fleet.update_weights(model.state_dict(), version=f"step-{step}")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from cbserve_client._channel import Closeable, Interceptor
from cbserve_client._connection import replica_targets, split_host_port
from cbserve_client._pause import PauseLease
from cbserve_client._types import (
    PauseInfo,
    PrefixCacheReset,
    SleepResult,
    Status,
    WeightsChecksum,
    WeightsUpdate,
)
from cbserve_client._weights import WeightsSource
from cbserve_client.admin import DEFAULT_TIMEOUT_S, AdminClient
from cbserve_client.errors import CbserveError, FleetError, WeightsMismatchError

__all__ = ["AdminFleet", "replica_targets", "run_on_all"]

Result = TypeVar("Result")


def run_on_all(
    executor: Executor, clients: Sequence[AdminClient], call: Callable[[AdminClient], Result]
) -> list[Result]:
    """``call`` on every client in parallel; results in client order, or FleetError naming each
    failed target once every client has answered (so none is left running behind the error)."""
    futures = [executor.submit(call, client) for client in clients]
    results: dict[str, Any] = {}
    failures: dict[str, CbserveError] = {}
    for client, future in zip(clients, futures, strict=True):
        try:
            results[client.target] = future.result()
        except CbserveError as exc:
            failures[client.target] = exc
    if failures:
        raise FleetError(failures, results)
    return [results[client.target] for client in clients]


class AdminFleet(Closeable):
    """:class:`AdminClient` s of several replicas; each call runs on all of them in parallel.

    A call that fails on some replicas raises :class:`FleetError` once every replica has answered,
    naming each failed target; the replicas that succeeded keep their change (there is no cross-replica
    transaction), and ``FleetError.results`` holds what they returned, so a caller can retry the others.

    Args:
        targets: the admin address of each replica.
        token, credentials, timeout, options, interceptors: as for :class:`AdminClient`, for every
            replica.
    """

    def __init__(
        self,
        targets: Sequence[str],
        token: str | None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Interceptor] = (),
    ) -> None:
        if not targets:
            raise ValueError("an AdminFleet needs at least one target")
        self.clients = [
            AdminClient(
                target,
                token,
                credentials=credentials,
                timeout=timeout,
                options=options,
                interceptors=interceptors,
            )
            for target in targets
        ]
        self._executor = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="cbserve-fleet")

    @classmethod
    def resolve(
        cls,
        target: str,
        token: str | None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Interceptor] = (),
    ) -> AdminFleet:
        """A fleet of every address ``target``'s host resolves to (:func:`replica_targets`). With TLS,
        each connection still checks the server certificate against that host name, not the address."""
        host, _port = split_host_port(target)
        if credentials is not None:
            options = (*options, ("grpc.ssl_target_name_override", host))
        return cls(
            replica_targets(target),
            token,
            credentials=credentials,
            timeout=timeout,
            options=options,
            interceptors=interceptors,
        )

    @property
    def targets(self) -> list[str]:
        return [client.target for client in self.clients]

    def _on_all(self, call: Callable[[AdminClient], Result]) -> list[Result]:
        """`call` on every replica in parallel; results in target order, or FleetError."""
        return run_on_all(self._executor, self.clients, call)

    def pause(
        self, mode: str = "keep", lease_s: float | None = None, *, timeout: float | None = None
    ) -> list[PauseLease]:
        """Pauses every replica (see :meth:`AdminClient.pause`); returns each replica's
        :class:`PauseLease`, in target order: release every one. If a replica cannot be paused, the
        holds already taken are released and FleetError is raised."""
        try:
            return self._on_all(lambda client: client.pause(mode, lease_s, timeout=timeout))
        except FleetError as error:
            for lease in error.results.values():
                lease.release()
            infos = {target: lease.info for target, lease in error.results.items()}
            raise FleetError(error.failures, infos) from None

    @contextlib.contextmanager
    def paused(
        self, mode: str = "keep", lease_s: float | None = None, *, timeout: float | None = None
    ) -> Iterator[list[PauseInfo]]:
        """Holds every replica paused for the duration of a ``with`` block (:meth:`pause`, then every
        release when the block exits); yields each replica's :class:`PauseInfo`, in target order."""
        leases = self.pause(mode, lease_s, timeout=timeout)
        with contextlib.ExitStack() as holds:
            for lease in leases:
                holds.push(lease)
            yield [lease.info for lease in leases]

    def update_weights(
        self, state_dict_or_path: WeightsSource, version: str | None = None, *, timeout: float | None = None
    ) -> list[WeightsUpdate]:
        """:meth:`AdminClient.update_weights` on every replica at once; results in target order.

        A mapping or path is sent to each replica as it is; an iterator of (name, tensor) pairs is
        read once, up front, since every replica needs all of it."""
        if not isinstance(state_dict_or_path, (str, bytes)) and not hasattr(state_dict_or_path, "items"):
            state_dict_or_path = list(state_dict_or_path)  # type: ignore[arg-type]
        return self._on_all(
            lambda client: client.update_weights(state_dict_or_path, version, timeout=timeout)
        )

    def status(self) -> list[Status]:
        """Each replica's :class:`Status`, in target order."""
        return self._on_all(lambda client: client.status())

    def sleep(self, level: int = 1, *, mode: str = "keep") -> list[SleepResult]:
        """:meth:`AdminClient.sleep` on every replica at once; results in target order."""
        return self._on_all(lambda client: client.sleep(level, mode=mode))

    def wake_up(self, tags: Sequence[str] | None = None) -> list[int]:
        """:meth:`AdminClient.wake_up` on every replica at once; the sleep level each has left, in
        target order."""
        return self._on_all(lambda client: client.wake_up(tags))

    def reset_prefix_cache(self, abort: bool = False) -> list[PrefixCacheReset]:
        """:meth:`AdminClient.reset_prefix_cache` on every replica at once; results in target order. A
        replica with requests in flight (without ``abort``) fails with FAILED_PRECONDITION in the
        FleetError, while the others are reset."""
        return self._on_all(lambda client: client.reset_prefix_cache(abort))

    def weights_checksum(self, per_tensor: bool = False) -> list[WeightsChecksum]:
        """:meth:`AdminClient.weights_checksum` of every replica at once; results in target order."""
        return self._on_all(lambda client: client.weights_checksum(per_tensor))

    def check_weights(self, expected: WeightsChecksum | None = None) -> WeightsChecksum:
        """Checks in one call that every replica holds the same weights (slime's check_weights after a
        sync): each computes its digest, with per-tensor digests, and each is compared with
        ``expected`` (the trainer's own, from :func:`~cbserve_client.weights_checksum`), or without it
        with the first replica's. Returns the common checksum; raises
        :class:`~cbserve_client.errors.WeightsMismatchError` naming every replica that differs and the
        tensors it differs in (FleetError when a replica cannot answer)."""
        checksums = dict(zip(self.targets, self.weights_checksum(per_tensor=True), strict=True))
        reference_name, reference = (
            ("expected", expected) if expected is not None else next(iter(checksums.items()))
        )
        differing: dict[str, tuple[str, ...]] = {}
        for target, checksum in checksums.items():
            if (checksum.algorithm, checksum.digest) != (reference.algorithm, reference.digest):
                differing[target] = _differing_tensors(reference, checksum)
        if differing:
            raise WeightsMismatchError(reference_name, checksums, differing)
        return reference

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self._executor.shutdown(wait=False)


def _differing_tensors(reference: WeightsChecksum, checksum: WeightsChecksum) -> tuple[str, ...]:
    """The names whose digests differ between two checksums (either side's names), in name order; all
    of them when the algorithms differ."""
    names = set(reference.tensors) | set(checksum.tensors)
    if reference.algorithm != checksum.algorithm:
        return tuple(sorted(names))
    return tuple(
        sorted(
            name
            for name in names
            if name not in reference.tensors
            or name not in checksum.tensors
            or reference.tensors[name].digest != checksum.tensors[name].digest
        )
    )
