"""A chat conversation through the model's chat template, as a caller may have it rendered.

The template is the model's, never a caller's: `chat_template_kwargs` carries template
variables (`enable_thinking`, ...) only. Every argument of `apply_chat_template` itself
(`chat_template`, which would render a caller's Jinja, `tokenize`, `tools`, `documents`,
...), the names the renderer binds (`messages`) and the tokenizer's special tokens
(`bos_token`, ...) are refused by name: those select a template or change how the
tokenizer behaves (the class of vLLM's advisory GHSA-6fvq-23cw-5628).

Rendering is Python work sized by the caller (the conversation, the tools), so it runs off
the HTTP event loop in a small pool of threads, within a time bound; requests past the
pool's queue are refused as overloaded. The rendered text is then checked against the
prompt limits (`max_prompt_chars`) before the tokenizer sees it."""

from __future__ import annotations

import asyncio
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from radixserve.chat.errors import ChatError

RENDERER_BINDS = frozenset({"messages", "conversation", "tools", "documents",
                            "add_generation_prompt"})
"""Names the template renderer binds itself (transformers' `render_jinja_template`)."""


def reserved_names(tokenizer: Any) -> frozenset[str]:
    """What `chat_template_kwargs` may not name for `tokenizer`: `apply_chat_template`'s own
    parameters (read from its signature, so a newer transformers' new ones are refused
    too), the renderer's bound names, and the special tokens the template is given."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    own = {name for name, p in params.items()
           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    special = set(getattr(tokenizer, "special_tokens_map", {}) or {})
    return frozenset(own | RENDERER_BINDS | special)


def template_variables(kwargs: dict[str, Any] | None, tokenizer: Any) -> dict[str, Any]:
    """`chat_template_kwargs` as template variables; a 400 naming the first key that is
    not one."""
    if not kwargs:
        return {}
    reserved = reserved_names(tokenizer)
    for key in kwargs:
        if key in reserved or not key.isidentifier():
            why = ("a template or an argument of the renderer, not a template variable"
                   if key in reserved else "not a template variable name")
            raise ChatError(400, f"chat_template_kwargs.{key} is not accepted: it is {why} "
                            "(the model's own chat template is always used)",
                            param=f"chat_template_kwargs.{key}")
    return dict(kwargs)


class TemplateRenderer:
    """Runs renders in `threads` threads, at most `max_pending` at once (running or
    queued), each within `timeout` seconds from its submission. A render past its time is
    answered at once; its thread finishes on its own (Python threads cannot be stopped),
    holding one of the few pool threads meanwhile, never more."""

    def __init__(self, threads: int, max_pending: int, timeout: float) -> None:
        self.timeout, self.max_pending = timeout, max_pending
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="chat-template")
        self._pending = 0
        self._lock = threading.Lock()

    async def render(self, fn: Callable[..., str], *args: Any, **kwargs: Any) -> str:
        with self._lock:
            if self._pending >= self.max_pending:
                raise ChatError(503, f"{self._pending} chat templates are rendering or waiting "
                                f"(max_pending_chat_renders={self.max_pending}); retry later",
                                type="server_overloaded", code="overloaded")
            self._pending += 1
        future = self._pool.submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            future.cancel()  # dropped from the queue if it never started
            raise ChatError(400, f"the chat template did not render the conversation within "
                            f"chat_template_timeout={self.timeout:g}s (--chat-template-timeout)",
                            param="messages") from None

    def _done(self, _: Any) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
