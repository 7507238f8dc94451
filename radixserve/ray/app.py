"""`app` (= `build_app`): the Ray Serve application of radixserve, in Ray's builder
convention, a function of a dict of arguments:

    serve run radixserve.ray:app model=/models/llama num_replicas=2 max_replicas_per_node=1
    serve.run(app({"model": "/models/llama", "num_replicas": 2}))

Two deployments: `RadixIngress` (the HTTP entry, light) and `RadixServer` (each replica a
whole radixserve server; routed by `RadixTreeRouter`). The arguments this module knows are
`DEPLOYMENT_ARGS`; every other one is a radixserve server option (`radixserve serve`'s, as
its keyword: `max_total_tokens=4096`), also accepted nested as `server_options`. Values
given on `serve run`'s command line arrive as strings: numbers, booleans and JSON are read
back (`num_replicas=2`, `max_total_tokens=4096`)."""

from __future__ import annotations

import json
import secrets
import warnings
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.ray.ingress import RadixIngress
from radixserve.ray.server import RadixServer

ROUTER_CLASS = "radixserve.ray.router.RadixTreeRouter"

DEPLOYMENT_ARGS: dict[str, Any] = {
    "model": None,
    "num_replicas": 1,
    # An int, or "auto" (autoscaling between min_replicas and max_replicas).
    "min_replicas": 1, "max_replicas": 4,
    "target_ongoing_requests": 8,
    # Autoscaling's target: calls queued or running per replica (as Ray counts them).
    "upscale_delay_s": 10.0, "downscale_delay_s": 60.0,
    # How long Ray's wish to scale up (down) must hold before it acts.
    "look_back_period_s": None, "metrics_interval_s": None,
    # The window Ray averages the counts over, and how often each handle sends them
    # (Ray's: 30 s, 10 s; Ray marks `metrics_interval_s` deprecated, yet in 2.60 it is what
    # sets that interval).
    "max_ongoing_requests": 64,
    # Calls Ray sends one replica at once; past that the router's next choice takes it.
    "num_cpus": 1.0, "num_gpus": 0.0, "memory": None,
    # Resources of one replica (`memory` in bytes), as Ray places it.
    "max_replicas_per_node": None,
    # 1: one replica per node.
    "router": "radix",
    # "radix" (RadixTreeRouter) or "pow2" (Ray's default, power of two choices).
    "policy": "cache_aware", "cache_threshold": 0.3, "balance_abs_threshold": 64,
    "balance_rel_threshold": 1.5,
    "cache_secret": None,
    # The replicas' shared cache secret (text, 32+ characters); default: made here, unless
    # the `cache_secret_file` option names a file on every node (kept out of Ray's config).
    "operator_key": None,
    # The key the router subscribes to the replicas' cache events with; default: the
    # `admin_api_key` option, else the first `api_key` (none: servers without keys).
    "replica_host": None,
    # Where each replica's RPC and cache-events sockets bind; default: its node's IP.
    "ingress_replicas": 1,
    "health_check_period_s": 5.0, "health_check_timeout_s": 30.0,
    "graceful_shutdown_timeout_s": 60.0,
    "name": "RadixServer",
}


def _value(raw: Any) -> Any:
    """A command-line value read back: JSON where it parses as such, else the string."""
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


SCALING_BOUNDS: dict[str, tuple[type, float, bool]] = {
    "min_replicas": (int, 0, True), "max_replicas": (int, 1, True),
    "target_ongoing_requests": (float, 0, False),
    "upscale_delay_s": (float, 0, True), "downscale_delay_s": (float, 0, True),
    "look_back_period_s": (float, 0, False), "metrics_interval_s": (float, 0, False)}
"""The autoscaling arguments: (type, bound, whether the bound itself is allowed). The last
two may be left unset (None: Ray's defaults)."""


def scaling_config(ours: dict[str, Any]) -> dict[str, Any]:
    """The autoscaling arguments checked, as Ray's `autoscaling_config` (those unset left
    out); a ValueError names a bad one."""
    config: dict[str, Any] = {}
    for name, (kind, bound, inclusive) in SCALING_BOUNDS.items():
        value = ours[name]
        if value is None and name in ("look_back_period_s", "metrics_interval_s"):
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (kind is int and not float(value).is_integer()) or not (
                value >= bound if inclusive else value > bound):
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"{name}={value!r}: {what} {'>=' if inclusive else '>'} "
                             f"{bound:g}")
        config[name] = kind(value)
    if config["max_replicas"] < config["min_replicas"]:
        raise ValueError(f"max_replicas={config['max_replicas']} is below "
                         f"min_replicas={config['min_replicas']}")
    return config


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this module's arguments, with defaults; the radixserve server options)."""
    args = {k: _value(v) for k, v in args.items()}
    options = dict(args.pop("server_options", None) or {})
    ours = {k: args.pop(k, default) for k, default in DEPLOYMENT_ARGS.items()}
    options.update(args)
    if not ours["model"]:
        raise ValueError("radixserve.ray:app needs model=<a model directory or name>")
    ours["model"] = str(ours["model"])
    if ours["cache_secret"] is None and not options.get("cache_secret_file"):
        ours["cache_secret"] = secrets.token_hex(32)
    if ours["operator_key"] is None:
        keys = options.get("api_key")
        first = keys[0] if isinstance(keys, list) and keys else keys
        ours["operator_key"] = options.get("admin_api_key") or (
            first.split("=")[0] if isinstance(first, str) else None)
    return ours, options


class _Server(RadixServer):
    """RadixServer bound on its node's address (for a router on another node)."""

    def __init__(self, model: str, options: dict[str, Any], cache_secret: str | None,
                 operator_key: str | None, host: str | None) -> None:
        self.name = serve.get_replica_context().replica_id.unique_id
        super().__init__(model, options, cache_secret, operator_key,
                         host or ray.util.get_node_ip_address())


def build_app(args: dict[str, Any]) -> Any:
    ours, options = split_args(args)
    autoscale = ours["num_replicas"] == "auto"
    scaling = scaling_config(ours)
    replicas = ours["num_replicas"]
    if not autoscale and (isinstance(replicas, bool) or not isinstance(replicas, (int, float))
                          or not float(replicas).is_integer() or replicas < 1):
        raise ValueError(f"num_replicas={replicas!r}: a whole number >= 1, or 'auto'")
    resources = {"num_cpus": ours["num_cpus"], "num_gpus": ours["num_gpus"]}
    if ours["memory"]:
        resources["memory"] = ours["memory"]
    server_options: dict[str, Any] = dict(
        name=ours["name"], ray_actor_options=resources,
        max_ongoing_requests=ours["max_ongoing_requests"],
        health_check_period_s=ours["health_check_period_s"],
        health_check_timeout_s=ours["health_check_timeout_s"],
        graceful_shutdown_timeout_s=ours["graceful_shutdown_timeout_s"],
        graceful_shutdown_wait_loop_s=0.5)
    if autoscale:
        server_options["autoscaling_config"] = scaling
    else:
        server_options["num_replicas"] = int(replicas)
    if ours["max_replicas_per_node"]:
        server_options["max_replicas_per_node"] = int(ours["max_replicas_per_node"])
    if ours["router"] == "radix":
        server_options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]
            request_router_kwargs={
                "cache_secret": ours["cache_secret"], "operator_key": ours["operator_key"],
                "cache_secret_file": options.get("cache_secret_file"),
                **{k: ours[k] for k in ("policy", "cache_threshold", "balance_abs_threshold",
                                        "balance_rel_threshold")}})
    elif ours["router"] != "pow2":
        raise ValueError(f"router={ours['router']!r}: 'radix' or 'pow2'")
    server_class: Any = serve.deployment(_Server)  # the overloads confuse mypy
    ingress_class: Any = serve.deployment(RadixIngress)
    with warnings.catch_warnings():  # metrics_interval_s: set on purpose (DEPLOYMENT_ARGS)
        warnings.filterwarnings("ignore", "The `metrics_interval_s`", DeprecationWarning)
        server = server_class.options(**server_options).bind(
            ours["model"], options, ours["cache_secret"], ours["operator_key"],
            ours["replica_host"])
    ingress = ingress_class.options(
        name="RadixIngress", num_replicas=int(ours["ingress_replicas"]),
        ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=10_000)
    return ingress.bind(server, ours["model"], options, ours["cache_secret"])


app = build_app
