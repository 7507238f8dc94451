"""From a caller's generate arguments to validated, tokenized requests: built and checked
in one place.

Shared by the in-process Engine and the RPC front door, so both accept and reject exactly
the same input with the same messages, before any work is queued: a request that can never
run is refused before any work, each error naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from radixserve.config import PROMPT_CHARS_PER_TOKEN, EngineConfig
from radixserve.messages import (BeamParams, GenerateCall, SamplingParams, TokenizedRequest,
                                 WorkerInfo)
from radixserve.messages.fields import nesting_depth
from radixserve.rids import check_batch_size, is_single, mint_rid
from radixserve.stop_strings import Stops

def parse_sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    """A dict of sampling settings to SamplingParams; errors name the offending field."""
    return SamplingParams() if raw is None else _parse(raw, SamplingParams, where)


def _parse(raw: Any, kind: type[msgspec.Struct], where: str) -> Any:
    if isinstance(raw, kind):
        raw = msgspec.structs.asdict(raw)  # built in Python: its bounds are still unchecked
    if not isinstance(raw, dict):
        raise TypeError(f"{where} must be a dict, got {type(raw).__name__}")
    raw = {k: v for k, v in raw.items() if v is not None}  # null means the default (SGLang)
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as e:
        msg = str(e).replace("`$.", f"`{where}.").replace(" - at `$`", "")
        raise ValueError(f"invalid {where}: {msg}") from None


def check_prompt_chars(text: str, config: EngineConfig, context_length: int,
                       where: str = "prompt") -> None:
    """Refuse a text prompt too long to be worth tokenizing (before the tokenizer runs):
    past `max_prompt_chars`, or by default a number of characters per token of the model's
    context length."""
    limit = config.max_prompt_chars
    if limit is None:
        limit = PROMPT_CHARS_PER_TOKEN * context_length
    if len(text) > limit:
        raise ValueError(f"{where} of {len(text)} characters exceeds max_prompt_chars={limit} "
                         f"({flag('max_prompt_chars')}; by default {PROMPT_CHARS_PER_TOKEN} "
                         "characters per token of the model's context length)")


def check_call_chars(prompt: str | list[str] | None, config: EngineConfig,
                     info: WorkerInfo) -> int:
    """The characters of a call's text prompts (0 for ids), refused past `max_call_chars`
    before any is tokenized: each prompt's own bound (`check_prompt_chars`) leaves a batch
    of thousands free to cost seconds of tokenizing. A lower bound on tokens from characters
    would refuse no sooner: a tokenizer's longest token is tens of characters (runs of
    spaces or `#`), far more than `PROMPT_CHARS_PER_TOKEN`."""
    chars = len(prompt) if isinstance(prompt, str) else sum([len(p) for p in prompt or ()])
    limit = config.max_call_chars
    if limit is None:
        limit = PROMPT_CHARS_PER_TOKEN * max(info.num_blocks * info.page_size,
                                             info.context_length)
    if chars > limit:
        raise ValueError(f"the call's prompts hold {chars} characters in all, more than "
                         f"max_call_chars={limit} ({flag('max_call_chars')}; by default "
                         f"{PROMPT_CHARS_PER_TOKEN} characters per token the KV pool holds)")
    return chars


def build_requests(tokenizer: Any, info: WorkerInfo, config: EngineConfig, *,
                   prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                   return_logprob: Any = False, logprob_start_len: Any = -1,
                   top_logprobs_num: Any = 0, rid: Any = None, beam: Any = None,
                   namespace: str | None = None, decoded: bool = False, lora_name: Any = None
                   ) -> tuple[list[TokenizedRequest], bool]:
    """Tokenize and validate one prompt or a batch: the one place a call is taken apart
    into requests. Returns the requests and whether the caller passed a single prompt.
    Raises ValueError/TypeError naming the field (and the prompt's index in a batch) for
    the first bad one. Everything that sizes the call's work (its prompts, each prompt's
    outputs, the call's outputs in all) is checked before the first prompt is tokenized,
    and each prompt is checked as soon as it is. `namespace` is the radix cache namespace
    of every request (derived by the caller from the tenant and `cache_salt`:
    radixserve/tenants.py). `lora_name`: the LoRA adapter's name, for every prompt or one per
    prompt (None: the base model), which the scheduler resolves. `decoded`: the call's
    structs were decoded from the wire (validated there), so they are not converted again."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt (text) or input_ids")
    single = is_single(prompt, input_ids)
    # List comprehensions, not generators: no frame resumed per element (a prompt's ids
    # may number a million).
    if prompt is not None:
        texts = [prompt] if single else prompt
        if not isinstance(texts, list) or not all([isinstance(p, str) for p in texts]):
            raise TypeError("prompt must be a string or a list of strings")
        n = len(texts)
        check_call_chars(texts, config, info)
    else:
        token_lists = [input_ids] if single else input_ids
        if not isinstance(token_lists, list) or not all(
                [isinstance(ids, list) and all([type(t) is int for t in ids])
                 for ids in token_lists]):
            raise TypeError("input_ids must be a list of ints or a list of lists of ints")
        n = len(token_lists)
    if n == 0:
        raise ValueError("the batch is empty")
    if not single:
        check_batch_size(n)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
    rids = rid if isinstance(rid, list) else [rid] * n
    if len(params) != n or len(rids) != n:
        raise ValueError(f"sampling_params and rid lists must have one entry per prompt ({n})")
    if not all([r is None or isinstance(r, str) for r in rids]):
        raise TypeError("rid must be a string or a list of strings")
    loras = lora_name if isinstance(lora_name, list) else [lora_name] * n
    if len(loras) != n or not all([a is None or isinstance(a, str) for a in loras]):
        raise ValueError(f"lora_name must be an adapter's name, or a list of one name (or "
                         f"None) per prompt ({n})")
    for name, value, kind in (("return_logprob", return_logprob, bool),
                              ("logprob_start_len", logprob_start_len, int),
                              ("top_logprobs_num", top_logprobs_num, int)):
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{name} must be {kind.__name__}, got {type(value).__name__}")
    named = [r for r in rids if r is not None]
    if len(set(named)) != len(named):
        raise ValueError(f"rid {next(r for r in named if named.count(r) > 1)!r} is given twice")
    # A decoded call's structs were validated when it was decoded: the one check at the edge.
    beam_params = beam if decoded or beam is None else _parse(beam, BeamParams, "beam")
    plans = []
    for i, sp in enumerate(params):
        try:
            sampling = ((SamplingParams() if sp is None else sp) if decoded else
                        parse_sampling_params(sp, "sampling_params" if single
                                              else f"sampling_params[{i}]"))
            plans.append(_plan(sampling, beam_params, top_logprobs_num, config))
        except ValueError as e:
            raise ValueError(str(e) if single else f"prompt {i}: {e}") from None
    outputs = sum([b.width if b is not None else s.n for s, b in plans])
    if outputs > config.max_queued_requests:  # else "overloaded" for ever
        raise ValueError(f"the call's {n} prompts ask for {outputs} outputs in all, more than "
                         f"max_queued_requests={config.max_queued_requests} "
                         f"({flag('max_queued_requests')})")
    entries = 0
    if return_logprob:  # the outputs' part, before any prompt is tokenized
        entries = sum([logprob_entries(b.width if b is not None else s.n, s.max_new_tokens,
                                       top_logprobs_num) for s, b in plans])
        check_logprob_entries(entries, config)
    requests = []
    for i, ((sampling, req_beam), r, lora) in enumerate(zip(plans, rids, loras)):
        if prompt is not None:
            check_prompt_chars(texts[i], config, info.context_length,
                               "the prompt" if single else f"prompt {i}")
            ids = tokenizer.encode(texts[i])
        else:
            ids = token_lists[i]
        start = logprob_start_len
        if start == -1 and return_logprob and sampling.max_new_tokens == 0:
            # Nothing is generated, so the prompt's logprobs are all it can return (SGLang's
            # frontend scores select's unconditional likelihood so, without a start).
            start = 0
        req = TokenizedRequest(
            rid=r or mint_rid(), input_ids=ids,
            sampling=sampling, return_logprob=return_logprob, logprob_start_len=start,
            top_logprobs_num=top_logprobs_num, beam=req_beam, namespace=namespace, lora=lora)
        try:
            validate_request(req, info, config)
        except ValueError as e:
            raise ValueError(str(e) if single else f"prompt {i}: {e}") from None
        if return_logprob and start >= 0:  # each output shows the prompt's
            entries += logprob_entries(req.num_outputs, len(ids) - start, top_logprobs_num)
            check_logprob_entries(entries, config)
        requests.append(req)
    return requests, single


def build_call(tokenizer: Any, info: WorkerInfo, config: EngineConfig, call: GenerateCall,
               namespace: str | None) -> tuple[list[TokenizedRequest], bool]:
    """`build_requests` for a generate call decoded from the wire (or the HTTP server)."""
    return build_requests(
        tokenizer, info, config, prompt=call.text, sampling_params=call.sampling_params,
        input_ids=call.input_ids, return_logprob=call.return_logprob,
        logprob_start_len=call.logprob_start_len, top_logprobs_num=call.top_logprobs_num,
        rid=call.rid, beam=call.beam, namespace=namespace, decoded=True,
        lora_name=call.lora_name)


def _plan(sampling: SamplingParams, beam: BeamParams | None, top_logprobs_num: int,
          config: EngineConfig) -> tuple[SamplingParams, BeamParams | None]:
    """One prompt's beam search, with the limits on its outputs checked (before its prompt
    is tokenized)."""
    if sampling.beam_search:  # SGLang's spelling of the same search
        if beam is not None:
            raise ValueError("pass beam or sampling_params.beam_width, not both")
        assert sampling.beam_width is not None  # as beam_search says
        beam = BeamParams(width=sampling.beam_width)
    if beam is not None:  # beams are chosen by score, never sampled
        check_beam(sampling)
        sampling = msgspec.structs.replace(sampling, temperature=0.0)
    check_outputs(sampling, beam, top_logprobs_num, config)
    return sampling, beam


def eos_token_ids(tokenizer: Any, model_dir: Path) -> list[int]:
    """EOS ids from the tokenizer and generation_config.json (what transformers stops on)."""
    ids = set() if tokenizer.eos_token_id is None else {tokenizer.eos_token_id}
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return sorted(ids)


# -- checks: what can never run is refused before any work ------------------------------
def flag(name: str) -> str:
    """A limit's server flag, as its error names it (beside the option's name)."""
    return f"--{name.replace('_', '-')}"


def check_sampling_limits(sp: SamplingParams, config: EngineConfig) -> None:
    """The size limits of a request's sampling settings (stop strings, constraints): cheap,
    and checked before anything else is done with them (Stops.of compiles stop_regex)."""
    stops = sp.stop_strings() + ([sp.stop_regex] if isinstance(sp.stop_regex, str)
                                 else list(sp.stop_regex or ()))
    if len(stops) > config.max_stop_strings:
        raise ValueError(f"sampling_params.stop and stop_regex hold {len(stops)} entries, more "
                         f"than max_stop_strings={config.max_stop_strings} "
                         f"({flag('max_stop_strings')})")
    for s in stops:
        if len(s) > config.max_stop_chars:
            raise ValueError(f"a sampling_params.stop or stop_regex entry of {len(s)} characters "
                             f"exceeds max_stop_chars={config.max_stop_chars} "
                             f"({flag('max_stop_chars')})")
    constraint = sp.constraint
    if constraint is not None and len(constraint[1]) > config.max_constraint_chars:
        raise ValueError(f"sampling_params.{constraint[0]} of {len(constraint[1])} characters "
                         f"exceeds max_constraint_chars={config.max_constraint_chars} "
                         f"({flag('max_constraint_chars')})")
    if constraint is not None:
        depth = nesting_depth(constraint[1], quoted=constraint[0] != "regex")
        if depth > config.max_constraint_depth:
            raise ValueError(f"sampling_params.{constraint[0]} nests {depth} deep, more than "
                             f"max_constraint_depth={config.max_constraint_depth} "
                             f"({flag('max_constraint_depth')})")


def validate_request(req: TokenizedRequest, info: WorkerInfo, config: EngineConfig) -> None:
    prompt = len(req.input_ids)
    if prompt == 0:
        raise ValueError("the prompt is empty: input_ids must hold at least one token")
    if prompt > info.context_length:  # before the ids are scanned
        raise ValueError(f"prompt of {prompt} tokens exceeds the model's maximum context length "
                         f"of {info.context_length} tokens")
    bad = [t for t in req.input_ids if not 0 <= t < info.vocab_size]
    if bad:
        raise ValueError(f"input_ids holds token id {bad[0]} outside the vocabulary "
                         f"[0, {info.vocab_size})")
    sp = req.sampling
    total = prompt + sp.max_new_tokens
    if total > info.context_length:
        raise ValueError(
            f"prompt of {prompt} tokens plus max_new_tokens={sp.max_new_tokens} exceeds the "
            f"model's maximum context length of {info.context_length} tokens")
    capacity = info.num_blocks * info.page_size
    if total > capacity:
        raise ValueError(
            f"prompt of {prompt} tokens plus max_new_tokens={sp.max_new_tokens} exceeds the "
            f"KV pool capacity of {capacity} tokens (max_total_tokens)")
    if sp.stop_token_ids and any(t >= info.vocab_size for t in sp.stop_token_ids):
        raise ValueError("sampling_params.stop_token_ids holds an id outside the vocabulary")
    for key in sp.logit_bias or ():
        if not (key.isascii() and key.isdigit() and int(key) < info.vocab_size):
            raise ValueError(f"sampling_params.logit_bias key {key!r} is not a token id of "
                             f"the vocabulary [0, {info.vocab_size})")
    check_sampling_limits(sp, config)
    if sp.stop_regex:
        Stops.of(sp)  # a stop_regex pattern that does not compile
    if req.logprob_start_len < -1 or req.logprob_start_len >= max(prompt, 1):
        raise ValueError(f"logprob_start_len must be -1 or in [0, {prompt}) for a prompt of "
                         f"{prompt} tokens, got {req.logprob_start_len}")
    check_outputs(req.sampling, req.beam, req.top_logprobs_num, config)
    if req.beam is not None:
        _validate_beam(req)


def check_outputs(sp: SamplingParams, beam: BeamParams | None, top_logprobs_num: int,
                  config: EngineConfig) -> None:
    """The limits on what a request's answer holds (samples, beams, alternatives per
    position): checked before its prompt is tokenized, as each sizes work and replies."""
    if not 0 <= top_logprobs_num <= config.max_top_logprobs_num:
        raise ValueError(f"top_logprobs_num must be in [0, {config.max_top_logprobs_num}] "
                         f"(max_top_logprobs_num, {flag('max_top_logprobs_num')}), got "
                         f"{top_logprobs_num}")
    if sp.n > config.max_running_requests:
        raise ValueError(f"sampling_params.n={sp.n} exceeds max_running_requests="
                         f"{config.max_running_requests} ({flag('max_running_requests')})")
    if beam is not None and beam.width > config.max_running_requests:
        raise ValueError(f"beam width {beam.width} exceeds max_running_requests="
                         f"{config.max_running_requests} ({flag('max_running_requests')})")
    outputs = beam.width if beam is not None else sp.n
    if outputs > config.max_queued_requests:  # else "overloaded" for ever
        raise ValueError(f"{outputs} outputs exceed max_queued_requests="
                         f"{config.max_queued_requests} ({flag('max_queued_requests')})")


def logprob_entries(outputs: int, positions: int, top_logprobs_num: int) -> int:
    """The logprobs `outputs` outputs return over `positions` positions each (prompt or
    output): each position's own and its `top_logprobs_num` alternatives. Every output
    counts the prompt's, as every output of a call's result shows them."""
    return outputs * positions * (1 + top_logprobs_num)


def check_logprob_entries(entries: int, config: EngineConfig) -> None:
    """The bound on a call's logprobs in all (each factor is bounded apart; their product
    sizes the prefill's top-k, the result and the reply)."""
    if entries > config.max_logprob_entries:
        raise ValueError(f"the call would return {entries} logprobs (outputs x positions x "
                         f"(1 + top_logprobs_num), prompts and outputs of every prompt), "
                         f"more than max_logprob_entries={config.max_logprob_entries} "
                         f"({flag('max_logprob_entries')})")


def check_beam(sp: SamplingParams) -> None:
    """Beam search takes no sampling: what it would ignore is refused, naming the field
    (`SamplingParams.beam_refusal`, the one rule every surface goes through)."""
    refused = sp.beam_refusal()
    if refused is not None:
        raise ValueError(f"beam search does not support sampling_params.{refused}")


def _validate_beam(req: TokenizedRequest) -> None:
    check_beam(req.sampling)
    if req.return_logprob:
        raise ValueError("beam search does not return logprobs; each beam has its score")
    if req.sampling.max_new_tokens < 1:
        raise ValueError("beam search needs max_new_tokens >= 1")
