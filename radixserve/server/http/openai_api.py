"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (plain or
streamed as server-sent events). Each request becomes one generate RPC call; the shapes
and the parameter translation are in `openai_protocol`, chat templates and tool calling in
`radixserve.chat`."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from radixserve.chat.templates import template_variables
from radixserve.chat.tool_calls.base import ToolCallParser
from radixserve.chat.tool_plan import ToolPlan, plan_tools
from radixserve.messages import ChunkReply, GenerateCall, error_text
from radixserve.results.errors import ErrorCode, ServerError
from radixserve.results.generate import GenerateOutput, GenerateResult
from radixserve.rids import NamingError, name_prompts
from radixserve.server.http import lora_routes, turns
from radixserve.server.http import openai_protocol as proto
from radixserve.server.http.errors import ApiError, decode_body, json_response
from radixserve.server.http.metrics import StreamTimer
from radixserve.server.http.state import state_of
from radixserve.server.http.openapi import STREAMED, request_body
from radixserve.server.http.state import AppState
from radixserve.server.http.turns import Constraint
from radixserve.server.http.streaming import (DONE, EventStream, Streamed, sse,
                                              stream_ended)

router = APIRouter()
STARTED = int(time.time())


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    """The base model, then each LoRA adapter loaded (vLLM's card: `parent` is the base,
    `root` the adapter's path, shown to the operator only)."""
    state = state_of(request)
    loaded = await lora_routes.adapters(state, request)
    base = await _card(state)
    return json_response({"object": "list", "data": [base, *(
        _adapter_card(base, a) for a in loaded)]})


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> Response:
    state = state_of(request)
    base = await _card(state)
    if model in state.model_names:
        return json_response(base)
    loaded = await lora_routes.adapters(state, request)
    card = next((_adapter_card(base, a) for a in loaded if a["name"] == model), None)
    if card is None:
        raise lora_routes.unknown_model(state, model, [a["name"] for a in loaded])
    return json_response(card)


async def _card(state: AppState) -> dict[str, Any]:
    info = await state.model_info()
    return {"id": state.served_name, "object": "model", "created": STARTED,
            "owned_by": "radixserve", "root": str(state.model_dir), "parent": None,
            "max_model_len": info["context_length"]}


def _adapter_card(base: dict[str, Any], adapter: dict[str, Any]) -> dict[str, Any]:
    return {**base, "id": adapter["name"], "root": adapter["path"], "parent": base["id"]}


@router.post("/v1/completions", openapi_extra=request_body(proto.CompletionRequest),
             responses=STREAMED)
async def completions(request: Request) -> Response:
    state = state_of(request)
    req = await decode_body(request, proto.CompletionRequest)
    lora = await lora_routes.resolve_model(state, request, req.model, req.lora_path)
    proto.check_common(req)
    if req.best_of not in (None, 1, req.n) and not req.use_beam_search:
        raise ApiError(400, "best_of is not supported", param="best_of")
    args = proto.completion_prompt(req.prompt)
    args["lora_name"] = lora
    max_tokens = proto.COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    args["sampling_params"] = proto.sampling_params(req, max_tokens)
    args["beam"] = proto.beam_search(req, req.best_of)
    # off the loop: the metaschema check walks the caller's schema (bounded in size first)
    schema = await asyncio.to_thread(proto.response_schema, req.response_format)
    _constrain(args, None if schema is None else ("json_schema", schema))
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= proto.MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {proto.MAX_LOGPROBS}], got "
                           f"{req.logprobs}", param="logprobs")
        args.update(return_logprob=True, top_logprobs_num=req.logprobs,
                    return_text_in_logprobs=True)
    return await _serve(request, state, req, args, _Shape("cmpl", "text_completion", req))


@router.post("/v1/chat/completions", openapi_extra=request_body(proto.ChatRequest),
             responses=STREAMED)
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    req = await decode_body(request, proto.ChatRequest)
    lora = await lora_routes.resolve_model(state, request, req.model, req.lora_path)
    proto.check_common(req)
    # off the loop: the tools' and response_format's schemas are checked (each bounded in
    # size first) against their metaschema, work sized by the caller
    plan = await asyncio.to_thread(plan_tools, req.tools, req.tool_choice,
                                   req.parallel_tool_calls, state.tokenizer)
    constraint, source = await asyncio.to_thread(chat_constraint, req.response_format, plan)
    messages = proto.chat_messages(req)
    kwargs = template_variables(req.chat_template_kwargs, state.tokenizer)
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    ids = await turns.prompt_ids(state, messages, plan, "messages", **kwargs)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    args: dict[str, Any] = {"input_ids": ids, "sampling_params": proto.sampling_params(
        req, await turns.room(state, len(ids), asked, "messages")),
        "beam": proto.beam_search(req, None), "lora_name": lora}
    _constrain(args, constraint)
    if plan is not None and plan.keeps_special_tokens:
        args["sampling_params"]["skip_special_tokens"] = False  # the calls' own markers
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= proto.MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {proto.MAX_LOGPROBS}], got "
                       f"{req.top_logprobs}", param="top_logprobs")
    if req.logprobs:
        args.update(return_logprob=True, top_logprobs_num=req.top_logprobs or 0,
                    return_text_in_logprobs=True)
    return await _serve(request, state, req, args,
                        _Shape("chatcmpl", "chat.completion", req, plan), source)


def chat_constraint(fmt: proto.ResponseFormat | None, plan: ToolPlan | None
                    ) -> tuple[Constraint | None, str]:
    """What a chat answer is constrained to, if anything (by the response format `fmt` or
    the tool plan), and the field it comes from."""
    schema = proto.response_schema(fmt)
    if plan is None:
        return (None if schema is None else ("json_schema", schema)), "response_format"
    if plan.mode == "auto" and schema is not None:
        # Enforcing the format would rule out every call, and not enforcing it would break
        # its promise. (Under required or a named function the call is the answer.)
        raise ApiError(400, "response_format cannot be enforced while tool_choice is auto; "
                       "pass tool_choice none, required or a function", param="response_format")
    return plan.constraint(), "tools"


def _constrain(args: dict[str, Any], constraint: Constraint | None) -> None:
    turns.constrain(args["sampling_params"], constraint)


class _Shape:
    """How one API spells its responses: completions' `text` or chat's `message`/`delta`.
    With tools, each chat choice's text is read by a parser of the plan (see
    `radixserve.chat.tool_calls`)."""

    def __init__(self, prefix: str, kind: str, req: Any,
                 plan: ToolPlan | None = None) -> None:
        self.chat = kind == "chat.completion"
        self.kind, self.req, self.plan = kind, req, plan
        self.endpoint = "chat_completions" if self.chat else "completions"
        self.rid_prefix = prefix
        self.tenant = "default"
        """The caller's tenant (set by `_serve`), for the per-tenant metrics."""
        self.logprobs = bool(req.logprobs) if self.chat else req.logprobs is not None
        self.created = int(time.time())

    def head(self, rid: str, chunk: bool) -> dict[str, Any]:
        kind = f"{self.kind}.chunk" if chunk and self.chat else self.kind
        return {"id": rid, "object": kind, "created": self.created, "model": self.req.model}

    def choice(self, index: int, result: GenerateOutput | None, body: dict[str, Any],
               called: bool = False) -> dict[str, Any]:
        """Choice `index` with `body` (its text, message or delta); `result` (the finished
        output; None mid-stream) gives the finish reason and logprobs. An output that ends
        by itself after tool calls finishes with `tool_calls`."""
        reason, matched = proto.finish_reason(result) if result else (None, None)
        if called and reason == "stop":
            reason = "tool_calls"
        out: dict[str, Any] = {"index": index, **body}
        lp = None
        if result and self.logprobs:
            lp = proto.chat_logprobs(result) if self.chat else proto.completion_logprobs(result)
        out.update(logprobs=lp, finish_reason=reason)
        if matched is not None:
            out["matched_stop"] = matched
        return out

    def answer(self, index: int, result: GenerateOutput) -> dict[str, Any]:
        text = result.text
        if not self.chat:
            return self.choice(index, result, {"text": text})
        if self.plan is None:
            return self.choice(index, result, {"message": {"role": "assistant", "content": text}})
        content, calls = self.plan.parser().parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return self.choice(index, result, {"message": message}, called=bool(calls))

    def full(self, rid: str, results: list[GenerateOutput]) -> dict[str, Any]:
        choices = [self.answer(i, r) for i, r in enumerate(results)]
        body = {**self.head(rid, False), "choices": choices,
                "usage": proto.usage(results, self.req.n)}
        if self.req.return_cached_tokens_details and results:
            body["sglext"] = proto.sglext(results[0])
        return body


class _StreamedChoices:
    """A stream's choices as they go: each one's parser (with tools) and whether its first
    delta, which carries the role, went out."""

    def __init__(self, shape: _Shape) -> None:
        self.shape = shape
        self.parsers: dict[int, ToolCallParser] = {}
        self.started: set[int] = set()

    def bodies(self, i: int, text: str, end: bool = False) -> list[dict[str, Any]]:
        """Choice `i`'s event bodies for its new `text`; at `end`, also what its parser
        held back. A chat choice's first chunk always sends its role."""
        shape = self.shape
        if not shape.chat:
            return [{"text": text}] if text else []
        if shape.plan is None:
            deltas = [{"content": text}] if text else []
        else:
            if i not in self.parsers:
                self.parsers[i] = shape.plan.parser()
            parser = self.parsers[i]
            deltas = parser.feed(text) + (parser.finish() if end else [])
        if not deltas and not end and i not in self.started:
            deltas = [{} if shape.plan else {"content": ""}]
        return [{"delta": self._opened(i, d)} for d in deltas]

    def closing(self, i: int) -> dict[str, Any]:
        """The body of choice `i`'s last chunk, the one with its finish reason."""
        if not self.shape.chat:
            return {"text": ""}
        if i in self.started:
            return {"delta": {}}
        return {"delta": self._opened(i, {} if self.shape.plan else {"content": ""})}

    def called(self, i: int) -> bool:
        return i in self.parsers and self.parsers[i].calls > 0

    def _opened(self, i: int, delta: dict[str, Any]) -> dict[str, Any]:
        if i in self.started:
            return delta
        self.started.add(i)
        return {"role": "assistant", **delta}


def openai_error(e: ServerError, constrained_by: str = "response_format") -> ApiError:
    """The server's messages name SGLang's parameters; say OpenAI's where they differ (a
    bad constraint came from `constrained_by`)."""
    if e.code != "invalid_request":
        return ApiError.from_server(e)
    message = e.message.replace("sampling_params.", "").replace("max_new_tokens", "max_tokens")
    if "json_schema" in message or "structural_tag" in message:
        return ApiError(400, f"{constrained_by}: {message}", param=constrained_by,
                        code="invalid_request")
    named = re.search(r"sampling_params\.(\w+)", e.message)
    param = (named[1].replace("max_new_tokens", "max_tokens") if named else
             next((p for p in ("logit_bias", "max_tokens", "temperature", "top_p", "stop", "n",
                               "seed") if re.search(rf"\b{p}\b", message)), None))
    return ApiError(400, message, param=param, code="invalid_request")


async def _serve(request: Request, state: AppState, req: Any, args: dict[str, Any],
                 shape: _Shape, constrained_by: str = "response_format") -> Response:
    try:
        named = name_prompts(args.get("text"), args.get("input_ids"), None, shape.rid_prefix)
    except NamingError as e:
        raise ApiError(400, str(e).replace(f"{e.field} holds", "prompt holds"),
                       param="prompt") from None
    rids = named.rids
    caller = state.caller(request)
    shape.tenant = caller[0]
    try:
        try:  # Python values: checked as the fields of a decoded call are
            call = msgspec.convert({**args, "call_id": 0, "rid": named.rid_arg,
                                    "api_key": caller[1], "cache_salt": req.cache_salt,
                                    "stream": req.stream}, GenerateCall)
        except msgspec.ValidationError as e:
            raise ServerError(ErrorCode.INVALID_REQUEST, f"invalid call: {error_text(e)}"
                              ) from None
        first, stream = await state.generate(request, call, rids)
    except ServerError as e:
        if args.get("lora_name") and "unknown LoRA adapter" in e.message:
            if req.lora_path is not None:  # SGLang's field named it (not checked before)
                raise lora_routes.unknown_model(state, req.lora_path, [], "lora_path") from None
            raise lora_routes.unknown_model(state, req.model, []) from None  # unloaded since
        raise openai_error(e, constrained_by) from None
    if stream is None:
        assert isinstance(first, GenerateResult)  # a plain call's answer
        state.metrics.finished(shape.endpoint, first.outputs, tenant=shape.tenant)
        return json_response(shape.full(rids[0], _choices(first, req.n)))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return EventStream(_events(state, stream, first, rids, shape, include_usage,
                               constrained_by, caller))


def _choices(result: GenerateResult, n: int) -> list[GenerateOutput]:
    """The outputs that are choices: all of them, or of a beam search each prompt's `n`
    best beams (its answer lists every beam, best first)."""
    if result.beams_per_prompt is None:
        return result.outputs
    kept, start = [], 0
    for count in result.beams_per_prompt:
        kept += result.outputs[start:start + n]
        start += count
    return kept


async def _events(state: AppState, stream: AsyncIterator[Streamed], first: Streamed,
                  rids: list[str],
                  shape: _Shape, include_usage: bool, constrained_by: str,
                  caller: tuple[str, str | None]) -> AsyncIterator[bytes]:
    """OpenAI's stream: deltas per choice as they come (text, or with tools content and
    tool calls); then each choice's finish reason (and, if asked, its logprobs, all in
    that last chunk); then usage; then [DONE]."""
    head = shape.head(rids[0], True)
    extra = {"usage": None} if include_usage else {}
    choices = _StreamedChoices(shape)
    timer = StreamTimer(state.metrics)
    finished = False
    try:
        chunk = first
        while isinstance(chunk, ChunkReply):
            i = chunk.index
            timer.chunk(i, len(chunk.token_ids), time.perf_counter())
            for body in choices.bodies(i, chunk.text):
                yield sse({**head, "choices": [shape.choice(i, None, body)], **extra})
            chunk = await stream.__anext__()
        state.metrics.finished(shape.endpoint, chunk.outputs, itl_observed=True,
                               tenant=shape.tenant)
        results = _choices(chunk, shape.req.n)
        whole = chunk.beams_per_prompt is not None  # beams are not streamed: text comes now
        finished = True
        for i, result in enumerate(results):
            for body in choices.bodies(i, result.text if whole else "", end=True):
                yield sse({**head, "choices": [shape.choice(i, None, body)], **extra})
            last = shape.choice(i, result, choices.closing(i), choices.called(i))
            event = {**head, "choices": [last], **extra}
            if shape.req.return_cached_tokens_details:
                event["sglext"] = proto.sglext(result)
            yield sse(event)
        if include_usage:
            yield sse({**head, "choices": [], "usage": proto.usage(results, shape.req.n)})
    except ServerError as e:
        finished = True
        yield sse(openai_error(e, constrained_by).body())
    finally:
        await stream_ended(state, caller[1], rids, stream, finished)
    yield DONE
