"""Admin refusals say how to fix them: which token is missing or wrong, how to configure one, which port
serves the admin API."""

from __future__ import annotations

import pytest
import torch
from cbserve_client import AdminClient, CbserveError, UnauthenticatedError

from tests.helpers.servers import RunningServer


def test_a_wrong_token_is_called_wrong(served: RunningServer) -> None:
    wrong = pytest.raises(UnauthenticatedError, match=r"wrong admin token.*CBSERVE_ADMIN_TOKEN")
    with AdminClient(served.admin_target, token="not-the-token") as admin, wrong:
        admin.status()


def test_a_missing_token_is_called_missing(served: RunningServer) -> None:
    missing = pytest.raises(UnauthenticatedError, match=r"admin token missing")
    with AdminClient(served.admin_target, token=None) as admin, missing:
        admin.status()


def test_a_server_without_a_token_says_how_to_configure_one(model: torch.nn.Module) -> None:
    running = RunningServer(model, admin_token=None)
    try:
        with (
            AdminClient(running.admin_target, token="anything") as admin,
            pytest.raises(UnauthenticatedError) as refused,
        ):
            admin.status()
    finally:
        running.close()
    details = refused.value.details
    assert "no admin token is configured" in details and "CBSERVE_ADMIN_TOKEN" in details, details
    assert "--admin-token-file" in details, details


def test_an_admin_client_at_the_generation_port_is_told_to_use_the_admin_port(served: RunningServer) -> None:
    with AdminClient(served.target, token="anything") as admin:
        with pytest.raises(CbserveError, match=r"is it the generation port\?.*--admin-port") as caught:
            admin.status()
        with pytest.raises(CbserveError, match=r"is it the generation port\?"), admin.paused():
            pass
    assert caught.value.code.name == "UNIMPLEMENTED"
