"""The RPC operations, each written once for `Client` and `AsyncClient`.

An operation builds its typed call (radixserve.messages) here and hands it to the
client's `_call` (or, for a stream, `_stream`): the sync client's return the answer, the
async client's an awaitable of it. The clients differ only in their transport, that is
in how a call is sent and its replies waited for; see `radixserve.api` for the
operations' contracts as a caller sees them.

`api_key`: the client's key (its tenant) goes with every call; an operation's own
`api_key` argument speaks for that one call instead.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Any, Generic, Literal, TypeVar

from radixserve.messages import (AbortCall, CacheInfoCall, CacheSnapshotCall, FlushCacheCall,
                                 GenerateCall, HealthCall, LoadLoraCall, LorasCall,
                                 ModelInfoCall, PinCall, ProfileCall, RpcCall, StatsCall,
                                 UnloadLoraCall, UnpinCall, WorkersCall, beam_arguments)
from radixserve.rids import NamingError, name_prompts

R = TypeVar("R")
"""What an operation returns: the answer (`Client`) or an awaitable of it (`AsyncClient`)."""


class Operations(ABC, Generic[R]):
    """Every call a client can make, built once; subclasses send them (`_call`, `_stream`)."""

    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key
        self._ids = itertools.count(1)

    @abstractmethod
    def _call(self, call: RpcCall, timeout: float | None, field: str | None = None) -> R:
        """Send `call` and wait for its answer (`timeout` None: the client's own); with
        `field`, that field of the answer."""

    @abstractmethod
    def _stream(self, call: GenerateCall, timeout: float | None) -> R:
        """Send a streamed generate call: its chunks, then `{"final": result}`."""

    def _key(self, api_key: str | None) -> str | None:
        return api_key or self.api_key

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 stream: bool = False, rid: str | list[str] | None = None,
                 cache_salt: str | None = None, beam: dict[str, Any] | None = None,
                 lora_name: str | list[str | None] | None = None,
                 api_key: str | None = None, timeout: float | None = None) -> R:
        """Same arguments and results as `Engine.generate` (`lora_name`: the LoRA adapter
        to run under, by the name it was loaded as, or one per prompt; None: the base model). With
        `stream=True`, the chunks `{"index", "text", "token_ids"}` (text since the output's
        previous chunk) ending with `{"final": result}`; a stream left before its end is
        aborted (as its caller).
        `beam`: beam search's parameters (see `beam_search`, which sets them)."""
        if stream and rid is None:  # a stream abandoned mid-way is aborted by rid
            try:
                rid = name_prompts(prompt, input_ids, None, "stream").rid_arg
            except NamingError:  # sent unnamed: the server refuses it, naming the field
                pass
        # Sent as the caller gave them: the server decodes them into their typed forms
        # and refuses a bad one (invalid_request naming the field), as it does any caller's.
        raw: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params,
                               "beam": beam}
        call = GenerateCall(
            call_id=next(self._ids), text=prompt, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs, stream=stream, rid=rid,
            cache_salt=cache_salt, lora_name=lora_name, api_key=self._key(api_key), **raw)
        return self._stream(call, timeout) if stream else self._call(call, timeout)

    def beam_search(self, prompt: str | list[str] | None = None,
                    input_ids: list[int] | list[list[int]] | None = None, *,
                    beam_width: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, ignore_eos: bool = False,
                    stop_token_ids: list[int] | None = None, skip_special_tokens: bool = True,
                    rid: str | list[str] | None = None, cache_salt: str | None = None,
                    api_key: str | None = None, timeout: float | None = None) -> R:
        """`Engine.beam_search` over RPC: per prompt, its beams best first."""
        return self.generate(prompt, input_ids=input_ids, rid=rid, cache_salt=cache_salt,
                             api_key=api_key, timeout=timeout, **beam_arguments(
                                 beam_width, max_new_tokens, length_penalty, early_stopping,
                                 ignore_eos, stop_token_ids, skip_special_tokens))

    def abort(self, rid: str, api_key: str | None = None) -> R:
        """Abort the request `rid` (with API keys: only the caller's own requests):
        `{"aborted": rid}`, whether or not it was running."""
        return self._call(AbortCall(next(self._ids), rid, self._key(api_key)), None)

    def abort_all(self, tenant: str | None = None, api_key: str | None = None) -> R:
        """Abort every request in flight of the caller's tenant; the operator's: of every
        tenant, or of `tenant` only. `{"aborted": count}`."""
        return self._call(AbortCall(next(self._ids), api_key=self._key(api_key),
                                    abort_all=True, tenant=tenant), None)

    def flush_cache(self, api_key: str | None = None) -> R:
        """Drop every cached prefix no request uses: `{"flushed": bool}` (False while
        requests run). The operator's call."""
        return self._call(FlushCacheCall(next(self._ids), self._key(api_key)), None)

    def model_info(self, api_key: str | None = None) -> R:
        return self._call(ModelInfoCall(next(self._ids), self._key(api_key)), None)

    def stats(self, api_key: str | None = None) -> R:
        return self._call(StatsCall(next(self._ids), self._key(api_key)), None)

    def health(self, api_key: str | None = None) -> R:
        """`{"status", "pids"}`: status `ok` once the model is loaded and warm."""
        return self._call(HealthCall(next(self._ids), self._key(api_key)), None)

    def cache_snapshot(self, api_key: str | None = None) -> R:
        """The server's radix tree as page hashes, for a cache-aware router:
        `{"epoch", "seq", "page_size", "hashes", "load"}` (see CacheSnapshotCall)."""
        return self._call(CacheSnapshotCall(next(self._ids), self._key(api_key)), None)

    def start_profile(self, output_dir: str | None = None, api_key: str | None = None) -> R:
        """Start a torch.profiler trace of the worker's steps (written, when stopped, to the
        server's profile directory, or to `output_dir`, one name inside it); an error if
        one is already running. The operator's call."""
        return self._call(ProfileCall(next(self._ids), "start", output_dir,
                                      self._key(api_key)), None)

    def stop_profile(self, api_key: str | None = None) -> R:
        """Stop the trace and write it: the reply names the file (`trace`)."""
        return self._call(ProfileCall(next(self._ids), "stop", None, self._key(api_key)), None)

    def workers(self, action: Literal["add", "remove", "list"] = "list",
                url: str | None = None, api_key: str | None = None) -> R:
        """A router's replicas: `list`, or `add` / `remove` the one at `url` (its RPC
        address). A server answers invalid_request."""
        return self._call(WorkersCall(next(self._ids), action, url, self._key(api_key)), None)

    def pin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                   ttl: float | None = None, cache_salt: str | None = None,
                   api_key: str | None = None, timeout: float | None = None) -> R:
        """Keep a prefix (its whole pages) in the server's memory, prefilled first if it
        is not cached, until `unpin_prefix` or `ttl` seconds (see PinCall):
        `{"tokens", "expires_in", "tier", "pinned_tokens"}`. ServerError invalid_request
        past the server's `--max-pinned-tokens`."""
        return self._call(PinCall(call_id=next(self._ids), text=text, input_ids=input_ids,
                                  ttl=ttl, cache_salt=cache_salt,
                                  api_key=self._key(api_key)), timeout)

    def unpin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                     cache_salt: str | None = None, api_key: str | None = None) -> R:
        """Drop the pin of exactly this prefix: `{"unpinned": bool, "tokens", ...}`."""
        return self._call(UnpinCall(call_id=next(self._ids), text=text, input_ids=input_ids,
                                    cache_salt=cache_salt, api_key=self._key(api_key)), None)

    def unpin_all(self, api_key: str | None = None) -> R:
        """Drop every pin the caller may see (with API keys: its tenant's):
        `{"unpinned": bool, "pins", "tokens", "pinned_tokens"}`."""
        return self._call(UnpinCall(call_id=next(self._ids), all=True,
                                    api_key=self._key(api_key)), None)

    def cache_info(self, top: int = 20, api_key: str | None = None) -> R:
        """The radix tree summarised (see CacheInfoCall and docs/rpc.md): `nodes` (the
        largest and hottest prefixes, with `text`), `totals` per tier, `pins`."""
        return self._call(CacheInfoCall(call_id=next(self._ids), top=top,
                                        api_key=self._key(api_key)), None)

    def load_lora_adapter(self, lora_name: str, lora_path: str, api_key: str | None = None,
                          timeout: float | None = None) -> R:
        """Load the PEFT LoRA adapter in the directory `lora_path` (on the server's machine)
        as `lora_name` (see LoadLoraCall): the adapter (`name`, `path`, `fingerprint`,
        `rank`, `target_modules`) and `unloaded`, the adapters unloaded to make room. The
        operator's call; ServerError invalid_request naming what is wrong with the adapter."""
        return self._call(LoadLoraCall(next(self._ids), lora_name, lora_path,
                                       self._key(api_key)), timeout)

    def unload_lora_adapter(self, lora_name: str, api_key: str | None = None) -> R:
        """Unload the adapter `lora_name`; requests using it end first, aborted with a
        message naming the unload. The operator's call."""
        return self._call(UnloadLoraCall(next(self._ids), lora_name, self._key(api_key)), None)

    def list_lora_adapters(self, api_key: str | None = None) -> R:
        """The adapters loaded, least recently used first: a list of `{"name", "path",
        "fingerprint", "rank", "target_modules"}` (`path` null but to the operator)."""
        return self._call(LorasCall(next(self._ids), self._key(api_key)), None, "loras")

    def _stream_aborts(self, call: GenerateCall) -> list[AbortCall]:
        """The calls that abort a stream its reader left (as its caller): one per rid."""
        rids = [call.rid] if isinstance(call.rid, str) else list(call.rid or ())
        return [AbortCall(next(self._ids), rid, call.api_key) for rid in rids]
