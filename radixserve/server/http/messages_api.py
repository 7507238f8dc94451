"""Anthropic's Messages API: `POST /v1/messages` (plain or streamed) and
`/v1/messages/count_tokens`. A request is read into the shared conversation
(`chat.conversation`), rendered and generated as chat completions are (`turns`), and its
answer's blocks are the content blocks. Every failure is answered in Anthropic's error
shape. Shapes: `messages_protocol`.

Usage follows Anthropic's meaning: `input_tokens` are the prompt tokens not read from the
cache, `cache_read_input_tokens` those that were (radixserve caches every prefix by itself:
no `cache_control` is needed), so their sum is what `count_tokens` says."""

from __future__ import annotations

import asyncio
import functools
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from radixserve.chat.errors import ChatError
from radixserve.chat.tool_plan import ToolPlan, plan_tools
from radixserve.results.errors import ServerError
from radixserve.results.generate import GenerateOutput, GenerateResult
from radixserve.server.http import lora_routes, turns
from radixserve.server.http import messages_protocol as mp
from radixserve.server.http.errors import ApiError, decode_body, json_response
from radixserve.server.http.state import state_of
from radixserve.server.http.openai_api import chat_constraint, openai_error
from radixserve.server.http.openapi import ANTHROPIC_ERRORS, STREAMED, request_body
from radixserve.server.http.state import AppState
from radixserve.server.http.streaming import EventStream

router = APIRouter()
_encode = msgspec.json.Encoder().encode
Route = Callable[[Request], Awaitable[Response]]


def anthropic_errors(route: Route) -> Route:
    """`route`, its failures in Anthropic's error shape."""
    @functools.wraps(route)
    async def answer(request: Request) -> Response:
        try:
            return await route(request)
        except ServerError as e:
            raise mp.AnthropicError.of(openai_error(e)) from None
        except (ApiError, ChatError) as e:
            if isinstance(e, mp.AnthropicError):
                raise
            raise mp.AnthropicError.of(e) from None
    return answer


async def _prompt(request: Request, state: AppState, req: mp.CountTokensRequest
                  ) -> tuple[list[int], ToolPlan | None, str | None]:
    """The prompt's ids, the tool plan and the LoRA adapter the model names."""
    lora = await lora_routes.resolve_model(state, request, req.model)
    mp.check(req)
    messages = mp.conversation(req)
    choice, parallel = mp.tool_choice(req)
    # off the loop: the tools' schemas are checked against their metaschema
    with turns.own_names((".function.parameters", ".input_schema")):
        plan = await asyncio.to_thread(plan_tools, mp.tools(req), choice, parallel,
                                       state.tokenizer)
    return await turns.prompt_ids(state, messages, plan, "messages"), plan, lora


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(mp.CountTokensRequest),
             responses=ANTHROPIC_ERRORS)
@anthropic_errors
async def count_tokens(request: Request) -> Response:
    """`{"input_tokens"}`: the prompt's tokens, tools and system prompt included."""
    state = state_of(request)
    req = await decode_body(request, mp.CountTokensRequest)
    ids, _, _ = await _prompt(request, state, req)
    return json_response({"input_tokens": len(ids)})


@router.post("/v1/messages", openapi_extra=request_body(mp.MessagesRequest),
             responses={**STREAMED, **ANTHROPIC_ERRORS})
@anthropic_errors
async def create_message(request: Request) -> Response:
    state = state_of(request)
    req = await decode_body(request, mp.MessagesRequest)
    ids, plan, lora = await _prompt(request, state, req)
    constraint, _ = chat_constraint(None, plan)
    sampling: dict[str, Any] = {"max_new_tokens": await turns.room(
        state, len(ids), req.max_tokens, "messages")}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            sampling[name] = getattr(req, name)
    if req.stop_sequences:
        sampling["stop"] = req.stop_sequences
    turns.constrain(sampling, constraint)
    call = await turns.generate(request, state, ids, sampling, "msg", "messages", req.stream,
                                plan, lora)
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": req.model}
    if call.rest is None:
        assert isinstance(call.first, GenerateResult)  # a plain call's answer
        output = call.finished(state, call.first)
        blocks = turns.whole(plan, output.text).blocks
        reason, matched = _stop_reason(output, req, bool([b for b in blocks
                                                          if b.kind == "call"]))
        return json_response({**head, "content": mp.content(blocks), "stop_reason": reason,
                              "stop_sequence": matched, "usage": _usage(output)})
    return EventStream(_events(state, call, turns.Blocks(plan), req, head, len(ids)))


def _stop_reason(out: GenerateOutput, req: mp.MessagesRequest, called: bool
                 ) -> tuple[str, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the answer."""
    reason = out.finish_reason
    if reason is not None and reason.type == "length":
        return "max_tokens", None
    if reason is not None and isinstance(reason.matched, str) and reason.matched in (
            req.stop_sequences or ()):
        return "stop_sequence", reason.matched
    return ("tool_use" if called else "end_turn"), None


def _usage(out: GenerateOutput) -> dict[str, Any]:
    return {"input_tokens": out.prompt_tokens - out.cached_tokens,
            "cache_read_input_tokens": out.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": out.completion_tokens}


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **fields}) + (
        b"\n\n")


async def _events(state: AppState, call: turns.Call, blocks: turns.Blocks,
                  req: mp.MessagesRequest, head: dict[str, Any], prompt_len: int
                  ) -> AsyncIterator[bytes]:
    """message_start, ping; per block content_block_start, its deltas (text_delta,
    input_json_delta), content_block_stop; message_delta with the stop reason and usage;
    message_stop. A failure is an `error` event."""
    usage = {"input_tokens": prompt_len, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 0, "output_tokens": 0}
    yield _event("message_start", message={**head, "content": [], "stop_reason": None,
                                           "stop_sequence": None, "usage": usage})
    yield _event("ping")
    steps = turns.streamed(state, call, blocks)
    try:
        async for step in steps:
            if isinstance(step, GenerateOutput):
                reason, matched = _stop_reason(step, req, bool(blocks.calls))
                yield _event("message_delta", delta={"stop_reason": reason,
                                                     "stop_sequence": matched},
                             usage=_usage(step))
                yield _event("message_stop")
                continue
            what, block, text = step
            if what == "start":
                opened = mp.content([block])[0]
                if block.kind == "call":
                    opened["input"] = {}  # its arguments follow as input_json_delta
                yield _event("content_block_start", index=block.index, content_block=opened)
            elif what == "delta":
                delta = ({"type": "text_delta", "text": text} if block.kind == "text" else
                         {"type": "input_json_delta", "partial_json": text})
                yield _event("content_block_delta", index=block.index, delta=delta)
            else:
                yield _event("content_block_stop", index=block.index)
    except ServerError as e:
        yield _event("error", error=mp.AnthropicError.of(openai_error(e)).body()["error"])
    finally:  # the client left mid-stream: its call is aborted now, not when collected
        await steps.aclose()
