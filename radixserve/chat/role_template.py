"""Role markers from the model's own chat template.

A program writes `system(...)`, `user(...)`, `assistant(...)`; the text around each message
must be exactly what the model's Jinja chat template would produce for the same messages,
or an instruct model sees a format it was not trained on. Rather than keep a table of
templates (as SGLang does), render the tokenizer's template with a sentinel content and cut
the rendering around it: what comes before the sentinel is the role's prefix, what comes
after is its suffix. A template that adds a default system message when the conversation
does not start with one (SmolLM2 does) is probed the same way, so `messages()` re-rendered
by the template gives back the program's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_SENTINEL = "\x00radixserve-role-content\x00"
ROLES = ("system", "user", "assistant")


@dataclass
class RoleTemplate:
    prefixes: dict[str, str] = field(default_factory=dict)
    suffixes: dict[str, str] = field(default_factory=dict)
    default_system_prompt: str | None = None
    """The system message the template adds when a conversation starts without one."""

    def prefix_and_suffix(self, role: str) -> tuple[str, str]:
        if role not in self.prefixes:
            raise ValueError(f"unknown role {role!r}; the template knows {sorted(self.prefixes)}")
        return self.prefixes[role], self.suffixes[role]

    @classmethod
    def chatml(cls) -> RoleTemplate:
        """The fallback for tokenizers without a usable chat template."""
        return cls({r: f"<|im_start|>{r}\n" for r in ROLES}, {r: "<|im_end|>\n" for r in ROLES})

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> RoleTemplate:
        if not getattr(tokenizer, "chat_template", None):
            return cls.chatml()
        try:
            return cls._probe(tokenizer)
        except Exception:  # a template that rejects the probe (e.g. strict alternation)
            return cls.chatml()

    @classmethod
    def _probe(cls, tokenizer: Any) -> RoleTemplate:
        def render(messages: list[dict[str, str]]) -> str:
            return tokenizer.apply_chat_template(messages, tokenize=False)

        template = cls()
        base_messages = [{"role": "system", "content": "x"}]
        base = render(base_messages)
        for role in ROLES:
            full = render(base_messages + [{"role": role, "content": _SENTINEL}])
            if not full.startswith(base):
                raise ValueError("the template does not render messages independently")
            prefix, _, suffix = full[len(base):].partition(_SENTINEL)
            template.prefixes[role], template.suffixes[role] = prefix, suffix
        alone = render([{"role": "user", "content": _SENTINEL}])
        head = alone[:alone.index(template.prefixes["user"] + _SENTINEL)]
        sys_prefix, sys_suffix = template.prefixes["system"], template.suffixes["system"]
        if head.startswith(sys_prefix) and head.endswith(sys_suffix) and head != sys_prefix:
            template.default_system_prompt = head[len(sys_prefix):len(head) - len(sys_suffix)]
        return template
