"""What the HTTP routes share: the client into the front door (in-process for a server, RPC
for a router) and how a generate call goes through it, a tokenizer of their own, the served
model's names and metrics."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import anyio

from radixserve.chat.templates import TemplateRenderer
from radixserve.chat.tool_format import tool_format
from radixserve.client import AsyncClient
from radixserve.client.aio import AsyncOperations
from radixserve.messages import GenerateCall
from radixserve.results.errors import ServerError
from radixserve.config import ServerConfig
from radixserve.server.http.errors import ClientGone
from radixserve.server.http.metrics import Metrics
from radixserve.server.http.response_file import ResponseFile
from radixserve.server.http.response_store import ResponseStore
from radixserve.server.http.streaming import Streamed
from radixserve.disk_layout import pinned
from radixserve.tenants import DEFAULT_TENANT, Tenants

log = logging.getLogger(__name__)
TENANT_SCOPE = "radixserve.tenant"
"""ASGI scope key where `RequestGate` leaves the caller's (tenant, key)."""


Connect = Callable[[ServerConfig], AsyncOperations]
"""Makes the routes' client into the front door (or router), whose own key (the default
tenant's, never the operator's) speaks for calls no HTTP caller's key does; each caller's
calls carry that caller's key (`AppState.caller`)."""


def rpc_gateway(address: str, key: str | None = None) -> Connect:
    """A client over RPC at `address` (an ipc path), authenticating with `key`: a router's
    HTTP server, a thread of the router's process."""
    return lambda config: AsyncClient(address, timeout=None, api_key=key,
                                      max_frame_bytes=config.max_frame_bytes,
                                      stream_backlog=config.http_stream_backlog)


def state_of(request: Any) -> AppState:
    """The routes' shared state, as the app holds it (`app.state.radix`)."""
    return request.app.state.radix


class AppState:
    """Created with the app; `start()` runs on the server's event loop before it serves."""

    rpc: AsyncOperations
    """The routes' client into the front door (or router), made by `start()`."""

    def __init__(self, config: ServerConfig, model_dir: Path, connect: Connect) -> None:
        self.config, self.model_dir, self.connect = config, Path(model_dir), connect
        self.tenants = Tenants.from_config(config)
        self.served_name = config.served_model_name or config.model
        self.model_names = {self.served_name, config.model, self.model_dir.name,
                            str(self.model_dir), "default"}
        """What a request's `model` may say: the served name, the model as given, its
        directory or its path, or `default` (what SGLang's examples send)."""
        self.serves_lora = config.enable_lora or bool(config.lora_paths)
        """Whether the OpenAPI schema says a `model` may also name a LoRA adapter (any
        server's routes look the name up: a router's replicas may serve adapters)."""
        self.metrics = Metrics(config.max_loras_per_batch if self.serves_lora else None)
        self.tokenizer: Any = None
        self.renderer = TemplateRenderer(config.chat_template_threads,
                                         config.max_pending_chat_renders,
                                         config.chat_template_timeout)
        """Chat templates render here, off the event loop (`chat.templates`)."""
        self.responses = ResponseStore(config.max_stored_responses,
                                       config.max_stored_response_bytes,
                                       config.stored_response_ttl)
        """The Responses API's stored responses, per tenant (`response_store`); with the
        disk tier, also in its directory (`response_file`, from `start`)."""
        self.response_file: ResponseFile | None = None
        self._info: dict[str, Any] | None = None
        self.closing = False
        """Set when the server shuts down: the front door no longer answers, so aborts are
        skipped (the scheduler goes down with everything it holds)."""

    async def start(self) -> None:
        from radixserve.model.loader import load_tokenizer

        self.rpc = self.connect(self.config)  # on the loop the routes run on
        # A tokenizer of its own: the front door's thread uses the other one, and a Hugging
        # Face fast tokenizer is not safe to share between threads ("Already borrowed").
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_dir)
        # The tool-call format probes the model's template once (cached): here, off the
        # event loop, rather than in the first request with tools. A template that breaks
        # on the probe breaks those requests, not the server's start.
        try:
            await asyncio.to_thread(tool_format, self.tokenizer)
        except Exception:  # noqa: BLE001
            log.warning("the chat template fails the tool-call probe", exc_info=True)
        if self.config.kv_disk_dir is not None:  # pinned at start by this process
            self.response_file = ResponseFile(pinned(self.config.kv_disk_dir),
                                              self.responses, self.config.model)
            await self.response_file.start([DEFAULT_TENANT, *self.tenants.names])

    async def stop(self) -> None:
        if self.response_file is not None:
            await self.response_file.close()
        self.renderer.close()
        rpc: AsyncOperations | None = getattr(self, "rpc", None)
        if rpc is not None:
            await rpc.close()

    async def model_info(self) -> dict[str, Any]:
        """The worker's model facts (fixed once it is ready, so asked once)."""
        if self._info is None:
            self._info = await self.rpc.model_info()
        return self._info

    @staticmethod
    def caller(request: Any) -> tuple[str, str | None]:
        """The (tenant, API key) of the HTTP request, as `RequestGate` checked it: the
        default tenant and no key when no key is configured."""
        return request.scope.get(TENANT_SCOPE, (DEFAULT_TENANT, None))

    async def abort(self, rids: list[str], api_key: str | None) -> None:
        """Abort `rids` even while the calling task is being cancelled (a client went away):
        this is what frees their KV blocks. `api_key` is the caller's (None without keys):
        rids are scoped by tenant, so an abort reaches only its caller's tenant's."""
        if self.closing:
            return
        with anyio.CancelScope(shield=True):
            for rid in rids:
                try:
                    await asyncio.wait_for(self.rpc.abort(rid, api_key), 5)
                except (ServerError, TimeoutError):
                    pass  # the server is going down or restarting: nothing left to free

    async def generate(self, request: Any, call: GenerateCall, rids: list[str]
                       ) -> tuple[Streamed, AsyncIterator[Streamed] | None]:
        """Send `call` (naming its prompts `rids`) and wait for its answer (or, streamed, its
        first event), racing the connection of `request`: if the client leaves first, the
        wait is cancelled, the rids are aborted (as the caller) and ClientGone is raised.
        Call it only once the body has been read, so the connection has nothing left to
        say but goodbye. Returns `(result, None)`, or for a stream `(first item, the
        rest)`."""
        events = self.rpc.stream_call(call) if call.stream else None
        task = asyncio.ensure_future(self.rpc.generate_call(call) if events is None
                                     else events.__anext__())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            await self.abort(rids, call.api_key)
            raise
        finally:
            watcher.cancel()
        if task.done():
            return task.result(), events
        task.cancel()
        await self.abort(rids, call.api_key)
        raise ClientGone()


async def _disconnected(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
