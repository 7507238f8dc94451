"""The expressions a program appends to its state: text, gen, select, role markers.

They are inert values: building one does no work, so `"Q: " + q + gen("a")` can be
composed freely and handed to `s += ...`; the interpreter gives them meaning. Names and
fields follow SGLang's frontend so that its programs port unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixserve.lang.choices import ChoicesSamplingMethod
from radixserve.messages.sampling import SamplingParams

# dtype -> regex, as SGLang's frontend spells them. int and float may be followed by
# spaces / newlines, which their stop strings then trim, so a number can end naturally
# instead of running to max_tokens. The runtime's regex engine (xgrammar) reads `\w`, `\d`
# and `\s` as ASCII classes, as SGLang's does: REGEX_STR admits ASCII words only.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

REQUEST_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num",
                  "return_text_in_logprobs", "lora_name")
"""The generate call's own arguments a gen (or run) may set beside its sampling settings.
`lora_name` (a loaded LoRA adapter's name): run()'s is every call of the program's (its
gens, selects, and the prefixes committed for forks and selects), a gen's that gen's."""

SETTINGS = frozenset(f.name for f in msgspec.structs.fields(SamplingParams)) | set(REQUEST_FIELDS)
"""What a gen or run takes by name: every `SamplingParams` field (the one declaration of
them) and `REQUEST_FIELDS`."""


@dataclass
class GenParams:
    """Settings of one gen, or run()'s defaults, by `SETTINGS` name; unset (or None) means
    "inherit from run()'s defaults", then the server's."""

    settings: dict[str, Any] = field(default_factory=dict)
    dtype: Any = None

    @classmethod
    def of(cls, dtype: Any = None, **settings: Any) -> GenParams:
        unknown = sorted(set(settings) - SETTINGS)
        if unknown:
            raise TypeError(f"unknown setting(s) {unknown}: a gen or run takes the fields of "
                            "SamplingParams (radixserve/messages/sampling.py) and "
                            f"{', '.join(REQUEST_FIELDS)}")
        return cls({k: v for k, v in settings.items() if v is not None}, dtype)

    def over(self, defaults: GenParams) -> GenParams:
        """These settings where set, `defaults` elsewhere."""
        return GenParams({**defaults.settings, **self.settings},
                         defaults.dtype if self.dtype is None else self.dtype)

    def resolved(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(sampling_params, request-level args) for `generate`, with `dtype` turned into
        its regex and stop strings."""
        sampling = {k: v for k, v in self.settings.items() if k not in REQUEST_FIELDS}
        stops = sampling.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        if self.dtype is not None:
            regex, extra_stops = dtype_regex(self.dtype)
            sampling["regex"] = regex
            stops += [s for s in extra_stops if s not in stops]
        sampling["stop"] = stops or None
        request = {k: v for k, v in self.settings.items() if k in REQUEST_FIELDS}
        return sampling, request


def dtype_regex(dtype: Any) -> tuple[str, list[str]]:
    """The regex (and the stop strings that trim its trailing whitespace) for a dtype."""
    if dtype in (int, "int"):
        return REGEX_INT, [" ", "\n"]
    if dtype in (float, "float"):
        return REGEX_FLOAT, [" ", "\n"]
    if dtype in (bool, "bool"):
        return REGEX_BOOL, []
    if dtype in (str, "str"):
        return REGEX_STR, []
    raise ValueError(f"gen(dtype=...) must be int, float, bool or str, got {dtype!r}")


class Expr:
    """Base of everything `s += ...` accepts besides plain strings; `+` builds a list."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList([as_expr(other), self])


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"only strings and gen/select/role expressions can be added, got "
                    f"{type(value).__name__}")


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr] = field(default_factory=list)

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for item in self.items:  # keep lists flat: ("a" + gen()) + "b" is three items
            flat.extend(item.items if isinstance(item, ExprList) else [item])
        self.items = flat


@dataclass(eq=False)
class Text(Expr):
    value: str


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float
    choices_method: ChoicesSamplingMethod


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class ConcatBranches(Expr):
    """join(mode="concate_and_append"): append each branch's new text, in order."""

    states: list[Any]
