"""The tool-call formats read back under `tool_choice` auto, by name: a model's chat template
asks for one of them (`chat.tool_format`), and its parser reads the calls."""

from __future__ import annotations

from radixserve.chat.tool_calls.base import FormatParser
from radixserve.chat.tool_calls.hermes import HermesParser
from radixserve.chat.tool_calls.llama3 import Llama3Parser
from radixserve.chat.tool_calls.mistral import MistralParser

PARSERS: dict[str, type[FormatParser]] = {
    parser.FORMAT: parser for parser in (HermesParser, MistralParser, Llama3Parser)}

FORMATS = {name: parser.DESCRIPTION for name, parser in PARSERS.items()}
"""Each format in words, for error messages."""
