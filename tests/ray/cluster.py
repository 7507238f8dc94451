"""A local Ray cluster of two nodes on this machine (`ray.cluster_utils.Cluster`, two CPUs
each), radixserve's Ray Serve app on it (two replicas, one per node, tiny random model) and
one plain radixserve server beside it, with the same options, as the reference.

Its fixtures are conftest.py's where `ray` is installed (an optional extra)."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest

import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from radixserve.ray import app
from radixserve.ray.keys import REPLICA_HEADER
from radixserve.server.runtime import Runtime
from tests.factories import tiny_model_dir
from tests.server.conftest import assert_server_idle

OPTIONS: dict[str, Any] = {"max_total_tokens": 2048, "served_model_name": "tiny",
                           "debug_invariants": True, "max_worker_restarts": 0}
"""The replicas' radixserve options, and the plain server's. No worker restarts in place:
a dead worker ends its server, and Ray replaces the replica (test_faults)."""
APP = "radix"


def app_args(tiny: Any, **changes: Any) -> dict[str, Any]:
    """The app's arguments (a fixed secret: a redeploy that changes only `num_replicas`
    keeps the replicas it does not stop)."""
    return {"model": str(tiny), "num_replicas": 2, "max_replicas_per_node": 1,
            "num_cpus": 1, "health_check_period_s": 1.0, "cache_secret": "5e" * 32,
            **OPTIONS, **changes}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "tiny-models")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address)
    try:
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def served(cluster, tiny):
    """The app's base URL on Ray's HTTP proxy; at the end, every replica idle with all its
    KV blocks free."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app(app_args(tiny)), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    yield url
    for replica in replicas(url).values():
        assert_server_idle(replica["rpc_address"])


@pytest.fixture(scope="module")
def plain(tiny):
    with Runtime(str(tiny), **OPTIONS) as rt:
        yield rt.http_url
        assert_server_idle(rt.rpc_address)


def replica_actors() -> dict[str, str]:
    """The live RadixServer replicas: their ids, and the node each runs on."""
    out = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")]):
        name = actor.name or ""
        if name.startswith(f"SERVE_REPLICA::{APP}#RadixServer#"):
            out[name.rpartition("#")[2]] = actor.node_id
    return out


def replicas(url: str) -> dict[str, dict[str, Any]]:
    """Each live replica's own description (GET /ray/replica, sent to it by name) and its
    node."""
    out = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for name, node in replica_actors().items():
            r = client.get("/ray/replica", headers={REPLICA_HEADER: name})
            assert r.status_code == 200, r.text
            assert r.json()["replica"] == name
            out[name] = {**r.json(), "node": node}
    return out


def replica_states(name: str = "RadixServer") -> dict[str, int]:
    """Ray's own count of the app's replicas of deployment `name` by state (`serve.status()`:
    RUNNING, STARTING, STOPPING, ...)."""
    application = serve.status().applications.get(APP)
    deployment = application.deployments.get(name) if application else None
    return {str(getattr(k, "value", k)): n for k, n in
            (deployment.replica_states if deployment else {}).items() if n}


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except Exception:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.5)
