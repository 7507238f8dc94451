"""The router's options: the one home of their defaults (`radixserve router --option`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from radixserve.config import ServerConfig, config_from_kwargs

POLICIES = ("cache_aware", "round_robin", "random", "shortest_queue")


@dataclass
class RouterConfig:
    """A field name here is the keyword of `RouterRuntime` and, with dashes, the flag."""

    replica: list[str] = field(default_factory=list)
    """Replicas' RPC addresses (`tcp://10.0.0.5:30001`); the flag may be given several
    times. More can join at run time (`POST /add_worker?url=`)."""
    policy: Literal["cache_aware", "round_robin", "random", "shortest_queue"] = "cache_aware"
    """How a call picks its replica: `cache_aware` (the longest cached prefix, unless the
    load is imbalanced), `round_robin`, `random` or `shortest_queue` (fewest requests)."""
    cache_threshold: float = 0.3
    """cache_aware: route to the replica holding the longest cached prefix when it covers
    at least this share of the prompt; else to the least loaded replica."""
    balance_abs_threshold: int = 64
    """cache_aware: the load counts as imbalanced when the busiest replica has more than
    this many requests above the idlest one ..."""
    balance_rel_threshold: float = 1.5
    """... and more than this many times as many. Then the call goes to the best cached
    match among the replicas that are not overloaded (affinity kept while rebalancing)."""
    model: str | None = None
    """The tokenizer the router matches prompts with and the HTTP API uses (the replicas'
    model: an alias, a directory or a .gguf file); None: what the first replica serves."""
    rpc_host: str = "127.0.0.1"
    """Interface of the router's RPC front door; anything but loopback must be asked for."""
    rpc_port: int = 31001
    """TCP port of the router's RPC front door; 0 picks a free one."""
    host: str = "127.0.0.1"
    """Interface of the router's HTTP server (the same APIs as a server's)."""
    port: int = 31000
    """TCP port of the router's HTTP server; 0 picks a free one."""
    health_interval: float = 0.5
    """Seconds between health checks of each replica."""
    health_timeout: float = 4.0
    """A replica that has not answered a health check for this long is taken for dead:
    its calls in flight fail with `replica_died` (a dropped connection counts at once)."""
    replica_timeout: float = 60.0
    """How long a replica given at start may take to answer before start-up fails."""
    max_frame_bytes: int = 16 * 1024 * 1024
    max_request_bytes: int = 16 * 1024 * 1024
    max_client_backlog: int = 1024
    http_stream_backlog: int = 4096
    api_key: str | list[str] | None = None
    """The replicas' API keys (`KEY` or `KEY=TENANT`, as `serve` takes them): the router
    checks callers against them, routes within each caller's tenant, and passes each
    call's key on. The router's own health and model_info calls use the first key."""
    api_keys_file: str | None = None
    """The replicas' file of API keys, one `key tenant` a line, in addition to `api_key`."""
    admin_api_key: str | None = None
    """The router's operator key: needed for flush_cache and the replicas call (add, remove, list)
    at the router; the operator is decided as a server decides it (docs/security.md)."""
    replica_admin_key: str | None = None
    """The replicas' operator key (their `--admin-api-key`), with which the router takes
    cache snapshots, subscribes to their cache events and flushes them. None:
    `admin_api_key`, else the first API key (the replicas' operator when all keys are the
    default tenant's). Without a working one the router routes by load only."""
    cache_secret_file: str | None = None
    """The replicas' `--cache-secret-file`: the router hashes prompts with it to find
    their cached prefixes. None: a secret of its own, which matches no replica's (routing
    by load only, with a warning)."""
    served_model_name: str | None = None
    """The model name the OpenAI API lists and accepts, as the replicas' own flag (default:
    the `model` option as given)."""
    log_level: str = "info"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> RouterConfig:
        return config_from_kwargs(cls, "router", kwargs)

    def validate(self) -> None:
        if isinstance(self.replica, str):
            self.replica = [self.replica]
        for url in self.replica:
            check_replica_url(url)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        for name in ("health_interval", "health_timeout", "replica_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        self.http_config("smollm2-135m").validate()  # ports, keys, limits, log level

    def http_config(self, model: str) -> ServerConfig:
        """The options the HTTP app shares with a server's, for the router's own app."""
        return ServerConfig(
            model=model, rpc_host=self.rpc_host, rpc_port=self.rpc_port, host=self.host,
            port=self.port, max_frame_bytes=self.max_frame_bytes,
            max_request_bytes=self.max_request_bytes, max_client_backlog=self.max_client_backlog,
            http_stream_backlog=self.http_stream_backlog, api_key=self.api_key,
            api_keys_file=self.api_keys_file, admin_api_key=self.admin_api_key,
            served_model_name=self.served_model_name,
            log_level=self.log_level)


def check_replica_url(url: object) -> str:
    """A replica's RPC address, `tcp://HOST:PORT` (or an `ipc://` path on this machine)."""
    if not isinstance(url, str) or not (
            (url.startswith("tcp://") and url.rpartition(":")[2].isdigit())
            or url.startswith("ipc://")):
        raise ValueError(f"a replica's address is its RPC endpoint, tcp://HOST:PORT "
                         f"(e.g. tcp://10.0.0.5:30001), got {url!r}")
    return url
