"""The HTTP control port's routes: vLLM 0.32's OpenAI-server names, methods, parameters and replies for what
the AdminService does (`/pause`, `/resume`, `/is_paused`, `/sleep`, `/wake_up`, `/is_sleeping`,
`/reset_prefix_cache`, `/init_weight_transfer_engine`, `/update_weights`, `/update_weight_version`,
`/weight_info`, `/server_info`, `/version`), and the names SMG's RL client fans out (`/pause_generation`,
`/continue_generation`). Each calls the shared admin operations (service.admin_operations) the gRPC
servicer calls; docs/control-http.md lists them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
from typing import Any

import torch
from cbserve_checksum import SAFETENSORS_NAMES

from engine import (
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    BucketPlan,
    BucketTensor,
    EngineBusyError,
    WeightBucket,
    dtype_from_name,
)
from service.admin_operations import AdminOperations
from service.control_server import BadRequest, ControlRequest, Route

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
# init_info: the group fields (vLLM's names where it has them), with cbserve's defaults.
GROUP_FIELDS = (
    "master_address",
    "master_port",
    "rank_offset",
    "world_size",
    "backend",
    "group_name",
    "timeout_s",
)


class HeldPause:
    """The pause `/pause` takes and `/resume` gives back. HTTP has no call that stays open, so the hold is a
    task of its own; it ends at `/resume` or when the server's pause lease (--max-pause-lease) runs out,
    as a gRPC Pause does, so a trainer that died paused cannot freeze the server for good."""

    def __init__(self, operations: AdminOperations) -> None:
        self.operations = operations
        self._holding: asyncio.Task[None] | None = None
        self._release = asyncio.Event()

    @property
    def held(self) -> bool:
        return self._holding is not None and not self._holding.done()

    async def take(self, mode: str) -> int:
        """Returns once the engine is paused (the requests ABORT cancelled); a pause already held through
        this port is kept as it is (0 cancelled)."""
        if self.held:
            return 0
        entered: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._release = asyncio.Event()
        self._holding = asyncio.ensure_future(self._hold(mode, entered, self._release))
        return await entered

    async def _hold(self, mode: str, entered: asyncio.Future[int], release: asyncio.Event) -> None:
        try:
            async with self.operations.pause(mode) as handle:
                entered.set_result(handle.cancelled if handle is not None else 0)
                lease_s = self.operations.max_pause_lease_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(release.wait(), lease_s)
                if not release.is_set():
                    logger.warning(
                        "the control port's pause ended with its lease (%g s) before /resume", lease_s
                    )
        except Exception as exc:
            if entered.done():
                raise
            entered.set_exception(exc)

    async def give_back(self) -> None:
        if self._holding is not None:
            self._release.set()
            await self._holding
            self._holding = None


class ControlRoutes:
    def __init__(self, operations: AdminOperations) -> None:
        self.operations = operations
        self.pause_hold = HeldPause(operations)

    def table(self) -> dict[str, Route]:
        return {
            "/pause": Route("POST", self.pause),
            "/pause_generation": Route("POST", self.pause),
            "/resume": Route("POST", self.resume),
            "/continue_generation": Route("POST", self.resume),
            "/is_paused": Route("GET", self.is_paused),
            "/sleep": Route("POST", self.sleep),
            "/wake_up": Route("POST", self.wake_up),
            "/is_sleeping": Route("GET", self.is_sleeping),
            "/reset_prefix_cache": Route("POST", self.reset_prefix_cache),
            "/init_weight_transfer_engine": Route("POST", self.init_weight_transfer_engine),
            "/update_weights": Route("POST", self.update_weights),
            "/update_weight_version": Route("POST", self.update_weight_version),
            "/weight_info": Route("GET", self.weight_info),
            "/server_info": Route("GET", self.server_info),
            "/version": Route("GET", self.version),
        }

    async def close(self) -> None:
        await self.pause_hold.give_back()

    # ------------------------------------------------------------------ pause

    async def pause(self, request: ControlRequest) -> dict[str, Any]:
        """`mode` (abort by default, as vLLM's) treats the requests in flight; with abort or wait,
        `clear_cache` (vLLM's, true by default) then drops the prefix cache."""
        mode = _choice(request.value("mode"), "mode", PAUSE_MODES, "abort")
        clear_cache = _boolean(request.value("clear_cache"), "clear_cache", True)
        self.operations.host()
        await self.pause_hold.take(mode)
        if clear_cache and mode != "keep":
            try:
                await self.operations.reset_prefix_cache(abort=False)
            except EngineBusyError as exc:  # requests queued since the pause: their blocks stay cached
                logger.info("pause: the prefix cache is kept (%s)", exc)
        return {"status": "paused"}

    async def resume(self, request: ControlRequest) -> dict[str, Any]:
        await self.pause_hold.give_back()
        return {"status": "resumed"}

    async def is_paused(self, request: ControlRequest) -> dict[str, Any]:
        return {"is_paused": self.operations.status().paused}

    # ------------------------------------------------------------------ memory

    async def sleep(self, request: ControlRequest) -> dict[str, Any]:
        level = _integer(request.value("level"), "level", SLEEP_LEVELS, 1)
        mode = _choice(request.value("mode"), "mode", PAUSE_MODES, "abort")
        await self.operations.sleep(level, mode)
        return {"status": "sleeping", "level": level}

    async def wake_up(self, request: ControlRequest) -> dict[str, Any]:
        tags = request.query.get("tags", [])
        for tag in tags:
            _choice(tag, "tags", WAKE_TAGS, None)
        level = await self.operations.wake_up(tags)
        return {"status": "sleeping" if level else "awake", "tags": tags or None}

    async def is_sleeping(self, request: ControlRequest) -> dict[str, Any]:
        return {"is_sleeping": self.operations.status().sleep_level > 0}

    async def reset_prefix_cache(self, request: ControlRequest) -> dict[str, Any]:
        """`success` false while requests are in flight (vLLM's contract); cbserve's `abort=true` cancels
        them first."""
        if _boolean(request.value("reset_running_requests"), "reset_running_requests", False):
            raise BadRequest(
                "reset_running_requests",
                "cbserve cannot reset the cache under running requests and keep them; abort=true cancels "
                "them first",
            )
        # reset_external: cbserve has no external (connector) cache, so there is nothing more to reset.
        _boolean(request.value("reset_external"), "reset_external", False)
        abort = _boolean(request.value("abort"), "abort", False)
        try:
            await self.operations.reset_prefix_cache(abort)
        except EngineBusyError:
            return {"success": False}
        return {"success": True}

    # ------------------------------------------------------------------ weights

    async def init_weight_transfer_engine(self, request: ControlRequest) -> dict[str, Any]:
        """Joins the trainer's weight-update group (docs/weight-sync.md), from `init_info`."""
        init_info = _object(request.json().get("init_info"), "init_info")
        unknown = sorted(set(init_info) - set(GROUP_FIELDS))
        if unknown:
            raise BadRequest(
                f"init_info.{unknown[0]}", f"unknown field; init_info takes {', '.join(GROUP_FIELDS)}"
            )
        await self.operations.init_weights_update_group(
            _text(init_info.get("master_address"), "init_info.master_address"),
            _bounded(init_info.get("master_port"), "init_info.master_port", 1, 65535),
            _bounded(init_info.get("rank_offset"), "init_info.rank_offset", 1, 2**31 - 1),
            _bounded(init_info.get("world_size"), "init_info.world_size", 2, 2**31 - 1),
            backend=_text(init_info.get("backend", "auto"), "init_info.backend"),
            group_name=_text(init_info.get("group_name", DEFAULT_GROUP_NAME), "init_info.group_name"),
            timeout_s=_positive(init_info.get("timeout_s", DEFAULT_GROUP_TIMEOUT_S), "init_info.timeout_s"),
        )
        return {"message": "Weight transfer initialized"}

    async def update_weights(self, request: ControlRequest) -> dict[str, Any]:
        """Receives the tensors `update_info` announces (`names`, `dtype_names`, `shapes`, as vLLM's), each
        broadcast by the trainer in that order as one flat buffer of its bytes; answers once applied."""
        update_info = _object(request.json().get("update_info"), "update_info")
        await self.operations.update_weights_from_distributed(_announced_plan(update_info), None)
        return {"message": "Weights updated"}

    async def update_weight_version(self, request: ControlRequest) -> dict[str, Any]:
        new_version = _text(request.json().get("new_version"), "new_version")
        await self.operations.label_weights(new_version)
        return {"success": True, "new_version": new_version}

    async def weight_info(self, request: ControlRequest) -> dict[str, Any]:
        """`weight_version`: the trainer's label of the weights (vLLM's, null until one is given);
        `weight_version_number`: cbserve's count (1 at start, +1 per update), as outputs carry it."""
        host = self.operations.host()
        return {
            "weight_version": host.admin.weight_version_label,
            "weight_version_number": host.weight_version,
        }

    # ------------------------------------------------------------------ the server

    async def server_info(self, request: ControlRequest) -> dict[str, Any]:
        """vLLM's keys with cbserve's contents: the engine's configuration (`config_format` text or json),
        cbserve's environment variables (none that holds a token or key), the system's versions."""
        config_format = _choice(request.value("config_format"), "config_format", ("text", "json"), "text")
        host = self.operations.host()
        config = host.manager.config
        as_json = json.loads(json.dumps(dataclasses.asdict(config), default=str))
        return {
            "vllm_config": str(config) if config_format == "text" else as_json,
            "vllm_env": {
                name: value
                for name, value in os.environ.items()
                if name.startswith("CBSERVE_") and "TOKEN" not in name and "KEY" not in name
            },
            "system_env": {
                "python_version": platform.python_version(),
                "torch_version": torch.__version__,
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "model": host.model_name,
            },
        }

    async def version(self, request: ControlRequest) -> dict[str, Any]:
        try:
            return {"version": importlib.metadata.version("cbserve")}
        except importlib.metadata.PackageNotFoundError:  # run from a checkout that pip did not install
            return {"version": None}


def _announced_plan(update_info: dict[str, Any]) -> BucketPlan:
    """One bucket per tensor, at offset 0: the trainer broadcasts each tensor's bytes on its own."""
    names = _list(update_info.get("names"), "update_info.names")
    dtype_names = _list(update_info.get("dtype_names"), "update_info.dtype_names")
    shapes = _list(update_info.get("shapes"), "update_info.shapes")
    if not len(names) == len(dtype_names) == len(shapes):
        raise BadRequest(
            "update_info",
            f"names, dtype_names and shapes differ in length: {len(names)}, {len(dtype_names)}, "
            f"{len(shapes)}",
        )
    if not names:
        raise BadRequest("update_info.names", "the update has no tensors")
    buckets = []
    for index, (name, dtype_name, shape) in enumerate(zip(names, dtype_names, shapes, strict=True)):
        dtype = _safetensors_dtype(dtype_name, f"update_info.dtype_names[{index}]")
        dims = tuple(
            _bounded(dim, f"update_info.shapes[{index}]", 0, 2**62)
            for dim in _list(shape, f"update_info.shapes[{index}]")
        )
        tensor = BucketTensor(_text(name, f"update_info.names[{index}]"), dtype, dims, 0)
        buckets.append(WeightBucket(tensor.num_bytes, (tensor,)))
    return BucketPlan(tuple(buckets))


def _safetensors_dtype(value: Any, field: str) -> str:
    """torch's name ("bfloat16", "torch.bfloat16", as vLLM's trainers send it) or safetensors' ("BF16")."""
    name = _text(value, field)
    name = SAFETENSORS_NAMES.get(name.removeprefix("torch."), name)
    try:
        dtype_from_name(name)
    except ValueError:
        raise BadRequest(
            field, f"unknown dtype {value!r}; torch's names or {sorted(SAFETENSORS_NAMES.values())}"
        ) from None
    return name


def _choice(value: Any, field: str, allowed: tuple[Any, ...], default: Any) -> Any:
    if value is None:
        return default
    if value not in allowed:
        raise BadRequest(field, f"{value!r} is not one of {', '.join(str(each) for each in allowed)}")
    return value


def _boolean(value: Any, field: str, default: bool) -> bool:
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    raise BadRequest(field, f"{value!r} is not a boolean (true or false)")


def _integer(value: Any, field: str, allowed: tuple[int, ...], default: int) -> int:
    if value is None:
        return default
    number = _bounded(value, field, min(allowed), max(allowed))
    return _choice(number, field, allowed, default)


def _bounded(value: Any, field: str, low: int, high: int) -> int:
    if value is None:
        raise BadRequest(field, "required")
    try:
        number = int(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if not isinstance(number, int) or isinstance(number, bool):
        raise BadRequest(field, f"{value!r} is not an integer")
    if not low <= number <= high:
        raise BadRequest(field, f"{number} is out of range: it must be in [{low}, {high}]")
    return number


def _positive(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BadRequest(field, f"{value!r} is not a number > 0")
    return float(value)


def _text(value: Any, field: str) -> str:
    if value is None:
        raise BadRequest(field, "required (a string)")
    if not isinstance(value, str) or not value:
        raise BadRequest(field, f"{value!r} is not a non-empty string")
    return value


def _list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(field, "required (a list)" if value is None else f"{value!r} is not a list")
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(
            field, "required (a JSON object)" if value is None else f"{value!r} is not an object"
        )
    return value
