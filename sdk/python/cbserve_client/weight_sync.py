"""The trainer's side of weight sync over a torch.distributed group (the "weight-update group" of
SGLang and verl, vLLM's stateless process group for RLHF).

``update_weights`` streams every byte through protobuf and the host. A trainer that can reach its
servers directly broadcasts them instead, over NCCL (GPU to GPU) or gloo: it forms one process group
with every rank of every server, the trainer being rank 0, and each push is then a short gRPC
announcement followed by a few large broadcasts.

    from cbserve_client import AdminFleet, WeightSyncGroup

    with AdminFleet.resolve("cbserve.ml.svc.cluster.local:50052", token=token) as fleet:
        with WeightSyncGroup.create(fleet, master_address=trainer_ip) as group:
            for step in range(steps):
                train_step(model)
                group.push(model.state_dict(), version=f"step-{step}")

The group is the trainer's own: torch.distributed's default group (the trainer may have one for its
own training) is neither needed nor touched. torch is imported only when a group is created, so this
module imports without it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from cbserve_client._buckets import DEFAULT_BUCKET_BYTES, WeightBucket, plan_buckets
from cbserve_client._channel import Closeable
from cbserve_client._types import WeightsUpdate, WeightsUpdateGroupInfo
from cbserve_client._weights import NamedTensors, named_tensor_list
from cbserve_client._weights_transfer import WeightsTransfer
from cbserve_client.admin import DEFAULT_GROUP_TIMEOUT_S, AdminClient
from cbserve_client.errors import CbserveError, FleetError, error_from_code
from cbserve_client.fleet import AdminFleet, run_on_all

if TYPE_CHECKING:
    import torch

__all__ = ["WeightSyncGroup"]

Result = TypeVar("Result")

_BACKENDS = ("gloo", "nccl")

# What a failed push leaves behind, appended to each server's error.
_NOTHING_SENT = (
    "no bucket was broadcast, so no weights changed; the weight-update group is closed: create a new "
    "WeightSyncGroup"
)
_WEIGHTS_INCOMPLETE = (
    "the transfer failed after the server began receiving buckets: its weights may be a mix of two "
    "versions (Status.weights_incomplete says why) and it holds every request until a push of every "
    "tensor succeeds; the weight-update group is closed: create a new WeightSyncGroup and push again"
)


class WeightSyncGroup(Closeable):
    """A weight-update group of this trainer (rank 0) and one server or every replica of a fleet.

    Form one with :meth:`create`, send weights with :meth:`push`; :meth:`close` (or leaving a ``with``
    block) leaves the group on every server and shuts the trainer's side down.

    Attributes:
        backend: "nccl" or "gloo".
        world_size: 1 (the trainer) + every tensor-parallel rank of every server.
        server_ranks: the group ranks each server holds, in the order of its clients.
    """

    def __init__(
        self,
        clients: Sequence[AdminClient],
        executor: Executor,
        process_group: Any,
        device: torch.device,
        backend: str,
        server_ranks: list[tuple[int, ...]],
    ) -> None:
        self._clients = clients
        self._executor = executor
        self._process_group = process_group
        self._device = device
        self.backend = backend
        self.server_ranks = server_ranks
        self.world_size = 1 + sum(len(ranks) for ranks in server_ranks)
        # The two packing buffers, used in turn and kept from one push to the next (the servers keep
        # theirs too): a fresh one is paged in again on every push, which on a CPU costs as much as the
        # broadcast.
        self._buffers: list[torch.Tensor] = []

    @classmethod
    def create(
        cls,
        servers: AdminClient | AdminFleet,
        *,
        master_address: str,
        master_port: int = 0,
        backend: str = "auto",
        group_name: str = "weights",
        group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> WeightSyncGroup:
        """Forms the group with ``servers`` (SGLang's init_weights_update_group, both sides at once).

        The trainer hosts the rendezvous (a torch.distributed TCPStore) on ``master_port`` (0: a free
        port) and tells the servers to reach it at ``master_address``, an address of this host that
        every server can reach. Each server takes one rank per tensor-parallel rank (its
        ``Status.tensor_parallel_size``), the servers of a fleet consecutive ranges from rank 1.
        ``backend``: "nccl" (buffers on this process's current CUDA device), "gloo" (host buffers) or
        "auto" (nccl when CUDA is available here); the servers are sent the backend chosen, so that
        both sides agree. ``group_timeout_s`` bounds the forming and each later broadcast. As for
        torch.distributed, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the network interface.

        Raises as soon as a server fails to join: its error (FleetError naming each replica, for a
        fleet), or torch's when the trainer's side fails. Servers that had joined leave again; servers
        still joining give up at the group's timeout.
        """
        if not group_timeout_s > 0:
            raise ValueError(f"group_timeout_s must be > 0, got {group_timeout_s!r}")
        clients = servers.clients if isinstance(servers, AdminFleet) else [servers]
        executor = ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="cbserve-weight-sync")
        try:
            return cls._form(
                clients, executor, master_address, master_port, backend, group_name, group_timeout_s
            )
        except BaseException:
            executor.shutdown(wait=False)
            raise

    @classmethod
    def _form(
        cls,
        clients: Sequence[AdminClient],
        executor: Executor,
        master_address: str,
        master_port: int,
        backend: str,
        group_name: str,
        group_timeout_s: float,
    ) -> WeightSyncGroup:
        """Hosts the rendezvous, has every server join while rank 0 forms its side, and returns once
        all of them took part in the warm-up broadcast, or as soon as one of them fails."""
        import torch
        import torch.distributed as distributed

        chosen = _chosen_backend(backend)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if chosen == "nccl" else torch.device("cpu")
        )
        sizes = [status.tensor_parallel_size for status in _on_servers(clients, executor, AdminClient.status)]
        world_size = 1 + sum(sizes)
        timeout = timedelta(seconds=group_timeout_s)
        # Listening before any server is asked to join: a port in use fails here, with nothing to undo.
        # (TCPStore and PrefixStore are torch.distributed's documented API, imported there without `as`.)
        store = distributed.TCPStore(  # type: ignore[attr-defined]
            master_address, master_port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        prefixed = distributed.PrefixStore(group_name, store)  # type: ignore[attr-defined]
        joins = [
            _in_daemon_thread(
                functools.partial(
                    client.init_weights_update_group,
                    master_address,
                    store.port,
                    rank_offset,
                    world_size,
                    backend=chosen,
                    group_name=group_name,
                    group_timeout_s=group_timeout_s,
                )
            )
            for client, rank_offset in zip(clients, itertools.accumulate([1, *sizes[:-1]]), strict=True)
        ]
        formation = _Formation(prefixed, chosen, world_size, timeout, device)
        finished, unfinished = wait([formation.future, *joins], return_when=FIRST_EXCEPTION)
        if not unfinished and all(future.exception() is None for future in finished):
            server_ranks = [join.result().ranks for join in joins]
            return cls(clients, executor, formation.future.result(), device, chosen, server_ranks)
        formation.abandon()
        description = (
            f"the weight-update group {group_name!r} ({chosen}, world size {world_size}, rendezvous at "
            f"{master_address}:{store.port})"
        )
        raise _formation_error(clients, joins, formation.future, description)

    def push(
        self, weights: NamedTensors, *, version: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> list[WeightsUpdate]:
        """Sends ``weights`` to every server of the group (SGLang's update_weights_from_distributed).

        ``weights``: a state dict or (name, tensor) pairs of torch tensors on any device, full
        (unsharded) and named as the server's model names its parameters; a server converts each to
        its parameter's dtype and keeps its own shard. They are packed, in the given order, into
        buckets of at most ``bucket_bytes`` (:func:`~cbserve_client.plan_buckets`), one broadcast
        each: the next bucket is packed while the last one travels, so this process holds two buckets
        (a tensor alone in its bucket travels from its own memory when it is contiguous and on the
        group's device). ``version`` is a free-form label. Returns what each server applied, in the
        order of its clients.

        Every server first checks the announcement: a bad one (an unknown name, a wrong shape) raises
        the server's InvalidArgumentError naming the tensor, before any server waits for buckets, and
        the group stays usable. A failure after that closes the group (the servers leave it), and the
        error says what the server was left with: when it had started receiving buckets, its weights
        may be a mix of two versions (``Status.weights_incomplete``), and it holds its requests until
        a push of every tensor succeeds through a new group.
        """
        if self._process_group is None:
            raise RuntimeError("this WeightSyncGroup is closed: create a new one")
        items = named_tensor_list(weights)
        for name, tensor in items:
            if not hasattr(tensor, "element_size"):
                raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch tensor")
        buckets = plan_buckets(
            [
                (name, str(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())
                for name, tensor in items
            ],
            bucket_bytes,
        )
        _on_servers(
            self._clients,
            self._executor,
            lambda client: client.update_weights_from_distributed(
                buckets, version=version, validate_only=True, timeout=client.timeout
            ),
        )
        transfers: list[WeightsTransfer] = []
        try:
            for client in self._clients:
                transfers.append(client.start_update_weights_from_distributed(buckets, version=version))
            self._collect(transfers, WeightsTransfer.wait_ready, _NOTHING_SENT)
            try:
                self._broadcast(buckets, dict(items))
            except Exception as exc:
                self._note_server_failures(exc, transfers)
                raise
            return self._collect(transfers, WeightsTransfer.wait_done, _WEIGHTS_INCOMPLETE)
        except BaseException:
            for transfer in transfers:
                transfer.close()
            self._close_after_failure()
            raise

    def close(self) -> None:
        """Leaves the group on every server (SGLang's destroy_weights_update_group), then shuts the
        trainer's side down so that no NCCL or gloo thread outlives it. Idempotent. Raises the servers'
        errors once the trainer's side is shut down."""
        self._close(abort=False)

    def _close(self, *, abort: bool) -> None:
        self._buffers = []
        process_group, self._process_group = self._process_group, None
        if process_group is None:
            return
        try:
            _on_servers(self._clients, self._executor, AdminClient.destroy_weights_update_group)
        finally:
            _shut_down(process_group, abort=abort)
            self._executor.shutdown(wait=False)

    def _close_after_failure(self) -> None:
        """Closes the group after a failed push: aborting, since a broadcast may never complete, and
        quietly, since the push's error matters more than any of closing's."""
        with contextlib.suppress(CbserveError):
            self._close(abort=True)

    def _note_server_failures(self, error: Exception, transfers: list[WeightsTransfer]) -> None:
        """Adds to a failed broadcast's ``error`` what the servers that ended their transfer said: the
        trainer's side only sees a timeout or a closed connection, the server knows why it stopped."""
        for client, transfer in zip(self._clients, transfers, strict=True):
            transfer.close()  # a server still receiving would wait for the rest until its timeout
            try:
                transfer.wait_done()
            except CbserveError as server_error:
                if server_error.code != grpc.StatusCode.CANCELLED:
                    error.add_note(f"{client.target}: {server_error}")

    def _collect(
        self,
        transfers: list[WeightsTransfer],
        wait_for: Callable[[WeightsTransfer], Result],
        consequence: str,
    ) -> list[Result]:
        """``wait_for`` every transfer; results in the order of the clients, or every server's error,
        each followed by ``consequence``, once all of them have answered."""
        results: dict[str, Any] = {}
        failures: dict[str, CbserveError] = {}
        for client, transfer in zip(self._clients, transfers, strict=True):
            try:
                results[client.target] = wait_for(transfer)
            except CbserveError as exc:
                explained = error_from_code(exc.code, f"{exc.details} ({consequence})")
                explained.__cause__ = exc
                failures[client.target] = explained
        if failures:
            raise _servers_error(self._clients, failures, results)
        return [results[client.target] for client in self._clients]

    def _broadcast(self, buckets: list[WeightBucket], tensors: Mapping[str, Any]) -> None:
        """Broadcasts each bucket from rank 0, in announcement order (the order the servers receive
        them), with at most two in flight: bucket k+1 is packed while bucket k travels.

        A bucket of one contiguous tensor already on the group's device travels from that tensor's own
        memory; any other is copied, tensor by tensor, into one of two packing buffers used in turn.
        Invariant: when bucket k is packed, only bucket k-1 may still be in flight, so the buffer
        bucket k-2 used is free again."""
        import torch

        with torch.no_grad():
            sources = [self._unpacked(bucket, tensors) for bucket in buckets]
            buffers = self._packing_buffers(
                [bucket.num_bytes for bucket, source in zip(buckets, sources, strict=True) if source is None]
            )
            in_flight: collections.deque[tuple[int, Any]] = collections.deque()
            num_packed = 0
            for index, (bucket, source) in enumerate(zip(buckets, sources, strict=True)):
                if len(in_flight) == 2:
                    _finish_broadcast(*in_flight.popleft(), len(buckets))
                if source is None:
                    source = buffers[num_packed % 2][: bucket.num_bytes]
                    num_packed += 1
                    _pack(bucket, tensors, source)
                try:
                    in_flight.append((index, self._process_group.broadcast(source, 0)))
                except Exception as exc:
                    _note_broadcast_failure(exc, index, len(buckets))
                    raise
            while in_flight:
                _finish_broadcast(*in_flight.popleft(), len(buckets))

    def _unpacked(self, bucket: WeightBucket, tensors: Mapping[str, Any]) -> torch.Tensor | None:
        """The bytes of a bucket that holds one contiguous tensor on the group's device, viewed in place;
        None for a bucket that has to be packed."""
        import torch

        if len(bucket.tensors) != 1:
            return None
        tensor: torch.Tensor = tensors[bucket.tensors[0].name].detach()
        if tensor.device != self._device or not tensor.is_contiguous():
            return None
        return tensor.reshape(-1).view(torch.uint8)

    def _packing_buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        """Two buffers on the group's device of at least the largest of ``sizes`` (none when empty),
        kept from one push to the next."""
        import torch

        largest = max(sizes, default=0)
        if largest and (not self._buffers or self._buffers[0].numel() < largest):
            self._buffers = []  # freed before their larger successors are allocated
            self._buffers = [torch.empty(largest, dtype=torch.uint8, device=self._device) for _ in range(2)]
        return self._buffers


def _pack(bucket: WeightBucket, tensors: Mapping[str, Any], packed: torch.Tensor) -> None:
    """Copies each tensor of ``bucket`` to its place in ``packed``, once.

    Contiguous host bytes into a host buffer are one memcpy (without the GIL): torch's copy_ would run
    an OpenMP team that competes for the cores with gloo's send thread, and its loop is slower than
    glibc's memcpy. Any other tensor (strided, or on another device) is copied by torch straight into
    its place, viewed as the tensor's dtype and shape, with no intermediate copy."""
    for placed in bucket.tensors:
        tensor = tensors[placed.name].detach()
        place = packed[placed.byte_offset : placed.byte_offset + placed.num_bytes]
        if tensor.is_contiguous() and tensor.device.type == packed.device.type == "cpu":
            ctypes.memmove(place.data_ptr(), tensor.data_ptr(), placed.num_bytes)
        else:
            place.view(tensor.dtype).view(tensor.shape).copy_(tensor)


def _finish_broadcast(index: int, work: Any, num_buckets: int) -> None:
    """Waits for the broadcast of bucket ``index``."""
    try:
        work.wait()
    except Exception as exc:
        _note_broadcast_failure(exc, index, num_buckets)
        raise


def _note_broadcast_failure(error: Exception, index: int, num_buckets: int) -> None:
    error.add_note(
        f"while broadcasting bucket {index + 1} of {num_buckets}: a server that applied "
        "earlier buckets reports Status.weights_incomplete until a push of every tensor "
        "succeeds; the weight-update group is closed: create a new WeightSyncGroup"
    )


def _in_daemon_thread(work: Callable[[], Result]) -> Future[Result]:
    """``work()`` on a daemon thread. Forming the group blocks every member until all have joined: when
    one server refuses, the trainer stops waiting at once, and what is still blocked (rank 0's side, the
    other servers' join calls, bounded by the group's timeout) must not keep the process from exiting,
    as the threads of an executor would."""
    future: Future[Result] = Future()

    def run() -> None:
        try:
            result = work()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=run, name="cbserve-weight-sync-formation", daemon=True).start()
    return future


class _Formation:
    """Rank 0 joining the group, on a daemon thread: the gloo constructor, or NCCL's first collective,
    blocks until every member has joined. Its process group is kept as soon as it exists, so that a
    server's failure can abort a formation still waiting for the others."""

    def __init__(
        self, store: Any, backend: str, world_size: int, timeout: timedelta, device: torch.device
    ) -> None:
        self._process_group: Any = None
        self.future = _in_daemon_thread(
            functools.partial(self._form, store, backend, world_size, timeout, device)
        )

    def _form(
        self, store: Any, backend: str, world_size: int, timeout: timedelta, device: torch.device
    ) -> Any:
        import torch
        import torch.distributed as distributed

        if backend == "nccl":
            options = distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._process_group = distributed.ProcessGroupNCCL(store, 0, world_size, options)
        else:
            self._process_group = distributed.ProcessGroupGloo(store, 0, world_size, timeout)
        # The servers' join returns after this same broadcast; with NCCL it forms the communicator.
        self._process_group.broadcast(torch.zeros(1, dtype=torch.uint8, device=device), 0).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return self._process_group

    def abandon(self) -> None:
        """Aborts rank 0's side, formed or still forming, after a server failed to join."""
        if self._process_group is not None:
            _shut_down(self._process_group, abort=True)


def _formation_error(
    clients: Sequence[AdminClient],
    joins: list[Future[WeightsUpdateGroupInfo]],
    formation: Future[Any],
    description: str,
) -> BaseException:
    """Why forming the group failed: the servers' errors when some refused or failed to join (servers
    that did join are made to leave again), else rank 0's own. Joins still running are left to end
    at their deadline: their servers give up on the group after its timeout."""
    joined = {
        client.target: join.result()
        for client, join in zip(clients, joins, strict=True)
        if join.done() and join.exception() is None
    }
    for client in clients:
        if client.target in joined:
            _leave_quietly(client)
    failures: dict[str, CbserveError] = {}
    for client, join in zip(clients, joins, strict=True):
        error = join.exception() if join.done() else None
        if error is not None and not isinstance(error, CbserveError):
            return error  # not a server's answer: an argument refused before the call
        if error is not None:
            failures[client.target] = error
    if failures:
        for client, join in zip(clients, joins, strict=True):
            if not join.done():
                failures[client.target] = error_from_code(
                    grpc.StatusCode.ABORTED,
                    "still joining when another server failed to; it gives up at the timeout",
                )
        return _servers_error(clients, failures, joined)
    error = formation.exception()
    assert error is not None  # the formation is what failed, when no server did
    error.add_note(f"while forming {description}")
    return error


def _chosen_backend(backend: str) -> str:
    import torch.distributed as distributed

    if backend == "auto":
        import torch

        return "nccl" if torch.cuda.is_available() and distributed.is_nccl_available() else "gloo"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {list(_BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not distributed.is_nccl_available():
        raise ValueError("backend 'nccl' needs a torch build with NCCL and a CUDA device; use 'gloo'")
    return backend


def _shut_down(process_group: Any, *, abort: bool) -> None:
    """Ends rank 0's side of the group: ``shutdown`` lets pending work finish, ``abort`` does not (it
    also unblocks a thread still waiting for NCCL to form). Older torch builds lack either."""
    end = getattr(process_group, "abort" if abort else "shutdown", None)
    if callable(end):
        end()


def _leave_quietly(client: AdminClient) -> None:
    """Has a server that joined leave again when forming the group failed elsewhere."""
    with contextlib.suppress(CbserveError):
        client.destroy_weights_update_group()


def _servers_error(
    clients: Sequence[AdminClient], failures: Mapping[str, CbserveError], results: Mapping[str, Any]
) -> CbserveError:
    """The error of a call that failed on some servers: the server's own with one server, else a
    FleetError naming each failed replica (with what the others returned)."""
    if len(clients) == 1:
        return next(iter(failures.values()))
    return FleetError(dict(failures), dict(results))


def _on_servers(
    clients: Sequence[AdminClient], executor: Executor, call: Callable[[AdminClient], Result]
) -> list[Result]:
    """``call`` on every server in parallel; results in client order, or :func:`_servers_error`."""
    try:
        return run_on_all(executor, clients, call)
    except FleetError as error:
        failure = _servers_error(clients, error.failures, error.results)
    raise failure
