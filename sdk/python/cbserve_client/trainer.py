"""What a trainer calls after each step, in one call each: push the new weights to every replica and prove
they hold them (:func:`push_and_verify`), and check that the servers' logprobs are the trainer's own
(:func:`check_logprobs`).

    from cbserve_client import AdminFleet, Client, WeightSyncGroup, check_logprobs, push_and_verify

    with AdminFleet([admin_target], token) as fleet:
        group = WeightSyncGroup.create(fleet, master_address=trainer_ip)
        report = push_and_verify(fleet, model.state_dict(), version=f"step-{step}", group=group)
        print(report.push_s, report.servers_checksum_s)  # where the sync's time went

    with Client(target) as client:
        check = check_logprobs(client, rollouts)  # rollouts: (prompt ids, completion ids, trainer logprobs)
        assert check.max_abs_difference == 0.0      # batch-invariant mode's promise

torch is imported only to digest the trainer's tensors, so this module imports without it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbserve_client._types import WeightsChecksum
from cbserve_client._weights import NamedTensors
from cbserve_client.checksum import weights_checksum
from cbserve_client.client import Client
from cbserve_client.fleet import AdminFleet

if TYPE_CHECKING:
    from cbserve_client.weight_sync import WeightSyncGroup

__all__ = ["LogprobsCheck", "PushReport", "check_logprobs", "push_and_verify"]


@dataclass(frozen=True, slots=True)
class PushReport:
    """What :func:`push_and_verify` did, and how long each phase took (seconds).

    Attributes:
        weight_versions: each replica's weight version after the push, by admin target.
        checksum: the digest every replica holds, equal to the trainer's own.
        push_s: the push (gRPC stream or group broadcast), from its first byte to every replica's reply.
        trainer_checksum_s: the trainer's digest of its own tensors, computed while the push runs.
        servers_checksum_s: every replica's digest and the comparison, after the push.
        total_s: the whole call.
    """

    weight_versions: dict[str, int]
    checksum: WeightsChecksum
    push_s: float
    trainer_checksum_s: float
    servers_checksum_s: float
    total_s: float


def push_and_verify(
    fleet: AdminFleet,
    weights: NamedTensors,
    *,
    version: str | None = None,
    group: WeightSyncGroup | None = None,
    dtype: Any = None,
) -> PushReport:
    """Pushes ``weights`` to every replica of ``fleet``, then checks that each holds exactly them.

    ``weights``: the full state dict (or (name, tensor) pairs), as for :meth:`AdminFleet.update_weights`:
    the check compares every replica's whole-model digest with the trainer's digest of these tensors, so
    a partial state dict would never match. The push goes over ``group`` (a :class:`WeightSyncGroup`
    formed with this fleet) when given, else through each replica's admin API. ``dtype``: the torch dtype
    the replicas hold the weights in, when it is not the trainer's (a bfloat16 trainer, float32 servers):
    the trainer digests its tensors cast to it, as the servers cast what they receive. No prefix-cache
    reset is needed after it: each replica drops the older weights' prefix blocks as the update lands,
    and keys the new ones by the new version.

    Returns a :class:`PushReport`; raises :class:`~cbserve_client.errors.WeightsMismatchError` naming each
    replica and tensor that differs from the trainer's, or the push's own error.
    """
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbserve-trainer-checksum") as executor:
        # The push reads the tensors and waits on the network: digesting them meanwhile costs no time.
        trainer_digest = executor.submit(_timed, weights_checksum, weights, dtype=dtype)
        push_started = time.perf_counter()
        if group is not None:
            updates = group.push(weights, version=version)
        else:
            updates = fleet.update_weights(weights, version=version)
        push_s = time.perf_counter() - push_started
        expected, trainer_checksum_s = trainer_digest.result()
    check_started = time.perf_counter()
    checksum = fleet.check_weights(expected=expected)
    servers_checksum_s = time.perf_counter() - check_started
    return PushReport(
        weight_versions={
            target: update.weight_version for target, update in zip(fleet.targets, updates, strict=True)
        },
        checksum=checksum,
        push_s=push_s,
        trainer_checksum_s=trainer_checksum_s,
        servers_checksum_s=servers_checksum_s,
        total_s=time.perf_counter() - started,
    )


@dataclass(frozen=True, slots=True)
class LogprobsCheck:
    """What :func:`check_logprobs` found.

    Attributes:
        max_abs_difference: the largest ``|server - trainer|`` over every token of every rollout checked.
        differences: per rollout, the largest difference over its completion's tokens.
        server_logprobs: per rollout, the server's logprob of each completion token.
    """

    max_abs_difference: float
    differences: tuple[float, ...]
    server_logprobs: tuple[tuple[float, ...], ...]


def check_logprobs(
    client: Client,
    rollouts: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
    *,
    timeout: float | None = None,
) -> LogprobsCheck:
    """Recomputes on the server the logprobs of rollouts the trainer scored, and returns how far they are
    from the trainer's: the check of batch-invariant mode's promise in production, without a second
    engine (in that mode, on the same weights, the largest difference is 0.0).

    ``rollouts``: (prompt token ids, completion token ids, the trainer's logprob of each completion
    token) — a sample of a step's rollouts is enough. Each is sent as one request whose prompt is the
    prompt and completion together, asking for the prompt's logprobs (``prompt_logprobs``): the server
    computes them in one forward, on the kernels that sampled, from the model's raw distribution
    (temperature and filters not applied, as a trainer's forward computes them). One token is generated
    per request and discarded. The requests run concurrently and are batched with other traffic.
    """
    for index, (prompt, completion, trainer_logprobs) in enumerate(rollouts):
        if not prompt or not completion:
            raise ValueError(f"rollouts[{index}]: the prompt and the completion need at least one token each")
        if len(trainer_logprobs) != len(completion):
            raise ValueError(
                f"rollouts[{index}]: {len(trainer_logprobs)} trainer logprobs for {len(completion)} "
                "completion tokens"
            )
    if not rollouts:
        raise ValueError("rollouts: at least one rollout is needed")
    with ThreadPoolExecutor(max_workers=min(32, len(rollouts)), thread_name_prefix="cbserve-check") as pool:
        recomputed = list(
            pool.map(lambda rollout: _server_logprobs(client, rollout[0], rollout[1], timeout), rollouts)
        )
    differences = tuple(
        max(abs(server - trainer) for server, trainer in zip(served, rollout[2], strict=True))
        for served, rollout in zip(recomputed, rollouts, strict=True)
    )
    return LogprobsCheck(max(differences), differences, tuple(recomputed))


def _server_logprobs(
    client: Client, prompt: Sequence[int], completion: Sequence[int], timeout: float | None
) -> tuple[float, ...]:
    """The server's logprob of each completion token, following the prompt."""
    result = client.generate(
        [*prompt, *completion], max_new_tokens=1, prompt_logprobs=0, ignore_eos=True, timeout=timeout
    )
    if result.prompt_logprobs is None:  # the server ignored prompt_logprobs: nothing to compare
        raise RuntimeError(f"the server at {client.target} returned no prompt logprobs")
    # The first token has no logprob (nothing precedes it): entry i is the logprob of token i + 1.
    return tuple(entry.logprob for entry in result.prompt_logprobs[len(prompt) - 1 :])


def _timed(call: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    return call(*args, **kwargs), time.perf_counter() - started
