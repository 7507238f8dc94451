"""What the three conversational APIs (Chat Completions, Responses, Messages) share between a
conversation and its answer: the prompt (the chat template over `chat.conversation`'s
messages, checked and tokenized), one generate call of one answer, and that answer read as
blocks of text and tool calls (`Blocks`), the same whether it streams or not: a streamed
answer goes through the same parser as a whole one, so its calls are the same calls."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from contextlib import contextmanager
from typing import Any, AsyncGenerator, AsyncIterator, Iterator, Literal

import msgspec
from starlette.requests import Request

from radixserve.chat import prompt
from radixserve.chat.errors import ChatError
from radixserve.chat.tool_calls.base import Delta, ToolCallParser
from radixserve.chat.tool_plan import ToolPlan
from radixserve.front_door.requests import check_prompt_chars
from radixserve.messages import ChunkReply, GenerateCall, error_text
from radixserve.results.errors import ErrorCode, ServerError
from radixserve.results.generate import GenerateOutput, GenerateResult
from radixserve.rids import mint_rid
from radixserve.server.http.errors import ApiError
from radixserve.server.http.state import AppState
from radixserve.server.http.streaming import Streamed, stream_ended

Constraint = tuple[str, dict[str, Any]]
"""An output constraint: the sampling parameter (json_schema, structural_tag) and its value."""


async def prompt_ids(state: AppState, messages: list[dict[str, Any]], plan: ToolPlan | None,
                     param: str, **template_kwargs: Any) -> list[int]:
    """The prompt's token ids: `messages` and the plan's tools through the chat template
    (off the event loop), its length checked before the tokenizer sees it. 400s name
    `param`, the request field that holds the conversation."""
    try:
        text = await state.renderer.render(prompt.render, state.tokenizer, messages, plan,
                                           **template_kwargs)
    except ChatError:
        raise
    except Exception as e:  # the template rejects the conversation (roles, order)
        raise ApiError(400, f"the chat template rejected the {param}: {e}",
                       param=param) from None
    info = await state.model_info()
    try:
        check_prompt_chars(text, state.config, info["context_length"],
                           "the conversation (rendered by the chat template)")
    except ValueError as e:
        raise ApiError(400, str(e), param=param) from None
    ids: list[int] = state.tokenizer.encode(text)
    return ids


async def room(state: AppState, prompt_len: int, asked: int | None, param: str) -> int:
    """max_new_tokens of an answer: what it asks for, else all the room the prompt leaves
    in the context (or the KV pool if smaller)."""
    info = await state.model_info()
    limit = min(info["context_length"], info["max_total_tokens"])
    if prompt_len >= limit:
        raise ApiError(400, f"the {param} take {prompt_len} tokens, the model's limit is "
                       f"{limit} tokens", param=param)
    return limit - prompt_len if asked is None else asked


@contextmanager
def own_names(*renames: tuple[str, str]) -> Iterator[None]:
    """The shared planners' refusals name chat's fields (`tools[0].function.parameters`,
    `response_format`): within, they name the caller's API's, each `(chat's, own)` of
    `renames` replaced in turn."""
    try:
        yield
    except (ChatError, ApiError) as e:
        for chat, own in renames:
            e.message = e.message.replace(chat, own)
            e.param = e.param.replace(chat, own) if e.param else e.param
        raise


def constrain(sampling: dict[str, Any], constraint: Constraint | None) -> None:
    if constraint is not None:
        name, value = constraint
        sampling[name] = json.dumps(value)


@dataclass
class Call:
    """One answer's generate call under way: its rid, the caller's key, and its result or,
    streamed, its first item and the rest."""

    rid: str
    key: str | None
    first: Streamed
    rest: AsyncIterator[Streamed] | None
    endpoint: str
    """The route's name in the metrics' `endpoint` label."""
    tenant: str

    def finished(self, state: AppState, result: GenerateResult) -> GenerateOutput:
        """The answer, counted in the metrics."""
        state.metrics.finished(self.endpoint, result.outputs, tenant=self.tenant)
        return result.outputs[0]


async def generate(request: Request, state: AppState, ids: list[int], sampling: dict[str, Any],
                   kind: str, endpoint: str, stream: bool, plan: ToolPlan | None,
                   lora: str | None = None) -> Call:
    """Send one prompt's generate call as the HTTP caller (their key, so their tenant's
    cache and quotas). ServerError passes through for the route to spell."""
    if plan is not None and plan.keeps_special_tokens:
        sampling["skip_special_tokens"] = False  # the calls' own markers
    rid = mint_rid(kind)
    tenant, key = state.caller(request)
    try:
        call = msgspec.convert({"input_ids": ids, "sampling_params": sampling, "call_id": 0,
                                "rid": rid, "api_key": key, "stream": stream,
                                "lora_name": lora}, GenerateCall)
    except msgspec.ValidationError as e:
        raise ServerError(ErrorCode.INVALID_REQUEST, f"invalid call: {error_text(e)}") from None
    first, rest = await state.generate(request, call, [rid])
    return Call(rid, key, first, rest, endpoint, tenant)


@dataclass
class Block:
    """A piece of an answer: text, or one tool call (`text` is then its arguments)."""

    index: int
    kind: Literal["text", "call"]
    text: str = ""
    name: str = ""
    call_id: str = ""


Event = tuple[Literal["start", "delta", "stop"], Block, str]
"""A block opens, grows by a piece of text, or closes."""


@dataclass
class Blocks:
    """An answer's text, as it comes, turned into blocks: the plan's parser (with tools)
    reads the calls out of it, and each content or call delta opens, grows or closes a
    block."""

    plan: ToolPlan | None
    blocks: list[Block] = field(default_factory=list)
    parser: ToolCallParser | None = None
    open: Block | None = None

    def __post_init__(self) -> None:
        self.parser = self.plan.parser() if self.plan is not None else None

    def feed(self, text: str) -> list[Event]:
        if self.parser is None:
            return self._deltas([{"content": text}] if text else [])
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[Event]:
        """The text ended: what the parser held back, then the open block closes."""
        out = self._deltas(self.parser.finish()) if self.parser is not None else []
        if self.open is not None:
            out.append(("stop", self.open, ""))
            self.open = None
        return out

    @property
    def calls(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "call"]

    def _deltas(self, deltas: list[Delta]) -> list[Event]:
        out: list[Event] = []
        for d in deltas:
            if d.get("content"):
                if self.open is None or self.open.kind != "text":
                    out += self._start(Block(len(self.blocks), "text"))
                out += self._grow(d["content"])
            for c in d.get("tool_calls", ()):
                if "id" in c:  # a call's first delta names it
                    out += self._start(Block(len(self.blocks), "call",
                                             name=c["function"]["name"], call_id=c["id"]))
                if c["function"]["arguments"]:
                    out += self._grow(c["function"]["arguments"])
        return out

    def _start(self, block: Block) -> list[Event]:
        out: list[Event] = [] if self.open is None else [("stop", self.open, "")]
        self.blocks.append(block)
        self.open = block
        return out + [("start", block, "")]

    def _grow(self, text: str) -> list[Event]:
        assert self.open is not None
        self.open.text += text
        return [("delta", self.open, text)]


def whole(plan: ToolPlan | None, text: str) -> Blocks:
    """A finished answer's blocks."""
    blocks = Blocks(plan)
    blocks.feed(text)
    blocks.finish()
    return blocks


async def streamed(state: AppState, call: Call, blocks: Blocks
                   ) -> AsyncGenerator[Event | GenerateOutput, None]:
    """A streamed answer's block events as its text comes, then its finished output. If the
    consumer stops early (the client left), the call is aborted as its caller."""
    assert call.rest is not None
    finished = False
    try:
        item = call.first
        while isinstance(item, ChunkReply):
            for event in blocks.feed(item.text):
                yield event
            item = await call.rest.__anext__()
        finished = True
        assert isinstance(item, GenerateResult)
        for event in blocks.finish():
            yield event
        yield call.finished(state, item)
    finally:
        await stream_ended(state, call.key, [call.rid], call.rest, finished)
