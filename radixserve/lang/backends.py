"""Where a program's calls go: the in-process Engine or a server over RPC.

Both backends talk to the runtime only through its public `generate` (the Engine's, or
the RPC Client's, which takes the same arguments and returns the same dicts). Everything
the DSL needs is built from three kinds of call: generate from the program's text, commit
a prefix (a zero-token request, so forked branches and select's choices hit the radix
cache), and score token logprobs (select). Each backend also counts the prompt tokens it
sent and how many of them the runtime reported as cached, so a program can print its own
cache hit rate.
"""

from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

from radixserve.chat.role_template import RoleTemplate
from radixserve.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from radixserve.lang.ir import GenParams
from radixserve.lang.scoring import score_choices


class Backend:
    """The calls the interpreter makes. Subclasses provide `_generate` (and may stream)."""

    tokenizer: Any
    chat_template: RoleTemplate
    commit_prefixes: bool = True
    """Whether fork/select first commit the shared prefix (pointless with the cache off)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                        "completion_tokens": 0}

    # -- what subclasses provide ---------------------------------------------------------
    def _generate(self, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _generate_stream(self, **kwargs: Any) -> Iterator[dict]:
        """Chunks `{"text": ...}` as the runtime sends them, then `{"final": result}`; by
        default (a runtime that cannot stream) one chunk at the end."""
        result = self._generate(**kwargs)
        yield {"text": result["text"]}
        yield {"final": result}

    def runtime_stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def flush_cache(self) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    # -- accounting ----------------------------------------------------------------------
    def _record(self, results: list[dict]) -> None:
        with self._lock:
            for r in results:
                meta = r["meta_info"]
                self._counts["requests"] += 1
                self._counts["prompt_tokens"] += meta["prompt_tokens"]
                self._counts["cached_tokens"] += meta["cached_tokens"]
                self._counts["completion_tokens"] += meta["completion_tokens"]

    def call(self, **kwargs: Any) -> Any:
        """`generate` on the runtime, counted."""
        out = self._generate(**kwargs)
        self._record(out if isinstance(out, list) else [out])
        return out

    def stats(self) -> dict[str, Any]:
        """Requests this backend sent, their prompt tokens, how many were cache hits."""
        with self._lock:
            c: dict[str, float] = dict(self._counts)
        c["cache_hit_rate"] = c["cached_tokens"] / max(c["prompt_tokens"], 1)
        return c

    def reset_stats(self) -> None:
        with self._lock:
            for key in self._counts:
                self._counts[key] = 0

    # -- the interpreter's calls ---------------------------------------------------------
    def generate(self, text: str, params: GenParams) -> tuple[str, dict]:
        sampling, request = params.resolved()
        result = self.call(prompt=text, sampling_params=sampling, **request)
        return result["text"], result["meta_info"]

    def generate_stream(self, text: str, params: GenParams) -> Iterator[tuple[str, dict | None]]:
        """Yields (new text, None) per chunk, then ("", meta_info)."""
        sampling, request = params.resolved()
        for chunk in self._generate_stream(prompt=text, sampling_params=sampling, **request):
            if "final" in chunk:
                self._record([chunk["final"]])
                yield "", {**chunk["final"]["meta_info"], "text": chunk["final"]["text"]}
            elif chunk.get("text"):
                yield chunk["text"], None

    def commit(self, text: str, lora_name: str | None = None) -> None:
        """Compute and cache `text`'s KV without generating (SGLang's commit_lazy), under
        the LoRA adapter `lora_name` (its KV is cached under it)."""
        if text and self.commit_prefixes:
            self.call(prompt=text, sampling_params={"max_new_tokens": 0},
                      **_adapter(lora_name))

    def select(self, text: str, choices: list[str], temperature: float,
               method: ChoicesSamplingMethod, lora_name: str | None = None) -> ChoicesDecision:
        """Score the choices (under the LoRA adapter `lora_name`) and pick one."""
        generate = self._generate if lora_name is None else functools.partial(
            self._generate, lora_name=lora_name)
        return score_choices(generate, self.tokenizer, text, choices, method,
                             temperature, commit_prefix=self.commit_prefixes,
                             on_results=self._record)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class ApiBackend(Backend):
    """A runtime behind the `Api` protocol (`radixserve/api.py`: the Engine, or a `Client` of
    a server or router): generate, stream, stats and flush go straight to `api`."""

    api: Any

    def _generate(self, **kwargs: Any) -> Any:
        return self.api.generate(**kwargs)

    def _generate_stream(self, **kwargs: Any) -> Iterator[dict]:
        return self.api.generate(stream=True, **kwargs)

    def runtime_stats(self) -> dict[str, Any]:
        return self.api.stats()

    def flush_cache(self) -> Any:
        return self.api.flush_cache()


class EngineBackend(ApiBackend):
    """The in-process Engine. Pass an Engine, or Engine options to start (and own) one."""

    def __init__(self, engine: Any = None, **engine_config: Any) -> None:
        super().__init__()
        if engine is None:
            from radixserve.engine import Engine

            engine = Engine(**engine_config)
            self._owned = True
        else:
            if engine_config:
                raise TypeError("pass an Engine or Engine options, not both")
            self._owned = False
        self.engine = self.api = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = RoleTemplate.from_tokenizer(self.tokenizer)
        self.commit_prefixes = bool(engine.config.enable_prefix_cache)

    def shutdown(self) -> None:
        if self._owned:
            self.engine.shutdown()


class RuntimeEndpoint(ApiBackend):
    """A radixserve server over RPC (`Runtime(...).rpc_address` or `radixserve serve`'s
    address). The tokenizer (for select's token boundaries and the chat template) is
    loaded from the model path the server reports: client and server share a machine.
    `api_key`: the caller's key on a server started with `--api-key` (its tenant)."""

    def __init__(self, address: str, timeout: float | None = 600.0,
                 tokenizer_path: str | None = None, api_key: str | None = None) -> None:
        super().__init__()
        from radixserve.client import Client
        from radixserve.model.loader import load_tokenizer

        self.address = address
        self.client = self.api = Client(address, timeout=timeout, api_key=api_key)
        self.model_info = self.client.model_info()
        self.tokenizer = load_tokenizer(Path(tokenizer_path or self.model_info["model_path"]))
        self.chat_template = RoleTemplate.from_tokenizer(self.tokenizer)

    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    def shutdown(self) -> None:
        self.client.close()


def _adapter(lora_name: str | None) -> dict[str, Any]:
    """A call's LoRA argument: none for the base model (so a runtime without `lora_name`
    still takes the call)."""
    return {} if lora_name is None else {"lora_name": lora_name}


_default: list[Backend | None] = [None]


def as_backend(obj: Any) -> Backend:
    """A Backend from a Backend, an Engine, or anything with `.endpoint` (a Runtime)."""
    if isinstance(obj, Backend):
        return obj
    if hasattr(obj, "endpoint"):
        return as_backend(obj.endpoint)
    engine_module = sys.modules.get("radixserve.engine")
    if engine_module is not None and isinstance(obj, engine_module.Engine):
        return EngineBackend(obj)
    raise TypeError(f"not a backend: {type(obj).__name__} (use EngineBackend(engine) or "
                    "RuntimeEndpoint(address))")


def set_default_backend(backend: Any) -> None:
    _default[0] = as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default[0]
