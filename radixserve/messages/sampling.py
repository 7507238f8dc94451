"""A request's sampling settings (SGLang's names and defaults) and beam search, as a generate
call carries them on every surface (RPC, HTTP, the Engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, TypedDict, TypeVar

import msgspec
from msgspec import NODEFAULT, Meta, Struct

from radixserve.messages.fields import MAX_BATCH, JsonObject, JsonValue


CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
"""The SamplingParams fields that constrain the output; a request takes at most one."""

T = TypeVar("T")
if TYPE_CHECKING:
    # A null on the wire is replaced by the field's default in `__post_init__`, so a
    # constructed SamplingParams holds a value: what the type checker should see.
    NullMeansDefault = Annotated[T, "null means default"]
else:
    NullMeansDefault = T | None  # decodes from null too (SGLang's clients send nulls)


MAX_LOGIT_BIAS = 300
"""`logit_bias` entries one request may carry, as OpenAI allows: a bound on the work it adds
to every step of every sample."""


class SamplingParams(Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-request sampling settings, named as in SGLang. Invalid values raise when decoded
    (a generate call's `sampling_params` are decoded as this type, on every surface) or
    converted (`msgspec.convert`, as the Engine does), naming the field: bounds are
    declared on the fields, the rest is checked in `__post_init__`.

    A null field means its default, as in SGLang, whose clients send nulls: the fields
    below that declare `| None` with another default get it back in `__post_init__`, so
    after construction only those whose default is None may be None."""

    max_new_tokens: NullMeansDefault[Annotated[int, Meta(ge=0)]] = 128
    temperature: NullMeansDefault[Annotated[float, Meta(ge=0)]] = 1.0
    top_p: NullMeansDefault[Annotated[float, Meta(gt=0, le=1)]] = 1.0
    top_k: NullMeansDefault[int] = -1
    min_p: NullMeansDefault[Annotated[float, Meta(ge=0, le=1)]] = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    ignore_eos: NullMeansDefault[bool] = False
    seed: int | None = None
    frequency_penalty: NullMeansDefault[Annotated[float, Meta(ge=-2, le=2)]] = 0.0
    presence_penalty: NullMeansDefault[Annotated[float, Meta(ge=-2, le=2)]] = 0.0
    repetition_penalty: NullMeansDefault[Annotated[float, Meta(gt=0, le=2)]] = 1.0
    skip_special_tokens: NullMeansDefault[bool] = True
    no_stop_trim: NullMeansDefault[bool] = False
    n: NullMeansDefault[Annotated[int, Meta(ge=1)]] = 1
    """Samples of the prompt; at most `max_running_requests`, checked before any work."""
    regex: Annotated[str, Meta(min_length=1)] | None = None
    """Constrain the output to match this regular expression: the scheduler masks every
    token that would break the match (scheduler/grammar.py; xgrammar's dialect: no
    look-around or back-references, `\\d` and `\\w` are ASCII). At most one of `regex`,
    `json_schema`, `ebnf` and `structural_tag` per request."""
    json_schema: Annotated[str, Meta(min_length=1)] | None = None
    """Constrain the output to JSON valid against this schema (the schema as a JSON string,
    as SGLang takes it), written compactly (`", "` and `": "`, no other whitespace); an
    object with `properties` gets no other keys unless `additionalProperties` allows them.
    Any JSON object (OpenAI's `response_format: {"type": "json_object"}`, as SGLang maps
    it) is `'{"type": "object"}'`."""
    ebnf: Annotated[str, Meta(min_length=1)] | None = None
    """Constrain the output to this EBNF grammar (GBNF, as xgrammar and llama.cpp read it;
    the start rule is `root`)."""
    structural_tag: Annotated[str, Meta(min_length=1)] | None = None
    """A JSON string: SGLang's `{"type": "structural_tag", "structures": [{"begin",
    "schema", "end"}], "triggers": [...]}` (free text, and after a trigger a tag whose body
    follows its schema), or xgrammar's `{"type": "structural_tag", "format": {...}}`."""
    min_new_tokens: NullMeansDefault[Annotated[int, Meta(ge=0)]] = 0
    """Until this many tokens are out, EOS and stop tokens cannot be picked and nothing
    stops the request (but `max_new_tokens`, which must be at least this, or a `regex`
    match that cannot grow)."""
    stop_regex: str | list[str] | None = None
    """Stop when the output text matches one of these (Python `re`) patterns; the text is
    cut before the match (after it with `no_stop_trim`), and the finish reason's `matched`
    names the pattern, as in SGLang. Patterns are checked at the edge (stop_strings.py)."""
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100, le=100)]],
                          Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    """At most `MAX_LOGIT_BIAS` entries (as OpenAI). Token id (as a string, as OpenAI and SGLang key
    it) -> value added to its logit before sampling, greedy rows included; -100 bans the token, 100
    all but forces it. The ids are checked against the vocabulary at the edge
    (front_door/requests.py)."""
    spaces_between_special_tokens: NullMeansDefault[bool] = True
    """Passed to the tokenizer's decode with `skip_special_tokens`, as SGLang does (fast
    tokenizers, such as the default model's, decode the same either way)."""
    sampling_seed: int | None = None
    """SGLang's other name for `seed`; passing both with different values is an error."""
    beam_width: Annotated[int, Meta(ge=1, le=64)] | None = None
    """SGLang's spelling of beam search: `beam_width` > 1 runs radixserve's beam search,
    and the answer is shaped as SGLang's (the best beam, and the first `n` beams in
    `meta_info.beam_results`, `n` <= `beam_width`)."""
    speculative: Literal["off", "lookup", "tree"] | None = None
    """Speculative decoding for this request (see the server's `--speculative`); None: the
    server's setting. The output is the same either way (greedy: token for token;
    sampling: in distribution); only the speed differs."""
    stream_interval: int | None = None
    """SGLang's streaming granularity: no meaning here (a stream sends every token). Listed
    in the result's `meta_info.ignored_params` when set."""
    custom_params: JsonObject | None = None
    """Arguments of SGLang's custom logit processors, which radixserve does not run. Listed
    in the result's `meta_info.ignored_params` when set."""
    watermark: JsonValue = None
    """SGLang's output watermarking, which would change the output: an error when set
    (but `{"enabled": false}`)."""

    def __post_init__(self) -> None:
        for name, default in _NULL_MEANS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, default)

        def fail(field: str, rule: str) -> None:
            raise ValueError(f"sampling_params.{field} {rule}, got {getattr(self, field)!r}")

        if self.top_k != -1 and self.top_k < 1:
            fail("top_k", "must be -1 (no limit) or >= 1")
        if self.stop is not None and any(s == "" for s in self.stop_strings()):
            fail("stop", "must not contain empty strings")
        if self.min_new_tokens > self.max_new_tokens:
            fail("min_new_tokens", f"must be at most max_new_tokens ({self.max_new_tokens})")
        if self.sampling_seed is not None:
            if self.seed is not None and self.seed != self.sampling_seed:
                fail("sampling_seed", f"is another name for seed, which is {self.seed}")
            self.seed = self.sampling_seed
        if self.watermark is not None and self.watermark != {"enabled": False}:
            raise ValueError("sampling_params.watermark is not supported by radixserve (it "
                             'would change the output): pass none, or {"enabled": false}')
        if self.beam_width is not None and self.beam_search and self.n > self.beam_width:
            fail("n", f"counts the beams returned, at most beam_width ({self.beam_width})")
        used = [f for f in CONSTRAINT_FIELDS if getattr(self, f) is not None]
        if len(used) > 1:
            raise ValueError(f"sampling_params.{used[0]} and sampling_params.{used[1]} cannot "
                             "be combined: pass at most one output constraint")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def ignored_params(self) -> list[str]:
        """The SGLang settings this request sets that mean nothing here (its results list
        them, so that nothing is ignored silently)."""
        return [name for name in ("stream_interval", "custom_params")
                if getattr(self, name) is not None]

    @property
    def beam_search(self) -> bool:
        return self.beam_width is not None and self.beam_width > 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The output constraint as (field name, text), or None (scheduler/grammar.py)."""
        for field in CONSTRAINT_FIELDS:
            text = getattr(self, field)
            if text is not None:
                return field, text
        return None

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature, self.top_k)

    def beam_refusal(self) -> str | None:
        """The first field this sets that beam search would ignore (beams are chosen by
        score, never sampled), or None: the one rule every surface refuses by. A field
        outside `BEAM_SEARCH_FIELDS` is set when it differs from its default (an empty
        list or map is unset; a temperature of 0 is what beam search does anyway)."""
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            if (f.name in BEAM_SEARCH_FIELDS or value == f.default or value in ([], {})
                    or (f.name == "temperature" and value == 0)
                    or (f.name == "n" and self.beam_search)  # n: the beams returned
                    or (f.name == "seed" and self.sampling_seed is not None)):  # by that name
                continue
            return f.name
        return None

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)


def is_greedy(temperature: float, top_k: int) -> bool:
    """The greedy rule, for a request's settings and the worker's rows alike."""
    return temperature < 1e-6 or top_k == 1


BEAM_SEARCH_FIELDS = frozenset({
    "max_new_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "beam_width", "speculative",
    "stream_interval", "custom_params", "watermark"})
"""The SamplingParams fields beam search honours, or that mean the same without it (the
ignored ones it lists, watermark refused anyway, speculative only changes the speed);
every other field is refused with beam search unless left at its default."""


_NULL_MEANS_DEFAULT = [(f.name, f.default) for f in msgspec.structs.fields(SamplingParams)
                       if f.default not in (None, NODEFAULT)]


SamplingParamsArg = SamplingParams | Annotated[list[SamplingParams],
                                               Meta(max_length=MAX_BATCH)] | None
"""A generate call's `sampling_params`: one for every prompt, or one per prompt of a
batch. Decoded as SamplingParams, so a bad or unknown field is refused with the call,
naming it, and a nested value at its first level (a client sends a map, as before)."""


class BeamParams(Struct, forbid_unknown_fields=True, kw_only=True):
    """Beam search as transformers' `generate(num_beams=width, do_sample=False)` does it."""

    width: Annotated[int, Meta(ge=1, le=64)] = 4
    length_penalty: float = 1.0
    """A finished beam scores `sum(logprobs) / generated_tokens ** length_penalty`."""
    early_stopping: bool | Literal["never"] = False


class BeamArguments(TypedDict):
    sampling_params: dict[str, object]
    beam: dict[str, object]


def beam_arguments(beam_width: int, max_new_tokens: int, length_penalty: float,
                   early_stopping: bool | str, ignore_eos: bool, stop_token_ids: list[int] | None,
                   skip_special_tokens: bool) -> BeamArguments:
    """The generate arguments of a beam-search call (Engine and clients alike)."""
    return {"sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos,
                                "stop_token_ids": stop_token_ids,
                                "skip_special_tokens": skip_special_tokens},
            "beam": {"width": beam_width, "length_penalty": length_penalty,
                     "early_stopping": early_stopping}}
