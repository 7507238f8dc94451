"""Reject, before any work, requests that can never run; each error names the field."""

from __future__ import annotations

from radixserve.config import EngineConfig
from radixserve.messages import CONSTRAINT_FIELDS, TokenizedRequest, WorkerInfo
from radixserve.stop_strings import Stops


def validate_request(req: TokenizedRequest, info: WorkerInfo, config: EngineConfig) -> None:
    prompt = len(req.input_ids)
    if prompt == 0:
        raise ValueError("the prompt is empty: input_ids must hold at least one token")
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
    Stops.of(sp)  # a stop_regex pattern that does not compile
    if req.logprob_start_len < -1 or req.logprob_start_len >= max(prompt, 1):
        raise ValueError(f"logprob_start_len must be -1 or in [0, {prompt}) for a prompt of "
                         f"{prompt} tokens, got {req.logprob_start_len}")
    if not 0 <= req.top_logprobs_num <= 100:
        raise ValueError(f"top_logprobs_num must be in [0, 100], got {req.top_logprobs_num}")
    if req.sampling.n > config.max_running_requests:
        raise ValueError(f"sampling_params.n={req.sampling.n} exceeds max_running_requests="
                         f"{config.max_running_requests}")
    if req.num_outputs > config.max_queued_requests:  # else "overloaded" for ever
        raise ValueError(f"{req.num_outputs} outputs exceed max_queued_requests="
                         f"{config.max_queued_requests}")
    if req.beam is not None:
        _validate_beam(req, config)


def _validate_beam(req: TokenizedRequest, config: EngineConfig) -> None:
    """Beam search takes no sampling: what it cannot honour is refused, not ignored."""
    sp = req.sampling
    if req.beam.width > config.max_running_requests:
        raise ValueError(f"beam width {req.beam.width} exceeds max_running_requests="
                         f"{config.max_running_requests}")
    unsupported = [name for name, used in (
        ("n", sp.n != 1 and not sp.beam_search),  # with beam_width: the beams returned
        ("stop", bool(sp.stop_strings())), ("stop_regex", bool(sp.stop_regex)),
        ("min_new_tokens", sp.min_new_tokens > 0),
        *((field, getattr(sp, field) is not None) for field in CONSTRAINT_FIELDS),
        ("logit_bias", bool(sp.logit_bias)),
        ("frequency_penalty", sp.frequency_penalty != 0),
        ("presence_penalty", sp.presence_penalty != 0),
        ("repetition_penalty", sp.repetition_penalty != 1)) if used]
    if unsupported:
        raise ValueError(f"beam search does not support sampling_params.{unsupported[0]}")
    if req.return_logprob:
        raise ValueError("beam search does not return logprobs; each beam has its score")
    if sp.max_new_tokens < 1:
        raise ValueError("beam search needs max_new_tokens >= 1")
