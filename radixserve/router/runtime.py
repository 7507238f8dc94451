"""Start the router: from the command line (`radixserve router`, `serve --replicas N`) or
from Python (`RouterRuntime`, which runs it in a child process like `Runtime`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from radixserve.server.runtime import Runtime
from radixserve.transport.sockets import exposure_warning
from radixserve.tenants import ensure_secret_file
from radixserve.router.config import RouterConfig
from radixserve.router.core import Router

log = logging.getLogger(__name__)


def run_router(config: RouterConfig, on_ready: Callable[[str, str], None],
               should_stop: Callable[[], bool]) -> int:
    """Serve RPC (and HTTP, in a thread) until `should_stop()`; `on_ready(rpc_address,
    http_url)` once every replica given has answered. Raises RuntimeError naming a replica
    that does not answer within `replica_timeout`."""
    from radixserve.model.loader import load_tokenizer, resolve_model
    from radixserve.server.http.server import HttpServer
    from radixserve.server.http.state import rpc_gateway

    logging.basicConfig(level=config.log_level.upper(), format="[router] %(message)s")
    router = Router(config, tokenizer=None)  # bind first: a busy port fails fast
    warning = exposure_warning(config)
    if warning:
        log.warning("WARNING: %s", warning)
    http = None
    gateway_dir = tempfile.mkdtemp(prefix="radixserve-router-")
    try:
        router.wait_joined(config.replica_timeout)
        replica: dict[str, Any] = next((r.info for r in router.replicas.values() if r.info), {})
        model = config.model or replica.get("model_path")
        if model is None:
            raise RuntimeError("the router needs --model (the replicas' model, for its "
                               "tokenizer) when no --replica is given")
        try:
            model_dir = resolve_model(model)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"the replicas serve {model!r}, which is not on this machine: "
                               "pass --model with a local copy of its tokenizer") from e
        router.tokenizer = load_tokenizer(model_dir)
        gateway, key = f"ipc://{gateway_dir}/http_gateway", secrets.token_urlsafe(32)
        router.bind_local(gateway, key)
        # The HTTP API answers to the names the replicas answer to: the model as given
        # (an alias like smollm2-135m, not the directory it resolved to) and their served
        # name, unless the router was given its own.
        served = config.served_model_name or replica.get("served_model_name")
        http = HttpServer(dataclasses.replace(config, served_model_name=served).http_config(
            config.model or replica.get("model") or model), model_dir, rpc_gateway(gateway, key))
        http.start()

        def ready(rpc_address: str) -> None:
            http.wait_ready()
            on_ready(rpc_address, http.url)

        router.serve(ready, should_stop)
    finally:
        if http is not None:
            http.stop()
        router.close()
        shutil.rmtree(gateway_dir, ignore_errors=True)
    return 0


class RouterRuntime(Runtime):
    """The router in a child process: `RouterRuntime(replica=[rt.rpc_address, ...],
    policy="cache_aware")`; `rpc_address` and `http_url` as for `Runtime`."""

    run = staticmethod(run_router)
    config_class = RouterConfig
    process_name = "radixserve-router"

    def __init__(self, model: str | None = None, *, startup_timeout: float = 120.0,
                 **options: Any) -> None:
        super().__init__(model, startup_timeout=startup_timeout, **options)


def serve_replicas(count: int, server_options: dict[str, Any], router: RouterConfig,
                   on_ready: Callable[[str, str], None], should_stop: Callable[[], bool]) -> int:
    """`radixserve serve --replicas N`: N local servers (one GPU each where there are
    several) behind a router that takes the RPC and HTTP ports asked for. With a
    `kv_disk_dir`, replica i keeps its disk tier in `<kv_disk_dir>/replica-<i>`. All share
    one cache secret: the `cache_secret_file` given, else one made in `kv_disk_dir` (kept
    for warm restarts) or in a private temporary directory."""
    logging.basicConfig(level=router.log_level.upper(), format="[router] %(message)s")
    gpus = _gpu_count()
    replicas = []
    state_dir = None
    if server_options.get("cache_secret_file") is None:
        secret_dir = server_options.get("kv_disk_dir")
        if not secret_dir:
            secret_dir = state_dir = tempfile.mkdtemp(prefix="radixserve-fleet-")
        secret = ensure_secret_file(Path(secret_dir))
        server_options = {**server_options, "cache_secret_file": str(secret)}
    router.cache_secret_file = server_options["cache_secret_file"]
    try:
        for i in range(count):
            env = os.environ.get("CUDA_VISIBLE_DEVICES")
            if gpus > 1:
                os.environ["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
            options = {**server_options, "rpc_port": 0, "port": 0, "cache_events_port": 0,
                       "kv_events_port": 0, "kv_events_replay_port": 0}  # in model_info
            if options.get("kv_disk_dir"):  # one disk store per server
                options["kv_disk_dir"] = os.path.join(options["kv_disk_dir"], f"replica-{i}")
            try:
                replicas.append(Runtime(**options))
            finally:
                if gpus > 1:
                    if env is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = env
            log.info("replica %d of %d ready: RPC at %s HTTP at %s", i + 1, count,
                     replicas[-1].rpc_address, replicas[-1].http_url)
        router.replica = [r.rpc_address for r in replicas]
        router.model = router.model or server_options.get("model")
        return run_router(router, on_ready, should_stop)
    finally:
        for replica in replicas:
            replica.shutdown()
        if state_dir is not None:
            shutil.rmtree(state_dir, ignore_errors=True)


def _gpu_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0
