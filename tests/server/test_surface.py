"""Promises of the HTTP and RPC surface that need no running server (issue 25, class 8):
every error code a server, a router or the client library can send has an HTTP status of
its own; no GET route changes state; an internal error tells its caller a reference to the
log, never the exception; a server open beyond loopback without keys says so."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import msgspec
import pytest
import zmq
from fastapi.testclient import TestClient

from radixserve.client import ServerError
from radixserve.results.errors import HTTP_STATUS, ErrorCode
from radixserve.config import ServerConfig
from radixserve.messages import ErrorReply, RpcCall, RpcReply, StatsCall
from radixserve.router.config import RouterConfig
from radixserve.server.http.app import create_app
from radixserve.server.http.state import rpc_gateway
from radixserve.server.http.errors import ApiError
from radixserve.transport.replies import ClientReplies
from radixserve.transport.sockets import exposure_warning
from tests.factories import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
SENDERS = [  # each names an error code as a string literal
    r'ErrorReply\(\s*[^,(]+(?:\([^()]*\))?,\s*"(\w+)"',
    r'RequestRejected\(\s*[^,]+,\s*"(\w+)"',
    r'\b_error\(\s*[^,]+,\s*[^,]+,\s*"(\w+)"',
    r'_fail_calls\(\s*[^,]+,\s*"(\w+)"',
    r'failure_code = "(\w+)"',
    r'ServerError\(\s*"(\w+)"',
]
ENUM_SENDER = r'\bErrorCode\.([A-Z_]+)\b'
"""A code named by its enum member (`ErrorCode.INVALID_REQUEST` sends invalid_request)."""
READ_ONLY_GETS = {"/health", "/health_generate", "/get_model_info", "/model_info",
                  "/get_server_info", "/server_info", "/list_workers", "/cache", "/cache/view",
                  "/v1/models", "/v1/models/{model:path}", "/metrics", "/openapi.json",
                  "/lora_adapters"}
"""The GET routes, each of which only reads (/health_generate's one-token probe aside)."""
SECRET = "/home/operator/.secrets/key-file"


def sent_codes() -> set[str]:
    codes: set[str] = set()
    for path in (ROOT / "radixserve").rglob("*.py"):
        text = path.read_text()
        for pattern in SENDERS:
            codes.update(re.findall(pattern, text))
        codes.update(ErrorCode[name].value for name in re.findall(ENUM_SENDER, text))
    return codes


def test_every_error_code_sent_has_an_http_status() -> None:
    """A code missing from the table surfaces over HTTP as a 500: the server blamed for
    a call it refused."""
    codes = sent_codes()
    # The scan does see the codes (a pattern gone stale would find none).
    assert {"invalid_request", "unauthorized", "malformed_frame", "internal", "overloaded",
            "slow_reader", "frame_too_large", "disconnected", "worker_died", "worker_hung",
            "no_replica", "replica_died", "replica_removed"} <= codes, codes
    missing = sorted(codes - set(HTTP_STATUS))
    assert not missing, f"error codes without an HTTP status in results/errors.py: {missing}"
    for code in codes:
        status = ApiError.from_server(ServerError(code, "x")).status
        assert 400 <= status < 600 and (status == 500) == (code == "internal"), (code, status)
    assert ApiError.from_server(ServerError("unauthorized", "no key")).status == 401


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The HTTP app over a front door that is not there: enough for routing and errors."""
    tiny = tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")
    gateway = f"ipc://{tmp_path_factory.mktemp('gw')}/none"
    return create_app(ServerConfig(model=str(tiny)), tiny, rpc_gateway(gateway))


def test_no_get_route_changes_state(app) -> None:
    gets = {route.path for route in app.routes if "GET" in getattr(route, "methods", ())}
    assert gets <= READ_ONLY_GETS, f"GET routes not known to be read-only: {gets - READ_ONLY_GETS}"
    for path in ("/flush_cache", "/start_profile", "/stop_profile"):
        assert path not in gets


def test_an_internal_http_error_names_a_reference_not_the_exception(app, caplog) -> None:
    async def broken() -> None:
        raise RuntimeError(f"cannot open {SECRET}")

    app.add_api_route("/broken-for-test", broken, methods=["POST"])
    with TestClient(app, raise_server_exceptions=False) as http, \
            caplog.at_level(logging.ERROR):
        r = http.post("/broken-for-test")
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "internal" and SECRET not in r.text and "RuntimeError" not in r.text
    reference = re.fullmatch(r"internal error \(reference (\w+): .*\)", error["message"])
    assert reference, error["message"]
    logged = [rec for rec in caplog.records if reference.group(1) in rec.getMessage()]
    assert logged and SECRET in str(logged[0].exc_info[1])  # the operator finds it all


def test_an_internal_rpc_error_names_a_reference_not_the_exception(caplog) -> None:
    ctx = zmq.Context()
    try:
        server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")

        def broken(peer: bytes, call: object) -> None:
            raise RuntimeError(f"cannot open {SECRET}")

        replies = ClientReplies(server, 16, lambda peer: None, lambda peer: {})
        client.send(msgspec.msgpack.encode(StatsCall(7)))
        assert server.poll(10_000)
        with caplog.at_level(logging.ERROR):
            replies.receive(server.recv_multipart(copy=False), msgspec.msgpack.Decoder(RpcCall),
                            broken)
        assert client.poll(10_000)
        reply = msgspec.msgpack.decode(client.recv(), type=RpcReply)
    finally:
        ctx.destroy(linger=0)
    assert isinstance(reply, ErrorReply) and reply.call_id == 7 and reply.code == "internal"
    assert SECRET not in reply.message and "RuntimeError" not in reply.message
    reference = re.fullmatch(r"internal error \(reference (\w+): .*\)", reply.message)
    assert reference and any(reference.group(1) in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("config, warned", [
    (ServerConfig(), False),
    (ServerConfig(host="0.0.0.0"), True),
    (ServerConfig(rpc_host="10.1.2.3"), True),
    (ServerConfig(host="localhost", rpc_host="::1"), False),
    (ServerConfig(host="0.0.0.0", api_key="sk-1"), False),
    (RouterConfig(rpc_host="*"), True),
    (RouterConfig(host="0.0.0.0", api_key=["sk-a=alice"]), False),
])
def test_a_server_open_beyond_loopback_without_keys_is_warned_of(config, warned) -> None:
    warning = exposure_warning(config)
    assert (warning is not None) == warned, warning
    if warned:
        assert "without an API key" in warning and "--api-key" in warning
