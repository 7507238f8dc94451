"""The app builder's arguments and the router's keys, without a cluster: what `serve run
radixserve.ray:app k=v ...` deploys, and how a call's prompt and caller become the page
hashes the router matches (tenants and adapters apart)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is an optional extra (radixserve[ray])")

from radixserve.chat.prompt import render
from radixserve.model.loader import load_tokenizer
from radixserve.ray import app
from radixserve.ray.app import ROUTER_CLASS, split_args
from radixserve.ray.keys import fleet_secret, route_key
from radixserve.tenants import Tenants, cache_secret_key

SECRET = cache_secret_key("ab" * 32)


def deployments(application):
    ingress = application._bound_deployment
    return ingress, ingress.init_args[0]._bound_deployment


def test_command_line_arguments_become_deployment_options_and_server_options():
    ours, options = split_args({"model": "/m", "num_replicas": "2", "max_total_tokens": "4096",
                                "admin_api_key": "sk-op", "log_level": "info",
                                "server_options": {"schedule_policy": "lpm"}})
    assert ours["num_replicas"] == 2 and ours["operator_key"] == "sk-op"
    assert options == {"max_total_tokens": 4096, "admin_api_key": "sk-op",
                       "log_level": "info", "schedule_policy": "lpm"}
    assert len(ours["cache_secret"]) == 64  # made once, handed to every replica and router
    with pytest.raises(ValueError, match="model="):
        split_args({"num_replicas": 2})

    ingress, server = deployments(app({
        "model": "/m", "num_replicas": "auto", "max_replicas": "3", "num_gpus": "1",
        "memory": str(8 << 30), "max_replicas_per_node": "1", "max_total_tokens": "4096"}))
    assert ingress.name == "RadixIngress" and server.name == "RadixServer"
    scaling = server._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == \
        (1, 3, 8)
    assert server.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1, "memory": 8 << 30}
    assert server._replica_config.max_replicas_per_node == 1
    router = server._deployment_config.request_router_config
    assert router.request_router_class == ROUTER_CLASS
    assert server.init_args[0] == "/m" and server.init_args[1] == {"max_total_tokens": 4096}

    _, pow2 = deployments(app({"model": "/m", "router": "pow2", "num_replicas": 2}))
    assert pow2._deployment_config.request_router_config.is_default_request_router()
    assert pow2.num_replicas == 2


def test_autoscaling_arguments_reach_rays_config_and_bad_ones_are_named():
    _, server = deployments(app({
        "model": "/m", "num_replicas": "auto", "min_replicas": "1", "max_replicas": "2",
        "target_ongoing_requests": "1", "upscale_delay_s": "0", "downscale_delay_s": "1.5",
        "look_back_period_s": "2", "metrics_interval_s": "0.25"}))
    scaling = server._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests,
            scaling.upscale_delay_s, scaling.downscale_delay_s, scaling.look_back_period_s,
            scaling.metrics_interval_s) == (1, 2, 1.0, 0.0, 1.5, 2.0, 0.25)
    _, default = deployments(app({"model": "/m", "num_replicas": "auto"}))
    scaling = default._deployment_config.autoscaling_config  # unset: Ray's own
    assert (scaling.look_back_period_s, scaling.metrics_interval_s) == (30.0, 10.0)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (10.0, 60.0)

    for bad, message in [
            ({"min_replicas": -1}, "min_replicas=-1: a whole number >= 0"),
            ({"max_replicas": 1.5}, "max_replicas=1.5: a whole number >= 1"),
            ({"target_ongoing_requests": 0}, "target_ongoing_requests=0: a number > 0"),
            ({"upscale_delay_s": "soon"}, "upscale_delay_s='soon': a number >= 0"),
            ({"downscale_delay_s": -1}, "downscale_delay_s=-1: a number >= 0"),
            ({"look_back_period_s": 0}, "look_back_period_s=0: a number > 0"),
            ({"metrics_interval_s": True}, "metrics_interval_s=True: a number > 0"),
            ({"min_replicas": 3, "max_replicas": 2}, "max_replicas=2 is below min_replicas=3"),
            ({"num_replicas": 0}, "num_replicas=0: a whole number >= 1, or 'auto'")]:
        with pytest.raises(ValueError) as e:
            app({"model": "/m", "num_replicas": "auto", **bad})
        assert str(e.value) == message


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(tiny)


def test_keys_hash_prompts_as_the_server_does_with_tenants_and_adapters_apart(tokenizer):
    tenants = Tenants({"sk-a": "a", "sk-b": "b"})

    def key(path, body, api_key=None):
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        return route_key(path, body, headers, tokenizer, tenants, SECRET)

    text = key("/generate", {"text": "Hello there"})
    assert text.prompts == [tokenizer.encode("Hello there")] and text.namespace is None
    assert key("/v1/completions", {"prompt": ["a b", "c"]}).prompts == [
        tokenizer.encode("a b"), tokenizer.encode("c")]
    assert key("/generate", {"input_ids": [1, 2, 3]}).prompts == [[1, 2, 3]]
    messages = [{"role": "user", "content": "Hi"}]
    assert key("/v1/chat/completions", {"messages": messages}).prompts == [
        tokenizer.encode(render(tokenizer, messages, None))]

    a, b = key("/generate", {"text": "x"}, "sk-a"), key("/generate", {"text": "x"}, "sk-b")
    salted = key("/generate", {"text": "x", "cache_salt": "s"}, "sk-a")
    adapter = key("/generate", {"text": "x", "lora_path": "sql"}, "sk-a")
    assert len({a.namespace, b.namespace, salted.namespace, adapter.namespace, None}) == 5
    assert key("/generate", {"text": "x"}, "sk-a") == a

    for path, body in [("/v1/models", {}), ("/generate", None), ("/generate", {"text": 3}),
                       ("/v1/chat/completions", {"messages": "no"})]:
        assert key(path, body).prompts == []  # routed by load; the replica names the error


def test_a_secret_file_on_every_node_keeps_the_secret_out_of_rays_config(tmp_path):
    secret = tmp_path / "fleet.secret"
    secret.write_text("cd" * 32)
    ours, options = split_args({"model": "/m", "cache_secret_file": str(secret)})
    assert ours["cache_secret"] is None and options["cache_secret_file"] == str(secret)
    _, server = deployments(app({"model": "/m", "cache_secret_file": str(secret)}))
    kwargs = server._deployment_config.request_router_config.request_router_kwargs
    assert kwargs["cache_secret"] is None and kwargs["cache_secret_file"] == str(secret)
    assert fleet_secret(None, str(secret)) == fleet_secret("cd" * 32, None)


def test_the_routers_view_is_the_operators(tiny):
    import asyncio

    from starlette.requests import Request

    from radixserve.ray.ingress import RadixIngress

    ingress = RadixIngress(None, str(tiny), {"api_key": ["sk-a=a"], "admin_api_key": "sk-op"},
                           "ab" * 32)

    def get(key: str | None) -> int:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        scope = {"type": "http", "method": "GET", "path": "/ray/router", "query_string": b"",
                 "headers": headers}

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}
        return asyncio.run(ingress(Request(scope, receive))).status_code

    assert (get(None), get("sk-a"), get("sk-op")) == (403, 403, 200)
