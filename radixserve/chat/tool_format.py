"""Which tool-call syntax a model writes, read from its chat template: whether the template
takes tools at all (else they go to the model the Hermes way), and if so which format it asks
for. Probed once per tokenizer (cached): the one place that decides."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from radixserve.chat.tool_calls.hermes import OPEN
from radixserve.chat.tool_types import NO_ARGUMENTS

_PROBE = [{"role": "user", "content": "Hi"}]
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "A probe.",
                                                "parameters": NO_ARGUMENTS}}


@lru_cache(maxsize=8)
def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes tools it is given: rendered with one and without."""
    try:
        plain = tokenizer.apply_chat_template(_PROBE, tokenize=False,
                                              add_generation_prompt=True)
        offered = tokenizer.apply_chat_template(_PROBE, tools=[_PROBE_TOOL], tokenize=False,
                                                add_generation_prompt=True)
    except Exception:  # a template that breaks on the probe is not one to trust with tools
        return False
    return offered != plain


_OWN_FORMATS = {"[TOOL_CALLS]": "mistral", "[AVAILABLE_TOOLS]": "mistral",
                "<|python_tag|>": "llama3",
                '"parameters": dictionary of argument name and its value': "llama3"}
"""What marks a template's own format, in what it writes or in its source, in this order."""


def tool_format(tokenizer: Any) -> str:
    """The syntax `tokenizer`'s model writes tool calls in: `hermes` when its template
    ignores tools (they get the Hermes fallback), else `template_tool_format`'s answer."""
    return template_tool_format(tokenizer) if template_takes_tools(tokenizer) else "hermes"


@lru_cache(maxsize=8)
def template_tool_format(tokenizer: Any) -> str:
    """The tool-call format a template that takes tools asks for, read from what it writes
    for a probe tool and from its source: `hermes` when it asks for `<tool_call>` blocks
    (Qwen2.5, Qwen3, Hermes models), `mistral` for `[TOOL_CALLS]` (Mistral v0.3 and later),
    `llama3` for Llama 3.1/3.2's JSON calls, else a description of a format no parser reads.
    The one place that decides."""
    offered = tokenizer.apply_chat_template(_PROBE, tools=[_PROBE_TOOL], tokenize=False,
                                            add_generation_prompt=True)
    if OPEN in offered:
        return "hermes"
    source = getattr(tokenizer, "chat_template", None)
    text = offered + (source if isinstance(source, str) else "")
    for marker, name in _OWN_FORMATS.items():
        if marker in text:
            return name
    return "not Hermes <tool_call>"

