"""`Api`: the operations a caller can run on a runtime, whichever it is.

`Engine` (in-process), `Client` (RPC, to a server or to a router in front of servers) and
`AsyncClient` (the same, for asyncio) all satisfy it, so code written against `Api` runs
on any of them (tests/server/test_api.py runs the same checks on each). The protocol is
generic in what an operation returns: `Api` is `ApiOf[Any]` (the answer itself) and
`AsyncApi` is `ApiOf[Awaitable[Any]]` (an awaitable of it).

Contracts every implementation keeps (results are SGLang-shaped dicts):
- `generate`: a dict for one prompt, a list of dicts for a batch (`n` per prompt for
  `n` > 1); invalid arguments are refused before anything runs (ValueError/TypeError in
  the Engine, ServerError `invalid_request` over RPC). With `stream=True`, an iterator
  (async iterator for `AsyncApi`) of chunks `{"index", "text", "token_ids"}`, text and
  tokens since that output's previous chunk, ending with `{"final": result}`; leaving it
  before the end aborts its requests.
- `abort(rid)`: `{"aborted": rid}`, whether or not `rid` was running.
- `flush_cache()`: whether the cache was flushed (False while requests run): the Engine
  answers a bool, a client `{"flushed": bool}`.
- `pin_prefix` / `unpin_prefix` / `unpin_all` / `cache_info`: see `Client` (a router
  refuses them: pins belong to one replica's tree).
- `stats()`, `model_info()`, `health()`: dicts (`health()["status"] == "ok"` when serving).
- `generate(..., lora_name=NAME)` runs under the LoRA adapter loaded as NAME (or one per
  prompt); `load_lora_adapter(lora_name, lora_path)` (the operator's; `lora_path` is the
  adapter's directory) answers the adapter's description, `unload_lora_adapter(name)` a
  dict, `list_lora_adapters()` the list of loaded adapters (docs/lora.md).

Transport options (a client's `timeout`, `api_key`) are not part of the protocol.
"""

from __future__ import annotations

from typing import Any, Awaitable, Protocol, TypeVar, runtime_checkable

R_co = TypeVar("R_co", covariant=True)


@runtime_checkable
class ApiOf(Protocol[R_co]):
    """The operations, each returning `R_co` (see the module's docstring)."""

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 stream: bool = False, rid: str | list[str] | None = None,
                 cache_salt: str | None = None,
                 lora_name: str | list[str | None] | None = None) -> R_co: ...

    def beam_search(self, prompt: str | list[str] | None = None,
                    input_ids: list[int] | list[list[int]] | None = None, *,
                    beam_width: int = 4, max_new_tokens: int = 16, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, ignore_eos: bool = False,
                    stop_token_ids: list[int] | None = None, skip_special_tokens: bool = True,
                    rid: str | list[str] | None = None, cache_salt: str | None = None) -> R_co: ...

    def abort(self, rid: str) -> R_co: ...

    def flush_cache(self) -> R_co: ...

    def stats(self) -> R_co: ...

    def model_info(self) -> R_co: ...

    def health(self) -> R_co: ...

    def pin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                   ttl: float | None = None, cache_salt: str | None = None) -> R_co: ...

    def unpin_prefix(self, text: str | None = None, input_ids: list[int] | None = None, *,
                     cache_salt: str | None = None) -> R_co: ...

    def unpin_all(self) -> R_co: ...

    def cache_info(self, top: int = 20) -> R_co: ...

    def start_profile(self, output_dir: str | None = None) -> R_co: ...

    def stop_profile(self) -> R_co: ...

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> R_co: ...

    def unload_lora_adapter(self, lora_name: str) -> R_co: ...

    def list_lora_adapters(self) -> R_co: ...


Api = ApiOf[Any]
"""Engine, Client: each operation returns its answer."""

AsyncApi = ApiOf[Awaitable[Any]]
"""AsyncClient: each operation returns an awaitable of its answer."""
