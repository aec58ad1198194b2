"""Security: every admin RPC refuses a missing or wrong bearer token and changes nothing; the admin
service is not on the main port (nor generation on the admin port); TLS refuses plaintext and
untrusted clients, and mutual TLS refuses a client without a certificate, on both ports and for
every kind of call."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from cbserve_client import AdminClient, Client
from cbserve_client.proto import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc, types_pb2

from service.tls import ServerTls, load_server_tls
from tests.helpers.certificates import Pki, make_pki
from tests.helpers.models import tiny_model
from tests.helpers.reliability import report
from tests.helpers.servers import ADMIN_TOKEN, ByteTokenizer, RunningServer, loaded_server

pytestmark = pytest.mark.reliability

CALL_TIMEOUT_S = 10.0
# `authorization` values (or whole metadata) that are not exactly "Bearer <token>".
BAD_CREDENTIALS: dict[str, list[tuple[str, str]]] = {
    "no metadata": [],
    "empty": [("authorization", "")],
    "scheme only": [("authorization", "Bearer")],
    "empty token": [("authorization", "Bearer ")],
    "wrong token": [("authorization", "Bearer wrong-token")],
    "token prefix": [("authorization", f"Bearer {ADMIN_TOKEN[:-1]}")],
    "token plus a character": [("authorization", f"Bearer {ADMIN_TOKEN}x")],
    "lower-case scheme": [("authorization", f"bearer {ADMIN_TOKEN}")],
    "other scheme": [("authorization", f"Basic {ADMIN_TOKEN}")],
    "no scheme": [("authorization", ADMIN_TOKEN)],
    "two spaces": [("authorization", f"Bearer  {ADMIN_TOKEN}")],
    "another header": [("x-admin-token", ADMIN_TOKEN), ("token", ADMIN_TOKEN)],
    "wrong first of two": [
        ("authorization", "Bearer wrong-token"),
        ("authorization", f"Bearer {ADMIN_TOKEN}"),
    ],
}
RIGHT_CREDENTIALS = [("authorization", f"Bearer {ADMIN_TOKEN}")]
AdminCall = Callable[[admin_pb2_grpc.AdminServiceStub, list[tuple[str, str]]], Any]
GenerationCall = Callable[[generation_pb2_grpc.GenerationServiceStub], Any]


def _unchanged_weights_update() -> list[admin_pb2.UpdateWeightsRequest]:
    """An update that rewrites one tensor with its own value: were it ever applied, only the weight
    version would show it (the tiny model is shared by other tests)."""
    norm = tiny_model("llama").get_parameter("model.norm.weight").detach().to(torch.float32).contiguous()
    data = norm.numpy().tobytes()
    chunk = admin_pb2.TensorChunk(
        name="model.norm.weight",
        dtype="F32",
        shape=list(norm.shape),
        byte_offset=0,
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
    )
    return [admin_pb2.UpdateWeightsRequest(chunk=chunk)]


def _first(call: Any) -> Any:
    """The first message of a server-streaming call (which is cancelled after it)."""
    try:
        return next(call)
    finally:
        call.cancel()


ADMIN_CALLS: dict[str, AdminCall] = {
    "GetStatus": lambda stub, metadata: stub.GetStatus(
        admin_pb2.GetStatusRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S
    ),
    "Pause": lambda stub, metadata: _first(
        stub.Pause(admin_pb2.PauseRequest(lease_s=5), metadata=metadata, timeout=CALL_TIMEOUT_S)
    ),
    "Stop": lambda stub, metadata: stub.Stop(
        admin_pb2.StopRequest(hard=True), metadata=metadata, timeout=CALL_TIMEOUT_S
    ),
    "Start": lambda stub, metadata: stub.Start(
        admin_pb2.StartRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S
    ),
    "UpdateWeights": lambda stub, metadata: stub.UpdateWeights(
        iter(_unchanged_weights_update()), metadata=metadata, timeout=CALL_TIMEOUT_S
    ),
}
PROMPT = types_pb2.GenerationRequest(
    token_ids=types_pb2.TokenIds(ids=[5, 6, 7]), sampling=types_pb2.SamplingParams(max_new_tokens=2)
)
GENERATION_CALLS: dict[str, GenerationCall] = {
    "GetModelInfo": lambda stub: stub.GetModelInfo(
        generation_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S
    ),
    "AddRequest": lambda stub: stub.AddRequest(
        generation_pb2.AddRequestRequest(request=PROMPT), timeout=CALL_TIMEOUT_S
    ),
    "StreamResults": lambda stub: _first(
        stub.StreamResults(generation_pb2.StreamResultsRequest(request_id="any"), timeout=CALL_TIMEOUT_S)
    ),
    "Cancel": lambda stub: stub.Cancel(
        generation_pb2.CancelRequest(request_id="any"), timeout=CALL_TIMEOUT_S
    ),
    "Generate": lambda stub: _first(
        stub.Generate(iter([generation_pb2.GenerateRequest(add=PROMPT)]), timeout=CALL_TIMEOUT_S)
    ),
}


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def _channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    return grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)


def _serve(tls: ServerTls | None = None) -> RunningServer:
    return loaded_server(tiny_model("llama"), tokenizer=ByteTokenizer(), tls=tls)


@pytest.fixture(scope="module")
def served() -> Iterator[RunningServer]:
    running = _serve()
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_served(pki: Pki) -> Iterator[RunningServer]:
    running = _serve(load_server_tls(str(pki.server_cert), str(pki.server_key)))
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def mtls_served(pki: Pki) -> Iterator[RunningServer]:
    running = _serve(load_server_tls(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    try:
        yield running
    finally:
        running.close()


def test_every_admin_rpc_refuses_a_missing_or_wrong_token_and_changes_nothing(served: RunningServer) -> None:
    refused = []
    with _channel(served.admin_target, None) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        for method, call in ADMIN_CALLS.items():
            for variant, metadata in BAD_CREDENTIALS.items():
                code = _code(lambda call=call, metadata=metadata: call(stub, metadata))
                if code != grpc.StatusCode.UNAUTHENTICATED:
                    refused.append(f"{method} with {variant}: {code.name}")
        status = stub.GetStatus(
            admin_pb2.GetStatusRequest(), metadata=RIGHT_CREDENTIALS, timeout=CALL_TIMEOUT_S
        )
    assert not refused, f"admin calls not refused with UNAUTHENTICATED: {refused}"
    observed = (status.running, status.paused, status.pause_holders, status.weight_version)
    assert observed == (True, False, 0, 1), f"a refused call changed the server: {status}"
    with Client(served.target, timeout=CALL_TIMEOUT_S) as client:
        assert client.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True).finish_reason == "length"
    report("security", admin_calls_without_the_right_token_refused=len(ADMIN_CALLS) * len(BAD_CREDENTIALS))


def test_admin_rpcs_are_absent_from_the_main_port_and_generation_from_the_admin_port(
    served: RunningServer,
) -> None:
    with _channel(served.target, None) as main, _channel(served.admin_target, None) as admin:
        admin_on_main = admin_pb2_grpc.AdminServiceStub(main)
        codes = {
            f"{method} on the main port": _code(lambda call=call: call(admin_on_main, RIGHT_CREDENTIALS))
            for method, call in ADMIN_CALLS.items()
        }
        generation_on_admin = generation_pb2_grpc.GenerationServiceStub(admin)
        codes |= {
            f"{method} on the admin port": _code(lambda call=call: call(generation_on_admin))
            for method, call in GENERATION_CALLS.items()
        }
    wrong = {call: code.name for call, code in codes.items() if code != grpc.StatusCode.UNIMPLEMENTED}
    assert not wrong, f"calls served on the wrong port (want UNIMPLEMENTED): {wrong}"
    report("security", calls_on_the_wrong_port_refused=len(codes))
    with AdminClient(served.admin_target, ADMIN_TOKEN, timeout=CALL_TIMEOUT_S) as admin_client:
        assert admin_client.status().running


def _refusals(server: RunningServer, credentials: grpc.ChannelCredentials | None) -> dict[str, str]:
    """Every kind of call on both ports; returns the calls NOT refused (UNAVAILABLE) with their code."""
    not_refused = {}
    with _channel(server.target, credentials) as main, _channel(server.admin_target, credentials) as admin:
        generation = generation_pb2_grpc.GenerationServiceStub(main)
        for method, call in GENERATION_CALLS.items():
            code = _code(lambda call=call: call(generation))
            if code != grpc.StatusCode.UNAVAILABLE:
                not_refused[method] = code.name
        admin_stub = admin_pb2_grpc.AdminServiceStub(admin)
        for method, admin_call in ADMIN_CALLS.items():
            code = _code(lambda admin_call=admin_call: admin_call(admin_stub, RIGHT_CREDENTIALS))
            if code != grpc.StatusCode.UNAVAILABLE:
                not_refused[method] = code.name
    return not_refused


def test_tls_refuses_plaintext_and_untrusted_clients_on_both_ports(
    tls_served: RunningServer, pki: Pki
) -> None:
    clients = (("plaintext", None), ("trusting another CA", pki.credentials(ca=pki.other_ca)))
    for name, credentials in clients:
        not_refused = _refusals(tls_served, credentials)
        assert not not_refused, f"TLS server: a {name} client was served: {not_refused}"
    report(
        "security",
        tls_calls_plaintext_or_untrusting_refused=len(clients) * (len(GENERATION_CALLS) + len(ADMIN_CALLS)),
    )
    with Client(tls_served.target, credentials=pki.credentials(), timeout=CALL_TIMEOUT_S) as client:
        assert client.generate("Hi", max_new_tokens=2, ignore_eos=True).finish_reason == "length"


def test_mtls_refuses_a_client_without_a_certificate_on_both_ports(
    mtls_served: RunningServer, pki: Pki
) -> None:
    not_refused = _refusals(mtls_served, pki.credentials())
    assert not not_refused, f"mTLS server: a client without a certificate was served: {not_refused}"
    report(
        "security", mtls_calls_without_a_client_certificate_refused=len(GENERATION_CALLS) + len(ADMIN_CALLS)
    )
    credentials = pki.credentials(with_client_cert=True)
    with Client(mtls_served.target, credentials=credentials, timeout=CALL_TIMEOUT_S) as client:
        assert client.generate("Hi", max_new_tokens=2, ignore_eos=True).finish_reason == "length"
    with _channel(mtls_served.admin_target, credentials) as channel:
        # A client certificate does not stand in for the admin token.
        code = _code(
            lambda: admin_pb2_grpc.AdminServiceStub(channel).GetStatus(
                admin_pb2.GetStatusRequest(), timeout=CALL_TIMEOUT_S
            )
        )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    with AdminClient(
        mtls_served.admin_target, ADMIN_TOKEN, credentials=credentials, timeout=CALL_TIMEOUT_S
    ) as admin:
        assert admin.status().running
