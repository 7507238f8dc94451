"""The prompt of a chat request: its messages and offered tools through the model's chat
template. The tools go to the template (`apply_chat_template(tools=...)`), and so do
assistant turns with `tool_calls` and `tool` results. A template that ignores tools (probed
once per tokenizer, `tool_format`; SmolLM2's has no tool support) gets them the Hermes way,
as Qwen2.5's template writes them: a `# Tools` section in the system prompt lists the
functions inside `<tools></tools>` and asks for `<tool_call>{"name": ..., "arguments":
...}</tool_call>`; earlier calls are written in that syntax in their assistant turns, and
results go back in a user turn as `<tool_response>...</tool_response>`. (SGLang and vLLM
leave such a template alone, so the model never hears of the tools.)"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from radixserve.chat.errors import ChatError
from radixserve.chat.tool_calls.base import json_arguments
from radixserve.chat.tool_calls.hermes import CLOSE, OPEN
from radixserve.chat.tool_format import template_takes_tools, template_tool_format
from radixserve.chat.tool_plan import ToolPlan


def render(tokenizer: Any, messages: list[dict[str, Any]], plan: ToolPlan | None,
           **template_kwargs: Any) -> str:
    """The prompt text: `messages` (as `openai_protocol.chat_messages` gives them) and the
    plan's tools through the chat template, or its Hermes fallback."""
    tools = plan.offered() if plan is not None else None
    if template_takes_tools(tokenizer):
        fmt = template_tool_format(tokenizer)
        if plan is not None and plan.mode == "auto" and plan.format != fmt:
            raise ChatError(500, f"this model's chat template writes tool calls as {fmt}, but "
                            f"the calls would be read as {plan.format} (plan_tools was not "
                            "given this tokenizer)", param="tool_choice")
        messages = [_for_template(m) for m in messages]
        if fmt == "mistral":
            messages = [_mistral_ids(m) for m in messages]
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True,
            **template_kwargs)
    return tokenizer.apply_chat_template(_hermes(messages, tools), tokenize=False,
                                         add_generation_prompt=True, **template_kwargs)


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_call_id(call_id: Any) -> Any:
    """Mistral's templates take 9 alphanumeric characters as a call id (and raise on any
    other): OpenAI's ids map to one, the same for a call and its result."""
    if not isinstance(call_id, str) or _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _mistral_ids(message: dict[str, Any]) -> dict[str, Any]:
    if "tool_call_id" in message:
        message = {**message, "tool_call_id": mistral_call_id(message["tool_call_id"])}
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [{**c, "id": mistral_call_id(c.get("id"))}
                                             for c in message["tool_calls"]]}
    return message


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """Templates `tojson` a call's arguments, so they take the object, not OpenAI's text."""
    if "tool_calls" not in message:
        return message
    calls = [{**c, "function": {**c["function"],
                                "arguments": json_arguments(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def _call_text(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": json_arguments(function["arguments"])}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


def _tools_section(tools: list[dict[str, Any]]) -> str:
    """Qwen2.5's wording, which Hermes-trained models know."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            f"within {OPEN}{CLOSE} XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def _hermes(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
            ) -> list[dict[str, Any]]:
    """Messages any template renders: calls as `<tool_call>` text in their assistant turn,
    results (consecutive ones together) as `<tool_response>` text in a user turn, and the
    tools section at the end of the system prompt (or as the system prompt, in place of
    whatever default the template would write)."""
    out: list[dict[str, Any]] = []
    responses: list[str] = []
    """The current run of consecutive tool results, joined once when it ends: appending to
    the turn's text one at a time copied it each time (quadratic in the run)."""
    for m in messages:
        if m["role"] != "tool" and responses:
            out.append({"role": "user", "content": "\n".join(responses)})
            responses = []
        if m["role"] == "tool":
            responses.append(f"<tool_response>\n{m['content']}\n</tool_response>")
        elif m.get("tool_calls"):
            calls = "\n".join(_call_text(c["function"]) for c in m["tool_calls"])
            out.append({"role": m["role"],
                        "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        else:
            out.append(m)
    if responses:
        out.append({"role": "user", "content": "\n".join(responses)})
    if tools:
        section = _tools_section(tools)
        if out and out[0]["role"] == "system":
            system = out[0]["content"]
            out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out

