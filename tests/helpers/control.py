"""Calls to a server's HTTP control port (service/control_server.py), as a trainer's HTTP client makes them,
and the tensors a trainer broadcasts for its `/update_weights`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch

from tests.helpers.servers import ADMIN_TOKEN

# Loopback never goes through a proxy.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def control_call(
    base_url: str, method: str, path: str, body: Any = None, token: str | None = ADMIN_TOKEN
) -> tuple[int, Any]:
    """(status, decoded JSON reply) of `method path` with `body` as JSON (raw when bytes), an HTTP error
    status included."""
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    if data is not None:
        headers["content-type"] = "application/json"
    request = urllib.request.Request(f"{base_url}{path}", data=data, method=method, headers=headers)
    try:
        with _OPENER.open(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def announcement(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The `update_info` of `/update_weights` for `tensors`, in the order the trainer broadcasts them."""
    return {
        "names": list(tensors),
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for tensor in tensors.values()],
        "shapes": [list(tensor.shape) for tensor in tensors.values()],
    }


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """What the trainer broadcasts for one announced tensor: its bytes, flat."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
