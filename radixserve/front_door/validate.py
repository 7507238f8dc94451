"""Reject, before any work, requests that can never run; each error names the field."""

from __future__ import annotations

from radixserve.config import EngineConfig
from radixserve.messages import BeamParams, SamplingParams, TokenizedRequest, WorkerInfo
from radixserve.messages.fields import nesting_depth
from radixserve.stop_strings import Stops


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
