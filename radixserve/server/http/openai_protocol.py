"""OpenAI's request and response shapes, and their translation to and from radixserve's
(SGLang's) generate arguments and typed results (`results.generate`). No I/O here: routes
live in `openai_api`.

Defaults follow OpenAI: temperature 1, top_p 1, n 1; completions generate at most 16 tokens
unless `max_tokens` says otherwise, chat completions up to the context (see `turns.room`).
A few SGLang/vLLM extensions are accepted too (top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, skip_special_tokens, no_stop_trim).

Every parameter of the `openai` client's `completions.create` and `chat.completions.create`
is declared here, so none is an "unknown field": each is supported, accepted without effect
(bookkeeping for OpenAI's side, prompt-cache hints: radixserve caches every prefix anyway,
predicted outputs: a speed hint), or accepted at its default only and refused by name at
any other (`foreign_fields.DefaultOnly`: it would change the answer in a way radixserve
cannot). So are the fields SGLang's OpenAI types add and its router sends at their defaults
(tests/server/test_sglang_router.py lists them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from radixserve.chat.conversation import Conversation, text_of
from radixserve.chat.schemas import ANY_OBJECT, checked_schema
from radixserve.chat.tool_types import FunctionName, ToolChoice, ToolDef
from radixserve.messages.sampling import MAX_LOGIT_BIAS, SamplingParams
from radixserve.results.generate import GenerateOutput
from radixserve.messages.rpc import LoraName
from radixserve.server.http.errors import ApiError
from radixserve.server.http.foreign_fields import DefaultOnly


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    """No effect: OpenAI pads stream events against length side channels; nothing here."""


class JsonSchemaFormat(Struct, forbid_unknown_fields=True):
    name: FunctionName
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class JsonSchemaResponse(Struct, tag_field="type", tag="json_schema",
                         forbid_unknown_fields=True):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponse


class _Sampling(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    n: int = 1
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    response_format: ResponseFormat | None = None
    """On both routes (an extension on completions, as vLLM and SGLang have it)."""
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    cache_salt: str | None = None
    """Only requests of the same tenant with the same salt share cached prefixes (vLLM's
    and SGLang's extension)."""
    return_cached_tokens_details: bool = False
    """SGLang: add `sglext.cached_tokens_details` to each response (its benchmark's
    --cache-report asks for it)."""
    use_beam_search: bool = False
    """vLLM's extension: beam search (as `Client.beam_search`) of width `best_of` (else
    `n`); the `n` best beams are the choices, best first."""
    length_penalty: float = 1.0
    """With `use_beam_search`: a finished beam scores `sum(logprobs) / tokens ** length_penalty`."""
    early_stopping: bool = False
    """With `use_beam_search`: stop once `best_of` beams have finished (transformers')."""
    # -- accepted, no effect: OpenAI's bookkeeping and prompt-cache hints --
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # -- SGLang's extensions, which its router sends on every request --
    lora_path: LoraName | None = None
    """SGLang's: the LoRA adapter to run under (`model` then names the base model or the
    same adapter)."""
    return_hidden_states: Annotated[bool, DefaultOnly("hidden states stay on the worker")] = False


class CompletionRequest(_Sampling):
    prompt: str | list[Any]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: Annotated[bool, DefaultOnly("the answer is the completion alone")] = False
    suffix: Annotated[str | None, DefaultOnly("radixserve does not fill in the middle")] = None
    best_of: int | None = None


MAX_CHAT_MESSAGES = 4096
"""Messages (tool results included) one chat request may hold: rendering is linear in them,
and this bounds the work one request gives the render threads every tenant shares."""
MAX_CHAT_PARTS = 256
"""Content parts, and tool calls, one chat message may hold."""


class ContentPart(Struct):
    type: str
    text: str | None = None


class CalledFunction(Struct):
    name: str
    arguments: str
    """JSON text, as OpenAI returns it (and so clients send it back)."""


class ToolCall(Struct):
    id: str
    function: CalledFunction
    type: str = "function"


class ChatMessage(Struct):
    """Unknown keys (refusal, annotations, ...) are ignored: clients send back the
    assistant messages they received, with every field the response had."""

    role: str
    content: str | Annotated[list[ContentPart], Meta(max_length=MAX_CHAT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_CHAT_PARTS)] | None = None
    """An assistant turn's calls (its content is then usually null)."""
    tool_call_id: str | None = None
    """A `tool` message: the call whose result it carries."""


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_CHAT_MESSAGES)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    """Passed to the chat template (reasoning models' templates read it; others do not)."""
    chat_template_kwargs: dict[str, Any] | None = None
    # -- accepted, no effect --
    prediction: Any = None
    """Predicted output: OpenAI uses it to go faster; the answer is the same without it."""
    modalities: list[Literal["text"]] | None = None
    """Only text: anything else is refused by name."""
    # -- SGLang's, sent by its router at these values --
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    """Both honoured as SGLang without a --reasoning-parser honours them: any reasoning
    stays in `content`, streamed as it comes."""
    continue_final_message: Annotated[bool, DefaultOnly(
        "the chat template always starts a new assistant turn")] = False
    # -- each would change the answer --
    audio: Annotated[Any, DefaultOnly("radixserve generates text only")] = None
    web_search_options: Annotated[Any, DefaultOnly("radixserve has no web search")] = None
    moderation: Annotated[Any, DefaultOnly("radixserve runs no moderation")] = None
    verbosity: Annotated[Any, DefaultOnly(
        "it steers OpenAI's models, and no chat template here takes it")] = None
    functions: Annotated[Any, DefaultOnly(
        "use tools (functions is OpenAI's deprecated spelling)")] = None
    function_call: Annotated[Any, DefaultOnly(
        "use tool_choice (function_call is OpenAI's deprecated spelling)")] = None


COMPLETION_MAX_TOKENS = 16
MAX_LOGPROBS = 20


def check_common(req: _Sampling) -> None:
    """What OpenAI rejects, with its parameter names, before the server sees it."""
    if req.n < 1:
        raise ApiError(400, f"n must be >= 1, got {req.n}", param="n")


def response_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema `response_format` constrains the answer to, if any."""
    if isinstance(fmt, JsonObjectFormat):
        return ANY_OBJECT
    if isinstance(fmt, JsonSchemaResponse):
        spec = fmt.json_schema
        if spec.schema is None:
            raise ApiError(400, "response_format.json_schema.schema is required",
                           param="response_format")
        return checked_schema(spec.schema, "response_format", strict=bool(spec.strict))
    return None


def beam_search(req: _Sampling, best_of: int | None) -> dict[str, Any] | None:
    """The generate call's `beam` (`messages.BeamParams`) for `use_beam_search`, or None.
    Beam search is deterministic, so sampling settings are refused with it, as vLLM does
    (by `SamplingParams.beam_refusal`, as on every surface)."""
    if not req.use_beam_search:
        for name, set_ in (("length_penalty", req.length_penalty != 1.0),
                           ("early_stopping", req.early_stopping)):
            if set_:
                raise ApiError(400, f"{name} needs use_beam_search", param=name)
        return None
    width = req.n if best_of is None else best_of
    if width < req.n:
        raise ApiError(400, f"best_of ({width}) must be at least n ({req.n}) with beam "
                       "search: the choices are the n best of best_of beams", param="best_of")
    return {"width": width, "length_penalty": req.length_penalty,
            "early_stopping": req.early_stopping}


SAMPLING_FIELDS = tuple(f.name for f in msgspec.structs.fields(_Sampling)
                        if f.name in {g.name for g in msgspec.structs.fields(SamplingParams)})
"""The request fields that are `SamplingParams` fields of the same name and meaning, passed
on as they are; the others are mapped (`max_tokens`, `response_format`, `tools`) or absent
(tests/server/test_sampling_surfaces.py checks each field's fate on every surface)."""


def sampling_params(req: _Sampling, max_new_tokens: int) -> dict[str, Any]:
    sp = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    sp["max_new_tokens"] = max_new_tokens
    if req.use_beam_search:  # n counts the choices, best_of the beams
        sp["n"] = 1
    return sp


def completion_prompt(prompt: Any) -> dict[str, Any]:
    """`prompt` as generate arguments: text (one or a batch) or token ids (one or a batch)."""
    if isinstance(prompt, str):
        return {"text": prompt}
    if prompt and all(isinstance(p, str) for p in prompt):
        return {"text": prompt}
    if prompt and all(type(t) is int for t in prompt):
        return {"input_ids": prompt}
    if prompt and all(isinstance(p, list) and p and all(type(t) is int for t in p)
                      for p in prompt):
        return {"input_ids": prompt}
    raise ApiError(400, "prompt must be a string, a non-empty list of strings, a list of "
                   "token ids or a list of lists of token ids", param="prompt")


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as chat-template input (`chat.conversation`, shared with the Responses
    and Messages APIs): text content; tool calls and results as OpenAI spells them
    (`prompt.render` turns them into what the template, or the tool-call fallback, reads)."""
    if not req.messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    talk = Conversation(MAX_CHAT_MESSAGES)
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        content = m.content
        if isinstance(content, list):
            content = text_of([(p.type, p.text) for p in content], ("text",),
                              f"{where}.content")
        if m.role == "tool" and m.tool_call_id is not None:
            talk.result(m.tool_call_id, content or "", where, m.name)
        else:
            talk.say(m.role, content or "", where, m.name)
        for k, c in enumerate(m.tool_calls or ()):
            talk.call(c.id, c.function.name, c.function.arguments, f"{where}.tool_calls[{k}]")
    return talk.messages


def finish_reason(out: GenerateOutput) -> tuple[str | None, int | str | None]:
    """OpenAI's finish reason (stop, length, abort) and what a stop matched."""
    reason = out.finish_reason
    return (None, None) if reason is None else (reason.type, reason.matched)


def usage(outputs: list[GenerateOutput], n: int, details: bool = True) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per sample), as OpenAI counts them; so do
    cached tokens: each prompt's first sample's, which is what that prompt's prefill saved
    (its later samples share the prompt with the first by construction)."""
    firsts = outputs[::n]
    prompt = sum(out.prompt_tokens for out in firsts)
    completion = sum(out.completion_tokens for out in outputs)
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}
    if details:
        body["prompt_tokens_details"] = {"cached_tokens": sum(o.cached_tokens for o in firsts)}
    return body


def sglext(out: GenerateOutput) -> dict[str, Any]:
    return {"cached_tokens_details": {"device": out.cached_tokens, "host": 0, "storage": 0}}


def completion_logprobs(out: GenerateOutput) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs,
    text_offset (from the start of the completion)."""
    lp = out.logprobs
    chosen = lp.output if lp is not None else []
    tokens = [t.text or "" for t in chosen]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = lp.output_top if lp is not None else []
    return {"tokens": tokens, "token_logprobs": [t.logprob for t in chosen],
            "top_logprobs": [{t.text or "": t.logprob for t in top} if top else None
                             for top in tops] or None,
            "text_offset": offsets}


def chat_logprobs(out: GenerateOutput) -> dict[str, Any]:
    lp = out.logprobs
    chosen = lp.output if lp is not None else []
    tops = lp.output_top if lp is not None else []
    content = []
    for k, token in enumerate(chosen):
        top = (tops[k] if k < len(tops) else None) or []
        content.append({"token": token.text or "", "logprob": token.logprob,
                        "bytes": _bytes(token.text),
                        "top_logprobs": [{"token": t.text or "", "logprob": t.logprob,
                                          "bytes": _bytes(t.text)} for t in top]})
    return {"content": content, "refusal": None}


def _bytes(text: str | None) -> list[int]:
    return list((text or "").encode("utf-8"))
