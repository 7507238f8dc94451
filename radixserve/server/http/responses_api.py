"""OpenAI's Responses API: `POST /v1/responses` (plain or streamed), `GET` and `DELETE
/v1/responses/{id}`. A request is read into the shared conversation (`chat.conversation`),
after the stored one it continues (`previous_response_id`), rendered and generated as chat
completions are (`turns`); its answer's blocks are the output items. A stored response
(`response_store`) pins its prompt, so that its continuation is prefilled from the cache
(only the new turn is computed), for as long as it may be continued (at most
`max_pin_ttl`); a dropped, expired or deleted one releases the pin. Shapes:
`responses_protocol`."""

from __future__ import annotations

import asyncio
import time
import uuid
from array import array
from typing import Any, AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from radixserve.chat.conversation import Conversation
from radixserve.chat.tool_plan import plan_tools
from radixserve.results.errors import ServerError
from radixserve.results.generate import GenerateOutput, GenerateResult
from radixserve.server.http import lora_routes, turns
from radixserve.server.http import openai_protocol as proto
from radixserve.server.http import responses_protocol as rp
from radixserve.server.http.errors import ApiError, decode_body, json_response
from radixserve.server.http.state import state_of
from radixserve.server.http.openai_api import chat_constraint, openai_error
from radixserve.server.http.openapi import STREAMED, request_body
from radixserve.server.http.response_store import Stored
from radixserve.server.http.state import AppState
from radixserve.server.http.streaming import EventStream
from radixserve.server.http.turns import Block

router = APIRouter()
_encode = msgspec.json.Encoder().encode


@router.post("/v1/responses", openapi_extra=request_body(rp.ResponsesRequest),
             responses=STREAMED)
async def create_response(request: Request) -> Response:
    """A response to `input` after the stored conversation `previous_response_id` names
    (if any); stored (and its prompt pinned) with `store`."""
    state = state_of(request)
    req = await decode_body(request, rp.ResponsesRequest)
    lora = await lora_routes.resolve_model(state, request, req.model)
    rp.check(req)
    tenant, key = state.caller(request)
    talk = Conversation(proto.MAX_CHAT_MESSAGES)
    if req.previous_response_id is not None:
        previous, gone = state.responses.get(tenant, req.previous_response_id)
        await release(state, gone, key)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        await _repin(state, tenant, key, previous)
        talk.extend(previous.messages, "previous_response_id")
    rp.read_input(req, talk)
    if req.store and not state.responses.fits(len(msgspec.json.encode(talk.messages))):
        field = "input" if req.previous_response_id is None else "previous_response_id"
        raise ApiError(400, f"{field}: the conversation is larger than one tenant's stored "
                       "responses may be (max_stored_response_bytes="
                       f"{state.responses.max_bytes}); start a new one, or store: false",
                       param=field)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    # off the loop: the tools' and format's schemas are checked against their metaschema
    # tools and the format's schema are flat here
    with turns.own_names((".function.", "."), ("response_format.json_schema", "text.format"),
                         ("response_format", "text.format")):
        plan = await asyncio.to_thread(plan_tools, rp.tools(req), rp.tool_choice(req),
                                       req.parallel_tool_calls, state.tokenizer)
        constraint, source = await asyncio.to_thread(chat_constraint,
                                                     rp.response_format(req), plan)
    ids = await turns.prompt_ids(state, system + talk.messages, plan, "input")
    sampling: dict[str, Any] = {"max_new_tokens": await turns.room(
        state, len(ids), req.max_output_tokens, "input")}
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            sampling[name] = getattr(req, name)
    turns.constrain(sampling, constraint)
    shape = _Shape(req, f"resp_{uuid.uuid4().hex}")
    try:
        call = await turns.generate(request, state, ids, sampling, "resp", "responses",
                                    req.stream, plan, lora)
    except ServerError as e:
        error = openai_error(e, "text.format" if source == "response_format" else source)
        if error.param == "max_tokens":  # chat's name for it
            error.param, error.message = "max_output_tokens", error.message.replace(
                "max_tokens", "max_output_tokens")
        raise error from None
    if call.rest is None:
        assert isinstance(call.first, GenerateResult)  # a plain call's answer
        output = call.finished(state, call.first)
        blocks = turns.whole(plan, output.text)
        body = shape.body(blocks.blocks, output)
        await _store(state, request, shape, body, talk, blocks.blocks, ids)
        return json_response(body)
    return EventStream(_events(state, request, call, turns.Blocks(plan), shape, talk, ids))


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    """A stored response of the caller's tenant; any other id is not found."""
    state = state_of(request)
    tenant, key = state.caller(request)
    stored, gone = state.responses.get(tenant, response_id)
    await release(state, gone, key)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return json_response(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    state = state_of(request)
    tenant, key = state.caller(request)
    stored = state.responses.delete(tenant, response_id)
    if stored is None:
        raise _not_found(response_id, "response_id")
    await release(state, [stored], key)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"{param}: no stored response {response_id[:128]!r} (never stored, "
                    "another key's, deleted or expired)", param=param, code="not_found")


async def release(state: AppState, gone: list[Stored], key: str | None) -> None:
    """Unpin the prompts the dropped responses held."""
    for stored in gone:
        if stored.pinned is not None:
            try:
                await state.rpc.unpin_prefix(None, list(stored.pinned), api_key=key)
            except ServerError:
                pass  # restarting: the pins went with the tree


async def _repin(state: AppState, tenant: str, key: str | None, stored: Stored) -> None:
    """Pin again the prompt of a response loaded after a restart (which lost its pin),
    before its continuation is prefilled: once, best effort (`response_file`)."""
    ids = state.responses.take_repin(tenant, stored)
    if ids is None:
        return
    ttl = min(max(stored.expires - state.responses.clock(), 1.0), state.config.max_pin_ttl)
    try:
        await state.rpc.pin_prefix(None, list(ids), ttl=ttl, api_key=key)
    except ServerError:
        return
    if state.responses.repinned(tenant, stored, ids):
        stored.pinned = ids
        await release(state, [stored], key)


async def _store(state: AppState, request: Request, shape: _Shape, body: dict[str, Any],
                 talk: Conversation, blocks: list[Block], ids: list[int]) -> None:
    """Store a finished response, with its output as the conversation's next turn, and
    pin its prompt for the next one (best effort: past the tenant's pin quota, the next
    turn still hits whatever the cache kept)."""
    if not shape.req.store or body["status"] == "failed":
        return
    for block in blocks:
        if block.kind == "text":
            talk.say("assistant", block.text, "output")
        else:
            talk.call(block.call_id, block.name, block.text, "output")
    if not blocks:
        talk.say("assistant", "", "output")
    stored = Stored(shape.id, body, talk.messages, array("i", ids))
    if not state.responses.fits(stored.size):
        body["store"] = False
        return
    tenant, key = state.caller(request)
    try:
        ttl = min(state.config.stored_response_ttl, state.config.max_pin_ttl)
        await state.rpc.pin_prefix(None, ids, ttl=ttl, api_key=key)
    except ServerError:
        stored.pinned = None
    await release(state, state.responses.put(tenant, stored), key)


class _Shape:
    """One request's response object and its items."""

    def __init__(self, req: rp.ResponsesRequest, id: str) -> None:
        self.req, self.id, self.created = req, id, int(time.time())

    def item(self, block: Block, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if block.kind == "call":
            return {"type": "function_call", "id": self.item_id(block),
                    "call_id": block.call_id, "name": block.name,
                    "arguments": block.text if done else "", "status": status}
        return {"type": "message", "id": self.item_id(block), "status": status,
                "role": "assistant", "content": [self.part(block.text)] if done else []}

    def item_id(self, block: Block) -> str:
        prefix = "fc" if block.kind == "call" else "msg"
        return f"{prefix}_{self.id[5:]}_{block.index}"

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, blocks: list[Block], out: GenerateOutput | None) -> dict[str, Any]:
        """The response object: in progress (`out` None) or finished."""
        req = self.req
        status, incomplete = "in_progress", None
        if out is not None:
            reason, _ = proto.finish_reason(out)
            status = "completed" if reason == "stop" else "incomplete"
            if reason == "length":
                incomplete = {"reason": "max_output_tokens"}
        fmt = req.text.format if req.text is not None and req.text.format else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model, "output": [self.item(b, True) for b in blocks],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": None,
            "store": req.store, "temperature": req.temperature, "text": {"format": fmt},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": req.top_p, "truncation": req.truncation or "disabled",
            "metadata": req.metadata or {}, "user": req.user,
            "usage": None if out is None else _usage(out)}


def _usage(out: GenerateOutput) -> dict[str, Any]:
    return {"input_tokens": out.prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.cached_tokens},
            "output_tokens": out.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": out.prompt_tokens + out.completion_tokens}


class _Events:
    """The stream's events, each numbered (`sequence_number`)."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


async def _events(state: AppState, request: Request, call: turns.Call, blocks: turns.Blocks,
                  shape: _Shape, talk: Conversation, ids: list[int]) -> AsyncIterator[bytes]:
    """response.created, response.in_progress; per item output_item.added (a message's
    content_part.added), its deltas (output_text.delta, function_call_arguments.delta),
    its done events; then response.completed (or response.incomplete), or on a failure
    an `error` event."""
    event = _Events()
    yield event("response.created", response=shape.body([], None))
    yield event("response.in_progress", response=shape.body([], None))
    steps = turns.streamed(state, call, blocks)
    try:
        async for step in steps:
            if isinstance(step, GenerateOutput):
                body = shape.body(blocks.blocks, step)
                await _store(state, request, shape, body, talk, blocks.blocks, ids)
                done = "response.completed" if body["status"] == "completed" else (
                    "response.incomplete")
                yield event(done, response=body)
                continue
            what, block, text = step
            where = {"output_index": block.index}
            at = {"item_id": shape.item_id(block), **where}
            if what == "start":
                yield event("response.output_item.added", item=shape.item(block, False),
                            **where)
                if block.kind == "text":
                    yield event("response.content_part.added", content_index=0,
                                part=shape.part(""), **at)
            elif what == "delta" and block.kind == "text":
                yield event("response.output_text.delta", content_index=0, delta=text,
                            logprobs=[], **at)
            elif what == "delta":
                yield event("response.function_call_arguments.delta", delta=text, **at)
            elif block.kind == "text":
                yield event("response.output_text.done", content_index=0, text=block.text,
                            logprobs=[], **at)
                yield event("response.content_part.done", content_index=0,
                            part=shape.part(block.text), **at)
                yield event("response.output_item.done", item=shape.item(block, True),
                            **where)
            else:
                yield event("response.function_call_arguments.done", name=block.name,
                            arguments=block.text, **at)
                yield event("response.output_item.done", item=shape.item(block, True),
                            **where)
    except ServerError as e:
        error = openai_error(e).body()["error"]
        yield event("error", code=error["code"], message=error["message"],
                    param=error["param"])
    finally:  # the client left mid-stream: its call is aborted now, not when collected
        await steps.aclose()
